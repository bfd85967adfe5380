"""The drafter's share of a speculative cycle, with its reduced vocabulary and with the full
head, side by side (default target, float32, 256 tokens of context).

    python experiments/cycle_share.py [DRAFTER] [--blocks 4 8 16]

A cycle is one drafter pass plus one verify pass of B tokens; loop bookkeeping is left out.
"""

import argparse
import json

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx

from mlx_dflash.bench import measure_pass_costs
from mlx_dflash.cli.common import load_pair
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.drafters import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", nargs="?", default=None)
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    model, drafter, _ = load_pair(None, resolve_drafter(args.drafter) if args.drafter else None)
    if drafter.vocab_ids is None:
        raise SystemExit("this drafter has no reduced vocabulary to compare")
    full = load_drafter(drafter.source_path, model=model, dtype=mx.float32)
    del full["draft_vocab"]  # the same weights through the target's whole head
    rows = {}
    for B in args.blocks:
        for name, d in (("reduced", drafter), ("full", full)):
            c = measure_pass_costs(model, B, d)
            share = c["draft_s"] / (c["draft_s"] + c["verify_s"])
            rows[f"B={B} {name}"] = {**c, "draft_share": share}
            print(f"B={B:2d} {name:8s} draft {c['draft_s'] * 1e3:6.1f} ms  verify "
                  f"{c['verify_s'] * 1e3:6.1f} ms  drafter share of the cycle {share:.0%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
