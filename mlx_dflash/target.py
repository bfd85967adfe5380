"""The target model: an mlx-lm model that also returns hidden states at the drafter's tap layers.

mlx-lm models have no hook for hidden states, so `Target.forward` runs the same modules the
model's own ``__call__`` runs (embedding, layers with the model's masks, final norm, head) and
keeps the outputs of the tap layers. The model's parameter tree is never touched and no mlx-lm
code is patched. What differs between architectures (which layers use which attention, sliding
windows, embedding scale) is in the table ``FAMILIES``, keyed by the mlx-lm module that defines
the decoder stack; an architecture outside the table is refused at load. On creation the forward
is also checked against ``model(x, cache)`` once, so a model whose forward differs anyway fails
loudly instead of silently changing the output.

Rollback after a partial accept is exact for every cache kind the table uses:

* full attention (``KVCache``, or ``QuantizedKVCache`` after :func:`quantize_kv`): trimmed in
  place (mlx-lm's ``trim``);
* sliding window (``RotatingKVCache``): a multi-token pass leaves the buffer in temporal order,
  so the rejected tail is cut off; after a one-token pass mlx-lm's ``trim`` is exact;
* Gated DeltaNet (``ArraysCache``: conv window + recurrent state; qwen3_next, qwen3_5): the state
  before the pass is kept (a reference, no copy) with the layer's inputs in the pass; rollback
  restores it and feeds the accepted positions through the layer's linear attention again
  ("replay"). Keeping the state after every position instead ("per_position") is implemented
  too, for measurement (BENCHMARKS.md compares the two).

A tree pass (``forward_tree``, tree.py) places each token at the position of its depth: for
the length of the pass each attention layer's rotary embedding is swapped for one that rotates
every token by its own position, and the pass gets a tree attention mask. Afterwards the KV
caches keep the anchor's and the accepted path's rows, moved to consecutive slots
(``keep_rows``; a sliding window's buffer is then cut as after a partial accept). Sliding-window
layers get a tree mask limited to their window. A recurrent (Gated DeltaNet) layer's state
follows one sequence, so it reads the pass as paths: row i's path (the anchor, i's ancestors,
i) is one batch row with its own copy of the state, right-padded to the deepest; row i's output
is its path's last, and the accepted path's state is the one its own batch row ends with (a
length per row, mlx-lm's right padding, stops each state at its path's end). Every family the
table covers takes tree passes (``tree_ready``), checked on first use against ordinary passes
and a continuation after ``keep_rows`` (with a context that wraps the window).

Split across machines by layers (mlx-lm's pipeline, distributed.py), each rank's Target runs its
own stage's layers (its caches, kinds and masks are those layers'), receives the hidden state
from the stage before and sends it on, as mlx-lm's model does; one gather then gives every rank
the last stage's output and every stage's tap features.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from . import attention, distributed

# Layer kinds, named as in Hugging Face configs' ``layer_types``.
FULL = "full_attention"
SLIDING = "sliding_attention"
RECURRENT = "linear_attention"

REPLAY = "replay"
PER_POSITION = "per_position"
RECURRENT_ROLLBACK = REPLAY  # measured cheaper at every block size (BENCHMARKS.md)


class UnsupportedTargetError(ValueError):
    pass


# -- per-family facts ---------------------------------------------------------------------------
# (A pipeline stage holds some layers only: the others are None, and these list its own.)
def _all_full(inner: nn.Module) -> list[str]:
    return [FULL for layer in inner.layers if layer is not None]


def _llama_kinds(inner: nn.Module) -> list[str]:
    return [SLIDING if layer.use_sliding else FULL for layer in inner.layers if layer is not None]


def _hybrid_kinds(inner: nn.Module) -> list[str]:
    return [RECURRENT if layer.is_linear else FULL for layer in inner.layers if layer is not None]


def _gpt_oss_kinds(inner: nn.Module) -> list[str]:
    return [FULL if kind == "full_attention" else SLIDING
            for kind, layer in zip(inner.layer_types, inner.layers) if layer is not None]


def _gemma3_kinds(inner: nn.Module) -> list[str]:
    p = inner.sliding_window_pattern
    return [FULL if i % p == p - 1 else SLIDING
            for i, layer in enumerate(inner.layers) if layer is not None]


def _gemma_embed_scale(inner: nn.Module, h: mx.array) -> mx.array:
    # Gemma multiplies embeddings by sqrt(hidden_size), rounded to bfloat16 as mlx-lm does.
    return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


@dataclass(frozen=True)
class Family:
    """What a decoder stack's ``__call__`` does beyond embed -> layers -> norm."""

    layer_kinds: Callable[[nn.Module], list[str]]  # FULL / SLIDING / RECURRENT per layer
    window: Callable[[nn.Module], int | None] = lambda inner: None  # sliding-window size
    embed_scale: Callable[[nn.Module, mx.array], mx.array] | None = None
    mask_array: bool = False  # attention that needs its causal mask as an array (MLA)


# Keyed by the mlx-lm module defining the decoder stack (``type(model.model).__module__``), so
# model types mlx-lm maps onto these modules (mistral -> llama), and the multimodal wrappers
# around them (qwen3_5_moe, gemma3), are covered by the same facts.
FAMILIES = {
    "llama": Family(_llama_kinds, window=lambda inner: inner.sliding_window),
    "qwen2": Family(_all_full),
    "qwen3": Family(_all_full),
    "qwen3_moe": Family(_all_full),
    "deepseek_v3": Family(_all_full, mask_array=True),
    "qwen3_next": Family(_hybrid_kinds),
    "qwen3_5": Family(_hybrid_kinds),
    "gpt_oss": Family(_gpt_oss_kinds, window=lambda inner: inner.window_size),
    "gemma3_text": Family(_gemma3_kinds, window=lambda inner: inner.window_size,
                          embed_scale=_gemma_embed_scale),
}


# -- Gated DeltaNet layers (qwen3_next, qwen3_5): x + linear_attn(norm(x)), then the MLP ----------
def _replay_recurrent(layer: nn.Module, h: mx.array, cache: ArraysCache) -> None:
    """Feed the layer's linear attention inputs it saw before, to advance its conv window and
    recurrent state; the output is discarded, so it is never computed."""
    x = layer.input_layernorm(h)
    layer.linear_attn(x, create_ssm_mask(x, cache), cache)


def _recurrent_layer_per_position(
    layer: nn.Module, h: mx.array, cache: ArraysCache
) -> tuple[mx.array, list[list[Any]]]:
    """The layer's output, with its linear attention run one position at a time so that the
    cache arrays after every position can be kept. The layer's own operations, position by
    position (matmuls of other shapes may round differently in the last bits)."""
    x = layer.input_layernorm(h)
    outputs, states = [], []
    for t in range(x.shape[1]):
        outputs.append(layer.linear_attn(x[:, t : t + 1], None, cache))
        states.append(list(cache.cache))
    h = h + mx.concatenate(outputs, axis=1)
    return h + layer.mlp(layer.post_attention_layernorm(h)), states


@dataclass
class _TreePaths:
    """A tree pass as a recurrent layer reads it: ``rows`` [B, L, D], row i's path (the anchor
    first, padded with the anchor after i); ``depths`` [B, L], where each path ends."""

    rows: mx.array
    depths: mx.array


def _recurrent_layer_on_paths(layer: nn.Module, h: mx.array, paths: _TreePaths,
                              cache: ArraysCache) -> tuple[mx.array, ArraysCache]:
    """The layer's output on a tree pass's rows [B, L, hidden], each row after its own path,
    and the cache after each row's path (batch row ``b * L + i``: row i of request b's).
    ``cache`` is left as it was."""
    B, L, D = paths.rows.shape
    x = layer.input_layernorm(h)[mx.arange(B)[:, None, None], paths.rows]  # [B, L, D, hidden]
    on_paths = ArraysCache(len(cache.cache))
    on_paths.cache = [None if a is None else mx.repeat(a, L, axis=0) for a in cache.cache]
    ends = paths.depths.reshape(-1)
    on_paths.lengths = ends + 1
    out = layer.linear_attn(x.reshape(B * L, D, -1), on_paths.make_mask(D), on_paths)
    on_paths.lengths = None
    h = h + out[mx.arange(B * L), ends].reshape(B, L, -1)
    return h + layer.mlp(layer.post_attention_layernorm(h)), on_paths


# -- what rolling back a pass needs -------------------------------------------------------------
@dataclass
class _RecurrentRecord:
    layer: nn.Module
    cache: ArraysCache
    before: list[Any]  # the cache arrays before the pass (references: arrays are immutable)
    inputs: mx.array | None = None  # replay: the layer's inputs in the pass
    states: list[list[Any]] | None = None  # per position: the cache arrays after each one
    paths: ArraysCache | None = None  # a tree pass: the cache after each row's path

    def restore(self, kept: int) -> None:
        """Set the cache to its state after the first ``kept`` positions of the pass."""
        if self.states is not None:
            self.cache.cache = list(self.states[kept - 1] if kept else self.before)
            return
        self.cache.cache = list(self.before)
        if kept:
            _replay_recurrent(self.layer, self.inputs[:, :kept], self.cache)

    def restore_rows(self, kept: Sequence[int]) -> None:
        """A batch cache's version of ``restore``: row ``i`` of the cache is set to its state
        after its own first ``kept[i]`` positions of the pass."""
        if self.states is not None:
            steps = [self.before] + self.states  # steps[t]: the arrays after t positions
            pick, rows = mx.array(list(kept)), mx.arange(len(kept))
            self.cache.cache = [mx.stack([s[j] for s in steps])[pick, rows]
                                for j in range(len(self.before))]
            return
        longest = max(kept)
        if min(kept) == longest == self.inputs.shape[1]:
            return  # every row kept the whole pass: the state after it stands
        self.cache.cache = list(self.before)
        if longest:
            # mlx-lm's right-padding lengths: each row's conv window and state stop advancing
            # after its own length (the masked positions leave them as they were).
            self.cache.lengths = mx.array(list(kept))
            _replay_recurrent(self.layer, self.inputs[:, :longest], self.cache)
            self.cache.lengths = None

    def keep_paths(self, rows: Sequence[int]) -> None:
        """After a tree pass: set each request's state (batch row b) to the one after the
        path of its pass row ``rows[b]``."""
        L = next(a for a in self.paths.cache if a is not None).shape[0] // len(rows)
        picked = mx.array([b * L + r for b, r in enumerate(rows)], dtype=mx.int32)
        self.cache.cache = [None if a is None else a[picked] for a in self.paths.cache]

    @property
    def nbytes(self) -> int:
        """Bytes this record keeps alive beyond the cache itself (the last per-position state
        is the cache's own)."""
        kept = list(self.before) + ([self.inputs] if self.inputs is not None else [])
        kept += [a for a in self.paths.cache] if self.paths is not None else []
        for state in (self.states or [])[:-1]:
            kept += state
        return sum(a.nbytes for a in kept if a is not None)


@dataclass
class _PassRecord:
    num_tokens: int
    recurrent: list[_RecurrentRecord] | None  # None: recurrent layers were not recorded


class TargetCache(list):
    """The model's per-layer caches, plus what an exact rollback of the last pass needs."""

    def __init__(self, caches: Sequence[Any]):
        super().__init__(caches)
        self.last_pass: _PassRecord | None = None

    @property
    def rollback_nbytes(self) -> int:
        """Bytes held for rolling back the last pass (recurrent layers' inputs or states)."""
        if self.last_pass is None or not self.last_pass.recurrent:
            return 0
        return sum(r.nbytes for r in self.last_pass.recurrent)


def fork_layer_cache(c: Any) -> Any:
    """A layer cache with the same contents whose writes never reach ``c``: new array objects
    over the same values (MLX copies a buffer on the first write when it is shared)."""
    if type(c) is KVCache:
        new = KVCache()
        if c.keys is not None:  # only the filled part: a later write copies no stale slots
            new.keys, new.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        new.offset = c.offset
        return new
    if isinstance(c, ArraysCache):  # recurrent layers replace their arrays, never write into them
        new = ArraysCache(len(c.cache))
        new.cache, new.left_padding, new.lengths = list(c.cache), c.left_padding, c.lengths
        return new
    return type(c).from_state(tree_map(lambda x: x[...] if isinstance(x, mx.array) else x,
                                       c.state))


def _parts(a: Any) -> tuple[mx.array, ...]:
    """A cache's keys (or values): one array, or a quantized cache's (packed, scales, biases)."""
    return a if isinstance(a, tuple) else (a,)


def each_part(f: Callable[[mx.array], mx.array], a: Any) -> Any:
    """``f`` on a cache's keys (or values): the array, or each of a quantized cache's three."""
    return tuple(f(x) for x in a) if isinstance(a, tuple) else f(a)


def head_dim(args: Any) -> int:
    """The width of one attention head of a model with these args."""
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def can_cut_back(layers: Sequence[Any]) -> bool:
    """Whether every layer cache can be cut back to any shorter prefix, exactly (plain KV, or a
    sliding window that has not wrapped yet; never a recurrent state)."""
    return can_trim_prompt_cache(list(layers)) and all(
        not isinstance(c, ArraysCache) for c in layers)


def filled_kv(c: KVCache | QuantizedKVCache) -> tuple[Any, Any]:
    """A full-attention cache's keys and values [1, heads, positions, head_dim], the filled
    part (a quantized cache's: each its packed values, scales and biases)."""
    def filled(x: mx.array) -> mx.array:
        return x[..., : c.offset, :]

    return each_part(filled, c.keys), each_part(filled, c.values)


def window_kv(c: RotatingKVCache, n: int) -> tuple[mx.array, mx.array, int]:
    """The last ``n`` positions (or all it holds, if fewer) a sliding-window cache holds, in
    order: keys and values [1, heads, m, head_dim] and the position of the first one."""
    if c.keys is None:
        raise ValueError("the sliding-window cache is empty")
    if c.keep:
        raise ValueError("sliding-window caches that keep their first positions are not held")
    keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
    # A buffer cut back after a pass may lead with one free slot (see _trim_rotating): only
    # ever take the newest positions, never more than the cache has seen.
    m = min(n, c.offset, keys.shape[2])
    return keys[..., -m:, :], values[..., -m:, :], c.offset - m


def rotating_from_window(keys: mx.array, values: mx.array, offset: int, max_size: int
                         ) -> RotatingKVCache:
    """A sliding-window cache holding ``keys`` / ``values`` (the newest positions before
    ``offset``, in order, at least ``max_size - 1`` of them once ``offset`` reaches that), in
    the layout a cut-back pass leaves (``_trim_rotating``), so that mlx-lm's updates of any
    length continue from it."""
    keys, values = keys[..., -(max_size - 1):, :], values[..., -(max_size - 1):, :]
    if offset >= max_size:  # a wrapped window: one free slot first, where the next write goes
        def free_slot_first(a: mx.array) -> mx.array:
            free = mx.zeros((*a.shape[:2], 1, a.shape[3]), dtype=a.dtype)
            return mx.concatenate([free, a], axis=2)

        keys, values = free_slot_first(keys), free_slot_first(values)
    cache = RotatingKVCache(max_size=max_size)
    cache.state = (keys, values, offset, 0, max_size, keys.shape[2])
    return cache


def positions_held(c: Any) -> int | None:
    """Positions a layer cache holds, or None for a recurrent state (it does not count)."""
    return None if isinstance(c, ArraysCache) else c.offset


def cut_back(layers: Sequence[Any], n: int) -> None:
    """Cut every layer back to its first ``n`` positions (check ``can_cut_back`` first)."""
    for c in layers:
        c.trim(c.offset - n)


def _trim_rotating(cache: RotatingKVCache, n: int, pass_tokens: int) -> None:
    if pass_tokens == 1:
        # A one-token pass wrote one slot in place. Moving the write position back is exact:
        # the key it overwrote (the oldest) is outside the window of every later position.
        cache.trim(n)
        return
    # A multi-token pass left the buffer in temporal order, ending with the pass: cut the
    # rejected tail (mlx-lm's trim would leave it in the buffer once the window is full).
    keys, values, offset, keep, max_size, idx = cache.state
    if idx != keys.shape[2]:
        raise RuntimeError("rotating cache is not in the layout a multi-token pass leaves")
    keys, values = keys[..., : idx - n, :], values[..., : idx - n, :]
    offset, idx = offset - n, idx - n
    if idx < max_size <= offset:
        # A whole pass cut back leaves max_size - 1 keys, all a one-token pass needs, but
        # mlx-lm's in-place update would try to grow a wrapped buffer: add a free slot after
        # the kept prefix, where the next write goes (and the next multi-token pass trims).
        def pad(a: mx.array) -> mx.array:
            free = mx.zeros((*a.shape[:2], 1, a.shape[3]), dtype=a.dtype)
            return mx.concatenate([a[..., :keep, :], free, a[..., keep:, :]], axis=2)

        keys, values, idx = pad(keys), pad(values), idx + 1
    cache.state = (keys, values, offset, keep, max_size, idx)


class _DepthRope:
    """A rotary embedding that puts token i of batch row b at ``offset[b] + positions[b, i]``:
    each token is rotated as a batch row of its own (MLX's rope takes one offset per row)."""

    def __init__(self, rope: Any, positions: mx.array):
        self.rope, self.positions = rope, positions  # [B, L]

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        B, H, L, D = x.shape
        rows = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        if isinstance(offset, mx.array) and offset.ndim:
            offset = offset[:, None]  # a batch cache: each row's own
        rotated = self.rope(rows, offset=(offset + self.positions).reshape(-1))
        return rotated.reshape(B, L, H, D).transpose(0, 2, 1, 3)


def _depend(cache: Any, h: mx.array) -> None:
    """Make a layer cache's arrays depend on ``h``, as mlx-lm's pipeline does: evaluating the
    caches alone (a prefill chunk) then runs the stages' messages too, on every rank."""
    if cache is None:
        return
    if isinstance(cache, ArraysCache):
        cache[0] = mx.depends(cache[0], h)
    elif getattr(cache, "keys", None) is not None:
        cache.keys = mx.depends(cache.keys, h)


def _only_kv(cache: Sequence[Any]) -> bool:
    """All layers trimmable at any depth (plain / quantized KV caches)."""
    return all(
        not isinstance(c, (RotatingKVCache, ArraysCache)) and c.is_trimmable() for c in cache
    )


# -- the adapter --------------------------------------------------------------------------------
def _text_model(model: nn.Module) -> nn.Module:
    """The language model inside a multimodal wrapper (qwen3_5, gemma3), else the model."""
    lm = getattr(model, "language_model", None)
    return lm if isinstance(lm, nn.Module) and hasattr(lm, "model") else model


class Target:
    """Wraps an mlx-lm model; owns all knowledge of mlx-lm model internals.

    ``model`` is the language model (for a multimodal wrapper, its ``language_model``);
    ``recurrent_rollback`` chooses how Gated DeltaNet states are rolled back (``"replay"`` or
    ``"per_position"``; both exact).
    """

    def __init__(
        self, model: nn.Module, check: bool = True, recurrent_rollback: str = RECURRENT_ROLLBACK
    ):
        text_model = _text_model(model)
        inner = getattr(text_model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise UnsupportedTargetError(
                f"target model {type(model).__module__} has no .model.layers / .model.embed_tokens;"
                " only standard decoder-only mlx-lm models are supported"
            )
        if recurrent_rollback not in (REPLAY, PER_POSITION):
            raise ValueError(f"recurrent_rollback must be '{REPLAY}' or '{PER_POSITION}'")
        args = text_model.args
        outer_args = getattr(model, "args", args)
        self.model_type = getattr(outer_args, "model_type", None) or type(model).__module__
        self.family = self._family(inner)
        self.model = text_model
        self.inner = inner
        # A pipeline stage (distributed.py) runs layers start..end-1 only; caches, kinds and
        # masks below are its own layers', in order; tap layer ids stay global.
        self.stages = int(getattr(inner, "pipeline_size", 1))
        start, end = (inner.start_idx, inner.end_idx) if self.stages > 1 else (0, len(inner.layers))
        self.here = list(range(start, end))
        self.layers_here = [inner.layers[i] for i in self.here]
        self.num_layers = (int(args.num_hidden_layers) if self.stages > 1
                           else len(inner.layers))
        self.hidden_size = int(args.hidden_size)
        self.vocab_size = int(args.vocab_size)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(
            text_model, "lm_head"
        )
        self.layer_kinds = self.family.layer_kinds(inner)
        self.window = self.family.window(inner)
        # Masks are built once per pass from the first layer of each kind, as mlx-lm does.
        self._first_of_kind = {k: self.layer_kinds.index(k) for k in set(self.layer_kinds)}
        self.recurrent_rollback = recurrent_rollback
        self._check_caches()
        # A stage of a split mlx-lm does not pipeline (distributed._split_layers) has no
        # model(x) to compare with: its own __call__ does not run the split.
        if check and (self.stages == 1 or hasattr(inner, "pipeline")):
            self._check_forward(model)

    def _family(self, inner: nn.Module) -> Family:
        module = type(inner).__module__
        name = module.rsplit(".", 1)[-1]
        if not module.startswith("mlx_lm.models.") or name not in FAMILIES:
            raise UnsupportedTargetError(
                f"model type '{self.model_type}' ({module}) is not a supported target; "
                f"supported mlx-lm families: {', '.join(FAMILIES)}"
            )
        return FAMILIES[name]

    @property
    def args(self) -> Any:
        """The language model's ModelArgs (hidden size, heads, ...)."""
        return self.model.args

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the target computes in (its embedding's, or its scales' if quantized)."""
        emb = self.inner.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    # -- the pieces the drafter shares ------------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings as the first layer sees them (scaled where the family scales them,
        as Hugging Face's embedding modules do, so drafters trained on HF targets match)."""
        h = self.inner.embed_tokens(tokens)
        if self.family.embed_scale is not None:
            h = self.family.embed_scale(self.inner, h)
        return h

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The LM head's rows for ``ids`` as a dense float matrix [len(ids), D]."""
        layer = self.inner.embed_tokens if self.tied else self.model.lm_head
        if hasattr(layer, "scales"):  # quantized embedding or linear
            biases = getattr(layer, "biases", None)
            return mx.dequantize(layer.weight[ids], layer.scales[ids],
                                 None if biases is None else biases[ids],
                                 group_size=layer.group_size, bits=layer.bits,
                                 mode=getattr(layer, "mode", "affine"))
        return layer.weight[ids]

    # -- forward with features ---------------------------------------------------------------
    @property
    def kv_quantization(self) -> tuple[int, int] | None:
        """(bits, group size) of the full-attention layers' KV caches (:func:`quantize_kv`), or
        None for full precision."""
        entry = _kv_quantized.get(id(self.model))
        return entry[1] if entry is not None and entry[0]() is self.model else None

    def make_cache(self) -> TargetCache:
        caches = make_prompt_cache(self.model)
        quantized = self.kv_quantization
        if quantized is not None:  # sliding windows and recurrent states stay as they are
            bits, group = quantized
            caches = [QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
                      for c in caches]
        return TargetCache(caches)

    def hidden_states(
        self,
        tokens: mx.array,
        cache: list[Any] | None,
        layer_ids: Sequence[int],
        record: bool = False,
        mask: mx.array | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Run the decoder stack. Returns (final post-norm hidden, concatenated tap features).

        With ``record`` (and a cache from ``make_cache``), keep what rolling back part of this
        pass needs for recurrent layers (their inputs or per-position states). ``mask``: the
        attention mask of every layer, or a list of each layer's (a tree pass's), instead of
        the model's own.
        """
        h = self.embed(tokens)
        if cache is None:
            cache = [None] * len(self.layers_here)
        if mask is None:
            masks = self._masks(h, cache)
        else:
            masks = mask if isinstance(mask, list) else [mask] * len(self.layers_here)
        tracked = isinstance(cache, TargetCache)
        recurrent = [] if record and tracked else None
        taps = {}
        wanted = set(layer_ids)
        stage = self.inner.pipeline_rank if self.stages > 1 else 0
        if stage < self.stages - 1:  # a pipeline stage after the first: the one before's output
            h = distributed.over_link(mx.distributed.recv_like(h, stage + 1))
        with attention.on_cpu():
            for j, (layer, c) in enumerate(zip(self.layers_here, cache)):
                if recurrent is not None and self.layer_kinds[j] == RECURRENT:
                    h = self._recorded_recurrent_layer(layer, h, masks[j], c, recurrent)
                else:
                    h = layer(h, masks[j], c)
                if self.here[j] in wanted:
                    taps[self.here[j]] = h
        if tracked:
            cache.last_pass = _PassRecord(tokens.shape[1], recurrent)
        features = None
        if layer_ids:
            features = mx.concatenate([taps.get(i, mx.zeros_like(h)) for i in layer_ids],
                                      axis=-1)
        if self.stages > 1:
            h, features = self._gather_stages(h, features, stage)
            _depend(cache[-1], h)
        return self.inner.norm(h), features

    def _gather_stages(self, h: mx.array, features: mx.array | None, stage: int
                       ) -> tuple[mx.array, mx.array | None]:
        """After a pipeline stage's layers: hand the hidden state on (as mlx-lm does), then
        one gather gives every stage the last stage's output and each stage's tap features
        (zeros where it has none), summed. One collective, so that every rank runs the same
        ones in the same order."""
        if stage != 0:
            h = mx.distributed.send(h, stage - 1)
        B, D = h.shape[0], h.shape[-1]
        both = h if features is None else mx.concatenate([h, features], axis=-1)
        gathered = distributed.over_link(mx.distributed.all_gather(both))  # [stages * B, ...]
        if features is not None:
            features = gathered[..., D:].reshape(-1, B, *features.shape[1:]).sum(axis=0)
        return gathered[:B, :, :D], features

    def forward(
        self, tokens: mx.array, cache: list[Any] | None, layer_ids: Sequence[int] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """Logits (equal to ``model(tokens, cache)``) and the tap-layer features; the pass can
        be rolled back with ``rollback``."""
        h, features = self.hidden_states(tokens, cache, layer_ids, record=True)
        return self.lm_head(h), features

    def _recorded_recurrent_layer(
        self, layer: nn.Module, h: mx.array, mask: Any, cache: ArraysCache,
        records: list[_RecurrentRecord],
    ) -> mx.array:
        record = _RecurrentRecord(layer, cache, list(cache.cache))
        records.append(record)
        if isinstance(mask, _TreePaths):
            h, record.paths = _recurrent_layer_on_paths(layer, h, mask, cache)
            return h
        if self.recurrent_rollback == PER_POSITION and mask is None:
            h, record.states = _recurrent_layer_per_position(layer, h, cache)
            return h
        record.inputs = h
        return layer(h, mask, cache)

    def _masks(self, h: mx.array, cache: list[Any]) -> list[Any]:
        masks = {}
        for kind, i in self._first_of_kind.items():
            if kind == RECURRENT:
                masks[kind] = create_ssm_mask(h, cache[i])
            else:
                window = self.window if kind == SLIDING else None
                masks[kind] = create_attention_mask(h, cache[i], window_size=window,
                                                    return_array=self.family.mask_array)
        return [masks[kind] for kind in self.layer_kinds]

    @staticmethod
    def rollback(cache: list[Any], num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions from every layer's cache (after a partial
        accept). Beyond plain KV caches this rolls back within the last pass only, which needs
        a cache from ``make_cache`` and the pass run by ``forward``."""
        if num_tokens <= 0:
            return
        record = getattr(cache, "last_pass", None)
        if _only_kv(cache) and (record is None or num_tokens > record.num_tokens):
            trim_prompt_cache(cache, num_tokens)
            return
        if record is None or num_tokens > record.num_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} positions: sliding-window and recurrent caches "
                "roll back within the last pass only, in a cache from Target.make_cache()"
            )
        has_recurrent = any(isinstance(c, ArraysCache) for c in cache)
        if has_recurrent and record.recurrent is None:
            raise ValueError("the last pass did not record its recurrent layers: run it with "
                             "Target.forward (or hidden_states(..., record=True))")
        for c in cache:
            if isinstance(c, RotatingKVCache):
                _trim_rotating(c, num_tokens, record.num_tokens)
            elif not isinstance(c, ArraysCache):
                c.trim(num_tokens)
        for rec in record.recurrent or []:
            rec.restore(record.num_tokens - num_tokens)
        cache.last_pass = None  # a second rollback would need the pass before

    # -- tree passes ---------------------------------------------------------------------------
    @property
    def tree_ready(self) -> bool:
        """Whether this target takes tree passes (``why_no_trees`` says why not)."""
        return self.why_no_trees() is None

    def why_no_trees(self) -> str | None:
        """None when this target takes tree passes: its attention layers have plain KV or
        sliding-window caches and a rotary embedding this module can place token by token,
        its recurrent layers a Gated DeltaNet state, and a tree pass equals ordinary passes
        (checked once per model); else the reason."""
        model, key = self.model, id(self.model)
        known = _tree_refusals.get(key)
        if known is not None and known[0]() is model:
            return known[1] or None
        attention = [j for j, kind in enumerate(self.layer_kinds) if kind != RECURRENT]
        caches = make_prompt_cache(model)
        if not all(type(caches[j]) is KVCache
                   or type(caches[j]) is RotatingKVCache and caches[j].keep == 0
                   for j in attention):
            reason = "its caches are not plain KV or sliding-window caches"
        elif not all(hasattr(getattr(self.layers_here[j], "self_attn", None), "rope")
                     for j in attention):
            reason = "its attention layers have no rotary embedding to place tokens with"
        elif not self._tree_matches():
            reason = "a tree pass does not match ordinary passes on it"
        else:
            reason = ""
        _tree_refusals[key] = (weakref.ref(model, lambda _, key=key: _tree_refusals.pop(key, None)),
                               reason)
        return reason or None

    def forward_tree(self, tokens: mx.array, depths: Sequence[int] | mx.array, visible: Any,
                     cache: list[Any], layer_ids: Sequence[int] = (),
                     max_depth: int | None = None) -> tuple[mx.array, mx.array | None]:
        """Logits [B, L, V] and tap features of a tree pass: ``tokens`` [B, L] (the anchor,
        then the nodes), row i at position ``offset + depths[i]`` and seeing the cached context
        and the rows ``visible[i]`` ([L, L] bool) marks; ``depths`` [L] or [B, L], ``visible``
        [L, L] or [B, L, L] (B > 1: a batch cache, batch_cache.py). Follow with ``keep_rows``
        (a batch cache: its ``commit_rows``). ``max_depth``: a bound on the depths where they
        are device arrays (recurrent layers read paths that long; default L - 1)."""
        if max_depth is None:
            max_depth = tokens.shape[1] - 1 if isinstance(depths, mx.array) else max(depths)
        positions = (depths if isinstance(depths, mx.array) else mx.array(list(depths))
                     ).astype(mx.int32)
        visible = mx.array(visible).astype(mx.bool_)
        if positions.ndim == 1:
            positions, visible = positions[None], visible[None]
        masks = self._tree_masks(positions, visible, cache, max_depth)
        attentions = [layer.self_attn for layer, kind in zip(self.layers_here, self.layer_kinds)
                      if kind != RECURRENT]
        ropes = [a.rope for a in attentions]
        for a, rope in zip(attentions, ropes):
            a.rope = _DepthRope(rope, positions)
        try:
            h, features = self.hidden_states(tokens, cache, layer_ids, record=True, mask=masks)
        finally:
            for a, rope in zip(attentions, ropes):
                a.rope = rope
        return self.lm_head(h), features

    def _tree_masks(self, positions: mx.array, visible: mx.array, cache: list[Any],
                    max_depth: int) -> list[Any]:
        """Each layer's mask for a tree pass (``positions`` [B, L], ``visible`` [B, L, L]).
        Attention: [B, 1, L, held + L], the keys its cache returns (what it held, then the
        pass's rows); full attention sees all it held, a sliding window the keys less than a
        window before the row's position and of the pass's rows its ancestors within the
        window. Recurrent: each row's path."""
        masks = {}
        for kind, i in self._first_of_kind.items():
            c = cache[i]
            window = self.window if kind == SLIDING else None
            if kind == RECURRENT:
                # path[b, i, d]: the row at depth d that row i sees (the anchor past i's depth)
                at_depth = visible[:, :, None, :] & (
                    positions[:, None, None, :] == mx.arange(max_depth + 1)[None, None, :, None])
                masks[kind] = _TreePaths(mx.argmax(at_depth.astype(mx.int32), axis=-1),
                                         positions)
            elif hasattr(c, "tree_mask"):  # a batch cache's rows (batch_cache.RaggedKVCache)
                masks[kind] = c.tree_mask(positions, visible, window)
            else:
                masks[kind] = self._single_tree_mask(positions[0], visible[0], c, window)
        return [masks[kind] for kind in self.layer_kinds]

    @staticmethod
    def _single_tree_mask(positions: mx.array, visible: mx.array, c: Any,
                          window: int | None) -> mx.array:
        """One request's attention mask for a tree pass: [L, held + L]."""
        offset, L = c.offset, positions.shape[0]
        if window is None:
            return mx.concatenate([mx.ones((L, offset), dtype=mx.bool_), visible], axis=1)
        # held: the newest positions an update of L tokens keeps before them (as
        # RotatingKVCache.make_mask counts them)
        held = 0 if c.keys is None else min(c.offset, c.max_size - 1)
        rows = offset + positions
        old = (rows[:, None] - mx.arange(offset - held, offset)[None, :]) < window
        near = (positions[:, None] - positions[None, :]) < window
        return mx.concatenate([old, visible & near], axis=1)

    @staticmethod
    def keep_rows(cache: list[Any], rows: Sequence[int]) -> None:
        """After a tree pass: keep only ``rows`` of it (row 0 the anchor, then the accepted
        path's), in consecutive slots; drop the rest. Recurrent layers take the state after
        the last row's path."""
        L = cache.last_pass.num_tokens
        n = len(rows)
        moved = list(rows) != list(range(n))
        picked = mx.array(list(rows), dtype=mx.int32)
        for c in cache:
            if isinstance(c, ArraysCache):
                continue
            # where the pass's rows start: a sliding-window buffer is left in temporal order
            # by a multi-token pass, ending with them
            start = c.keys.shape[2] - L if isinstance(c, RotatingKVCache) else c.offset - L
            if moved:  # (a quantized cache's keys and values are each 3 arrays)
                for a in [*_parts(c.keys), *_parts(c.values)]:
                    a[..., start : start + n, :] = a[..., start + picked, :]
            if isinstance(c, RotatingKVCache):
                _trim_rotating(c, L - n, L)
            else:
                c.offset -= L - n
        for record in cache.last_pass.recurrent or []:
            record.keep_paths([rows[-1]])
        cache.last_pass = None

    def _tree_matches(self) -> bool:
        """A tree pass equals ordinary passes: a chain of two nodes, and a second child of the
        anchor (its own pass), on scratch caches."""
        # long enough that a sliding window has wrapped: its mask's edge is checked too
        length = 3 + (self.window or 0) if SLIDING in self.layer_kinds else 3
        context = (mx.arange(1, length + 1, dtype=mx.uint32) % self.vocab_size)[None]
        tree_tokens = mx.array([[4, 5, 6, 7]], dtype=mx.uint32)  # anchor 4; 5 -> 6; 7

        # Each pass is evaluated on its own: split across ranks by pipeline (distributed.py)
        # the ranks' graphs differ, and independent passes evaluated together could send their
        # messages in different orders on different ranks.
        def run(out: mx.array) -> mx.array:
            mx.eval(out)
            return out

        def after_context() -> TargetCache:
            cache = self.make_cache()
            run(self.hidden_states(context, cache, ())[0])
            return cache

        tree_cache, side_cache = after_context(), after_context()
        got = run(self.forward_tree(tree_tokens, [0, 1, 2, 1],
                                    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]],
                                    tree_cache)[0][0])
        chain = run(self.forward(tree_tokens[:, :3], after_context())[0][0])
        side = run(self.forward(mx.array([[4, 7]], dtype=mx.uint32), side_cache)[0][0])
        # keeping the side branch (anchor, 7), the caches continue as the side's own pass
        self.keep_rows(tree_cache, [0, 3])
        after = mx.array([[8, 9]], dtype=mx.uint32) % self.vocab_size
        got = mx.concatenate([got, run(self.forward(after, tree_cache)[0][0])])
        want = mx.concatenate([chain, side[1:], run(self.forward(after, side_cache)[0][0])])
        tol = 1e-3 if self.dtype == mx.float32 else 3e-2  # half precision: ops in other orders
        return mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol,
                           rtol=tol).item()

    # -- load-time checks --------------------------------------------------------------------
    def _check_caches(self) -> None:
        """Each layer's cache is a kind whose rollback this module knows."""
        expected = {FULL: "KVCache", SLIDING: "RotatingKVCache", RECURRENT: "ArraysCache"}
        for i, (kind, c) in enumerate(zip(self.layer_kinds, make_prompt_cache(self.model))):
            ok = {
                FULL: not isinstance(c, (RotatingKVCache, ArraysCache)) and c.is_trimmable(),
                SLIDING: isinstance(c, RotatingKVCache),
                RECURRENT: isinstance(c, ArraysCache),
            }[kind]
            if not ok:
                raise UnsupportedTargetError(
                    f"model type '{self.model_type}': layer {i} ({kind}) has a "
                    f"{type(c).__name__}, expected a {expected[kind]}; not supported"
                )

    def _check_forward(self, model: nn.Module) -> None:
        """Our forward equals ``model(x, cache)`` on a fresh cache and on a continuation."""
        probe = mx.array([[1, 2, 3, 4, 5, 6, 7]]) % self.vocab_size
        ref_cache, our_cache = list(self.make_cache()), self.make_cache()  # (KV quantized alike)
        for chunk in (probe[:, :4], probe[:, 4:]):
            with attention.on_cpu():  # the attention our passes use, so that the two are equal
                expected = model(chunk, cache=ref_cache)
            mx.eval(expected)  # one pass at a time (see _tree_matches)
            got, _ = self.forward(chunk, our_cache)
            same = expected.shape == got.shape and (
                mx.array_equal(expected, got).item()
                if self.recurrent_rollback == REPLAY or RECURRENT not in self.layer_kinds
                # One position at a time may round differently from the model's batched call.
                else mx.allclose(expected, got, rtol=1e-4, atol=1e-4).item()
            )
            if not same:
                raise UnsupportedTargetError(
                    f"model type '{self.model_type}': the feature-tapping forward does not "
                    "reproduce model(x) exactly; this architecture is not supported yet"
                )


_checked: dict[int, weakref.ref] = {}  # models whose tapped forward was checked once

# Per model (weakly): (bits, group size) of its quantized KV caches (quantize_kv).
_kv_quantized: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}
KV_BITS = (2, 3, 4, 5, 6, 8)


def quantize_kv(model: Any, bits: int | None, group_size: int = 64) -> None:
    """Run ``model`` with its full-attention layers' keys and values quantized to ``bits`` (None:
    full precision again), wherever the package runs it: single requests, the batch engine,
    prefix caches. From the first position on (mlx-lm's ``kv_bits`` starts at
    ``quantized_kv_start``), so speculative output equals plain decoding with the same caches."""
    model = _text_model(model.model if isinstance(model, Target) else model)
    if bits is None:
        _kv_quantized.pop(id(model), None)
        return
    if bits not in KV_BITS:
        raise ValueError(f"KV cache bits must be one of {', '.join(map(str, KV_BITS))}, "
                         f"got {bits}")
    width = head_dim(model.args)
    if group_size not in (32, 64, 128) or width % group_size:
        raise ValueError(f"KV cache group size {group_size} does not divide the target's head "
                         f"dimension {width} (32, 64 or 128 that does)")
    key = id(model)
    _kv_quantized[key] = (weakref.ref(model, lambda _, key=key: _kv_quantized.pop(key, None)),
                          (bits, group_size))


# Per model (weakly): why it takes no tree passes ("" when it does), checked once.
_tree_refusals: dict[int, tuple[weakref.ref, str]] = {}


def as_target(model: Any) -> Target:
    """The Target wrapper for an mlx-lm model; the forward check runs once per model object.

    Only weak references are kept, so a model that is dropped is freed.
    """
    if isinstance(model, Target):
        return model
    ref = _checked.get(id(model))
    if ref is not None and ref() is model:
        return Target(model, check=False)
    target = Target(model)
    key = id(model)
    _checked[key] = weakref.ref(model, lambda _, key=key: _checked.pop(key, None))
    return target
