"""Turn `mlx-dflash bench --json` output into BENCHMARKS.md tables and a PNG plot.

Usage: python scripts/bench_report.py results/bench_NAME.json [--plot results/bench_NAME.png]
Prints the Markdown; the plot needs matplotlib (pip install matplotlib).
"""

import argparse
import json
from pathlib import Path

from mlx_dflash.bench import format_table


def markdown(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    out = [
        f"Machine: {m['platform']} ({m.get('processor') or 'cpu'}), MLX {m['mlx']} on "
        f"{m['device']}, BLAS `{m.get('blas', '?')}`.",
        f"Settings: target {s.get('model')}, drafter `{s.get('drafter')}`, dtype {s['dtype']}, "
        f"greedy, max_tokens {s['max_tokens']}, block sizes {s['block_sizes']} (no copy drafts)"
        " and `auto` (the default settings: block scheduler + lookup drafts, copied from the "
        "context or from the drafter's n-gram table if it has one); per prompt the plain run "
        "and each variant run back to back (interleaved).",
        "",
        format_table(results),
    ]
    out += ["", "Acceptance rate by block position (fraction of cycles whose draft at position k "
            "was accepted, among cycles that drafted position k):", ""]
    variants = list(next(iter(results["domains"].values()))["speculative"])
    n = max(len(e["speculative"][v]["acceptance_by_position"])
            for e in results["domains"].values() for v in variants)
    out.append("| domain | B | " + " | ".join(str(k) for k in range(1, n + 1)) + " |")
    out.append("|---|---|" + "---:|" * n)
    for domain, e in results["domains"].items():
        for B in variants:
            rates = e["speculative"][B]["acceptance_by_position"]
            cells = [f"{r:.2f}" if r is not None else "" for r in rates]
            cells += [""] * (n - len(cells))
            out.append(f"| {domain} | {B} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    blocks = [str(b) for b in results["settings"]["block_sizes"]]
    widest = max(blocks, key=int)
    for domain, e in results["domains"].items():
        rates = e["speculative"][widest]["acceptance_by_position"]
        ax1.plot(range(1, len(rates) + 1), rates, marker="o", label=domain)
        ax2.plot([int(b) for b in blocks], [e["speculative"][b]["speedup"] for b in blocks],
                 marker="o", label=domain)
    ax1.set(title=f"Acceptance by block position (B={widest})", xlabel="position k",
            ylabel="acceptance rate", ylim=(0, 1))
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set(title="Speedup over plain mlx-lm greedy", xlabel="block size", ylabel="speedup (x)")
    ax2.set_xticks([int(b) for b in blocks])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    print(markdown(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
