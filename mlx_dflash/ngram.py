"""N-gram drafts from the target's own text: a lookup table of what the target says next.

Built from the target's greedy responses in the training feature store (never the eval files):
for every context of 1..``max_n`` tokens seen at least ``min_count`` times, the token that most
often followed it and how often (``prob``). A draft is the greedy rollout of that table, each
step backing off from the longest matching context; ``prob`` of each step multiplied gives the
chance that the drafted prefix survives, which the scheduler weighs against the drafter's block
(REST, He et al. 2024, retrieves from a datastore the same way; ours is a few MB). Like a copied
block it is a point-mass proposal, so verification stays exact at every temperature.

Stored beside a drafter as ``ngram.npz`` (``ctx{n}`` [M, n], ``next{n}`` [M], ``prob{n}`` [M]).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

FILE_NAME = "ngram.npz"


class NgramTable:
    def __init__(self, entries: dict[tuple[int, ...], tuple[int, float]], max_n: int):
        self.entries = entries  # context -> (next token, P(next | context))
        self.max_n = max_n

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], max_n: int = 4, min_count: int = 2,
              min_prob: float = 0.2) -> NgramTable:
        """From token sequences (the target's responses: contexts may reach into the prompt,
        but only response tokens are counted as continuations, pass (tokens, start) pairs or
        plain sequences)."""
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in sequences:
            tokens, start = (seq if isinstance(seq, tuple) else (seq, 0))
            tokens = [int(t) for t in tokens]
            for j in range(max(start, 1), len(tokens)):
                for n in range(1, min(max_n, j) + 1):
                    counts[tuple(tokens[j - n : j])][tokens[j]] += 1
        entries = {}
        for ctx, c in counts.items():
            token, count = c.most_common(1)[0]
            prob = count / sum(c.values())
            if count >= min_count and prob >= min_prob:
                entries[ctx] = (token, prob)
        return cls(entries, max_n)

    def save(self, path: str | Path) -> None:
        arrays = {}
        for n in range(1, self.max_n + 1):
            rows = [(ctx, nxt, p) for ctx, (nxt, p) in self.entries.items() if len(ctx) == n]
            arrays[f"ctx{n}"] = np.array([r[0] for r in rows], dtype=np.uint32).reshape(-1, n)
            arrays[f"next{n}"] = np.array([r[1] for r in rows], dtype=np.uint32)
            arrays[f"prob{n}"] = np.array([r[2] for r in rows], dtype=np.float16)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        try:
            data = np.load(path)
            max_n = max(int(k[3:]) for k in data.files if k.startswith("ctx"))
            entries = {}
            for n in range(1, max_n + 1):
                ctx, nxt, prob = data[f"ctx{n}"], data[f"next{n}"], data[f"prob{n}"]
                entries.update(zip(map(tuple, ctx.tolist()),
                                   zip(nxt.tolist(), prob.astype(np.float32).tolist())))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"n-gram table {path} cannot be read: {e}") from e
        return cls(entries, max_n)

    def check_vocab(self, vocab_size: int, where: str) -> None:
        """Refuse a table whose token ids do not fit the target's vocabulary."""
        top = max((max(max(ctx), nxt) for ctx, (nxt, _) in self.entries.items()), default=-1)
        if top >= vocab_size:
            raise ValueError(f"{where}: n-gram table holds token id {top}, the target's "
                             f"vocabulary has {vocab_size}")

    def draft(self, history: Sequence[int], max_len: int) -> tuple[list[int], list[float]]:
        """Up to ``max_len`` tokens after ``history``, and P(step | the steps before) of each:
        the longest known context decides each step (no step when it is too uncertain)."""
        h = list(history[-self.max_n :])
        tokens: list[int] = []
        probs: list[float] = []
        while len(tokens) < max_len:
            for n in range(min(self.max_n, len(h)), 0, -1):
                hit = self.entries.get(tuple(h[-n:]))
                if hit is not None:
                    break
            else:
                break
            tokens.append(hit[0])
            probs.append(hit[1])
            h = h[1:] + [hit[0]] if len(h) >= self.max_n else h + [hit[0]]
        return tokens, probs
