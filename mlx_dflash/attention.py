"""Attention for passes computed on MLX's CPU backend.

On the CPU, MLX computes ``mx.fast.scaled_dot_product_attention`` as matmul, softmax, matmul,
and its ``exp`` runs ~12 ns an element here (numpy's ~3 ns). At long contexts the softmax is
most of a pass: a 7-query verify over 16k keys spends ~17 of its ~28 ms a layer in it, and a
verify pays it for every query, so a verify cost ~3x a decode there, where an Apple GPU's fused
kernel costs little more than a decode. :func:`attention` computes the same function with a
polynomial exp fused by ``mx.compile`` (MLX's own range reduction and coefficients), and divides
by the row sums after the value product (64 numbers a row instead of a row of keys).

The target's passes build their graph inside :func:`on_cpu`, which swaps it in for
``mx.fast.scaled_dot_product_attention`` while the layers are called (mlx-lm's attention
modules call that function by name). It applies to passes of a few queries (at most
``MOST_SCORES`` scores: decode, verify, trees, a batch's blocks) in float32 without attention
sinks on the CPU; everything else (a prefill chunk, other dtypes) goes to MLX's.
``MLX_DFLASH_CPU_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx

ENV_SWITCH = "MLX_DFLASH_CPU_ATTENTION"

LOG2E = 1.4426950408889634
# MLX's own polynomial for 2**f on |f| <= 1/2 (mlx/backend/cpu/simd/math.h), highest first.
_POW2 = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
         5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1, 1.0)


@mx.compile
def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x: MLX's algorithm (within 1 ulp of ``mx.exp``: separate multiplies
    and adds instead of fused ones), written so that the compiled loop has no ``floor`` call."""
    t = mx.clip(x * LOG2E, -127.4, 128.0)
    # n = floor(t + 1/2) is k - 128, truncating a positive number; 2**n's exponent bits are k - 1
    # (0 below 2**-126, where the result is 0 as MLX's is; all ones above 2**127: inf).
    k = (t + 128.5).astype(mx.int32)
    f = t - (k - 128).astype(mx.float32)
    p = _POW2[0]
    for c in _POW2[1:]:
        p = p * f + c
    return p * mx.left_shift(k - 1, 23).view(mx.float32)


@mx.compile
def _shifted_exp(scores: mx.array, row_max: mx.array) -> mx.array:
    return fast_exp(scores - row_max)


_MLX_ATTENTION = mx.fast.scaled_dot_product_attention

# Past this many scores (a prefill chunk's: thousands of queries) the passes over memory, not
# exp, are the cost, and MLX's one softmax op makes fewer of them than this does.
MOST_SCORES = 1 << 23


def _grouped_mask(mask: mx.array, heads: int, kv_heads: int) -> mx.array:
    """A mask broadcastable to [B, heads, L, T] as one broadcastable to [B, kv, rep, L, T]."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h, length, keys = mask.shape
    if h == 1:
        return mask.reshape(b, 1, 1, length, keys)
    return mask.reshape(b, kv_heads, heads // kv_heads, length, keys)


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
              mask: None | str | mx.array = None, sinks: mx.array | None = None,
              **kwargs: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (same arguments), with :func:`fast_exp` for
    float32 on the CPU."""
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if (sinks is not None or kwargs or q.dtype != mx.float32 or k.dtype != mx.float32
            or v.dtype != mx.float32 or scores > MOST_SCORES):
        return _MLX_ATTENTION(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return few_queries(q, k, v, scale, mask)


def few_queries(q: mx.array, k: mx.array, v: mx.array, scale: float,
                mask: None | str | mx.array) -> mx.array:
    """The attention of float32 ``q`` [B, H, L, D] over ``k``, ``v`` [B, kv, T, D]."""
    B, H, L, D = q.shape
    kv_heads, T = k.shape[1], k.shape[2]
    rep = H // kv_heads
    # Query heads h = g * rep + r share key head g: one matmul per key head, no copies of K/V.
    scores = ((q * scale).reshape(B, kv_heads, rep * L, D) @ k.swapaxes(-1, -2))
    scores = scores.reshape(B, kv_heads, rep, L, T)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask '{mask}'")
        # Queries are the last L positions of the T keys.
        visible = mx.arange(T)[None] <= mx.arange(T - L, T)[:, None]
        scores = mx.where(visible, scores, -mx.inf)
    elif mask is not None:
        grouped = _grouped_mask(mask, H, kv_heads)
        scores = (mx.where(grouped, scores, -mx.inf) if grouped.dtype == mx.bool_
                  else scores + grouped.astype(mx.float32))
    weights = _shifted_exp(scores, mx.stop_gradient(scores.max(axis=-1, keepdims=True)))
    weights = weights.reshape(B, kv_heads, rep * L, T)
    out = (weights @ v) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(B, H, L, D)


def enabled() -> bool:
    """Whether passes built on the default device use :func:`attention`: the CPU, unless
    ``MLX_DFLASH_CPU_ATTENTION=0``."""
    return (os.environ.get(ENV_SWITCH, "1") != "0"
            and mx.default_device().type == mx.DeviceType.cpu)


_swap_lock = threading.Lock()
_swap_depth = 0


@contextmanager
def on_cpu() -> Iterator[None]:
    """Within: ``mx.fast.scaled_dot_product_attention`` is :func:`attention`, where
    :func:`enabled` (the graph is built here; it is computed later, as usual)."""
    global _swap_depth
    if not enabled():
        yield
        return
    with _swap_lock:
        _swap_depth += 1
        mx.fast.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        with _swap_lock:
            _swap_depth -= 1
            if _swap_depth == 0:
                mx.fast.scaled_dot_product_attention = _MLX_ATTENTION
