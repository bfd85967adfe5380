"""Per-cycle cost of the verification and path-selection steps: Metal kernel vs MLX path.

Each step is what one decoding cycle runs once (mlx_dflash.kernels): greedy verification,
sampled verification (dense proposal, with and without top-k; K-candidate proposal) and the
DFlash 2 selector walk (greedy and sampled), on a vocabulary of V, L drafts, K candidates.

On a Mac with Metal it times both paths on the GPU and first checks that the kernels agree
with the MLX path on these inputs (the kernels have only run in the C++ harness before):
    python scripts/bench_kernels.py --json results/kernels_bench_mac_DATE.json
Elsewhere (or with --cpu) it times the MLX path on the CPU.

Prints a markdown table (median milliseconds per call = per cycle).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx_dflash  # noqa: F401  (loads the fast BLAS before mlx)
import mlx.core as mx
import numpy as np

from mlx_dflash import kernels


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def make_inputs(V: int, L: int, K: int, dtype: mx.Dtype, seed: int = 0) -> dict:
    """Target logits and drafts that a drafter close to the target would propose (about
    half the drafts accepted), its dense and K-candidate proposals, the selector's lattice."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((1, L + 1, V)) * 2.5).astype(np.float32)
    draft_logits = logits[:, :L] + 0.3 * rng.standard_normal((1, L, V)).astype(np.float32)
    q = softmax(draft_logits.astype(np.float64))
    drafts = np.array([[rng.choice(V, p=q[0, i]) for i in range(L)]], np.uint32)
    greedy_drafts = logits.argmax(-1)[:, :L].astype(np.uint32)
    greedy_drafts[0, L // 2] = (greedy_drafts[0, L // 2] + 1) % V
    ids = np.argsort(-draft_logits, axis=-1)[..., :K].astype(np.uint32)
    probs = softmax(np.take_along_axis(draft_logits, ids.astype(np.int64), -1))
    cand_drafts = ids[..., 0]
    return {
        "logits": mx.array(logits).astype(dtype),
        "drafts": mx.array(drafts),
        "greedy_drafts": mx.array(greedy_drafts),
        "q": mx.array(q.astype(np.float32)),
        "ids": mx.array(ids),
        "probs": mx.array(probs.astype(np.float32)),
        "cand_drafts": mx.array(cand_drafts),
        "u": mx.array(rng.random((1, L + 1)).astype(np.float32)),
        "first": mx.array(rng.standard_normal((1, K)).astype(np.float32)),
        "rest": mx.array(rng.standard_normal((1, L - 1, K, K)).astype(np.float32)),
        "walk_u": mx.array(rng.random((1, L)).astype(np.float32)),
    }


def steps(x: dict) -> dict:
    """step name -> (MLX path call, Metal kernel call), each returning arrays to evaluate."""
    def both(name, *args, **kw):
        return (lambda: getattr(kernels, f"{name}_mlx")(*args, **kw),
                lambda: getattr(kernels, f"{name}_metal")(*args, **kw))

    return {
        "verify_greedy": both("verify_greedy", x["logits"], x["greedy_drafts"]),
        "verify_sample (dense q)": both("verify_sample", x["logits"], x["drafts"], x["q"],
                                        x["u"], 1.0, 0),
        "verify_sample (dense q, top-k 50)": both("verify_sample", x["logits"], x["drafts"],
                                                  x["q"], x["u"], 1.0, 50),
        "verify_sample (K candidates)": both("verify_sample_candidates", x["logits"],
                                             x["cand_drafts"], x["ids"], x["probs"], x["u"],
                                             1.0, 0),
        "path_select greedy": both("path_select", x["first"], x["rest"]),
        "path_select sampled": both("path_select", x["first"], x["rest"], x["walk_u"], 0.8),
    }


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def agreement(mlx_fn, metal_fn) -> str:
    """Whether the kernel's outputs equal the MLX path's (integers) or are close (floats)."""
    a, b = mlx_fn(), metal_fn()
    for x, y in zip(a, b):
        if x is None:
            continue
        if mx.issubdtype(x.dtype, mx.floating):
            if not mx.allclose(x, y, atol=1e-5).item():
                return "floats differ"
        elif not mx.array_equal(x, y).item():
            return f"differ: {x.tolist()} vs {y.tolist()}"
    return "equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--drafts", type=int, default=15, help="L: drafts verified per cycle")
    ap.add_argument("--candidates", type=int, default=16, help="K of DFlash 2's selector")
    ap.add_argument("--dtype", default="bfloat16", help="the target logits' dtype")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="time the MLX path on the CPU only")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    metal = mx.metal.is_available() and not args.cpu
    if not metal:
        mx.set_default_device(mx.cpu)
    x = make_inputs(args.vocab, args.drafts, args.candidates, getattr(mx, args.dtype))
    rows = []
    for name, (mlx_fn, metal_fn) in steps(x).items():
        row = {"step": name, "mlx_ms": median_ms(mlx_fn, args.iters, args.warmup)}
        if metal:
            row["check"] = agreement(mlx_fn, metal_fn)
            row["kernel_ms"] = median_ms(metal_fn, args.iters, args.warmup)
        rows.append(row)

    device = "Metal GPU" if metal else f"CPU ({platform.processor() or platform.machine()})"
    print(f"V={args.vocab}, L={args.drafts}, K={args.candidates}, logits {args.dtype}, "
          f"{device}, median of {args.iters}, ms per cycle\n")
    if metal:
        print("| step | MLX path | kernel | speedup | kernel == MLX path |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['step']} | {r['mlx_ms']:.3f} | {r['kernel_ms']:.3f} | "
                  f"{r['mlx_ms'] / r['kernel_ms']:.1f}x | {r['check']} |")
    else:
        print("| step | MLX path |\n|---|---|")
        for r in rows:
            print(f"| {r['step']} | {r['mlx_ms']:.3f} |")
    if args.json:
        meta = {k: getattr(args, k) for k in ("vocab", "drafts", "candidates", "dtype", "iters")}
        with open(args.json, "w") as f:
            json.dump({"device": device, **meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
