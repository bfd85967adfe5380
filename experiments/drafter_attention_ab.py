"""`auto` with the drafter's passes built under the package's CPU attention (as shipped) and
under MLX's, interleaved on the structured bench's tasks, each order once; replies compared.

    python experiments/drafter_attention_ab.py [--tasks 8] [-n 128] [--out FILE.json]
"""

from __future__ import annotations

import contextlib
import types

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
import mlx_dflash.drafters.base as base
from mlx_dflash import attention
from mlx_dflash.bench import _speculative
from mlx_dflash.bench_structured import read_tasks, task_prompt
from mlx_dflash.default_pair import load_default
from report import report, task_options

MLX_ONLY = types.SimpleNamespace(on_cpu=contextlib.nullcontext)  # the drafter's passes as before


def main() -> None:
    args = task_options(tasks=8, max_tokens=128)
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
    report(result, args.out)


if __name__ == "__main__":
    main()
