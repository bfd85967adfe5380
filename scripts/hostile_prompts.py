"""Write a hostile prompt set: transform random character strings, so drafts almost never
match (the scheduler must then decode plainly, not slower).

    python scripts/hostile_prompts.py docs/hostile_prompts.jsonl [--n 16]

docs/hostile_prompts.jsonl, the set `mlx-dflash bench` runs in BENCHMARKS.md, is this script's
output with --n 8.
"""

import argparse
import json
import random
import string

TASKS = ["Reverse this string character by character: {s}",
         "Rewrite this string in upper case, keeping every character: {s}",
         "Insert a dash between every two characters of: {s}",
         "Repeat this string three times, separated by spaces: {s}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "#%&*+=?@"
    with open(args.out, "w") as f:
        for i in range(args.n):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(24, 40)))
            f.write(json.dumps({"id": i, "prompt": TASKS[i % len(TASKS)].format(s=s)}) + "\n")


if __name__ == "__main__":
    main()
