"""Copy drafts (prompt lookup): when the last few committed tokens occurred before, in the
prompt or the output, the tokens that followed them then are a candidate block.

Math and code copy a lot from their prompts (names, numbers, expressions). A copied block is
verified like any draft; at temperature > 0 it is a point-mass proposal, so rejection
sampling stays exact.
"""

from __future__ import annotations


class CopyIndex:
    """The most recent earlier occurrence of every ``ngram``-token window, kept up to date
    as tokens are committed (O(new tokens) per cycle, host-side, no sync)."""

    def __init__(self, tokens: list[int], ngram: int = 3):
        self.ngram = ngram
        self.tokens: list[int] = []
        self.next_pos: dict[tuple[int, ...], int] = {}  # window -> index of the token after it
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        n, start = self.ngram, len(self.tokens)
        self.tokens.extend(tokens)
        # Index the windows whose following token is now known (never the current suffix).
        for end in range(max(start, n), len(self.tokens)):
            self.next_pos[tuple(self.tokens[end - n : end])] = end

    def lookup(self, max_len: int) -> list[int]:
        """The continuation (at most ``max_len`` tokens) after the last occurrence of the
        current suffix, or [] when the suffix never occurred before."""
        if max_len <= 0 or len(self.tokens) < self.ngram:
            return []
        pos = self.next_pos.get(tuple(self.tokens[-self.ngram :]))
        return [] if pos is None else self.tokens[pos : pos + max_len]
