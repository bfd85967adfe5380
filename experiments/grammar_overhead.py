"""What the grammar machinery costs speculation when it constrains nothing: the default pair's
``auto`` on the structured-output tasks' prompts without a grammar and with one that admits any
text (a regular expression matching everything), interleaved task by task. The replies are the
same (checked), so the difference is the matcher's host work, the masks and the extra sync
before each target pass, with no forced tokens to pay for them.

    python experiments/grammar_overhead.py [--tasks 8] [-n 128] [--out FILE.json]
"""

from __future__ import annotations

import time

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_dflash import Grammar, load_default, stream_generate
from mlx_dflash.bench_structured import read_tasks, task_prompt
from report import report, task_options


def run(model, drafter, tokenizer, prompt, max_tokens, grammar):
    tic, tokens, last = time.perf_counter(), [], None
    for last in stream_generate(model, drafter, tokenizer, prompt, max_tokens=max_tokens,
                                grammar=grammar):
        tokens += last.tokens
    return tokens, time.perf_counter() - tic, last.stats


def main() -> None:
    args = task_options(tasks=8, max_tokens=128)
    model, drafter, tokenizer = load_default(progress=False)
    anything = Grammar.regex(r"(?s:.*)")
    totals = {"free": [0, 0.0, 0], "any": [0, 0.0, 0]}
    equal = 0
    tasks = read_tasks()[: args.tasks]
    run(model, drafter, tokenizer, task_prompt(tokenizer, tasks[0]), 8, anything)  # warm-up
    for task in tasks:
        prompt = task_prompt(tokenizer, task)
        free = run(model, drafter, tokenizer, prompt, args.n, None)
        any_ = run(model, drafter, tokenizer, prompt, args.n, anything)
        equal += free[0] == any_[0]
        for name, (tokens, seconds, stats) in (("free", free), ("any", any_)):
            totals[name][0] += len(tokens)
            totals[name][1] += seconds
            totals[name][2] += stats.cycles
        print(f"{task['name']}: free {len(free[0])} tok {free[1]:.2f}s, any-text grammar "
              f"{any_[1]:.2f}s, equal {free[0] == any_[0]}", flush=True)
    summary = {name: {"tokens": t, "seconds": s, "cycles": c, "tokens_per_s": t / s,
                      "ms_per_cycle": 1e3 * s / c} for name, (t, s, c) in totals.items()}
    summary["any_vs_free"] = summary["any"]["tokens_per_s"] / summary["free"]["tokens_per_s"]
    result = {"mlx": mx.__version__, "tasks": len(tasks), "max_tokens": args.n,
              "replies_equal": equal, "summary": summary}
    report(result, args.out)


if __name__ == "__main__":
    main()
