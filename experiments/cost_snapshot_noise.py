"""How steady the block scheduler's one-time cost snapshot is: the passes timed one after the
other (best of 2 each, the snapshot before 2026-12-03) against timed in turn within each round
(``best_times``, best of 5), taking turns in one process, and a long in-turn reference.

Usage: python experiments/cost_snapshot_noise.py [--trials 4] [--block-size 8] \
           [--json results/cost_snapshot_noise_DATE.json]
Run it on a quiet machine: the point is the spread between trials, not load.
"""

import argparse
import json
import platform

import mlx_dflash  # noqa: F401  (fast BLAS first)
import numpy as np

from mlx_dflash.target import as_target
from mlx_dflash.default_pair import load_default
from mlx_dflash.schedule import _sizes, best_time, best_times, snapshot_passes

CONTEXT = 128


def ratios(times: list[float], sizes: tuple[int, ...]) -> dict:
    """Each verify and the draft pass as a multiple of a 1-token decode."""
    out = {f"verify{n}": t / times[0] for n, t in zip(sizes, times[:-1])}
    out["draft"] = times[-1] / times[0]
    out["decode_ms"] = times[0] * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, drafter, _ = load_default(progress=False)
    fns = snapshot_passes(as_target(model), drafter, CONTEXT, args.block_size)
    sizes = _sizes(args.block_size)
    methods = {
        "one after another, best of 2": lambda: [best_time(f, 2) for f in fns],
        "in turn, best of 5": lambda: best_times(fns, 5),
    }
    rows = {name: [] for name in methods}
    for trial in range(args.trials):
        for name, method in methods.items():
            rows[name].append(ratios(method(), sizes))
            r = rows[name][-1]
            print(f"trial {trial} {name:30s} decode {r['decode_ms']:.0f} ms  "
                  + "  ".join(f"v{n} {r[f'verify{n}']:.2f}" for n in sizes[1:])
                  + f"  draft {r['draft']:.2f}", flush=True)
    reference = ratios(best_times(fns, 30), sizes)
    print("reference, in turn, best of 30: "
          + "  ".join(f"v{n} {reference[f'verify{n}']:.2f}" for n in sizes[1:])
          + f"  draft {reference['draft']:.2f}")
    for name, trials in rows.items():
        for key in [f"verify{n}" for n in sizes[1:]] + ["draft"]:
            v = np.array([t[key] for t in trials])
            print(f"{name:30s} {key:8s} min {v.min():.2f} max {v.max():.2f} "
                  f"(reference {reference[key]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "context": CONTEXT, "block_size": args.block_size,
                       "trials": rows, "reference": reference}, f, indent=1)


if __name__ == "__main__":
    main()
