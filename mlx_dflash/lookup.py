"""Copy drafts (prompt lookup): when the last few committed tokens occurred before, in the
prompt or the output, the tokens that followed them then are a candidate block.

Math and code copy a lot from their prompts (names, numbers, expressions). A copied block is
verified like any draft; at temperature > 0 it is a point-mass proposal, so rejection
sampling stays exact.
"""

from __future__ import annotations


# Earlier occurrences of each window a lookup can branch into (the latest ones).
BRANCH_MEMORY = 4


class CopyIndex:
    """The most recent earlier occurrence of every window of ``ngram`` to ``longest`` tokens,
    kept up to date as tokens are committed (O(new tokens) per cycle, host-side, no sync).

    A lookup prefers the longest window that occurred before: trying 4, 3 then 2 tokens
    accepts more than 2 alone (docs/training.md has the comparison).
    """

    def __init__(self, tokens: list[int], ngram: int = 3, longest: int | None = None):
        self.ngram = ngram
        self.sizes = list(range(max(longest or ngram, ngram), ngram - 1, -1))  # longest first
        self.tokens: list[int] = []
        # window -> indices of the tokens after its last BRANCH_MEMORY occurrences (latest
        # last), one table per window size
        self.next_pos: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        # Index the windows whose following token is now known (never the current suffix).
        for n in self.sizes:
            table = self.next_pos[n]
            for end in range(max(start, n), len(self.tokens)):
                ends = table.setdefault(tuple(self.tokens[end - n : end]), [])
                ends.append(end)
                if len(ends) > BRANCH_MEMORY:
                    del ends[0]

    def lookup(self, max_len: int) -> list[int]:
        """The continuation (at most ``max_len`` tokens) after the last occurrence of the
        longest current suffix that occurred before, or [] when none did."""
        return self.lookup_window(max_len)[1]

    def lookup_window(self, max_len: int) -> tuple[int, list[int]]:
        """``lookup`` with the length of the window it matched (0 and [] when none)."""
        if max_len <= 0:
            return 0, []
        n, ends = self._matched()
        return (n, self.tokens[ends[-1] : ends[-1] + max_len]) if ends else (0, [])

    def _matched(self) -> tuple[int, list[int]]:
        """(size, where the following tokens start, latest last) of the longest current
        suffix that occurred before; (0, []) when none did."""
        for n in self.sizes:
            ends = self.next_pos[n].get(tuple(self.tokens[-n:])) if len(self.tokens) >= n else None
            if ends:
                return n, ends
        return 0, []

    def lookup_branches(self, max_len: int, most: int = BRANCH_MEMORY) -> list[list[int]]:
        """Up to ``most`` different continuations (each at most ``max_len`` tokens) after the
        latest occurrences of the longest current suffix that occurred before, the latest
        first: a tree's branches (tree.DraftTree.of_branches). [] when none occurred."""
        branches: list[list[int]] = []
        for end in reversed(self._matched()[1] if max_len > 0 else []):
            branch = self.tokens[end : end + max_len]
            if branch not in branches:
                branches.append(branch)
        return branches[:most]
