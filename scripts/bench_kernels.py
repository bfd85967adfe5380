"""Every Metal kernel variant the decode loop can launch: compiled, checked against its MLX
twin, and timed against it. Run once on a Mac and send the JSON back.

    python scripts/bench_kernels.py --json kernels_mac.json

For each variant (mlx_dflash.kernels.decode_variants: each step with and without drafts,
logits in float32 / bfloat16 / float16, K = 1 and 16 candidates, the walk greedy and sampled)
and each block length (1, 3, 7, 15 drafts; top-k 0 and 50 for the sampled steps), on a
vocabulary of V: whether the kernel compiles and runs, whether its outputs equal the MLX
path's (tokens equal, proposals within 1e-5), and the median milliseconds per call of both
(one call is one decoding cycle's step). A failing variant is recorded with its error; the
run goes on. Without Metal (or with --cpu) it times the MLX path on the CPU only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx_dflash  # noqa: F401  (loads the fast BLAS before mlx)
import mlx.core as mx

from mlx_dflash import kernels
from mlx_dflash.kernels import decode_variants, disagreement, example, run

BLOCKS = (1, 3, 7, 15)


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def cases(vocab: int):
    """(variant, drafts, top_k, arguments) for every row of the table."""
    for variant in decode_variants():
        for L in BLOCKS if variant.drafted else (0,):
            args = example(variant, drafts=max(L, 1), vocab=vocab)
            top_ks = (0, 50) if "top_k" in args else (None,)
            for top_k in top_ks:
                if top_k is not None:
                    args = {**args, "top_k": top_k}
                yield variant, L, top_k, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="time the MLX path on the CPU only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    metal = mx.metal.is_available() and not args.cpu
    if not metal:
        mx.set_default_device(mx.cpu)
    rows = []
    for variant, L, top_k, x in cases(args.vocab):
        row = {"variant": str(variant), "drafts": L, "top_k": top_k,
               "mlx_ms": median_ms(lambda v=variant, x=x: run(v, x, False), args.iters,
                                   args.warmup)}
        if metal:
            try:
                got = run(variant, x, True)
                mx.eval(got)
                row["check"] = disagreement(got, run(variant, x, False)) or "equal"
                row["kernel_ms"] = median_ms(lambda v=variant, x=x: run(v, x, True), args.iters,
                                             args.warmup)
            except Exception as e:  # recorded, and on to the next variant
                row["check"] = f"failed: {type(e).__name__}: {e}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    info = {"platform": platform.platform(), "machine": platform.machine(),
            "mlx": mx.__version__, "metal": metal, "vocab": args.vocab, "iters": args.iters,
            "kernels_backend": kernels.backend() if metal else "mlx"}
    if metal:
        info["device"] = mx.metal.device_info()
    failed = [r for r in rows if r.get("check", "equal") != "equal"]
    print(f"\n{len(rows)} cases, {len(failed)} not equal or failed; "
          f"{'GPU' if metal else 'CPU'}, V={args.vocab}, median of {args.iters}, ms per call\n")
    header = "| variant | drafts | top-k | MLX path |"
    print(header + (" kernel | speedup | kernel == MLX path |" if metal else ""))
    print("|---" * (7 if metal else 4) + "|")
    for r in rows:
        line = f"| {r['variant']} | {r['drafts']} | {r['top_k'] or ''} | {r['mlx_ms']:.3f} |"
        if metal:
            ms = r.get("kernel_ms")
            line += (f" {ms:.3f} | {r['mlx_ms'] / ms:.1f}x |" if ms else " - | - |")
            line += f" {r['check']} |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
