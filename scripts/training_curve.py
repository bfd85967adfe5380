"""Plot held-out acceptance against training time for one or more runs.

    python scripts/training_curve.py RUN_DIR[=LABEL][@HOURS] ... \
        --plot results/training_curve_DATE.png

``@HOURS`` shifts a run that continued from an earlier checkpoint by the training hours behind
it, so that a lineage of runs reads as one curve.

Reads each run's val_log.jsonl (written at every checkpoint): the teacher-forced expected
acceptance length on held-out store sequences (greedy prefix of a 16-token block, +1) against
training hours (wall-clock time of the training steps; checkpoint and validation time left out).
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--plot", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in args.runs:
        spec, _, offset = spec.partition("@")
        path, _, label = spec.partition("=")
        rows = [json.loads(line) for line in open(Path(path) / "val_log.jsonl")]
        hours = [float(offset or 0) + r["train_seconds"] / 3600 for r in rows]
        ax1.plot(hours, [r["expected_tau"] for r in rows], marker="o", label=label or path)
        ax2.plot(hours, [r["accuracy"][0] for r in rows], marker="o", label=label or path)
        print(f"{label or path}: " + ", ".join(f"{h:.2f} h -> tau {r['expected_tau']:.3f}"
                                               for h, r in zip(hours, rows)))
    ax1.set(title="Held-out expected acceptance length (teacher-forced)",
            xlabel="training hours (wall clock of the run)", ylabel="tau")
    ax2.set(title="Held-out position-1 accuracy", xlabel="training hours (wall clock of the run)",
            ylabel="accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
