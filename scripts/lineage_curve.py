"""Eval-file acceptance of the shipped DSpark lineage against its cumulative training hours.

    python scripts/lineage_curve.py \
        "results/eval_dspark_2026-12-01_1.67h.json:dspark-0.75h@0.75=2026-12-01 00:57" ... \
        --plot results/lineage_dspark_DATE.png

Each spec names an eval_drafters.py JSON, the drafter label inside it, the training hours
behind that drafter and a label (its version: the date it shipped), written along the top.
Plots mean acceptance at B = 8 (exact greedy simulation, 16 prompts per domain), drafter
alone and with copy lookups (n = 2, the rule every evaluation of the lineage measured), one
line per domain, on a log2 hour axis: a straight line is a constant gain per doubling of
training time.
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--plot", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []  # (hours, label, {domain: (alone, copy)})
    for spec in args.specs:
        rest, _, label = spec.partition("=")
        rest, _, hours = rest.partition("@")
        path, _, name = rest.partition(":")
        domains = json.load(open(path))["domains"]
        taus = {d: (rows[f"{name} | B=8 | drafter"]["tau"],
                    rows[f"{name} | B=8 | drafter+copy n=2"]["tau"])
                for d, rows in domains.items()}
        points.append((float(hours), label, taus))
        print(f"{label:4s} {float(hours):5.2f} h  " + "  ".join(
            f"{d} {a:.2f} / {c:.2f}" for d, (a, c) in taus.items()))
    points.sort()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, domain in enumerate(points[0][2]):
        hours = [p[0] for p in points]
        for j, style in enumerate(("-", "--")):
            ax.plot(hours, [p[2][domain][j] for p in points], style, marker="o", color=f"C{i}",
                    label=f"{domain}{' + copy' if j else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([0.5, 1, 2, 4, 8, 16], ["0.5", "1", "2", "4", "8", "16"])
    top = ax.secondary_xaxis("top")
    top.set_xticks([p[0] for p in points], [p[1] for p in points], rotation=90, fontsize=7)
    top.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set(title="DSpark lineage on the eval files (B = 8, exact greedy simulation)",
           xlabel="cumulative training hours (2-core CPU, log2)", ylabel="mean acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
