"""`auto` with the drafter's passes built under the package's CPU attention (as shipped) and
under MLX's, interleaved on the structured bench's tasks, each order once; replies compared.

    python experiments/drafter_attention_ab.py [--tasks 8] [-n 128] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
import mlx_dflash.drafters.base as base
from mlx_dflash import attention
from mlx_dflash.bench import _speculative
from mlx_dflash.bench_structured import read_tasks, task_prompt
from mlx_dflash.default_pair import load_default

MLX_ONLY = types.SimpleNamespace(on_cpu=contextlib.nullcontext)  # the drafter's passes as before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, drafter, tokenizer = load_default(progress=False)
    tasks = read_tasks()[: args.tasks]
    totals = {"ours": [0, 0.0], "mlx": [0, 0.0]}  # tokens, seconds
    equal = 0
    _speculative(model, drafter, tokenizer, task_prompt(tokenizer, tasks[0]), 8, {})  # warm-up
    for order in (("ours", "mlx"), ("mlx", "ours")):
        for task in tasks:
            prompt, replies = task_prompt(tokenizer, task), {}
            for name in order:
                base.attention = attention if name == "ours" else MLX_ONLY
                out, seconds, _ = _speculative(model, drafter, tokenizer, prompt, args.n, {})
                totals[name][0] += len(out)
                totals[name][1] += seconds
                replies[name] = out
            base.attention = attention
            equal += replies["ours"] == replies["mlx"]
            print(f"{task['name']}: equal {replies['ours'] == replies['mlx']}", flush=True)
    summary = {k: {"tokens": n, "seconds": s, "tokens_per_s": n / s}
               for k, (n, s) in totals.items()}
    summary["ours_vs_mlx"] = summary["ours"]["tokens_per_s"] / summary["mlx"]["tokens_per_s"]
    result = {"mlx": mx.__version__, "tasks": len(tasks), "max_tokens": args.n,
              "replies_equal": equal, "runs": 2 * len(tasks), "summary": summary}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
