"""The Metal kernels' first-use check, and the variants and inputs it shares with the CI check
(tests/test_kernel_variants.py) and scripts/bench_kernels.py.

A variant (:class:`kernels.Variant`) is checked once per process before its first real use:
it runs on small inputs, at the largest threadgroup the decode loop launches, next to its MLX
twin; it passes when both give the same tokens (and proposals within 1e-5). The inputs have
clear margins: one token per position carries most of the probability, and the uniforms
fall well inside it, so float rounding cannot decide a sample.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from . import kernels
from .kernels import Variant

# Large enough that every kernel launches its largest threadgroup (row_threads' cap).
CHECK_VOCAB = 8 * 1024
DTYPES = ("float32", "bfloat16", "float16")
CANDIDATES = (1, 16)  # copied blocks; DFlash 2's walk and DSpark's Markov walk


def decode_variants() -> list[Variant]:
    """Every variant the decode loop can launch: each step with and without drafts, logits
    in float32, bfloat16 and float16, the candidate counts it uses, the walk greedy and
    sampled."""
    out = []
    for dtype in DTYPES:
        for drafted in (False, True):
            out.append(Variant("verify_greedy", dtype, drafted))
            out.append(Variant("verify_sample", dtype, drafted))
            out += [Variant("verify_sample_candidates", dtype, drafted, K) for K in CANDIDATES]
    out += [Variant("path_select", "float32", drafted, 16, sampled)
            for drafted in (False, True) for sampled in (False, True)]
    return out


def example(variant: Variant, drafts: int = 3, vocab: int = CHECK_VOCAB,
            seed: int = 0) -> dict[str, Any]:
    """Arguments of the variant's step (``drafts`` drafts when it has any; path_select:
    ``drafts + 1`` steps), with clear margins: at each position one token carries ~95% of
    the target's probability; the drafts follow it except the last one, which the target
    rejects, so both the accepting and the residual branches run."""
    rng = np.random.default_rng(seed)
    L = drafts if variant.drafted else 0
    if variant.step == "path_select":
        K, n = variant.candidates, L + 1
        first = rng.standard_normal((1, K)).astype(np.float32)
        first[0, 3 % K] += 12.0
        rest = rng.standard_normal((1, n - 1, K, K)).astype(np.float32)
        rest[..., np.arange(K), (np.arange(K) * 5 + 1) % K] += 12.0
        args = {"first": mx.array(first), "rest": mx.array(rest)}
        if variant.sampled:
            args["uniforms"] = mx.array(np.full((1, n), 0.5, np.float32))
            args["temperature"] = 0.8
        return args
    peaks = (np.arange(L + 1) * 17 + 5) % vocab
    logits = rng.standard_normal((1, L + 1, vocab)).astype(np.float32) * 0.5
    logits[0, np.arange(L + 1), peaks] += 12.0
    draft_ids = peaks[:L].copy()
    if L:
        draft_ids[-1] = (draft_ids[-1] + 1) % vocab  # the target rejects it
    args = {"logits": mx.array(logits).astype(getattr(mx, variant.dtype)),
            "drafts": mx.array(draft_ids[None].astype(np.uint32))}
    if variant.step == "verify_greedy":
        return args
    if variant.step == "verify_sample":
        q = np.full((1, L, vocab), 0.1 / (vocab - 1), np.float32)
        q[0, np.arange(L), draft_ids] = 0.9
        args["draft_probs"] = mx.array(q)
    else:
        K = variant.candidates
        ids = (draft_ids[:, None] + np.arange(K)[None] * 31) % vocab
        probs = np.full((L, K), 0.1 / max(K - 1, 1), np.float32)
        probs[:, 0] = 0.9 if K > 1 else 1.0
        args["cand_ids"] = mx.array(ids[None].astype(np.uint32))
        args["cand_probs"] = mx.array(probs[None])
    args["uniforms"] = mx.array(np.full((1, L + 1), 0.5, np.float32))
    args["temperature"], args["top_k"] = 1.0, 5
    return args


def run(variant: Variant, args: dict[str, Any], metal: bool) -> list[mx.array]:
    """The variant's step on ``args`` by the kernel (``metal``) or by its MLX twin (lazy)."""
    suffix = "metal" if metal else "mlx"
    out = getattr(kernels, f"{variant.step}_{suffix}")(**args)
    return [a for a in out if a is not None]


def check(variant: Variant) -> str | None:
    """None when the kernel compiles, runs and agrees with its twin; else what went wrong."""
    args = example(variant)
    want = run(variant, args, metal=False)
    mx.eval(want)
    try:
        got = run(variant, args, metal=True)
        mx.eval(got)
    except Exception as e:  # a compile error, a launch MLX refuses: any failure falls back
        return f"{type(e).__name__}: {e}"
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return f"output shape {g.shape}, expected {w.shape}"
        if mx.issubdtype(w.dtype, mx.floating):
            if not mx.allclose(g, w, atol=1e-5).item():
                return "proposals differ from the MLX path's"
        elif not mx.array_equal(g, w).item():
            return f"tokens {g.tolist()}, expected {w.tolist()}"
    return None
