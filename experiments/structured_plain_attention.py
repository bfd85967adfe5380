"""How much of the structured bench's speedup is the CPU attention's: mlx-lm's plain
constrained decoding (the bench's baseline, bench_structured._plain with a grammar) with MLX's
attention and with the attention the target's passes use on the CPU (attention.on_cpu),
interleaved task by task, on the shipped extraction tasks.

    python experiments/structured_plain_attention.py [--tasks 24] [-n 256] [--out FILE.json]
"""

from __future__ import annotations


import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_dflash import Grammar, attention, load_default
from mlx_dflash.bench_structured import _plain, read_tasks, task_prompt
from report import report, task_options


def main() -> None:
    args = task_options(tasks=24, max_tokens=256)
    model, _, tokenizer = load_default(progress=False)
    totals = {"mlx": [0, 0.0], "ours": [0, 0.0]}
    equal = 0
    for task in read_tasks()[: args.tasks]:
        prompt, grammar = task_prompt(tokenizer, task), Grammar.json_schema(task["schema"])
        mlx_out, mlx_s, _ = _plain(model, tokenizer, prompt, grammar, args.n)
        with attention.on_cpu():
            ours_out, ours_s, _ = _plain(model, tokenizer, prompt, grammar, args.n)
        equal += mlx_out == ours_out
        totals["mlx"][0] += len(mlx_out)
        totals["mlx"][1] += mlx_s
        totals["ours"][0] += len(ours_out)
        totals["ours"][1] += ours_s
        print(f"{task['name']}: {len(mlx_out)} tok, MLX's attention {mlx_s:.2f}s, ours "
              f"{ours_s:.2f}s, equal {mlx_out == ours_out}", flush=True)
    tps = {k: t / s for k, (t, s) in totals.items()}
    result = {"mlx": mx.__version__, "tasks": args.tasks, "max_tokens": args.n,
              "tokens_per_s": tps, "ours_vs_mlx": tps["ours"] / tps["mlx"],
              "replies_equal": equal}
    report(result, args.out)


if __name__ == "__main__":
    main()
