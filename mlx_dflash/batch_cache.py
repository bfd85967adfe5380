"""A batch of per-request KV caches in one array, each row with its own length.

Rows share the write position (``_idx``); ``valid`` marks the slots a row holds, so after a
batched verify each row keeps its own accepted prefix and masks out the rest (rejected drafts,
padding) instead of moving anything. RoPE reads ``offset``: each row's own next position. The
holes are squeezed out now and then (``compact``). mlx-lm's models drive it through the usual
cache calls (``offset``, ``make_mask``, ``update_and_fetch``).

Every layer kind a target has gets its own batch cache (``make_batch_cache``):

* full attention: a :class:`RaggedKVCache` (:class:`QuantizedRaggedKVCache` when the target's
  KV caches are quantized: target.quantize_kv);
* sliding window: a :class:`RaggedKVCache` with ``window``: its mask also hides, for each row
  and query, the positions older than the window, and squeezing out the holes drops them;
* recurrent (Gated DeltaNet): a :class:`BatchRecurrentCache`, every row's conv window and state
  stacked. The verify pass is recorded as a single request's is (``Target.forward``), and
  :meth:`BatchTargetCache.commit` restores each row to its state after its own accepted prefix.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from .target import (
    FULL, RECURRENT, SLIDING, Target, TargetCache, _parts, each_part, filled_kv,
    rotating_from_window, window_kv,
)


class BatchNotSupported(ValueError):
    """The target has layers a batch cache cannot hold."""


class RaggedKVCache:
    """Full-attention layer of many requests (``window``: a sliding-window layer)."""

    step = 256  # slots added at a time

    def __init__(self, window: int | None = None):
        self.window = window
        # [rows] position of each row's first held slot: 0 unless old window positions went
        self.base = mx.zeros((0,), dtype=mx.int32)
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
        kv = [*_parts(self.keys), *_parts(self.values)] if self.keys is not None else []
        return [*kv, self.valid, self.offset, self.base]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # -- what the model calls -------------------------------------------------------------------
    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs) -> mx.array:
        """[rows, 1, N, _idx + N]: the row's held slots, and the pass's own causally; with
        ``window_size``, only those less than that many positions before each query."""
        slots = mx.arange(self._idx + N)
        causal = slots[None, :] <= (self._idx + mx.arange(N))[:, None]  # [N, T]
        held = mx.concatenate([self.valid[:, : self._idx],
                               mx.ones((self.rows, N), dtype=mx.bool_)], axis=1)
        mask = held[:, None, None, :] & causal[None, None]
        if window_size is None:
            return mask
        # A row's held slots are its positions in order, from its base on.
        positions = self.base[:, None] + mx.cumsum(held.astype(mx.int32), axis=1) - 1
        queries = self.offset[:, None] + mx.arange(N)  # [rows, N]
        recent = positions[:, None, :] > queries[:, :, None] - window_size  # [rows, N, T]
        return mask & recent[:, None]

    def tree_mask(self, positions: mx.array, visible: mx.array, window: int | None
                  ) -> mx.array:
        """[rows, 1, L, _idx + L] for a tree pass (tree.py): the row's held slots (with
        ``window``, those less than a window before each query's position), and of the pass's
        rows those ``visible`` [rows, L, L] marks (within the window)."""
        held = self.valid[:, None, : self._idx]  # [rows, 1, _idx]
        own = visible
        if window is not None:
            held_positions = self.base[:, None] + mx.cumsum(held[:, 0].astype(mx.int32), 1) - 1
            queries = self.offset[:, None] + positions  # [rows, L]
            held = held & (held_positions[:, None, :] > queries[:, :, None] - window)
            own = own & (positions[:, :, None] - positions[:, None, :] < window)
        L = positions.shape[1]
        held = mx.broadcast_to(held, (self.rows, L, self._idx))
        return mx.concatenate([held, own], axis=2)[:, None]

    def stored(self, x: mx.array) -> Any:
        """Keys or values as this cache holds them."""
        return x

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        S = keys.shape[2]
        keys, values = self.stored(keys), self.stored(values)
        self._reserve(self._idx + S, keys, values)
        start = self._idx
        for held, new in zip([*_parts(self.keys), *_parts(self.values)],
                             [*_parts(keys), *_parts(values)]):
            held[..., start : start + S, :] = new
        self._pass = (start, self.offset)
        self.offset = self.offset + S
        self._idx += S
        return (each_part(lambda x: x[..., : self._idx, :], self.keys),
                each_part(lambda x: x[..., : self._idx, :], self.values))

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

    def commit_rows(self, kept: Sequence[Sequence[int]]) -> None:
        """After a batched tree pass: row i keeps the pass's rows ``kept[i]`` (the anchor and
        its accepted path: in slot order, their positions in order)."""
        start, offset = self._pass
        S = self._idx - start
        keep = np.zeros((self.rows, S), dtype=bool)
        for i, rows in enumerate(kept):
            keep[i, list(rows)] = True
        self.valid[:, start : start + S] = mx.array(keep)
        self.offset = offset + mx.array([len(r) for r in kept], dtype=mx.int32)
        self.lengths = [n + len(r) for n, r in zip(self.lengths, kept)]
        self._pass = None

    def discard(self) -> None:
        """Forget the last pass entirely (its slots are written over by the next)."""
        start, offset = self._pass
        self._idx, self.offset, self._pass = start, offset, None

    def add_row(self, cache: Any) -> None:
        """A new row holding what a prefilled request's layer cache holds (a sliding window's
        last ``window - 1`` positions: all the next pass reads); it starts at slot 0 and its
        gap up to ``_idx`` stays masked."""
        if self.window is None:
            keys, values = filled_kv(cache)
            start = 0
        else:
            keys, values, start = window_kv(cache, self.window - 1)
        P = _parts(keys)[0].shape[2]
        self._idx = max(self._idx, P)
        self._reserve(self._idx, keys, values)
        capacity = self.capacity
        pad = [(0, 0), (0, 0), (0, capacity - P), (0, 0)]
        self.keys = _join(self.keys, each_part(lambda x: mx.pad(x, pad), keys))
        self.values = _join(self.values, each_part(lambda x: mx.pad(x, pad), values))
        self.valid = mx.concatenate([self.valid, (mx.arange(capacity) < P)[None]], axis=0)
        self.offset = mx.concatenate([self.offset, mx.array([start + P], dtype=mx.int32)])
        self.base = mx.concatenate([self.base, mx.array([start], dtype=mx.int32)])
        self.lengths.append(P)

    def row_cache(self, row: int) -> KVCache | RotatingKVCache:
        """One row as a single request's cache: its held slots, in order."""
        T, n = self._idx, self.lengths[row]
        slots = mx.arange(T)
        order = mx.argsort(mx.where(self.valid[row, :T], slots, T + slots))[:n]
        keys = each_part(lambda x: x[row : row + 1, :, :T][:, :, order], self.keys)
        values = each_part(lambda x: x[row : row + 1, :, :T][:, :, order], self.values)
        if self.window is not None:
            offset = self.base[row].item() + n  # (a row leaving: not per token)
            return rotating_from_window(keys, values, offset, self.window)
        cache = self.single_cache()
        cache.keys, cache.values, cache.offset = keys, values, n
        return cache

    def single_cache(self) -> KVCache:
        """An empty single request's cache of this layer's kind."""
        return KVCache()

    @property
    def capacity(self) -> int:
        return _parts(self.keys)[0].shape[2]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (finished requests leave)."""
        if not rows:
            self.__init__(self.window)  # empty: the next request starts a fresh array
            return
        idx = mx.array(list(rows), dtype=mx.int32)
        if self.keys is not None:
            self.keys = each_part(lambda x: x[idx], self.keys)
            self.values = each_part(lambda x: x[idx], self.values)
        self.valid, self.offset, self.base = self.valid[idx], self.offset[idx], self.base[idx]
        self.lengths = [self.lengths[i] for i in rows]
        self.compact()

    def compact(self, force: bool = False) -> None:
        """Squeeze out the holes when they take up a quarter of the slots (or ``force``):
        every row's held slots move to the front, in order. A sliding window's rows keep only
        the ``window - 1`` newest positions (all the next pass reads)."""
        if self.keys is None or not self.lengths:
            return
        kept = (self.lengths if self.window is None
                else [min(n, self.window - 1) for n in self.lengths])
        longest, T = max(kept), self._idx
        if not force and T - longest < max(32, T // 4):
            return
        slots = mx.arange(T)
        valid = self.valid[:, :T]
        if kept != self.lengths:  # the oldest held slots of each row go too
            dropped = mx.array([n - k for n, k in zip(self.lengths, kept)], dtype=mx.int32)
            valid = valid & (mx.cumsum(valid.astype(mx.int32), axis=1) > dropped[:, None])
            self.base = self.base + dropped
            self.lengths = kept
        order = mx.argsort(mx.where(valid, slots, T + slots), axis=1)[:, :longest]
        capacity = self.capacity
        pad = [(0, 0), (0, 0), (0, capacity - longest), (0, 0)]

        def squeezed(x: mx.array) -> mx.array:
            return mx.pad(mx.take_along_axis(x[..., :T, :], order[:, None, :, None], axis=2), pad)

        self.keys, self.values = each_part(squeezed, self.keys), each_part(squeezed, self.values)
        self.valid = mx.arange(capacity)[None, :] < mx.array(self.lengths)[:, None]
        self._idx = longest

    def _reserve(self, slots: int, keys: Any, values: Any) -> None:
        """Room for ``slots`` slots in every row (grown ``step`` at a time)."""
        if self.keys is not None and slots <= self.capacity:
            return
        capacity = -(-slots // self.step) * self.step
        if self.keys is None:
            rows = self.rows

            def empty(x: mx.array) -> mx.array:
                return mx.zeros((rows, x.shape[1], capacity, x.shape[3]), dtype=x.dtype)

            self.keys, self.values = each_part(empty, keys), each_part(empty, values)
            self.valid = mx.zeros((rows, capacity), dtype=mx.bool_)
            return
        grow = capacity - self.capacity
        pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
        self.keys = each_part(lambda x: mx.pad(x, pad), self.keys)
        self.values = each_part(lambda x: mx.pad(x, pad), self.values)
        self.valid = mx.pad(self.valid, [(0, 0), (0, grow)])


class QuantizedRaggedKVCache(RaggedKVCache):
    """A full-attention layer of many requests with quantized keys and values (each held as
    packed values, scales and biases); mlx-lm's attention reads it quantized (``bits``)."""

    def __init__(self, bits: int, group_size: int):
        super().__init__()
        self.bits, self.group_size = bits, group_size

    def stored(self, x: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def single_cache(self) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def keep_rows(self, rows: Sequence[int]) -> None:
        if not rows:
            self.__init__(self.bits, self.group_size)
            return
        super().keep_rows(rows)


def _join(held: Any, new: Any) -> Any:
    """Rows ``new`` stacked after ``held`` (arrays, or tuples of them)."""
    if isinstance(held, tuple):
        return tuple(mx.concatenate([h, n], axis=0) for h, n in zip(held, new))
    return mx.concatenate([held, new], axis=0)


class BatchRecurrentCache(ArraysCache):
    """Recurrent layer (Gated DeltaNet conv window and state) of many requests: every array
    stacked [rows, ...]. A verify pass advances each row through all the pass's positions;
    :meth:`BatchTargetCache.commit` then restores each row to its own accepted prefix."""

    def __init__(self, size: int):
        super().__init__(size)
        self.rows = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache if a is not None)

    def add_row(self, cache: ArraysCache) -> None:
        """A new row holding a prefilled request's conv window and state."""
        if any(a is None for a in cache.cache):
            raise ValueError("a recurrent row needs a cache that has seen its prompt")
        self.cache = (list(cache.cache) if self.rows == 0 else
                      [mx.concatenate([a, b]) for a, b in zip(self.cache, cache.cache)])
        self.rows += 1

    def row_cache(self, row: int) -> ArraysCache:
        """One row as a single request's cache."""
        cache = ArraysCache(len(self.cache))
        cache.cache = [a[row : row + 1] for a in self.cache]
        return cache

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order."""
        if not rows:
            self.__init__(len(self.cache))
            return
        self.filter(mx.array(list(rows), dtype=mx.int32))
        self.rows = len(rows)

    def commit(self, kept: Sequence[int]) -> None:
        """Nothing of its own: the pass's record restores the states (BatchTargetCache)."""

    def commit_rows(self, kept: Sequence[Sequence[int]]) -> None:
        """Likewise, after a tree pass."""

    def discard(self) -> None:
        """Likewise (BatchTargetCache)."""

    def compact(self, force: bool = False) -> None:
        """Nothing to squeeze: one state per row."""


class BatchTargetCache(TargetCache):
    """A batch's per-layer caches (rows in the same order in every layer) and the last verify
    pass's record (``Target.forward``), which a recurrent layer's rollback needs."""

    def add_row(self, cache: Sequence[Any]) -> None:
        """A prefilled request's caches (one per layer) as a new row of every layer."""
        for layer, c in zip(self, cache):
            layer.add_row(c)

    def commit(self, kept: Sequence[int]) -> None:
        """After a batched pass: row ``i`` keeps the first ``kept[i]`` positions it wrote, in
        every layer (recurrent rows restored to their state after them)."""
        for record in self._recurrent_records():
            record.restore_rows(kept)
        for layer in self:
            layer.commit(kept)
        self.last_pass = None  # the record keeps the pass's inputs alive

    def commit_rows(self, kept: Sequence[Sequence[int]]) -> None:
        """After a batched tree pass (``Target.forward_tree``): row ``i`` keeps the pass's
        rows ``kept[i]``, its anchor and accepted path, in every layer (recurrent rows take
        the state after that path)."""
        for record in self._recurrent_records():
            record.keep_paths([rows[-1] for rows in kept])
        for layer in self:
            layer.commit_rows(kept)
        self.last_pass = None

    def discard(self) -> None:
        """Forget the last pass entirely."""
        for record in self._recurrent_records():
            record.cache.cache = list(record.before)
        for layer in self:
            layer.discard()
        self.last_pass = None

    def keep_rows(self, rows: Sequence[int]) -> None:
        for layer in self:
            layer.keep_rows(rows)

    def compact(self, force: bool = False) -> None:
        for layer in self:
            layer.compact(force)

    def row_cache(self, row: int) -> TargetCache:
        """One row as a single request's caches."""
        return TargetCache([layer.row_cache(row) for layer in self])

    @property
    def slots(self) -> int:
        """Slots the attention layers' rows span: the context a pass reads (a full-attention
        layer's, when there is one)."""
        attention = [layer for layer in self if isinstance(layer, RaggedKVCache)]
        full = [layer for layer in attention if layer.window is None]
        return (full or attention)[0].slots if attention else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self)

    @property
    def state(self) -> list[mx.array]:
        return [a for layer in self for a in (
            layer.state if isinstance(layer, RaggedKVCache) else layer.cache) if a is not None]

    def _recurrent_records(self) -> list[Any]:
        record = self.last_pass
        if record is None:
            return []
        if record.recurrent is None and any(isinstance(c, ArraysCache) for c in self):
            raise ValueError("the last pass did not record its recurrent layers: run it with "
                             "Target.forward")
        return record.recurrent or []


def make_batch_cache(target: Target) -> BatchTargetCache:
    """An empty batch cache for the target: one per layer, of its kind."""
    layers = []
    for i, (kind, c) in enumerate(zip(target.layer_kinds, target.make_cache())):
        if kind == FULL and isinstance(c, QuantizedKVCache):
            layers.append(QuantizedRaggedKVCache(c.bits, c.group_size))
        elif kind == FULL:
            layers.append(RaggedKVCache())
        elif (kind == SLIDING and isinstance(c, RotatingKVCache) and not c.keep
              and c.max_size == target.window):
            layers.append(RaggedKVCache(window=target.window))
        elif kind == RECURRENT and isinstance(c, ArraysCache):
            layers.append(BatchRecurrentCache(len(c.cache)))
        else:
            raise BatchNotSupported(
                f"model type '{target.model_type}': layer {i} ({kind}, {type(c).__name__}) "
                "cannot be batched")
    return BatchTargetCache(layers)
