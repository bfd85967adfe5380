"""`auto` with and without the scheduler's per-request calibration of the drafter's survival
scores (schedule.Scheduler.calibration), against plain mlx-lm decoding, interleaved prompt by
prompt in one process (the same machine state for all three).

    python experiments/request_calibration.py [--limit 8] [--no-lookups] PROMPTS.jsonl ...
"""

import argparse
import json
import time

from mlx_dflash import load_default, stream_generate  # first: it loads the fast BLAS
from mlx_dflash.bench import _plain, load_prompt_sets
from mlx_dflash.tree import Calibration


ORDER = ["calibrated", "uncalibrated"]  # run in this order after plain (--swap: reversed)


class Uncalibrated(Calibration):
    """The drafter's scores as they are (what the scheduler read before)."""

    def observe(self, scores, survived) -> None:
        pass


def run(model, drafter, tok, ids, lookups: bool, calibrated: bool) -> tuple[list[int], float]:
    import mlx_dflash.schedule as schedule

    schedule.Calibration = Calibration if calibrated else Uncalibrated
    tic, out = time.perf_counter(), []
    for r in stream_generate(model, drafter, tok, ids, max_tokens=96, copy_drafts=lookups):
        out += r.tokens
    schedule.Calibration = Calibration
    return out, time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--no-lookups", action="store_true")
    parser.add_argument("--swap", action="store_true", help="uncalibrated first")
    args = parser.parse_args()
    if args.swap:
        ORDER.reverse()
    model, drafter, tok = load_default(progress=False)
    result = {"lookups": not args.no_lookups, "max_tokens": 96, "order": ORDER}
    for domain, texts in load_prompt_sets(args.prompts, args.limit).items():
        secs = {"plain": 0.0, "calibrated": 0.0, "uncalibrated": 0.0}
        tokens, equal = 0, 0
        for text in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True)
            ref, elapsed = _plain(model, tok, ids, 96)
            secs["plain"] += elapsed
            tokens += len(ref)
            for name in ORDER:
                out, elapsed = run(model, drafter, tok, ids, not args.no_lookups,
                                   name == "calibrated")
                secs[name] += elapsed
                equal += out == ref
        row = {name: tokens / s for name, s in secs.items()}
        row.update(prompts=len(texts), outputs_equal=f"{equal}/{2 * len(texts)}",
                   calibrated_over_uncalibrated=secs["uncalibrated"] / secs["calibrated"])
        result[domain] = row
        print(domain, json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
