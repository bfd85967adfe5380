"""A batch of per-request KV caches in one array, each row with its own length.

Rows share the write position (``_idx``); ``valid`` marks the slots a row holds, so after a
batched verify each row keeps its own accepted prefix and masks out the rest (rejected drafts,
padding) instead of moving anything. RoPE reads ``offset``: each row's own next position. The
holes are squeezed out now and then (``compact``). mlx-lm's models drive it through the usual
cache calls (``offset``, ``make_mask``, ``update_and_fetch``).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class RaggedKVCache:
    step = 256  # slots added at a time

    def __init__(self):
        self.keys: mx.array | None = None  # [rows, heads, capacity, head_dim]
        self.values: mx.array | None = None
        self.valid = mx.zeros((0, 0), dtype=mx.bool_)  # [rows, capacity]
        self.offset = mx.zeros((0,), dtype=mx.int32)  # [rows] next position of each row
        self.lengths: list[int] = []  # positions each row holds (host side)
        self._idx = 0  # next slot written, the same for every row
        self._pass: tuple[int, mx.array] | None = None  # (first slot, offset) of the last pass

    @property
    def slots(self) -> int:
        """Slots every row spans (held positions and holes): what attention reads."""
        return self._idx

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values, self.valid, self.offset) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # -- what the model calls -------------------------------------------------------------------
    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs) -> mx.array:
        """[rows, 1, N, _idx + N]: the row's held slots, and the pass's own causally."""
        if window_size is not None:
            raise ValueError("a ragged batch cache holds full-attention layers only")
        slots = mx.arange(self._idx + N)
        causal = slots[None, :] <= (self._idx + mx.arange(N))[:, None]  # [N, T]
        held = mx.concatenate([self.valid[:, : self._idx],
                               mx.ones((self.rows, N), dtype=mx.bool_)], axis=1)
        return held[:, None, None, :] & causal[None, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        S = keys.shape[2]
        self._reserve(self._idx + S, keys, values)
        start = self._idx
        self.keys[..., start : start + S, :] = keys
        self.values[..., start : start + S, :] = values
        self._pass = (start, self.offset)
        self.offset = self.offset + S
        self._idx += S
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    # -- what the batch engine calls ------------------------------------------------------------
    def commit(self, kept: Sequence[int]) -> None:
        """After a batched pass: row i keeps the first ``kept[i]`` positions it wrote."""
        start, offset = self._pass
        S = self._idx - start
        keep = mx.array(list(kept), dtype=mx.int32)
        self.valid[:, start : start + S] = mx.arange(S)[None, :] < keep[:, None]
        self.offset = offset + keep
        self.lengths = [n + k for n, k in zip(self.lengths, kept)]
        self._pass = None

    def discard(self) -> None:
        """Forget the last pass entirely (its slots are written over by the next)."""
        start, offset = self._pass
        self._idx, self.offset, self._pass = start, offset, None

    def add_row(self, keys: mx.array, values: mx.array) -> None:
        """A new row holding ``keys`` / ``values`` [1, heads, P, head_dim] (a prefilled
        request); it starts at slot 0 and its gap up to ``_idx`` stays masked."""
        P = keys.shape[2]
        self._idx = max(self._idx, P)
        self._reserve(self._idx, keys, values)
        capacity = self.keys.shape[2]
        pad = [(0, 0), (0, 0), (0, capacity - P), (0, 0)]
        self.keys = mx.concatenate([self.keys, mx.pad(keys, pad)], axis=0)
        self.values = mx.concatenate([self.values, mx.pad(values, pad)], axis=0)
        self.valid = mx.concatenate([self.valid, (mx.arange(capacity) < P)[None]], axis=0)
        self.offset = mx.concatenate([self.offset, mx.array([P], dtype=mx.int32)])
        self.lengths.append(P)

    def row_cache(self, row: int) -> KVCache:
        """One row as a single request's cache: its held slots, in order."""
        T, n = self._idx, self.lengths[row]
        slots = mx.arange(T)
        order = mx.argsort(mx.where(self.valid[row, :T], slots, T + slots))[:n]
        cache = KVCache()
        cache.keys = self.keys[row : row + 1, :, :T][:, :, order]
        cache.values = self.values[row : row + 1, :, :T][:, :, order]
        cache.offset = n
        return cache

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (finished requests leave)."""
        if not rows:
            self.__init__()  # empty: the next request starts a fresh array
            return
        idx = mx.array(list(rows), dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.valid, self.offset = self.valid[idx], self.offset[idx]
        self.lengths = [self.lengths[i] for i in rows]
        self.compact()

    def compact(self, force: bool = False) -> None:
        """Squeeze out the holes when they take up a quarter of the slots (or ``force``):
        every row's held slots move to the front, in order."""
        if self.keys is None or not self.lengths:
            return
        longest, T = max(self.lengths), self._idx
        if not force and T - longest < max(32, T // 4):
            return
        slots = mx.arange(T)
        order = mx.argsort(mx.where(self.valid[:, :T], slots, T + slots), axis=1)[:, :longest]
        capacity = self.keys.shape[2]
        pad = [(0, 0), (0, 0), (0, capacity - longest), (0, 0)]
        self.keys = mx.pad(mx.take_along_axis(self.keys[..., :T, :], order[:, None, :, None],
                                              axis=2), pad)
        self.values = mx.pad(mx.take_along_axis(self.values[..., :T, :],
                                                order[:, None, :, None], axis=2), pad)
        self.valid = mx.arange(capacity)[None, :] < mx.array(self.lengths)[:, None]
        self._idx = longest

    def _reserve(self, slots: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``slots`` slots in every row (grown ``step`` at a time)."""
        if self.keys is not None and slots <= self.keys.shape[2]:
            return
        _, heads, _, k_dim = keys.shape
        capacity = -(-slots // self.step) * self.step
        if self.keys is None:
            rows = self.rows
            self.keys = mx.zeros((rows, heads, capacity, k_dim), dtype=keys.dtype)
            self.values = mx.zeros((rows, heads, capacity, values.shape[3]), dtype=values.dtype)
            self.valid = mx.zeros((rows, capacity), dtype=mx.bool_)
            return
        grow = capacity - self.keys.shape[2]
        pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        self.valid = mx.pad(self.valid, [(0, 0), (0, grow)])
