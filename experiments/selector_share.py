"""DFlash 2's selector (top-K candidates + the path walk) as a share of a speculative cycle
(default target, float32, 256 tokens of context), side by side with the same drafter's pass
without it (what a DFlash drafter of the same size costs).

    python experiments/selector_share.py DFLASH2_DRAFTER [--blocks 4 8 16]
"""

import argparse
import json

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx

from mlx_dflash.accept import SamplingParams
from mlx_dflash.bench import measure_pass_costs
from mlx_dflash.cli.common import load_pair
from mlx_dflash.target import as_target
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.schedule import best_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    model, drafter, _ = load_pair(None, resolve_drafter(args.drafter))
    if drafter.family != "dflash2":
        raise SystemExit(f"{args.drafter} is a {drafter.family} drafter, not DFlash 2")
    target = as_target(model)
    cache = drafter.make_cache()
    _, feats = target.hidden_states(mx.zeros((1, args.context), dtype=mx.uint32), None,
                                    drafter.target_layer_ids)
    drafter.commit(feats, cache)
    anchor = mx.zeros((1,), dtype=mx.uint32)
    rows = {}
    for B in args.blocks:
        width = max(B, drafter.block_size)
        verify = measure_pass_costs(model, B, context=args.context)["verify_s"]
        with_selector = best_time(lambda w=width, k=B - 1: mx.eval(drafter.propose(
            target, anchor, cache, w, k, SamplingParams()).drafts), 5)
        without = best_time(lambda w=width, k=B - 1: mx.eval(mx.argmax(drafter.draft_logits(
            target, anchor, cache, w, k), axis=-1)), 5)
        cycle = with_selector + verify
        rows[f"B={B}"] = {"verify_s": verify, "draft_s": with_selector,
                          "draft_without_selector_s": without,
                          "selector_share": (with_selector - without) / cycle,
                          "cycle_vs_dflash": cycle / (without + verify)}
        print(f"B={B:2d} verify {verify * 1e3:6.1f} ms  draft {with_selector * 1e3:6.1f} ms "
              f"(without selector {without * 1e3:6.1f} ms)  selector share of the cycle "
              f"{rows[f'B={B}']['selector_share']:.1%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
