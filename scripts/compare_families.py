"""Train EAGLE-3, DSpark and DFlash drafters for the default target on one feature store with
the same budget, then measure each on the eval files: held-out teacher-forced accuracy by
position (the last validation) and greedy decoding against plain decoding, side by side.

    python scripts/compare_families.py runs/store --out runs/families --minutes 15 \
        --limit 6 --json results/families_eagle3_dspark_dflash_DATE.json

Every family drafts at most 7 tokens (DFlash and EAGLE-3: block 8; DSpark: g = 7), starts from
its own default initialisation and trains alone on the machine (rerun to resume a family whose
checkpoint is missing; one that has one is not trained again). Same recipe otherwise: 16k draft
vocabulary, 0.1 CE + 1.8 TV (each family's own position weights; DSpark adds its confidence
BCE), 16 anchors a sequence, lr 6e-4 over the budget. Benches: fixed verify blocks 4 and 8,
drafter alone (no copy drafts), and the defaults ('auto': scheduler + copy drafts).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

D = "../shared/datasets/"
EVAL = [D + "eval_code_humaneval.jsonl", D + "eval_math_gsm8k.jsonl",
        D + "eval_chat_sharegpt.jsonl"]
FAMILIES = {"eagle3": 8, "dspark": 7, "dflash": 8}  # family -> --block-size (7 drafts each)
CLI = [sys.executable, "-m", "mlx_dflash.cli"]


def train(family: str, block: int, store: str, out: Path, minutes: float) -> None:
    if (out / "checkpoint" / "config.json").exists():
        return
    subprocess.run([*CLI, "train", "--out", str(out), "--store", store, "--family", family,
                    "--block-size", str(block), "--draft-vocab", "16384", "--ce-weight", "0.1",
                    "--tv-weight", "1.8", "--anchors", "16", "--lr", "6e-4",
                    "--minutes", str(minutes)], check=True)


def bench(drafter: Path, limit: int, max_tokens: int, out: Path) -> dict:
    if not out.exists():
        prompts = [a for f in EVAL for a in ("--prompts", f)]
        subprocess.run([*CLI, "bench", *prompts, "--drafter", str(drafter), "--block-size", "4",
                        "--block-size", "8", "--limit", str(limit), "--max-tokens",
                        str(max_tokens), "--json", str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--out", default="runs/families")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--limit", type=int, default=6, help="eval prompts per file")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for family, block in FAMILIES.items():
        run = Path(args.out) / family
        train(family, block, args.store, run, args.minutes)
        lines = (run / "val_log.jsonl").read_text().splitlines()
        result = bench(run / "checkpoint", args.limit, args.max_tokens, run / "bench.json")
        rows.append({"family": family, "block_size": block, "validation": json.loads(lines[-1]),
                     "bench": result})
    with open(args.json, "w") as f:
        json.dump({"store": args.store, "minutes": args.minutes, "families": rows}, f, indent=1)
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The BENCHMARKS.md table: per family and domain, the fixed block of 4 (drafter alone)
    and auto: speedup, mean acceptance length, acceptance of draft positions 1-3."""
    out = ["| family | steps | held-out tau | domain | B=4 speedup | B=4 tau "
           "| accepted at 1 / 2 / 3 | auto speedup | auto tau |",
           "|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in rows:
        v = r["validation"]
        for domain, d in r["bench"]["domains"].items():
            b4, auto = d["speculative"]["4"], d["speculative"]["auto"]
            acc = " / ".join(f"{a:.2f}" for a in b4["acceptance_by_position"][:3])
            out.append(f"| {r['family']} | {v['step']} | {v['expected_tau']:.2f} | {domain} | "
                       f"{b4['speedup']:.2f}x | {b4['mean_acceptance_length']:.2f} | {acc} | "
                       f"{auto['speedup']:.2f}x | {auto['mean_acceptance_length']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
