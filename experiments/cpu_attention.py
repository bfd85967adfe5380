"""Target pass costs on the CPU with MLX's attention and with mlx_dflash.attention, and with
glibc's default malloc thresholds and raised ones (MLX's CPU buffers come from malloc; glibc maps
and unmaps big ones on every use, and each page of a fresh mapping faults once).

    python experiments/cpu_attention.py [--contexts 1024 4096 16384] [--out FILE.json]
    python experiments/cpu_attention.py --crossover [--out FILE.json]
    python experiments/cpu_attention.py --drafter [--contexts ...] [--out FILE.json]

``--crossover``: one layer's attention alone (the default target's 9 query and 3 key heads),
MLX's against ``attention.few_queries``, from 8 to 2048 causal queries over 4k and 16k keys:
where the second stops paying (attention.MOST_SCORES). ``--drafter``: the default drafter's
pass (a block of drafts over the context features) with each attention.

Every configuration is timed in turn within each round (best of the rounds), over a KV cache
stretched to each context (schedule.stretch), with the default pair.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
from pathlib import Path

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_dflash import attention
from mlx_dflash.default_pair import load_default
from mlx_dflash.drafters.base import verify_width
from mlx_dflash.schedule import best_times, snapshot_passes
from mlx_dflash.target import Target
from report import report

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def raise_malloc_thresholds(limit: int) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, limit)
    libc.mallopt(M_TRIM_THRESHOLD, limit)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}"


def crossover(rounds: int) -> list[dict]:
    rows = []
    for keys in (4096, 16384):
        k, v = (mx.random.normal((1, 3, keys, 64)) for _ in range(2))
        for queries in (8, 32, 128, 512, 2048):
            q = mx.random.normal((1, 9, queries, 64))
            mx.eval(q, k, v)
            mlx_s, ours_s = best_times([
                lambda q=q, k=k, v=v: mx.eval(
                    attention._MLX_ATTENTION(q, k, v, scale=0.125, mask="causal")),
                lambda q=q, k=k, v=v: mx.eval(attention.few_queries(q, k, v, 0.125, "causal"))],
                rounds)
            row = {"keys": keys, "queries": queries, "scores": 9 * queries * keys,
                   "mlx_ms": round(mlx_s * 1e3, 1), "ours_ms": round(ours_s * 1e3, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def drafter_passes(target: Target, drafter, contexts: list[int], rounds: int) -> list[dict]:
    rows = []
    width = verify_width(drafter)  # as the decode loop drafts
    for context in contexts:
        draft = snapshot_passes(target, drafter, context, width, (1,))[1]
        times = best_times([under(s, draft) for s in ("0", "1")], rounds)
        row = {"context": context, "mlx_ms": round(times[0] * 1e3, 1),
               "ours_ms": round(times[1] * 1e3, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def under(switch: str, fn):
    """``fn`` with the package's CPU attention on ("1") or off ("0")."""
    def run():
        os.environ[attention.ENV_SWITCH] = switch
        fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--drafter", action="store_true")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.crossover:
        result = {"machine": machine(),
                  "mlx": mx.__version__, "crossover": crossover(args.rounds)}
        return report(result, args.out, show=False)
    model, drafter, _ = load_default(progress=False)
    target = Target(model)
    if args.drafter:
        result = {"machine": machine(),
                  "mlx": mx.__version__, "drafter": drafter_passes(target, drafter, args.contexts,
                                                                     args.rounds)}
        return report(result, args.out, show=False)
    rows = []
    # Default malloc first: raised thresholds cannot be lowered back to glibc's dynamic ones.
    for malloc in ("glibc default", "thresholds 1 GiB"):
        if malloc != "glibc default":
            raise_malloc_thresholds(1 << 30)
        for context in args.contexts:
            passes = snapshot_passes(target, None, context, max(args.sizes), tuple(args.sizes))
            fns = [under(s, p) for s in ("0", "1") for p in passes]
            times = best_times(fns, args.rounds)
            n = len(passes)
            for name, part in (("mlx", times[:n]), ("ours", times[n:])):
                row = {"malloc": malloc, "context": context, "attention": name,
                       "ms": {str(k): round(t * 1e3, 1) for k, t in zip(args.sizes, part)}}
                row["verify_vs_decode"] = {str(k): round(t / part[0], 2)
                                           for k, t in zip(args.sizes, part)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"machine": machine(),
              "blas": Path(mlx_dflash._blas.sgemm_provider() or "default").name,
              "mlx": mx.__version__, "rows": rows}
    report(result, args.out, show=False)


if __name__ == "__main__":
    main()
