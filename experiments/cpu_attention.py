"""Target pass costs on the CPU with MLX's attention and with mlx_dflash.attention, and with
glibc's default malloc thresholds and raised ones (MLX's CPU buffers come from malloc; glibc maps
and unmaps big ones on every use, and each page of a fresh mapping faults once).

    python experiments/cpu_attention.py [--contexts 1024 4096 16384] [--out FILE.json]

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
from mlx_dflash.schedule import best_times, snapshot_passes
from mlx_dflash.target import Target

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, drafter, _ = load_default(progress=False)
    target = Target(model)
    rows = []
    # Default malloc first: raised thresholds cannot be lowered back to glibc's dynamic ones.
    for malloc in ("glibc default", "thresholds 1 GiB"):
        if malloc != "glibc default":
            raise_malloc_thresholds(1 << 30)
        for context in args.contexts:
            passes = snapshot_passes(target, None, context, max(args.sizes), tuple(args.sizes))

            def under(switch: str, fn):
                def run():
                    os.environ[attention.ENV_SWITCH] = switch
                    fn()
                return run
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
    result = {"machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}",
              "blas": Path(mlx_dflash._blas.sgemm_provider() or "default").name,
              "mlx": mx.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
