"""The structured bench's tasks whose constrained replies the 256-token limit cut, again with a
larger limit: does each reply then end, parse and validate against its schema? (`auto` under
the schema, greedy, as the bench runs it.)

    python experiments/structured_cut_replies.py [--tasks invoice flight_booking server_log]
        [-n 1024] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
from mlx_dflash.bench import _speculative
from mlx_dflash.bench_structured import _valid, read_tasks, task_prompt
from mlx_dflash.default_pair import load_default
from mlx_dflash.grammar import Grammar
from report import report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", default=["invoice", "flight_booking", "server_log"])
    ap.add_argument("-n", type=int, default=1024)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, drafter, tokenizer = load_default(progress=False)
    rows = []
    for task in [t for t in read_tasks() if t["name"] in args.tasks]:
        grammar = Grammar.json_schema(task["schema"])
        out, seconds, stats = _speculative(model, drafter, tokenizer, task_prompt(tokenizer, task),
                                           args.n, {"grammar": grammar})
        row = {"name": task["name"], "tokens": len(out), "ended": len(out) < args.n,
               "valid": _valid(tokenizer.decode(out), task["schema"]),
               "tokens_per_s": len(out) / seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report({"max_tokens": args.n, "tasks": rows}, args.out, show=False)


if __name__ == "__main__":
    main()
