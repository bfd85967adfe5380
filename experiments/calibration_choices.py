"""Does a DSpark calibration change what the block scheduler verifies on the eval files?

Decodes the first prompts of each eval file greedily with the default pair at the default
settings (scheduler + lookup drafts), once per calibration (temperatures and offsets read from
calibration result files), with the same cached pass costs, and records every cycle's choice
(where its block came from and how many tokens it verified). Outputs must be equal; the
choices are compared prompt by prompt.

    python experiments/calibration_choices.py \
        old=results/calibration_dspark_2026-12-04_11.67h.json \
        new=results/calibration_dspark_2026-12-05_unseen-rows.json \
        --limit 8 --max-tokens 96 --json OUT.json
"""

import argparse
import json
from collections import Counter

import mlx_dflash  # noqa: F401  (fast BLAS first)
import numpy as np

from mlx_dflash import policy, stream_generate
from mlx_dflash.bench import chat_prompt, load_prompt_sets
from mlx_dflash.default_pair import load_default

D = "../shared/datasets"
FILES = [f"{D}/eval_code_humaneval.jsonl", f"{D}/eval_math_gsm8k.jsonl",
         f"{D}/eval_chat_sharegpt.jsonl"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("calibrations", nargs=2, help="NAME=calibration result JSON")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, drafter, tokenizer = load_default(progress=False)
    fits = {}
    for spec in args.calibrations:
        name, path = spec.split("=", 1)
        data = json.load(open(path))
        fits[name] = (data["temperatures"], data["offsets"])

    choices: list = []
    original = policy.BlockPolicy.choose

    def recording(self, room, context, may_look_up=True):
        K, block, source = original(self, room, context, may_look_up)
        choices.append((source, K))
        return K, block, source

    policy.BlockPolicy.choose = recording
    report = {"max_tokens": args.max_tokens, "limit": args.limit, "domains": {}}
    for domain, prompts in load_prompt_sets(FILES, args.limit).items():
        rows = []
        for text in prompts:
            tokens = chat_prompt(tokenizer, text)
            row = {}
            for name, (temps, offsets) in fits.items():
                drafter.args.confidence_temperatures = temps
                drafter.args.confidence_offsets = offsets
                choices.clear()
                out, r = [], None
                for r in stream_generate(model, drafter, tokenizer, tokens,
                                         max_tokens=args.max_tokens):
                    out += r.tokens
                row[name] = {"tokens": out, "choices": list(choices),
                             "accepted": sum(r.stats.acceptance_lengths) if r else 0,
                             "cycles": r.stats.cycles if r else 0}
            rows.append(row)
        a, b = (n for n in fits)
        summary = {"prompts": len(rows),
                   "outputs_equal": sum(r[a]["tokens"] == r[b]["tokens"] for r in rows),
                   "choices_equal": sum(r[a]["choices"] == r[b]["choices"] for r in rows)}
        for name in fits:
            cs = [c for r in rows for c in r[name]["choices"]]
            drafted = [k for s, k in cs if s == "drafter"]
            cycles = sum(r[name]["cycles"] for r in rows)
            summary[name] = {"cycles": cycles,
                             "mean_acceptance_length":
                                 sum(r[name]["accepted"] for r in rows) / max(cycles, 1),
                             "choices_by_source": dict(Counter(s for s, _ in cs)),
                             "mean_drafts_verified": float(np.mean(drafted)) if drafted
                             else 0.0,
                             "drafts_verified_histogram": dict(sorted(Counter(drafted).items()))}
        report["domains"][domain] = summary
        print(domain, json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
