"""Summarise short training runs side by side: the last held-out validation of each run
(teacher-forced accuracy by position and the expected acceptance length it implies).

    python scripts/ablation_table.py RUN_DIR[=LABEL] ... [--positions 7] [--json OUT]

Runs with longer blocks are cut to ``--positions`` so that every row counts the same drafts
(the expected acceptance length is recomputed from the accuracies only when cut; otherwise it
is the one validation measured from whole prefixes).
"""

import argparse
import json
from pathlib import Path


def last_validation(run: Path) -> dict:
    lines = (run / "val_log.jsonl").read_text().splitlines()
    if not lines:
        raise SystemExit(f"{run} has no validation yet")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--positions", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.runs:
        path, _, label = spec.partition("=")
        val = last_validation(Path(path))
        acc = val["accuracy"][: args.positions]
        rows.append({"run": label or Path(path).name, "step": val["step"],
                     "train_minutes": round(val["train_seconds"] / 60, 1),
                     "accuracy": [round(a, 3) for a in acc],
                     "expected_tau": round(val["expected_tau"], 3),
                     "positions": len(val["accuracy"])})
    print("| run | steps | minutes | " + " | ".join(f"acc {k + 1}" for k in range(args.positions))
          + " | expected tau |")
    print("|---|---:|---:|" + "---:|" * args.positions + "---:|")
    for r in rows:
        tau = r["expected_tau"] if r["positions"] <= args.positions else \
            f"{r['expected_tau']} ({r['positions']} positions)"
        print(f"| {r['run']} | {r['step']} | {r['train_minutes']} | "
              + " | ".join(f"{a:.3f}" for a in r["accuracy"]) + f" | {tau} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
