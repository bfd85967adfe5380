"""Measure the target's verify/decode cost ratio with MLX's bundled BLAS and with the fast one.

Each setting runs in a fresh process (the BLAS is chosen at load time). Writes a Markdown table
(default results/blas_ratio.md; the figures of 2026-11-30 are in docs/blas.md).
Usage: python experiments/blas_ratio.py [--model DIR] [--out FILE.md]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys
import mlx_dflash
from mlx_dflash import _blas
from mlx_dflash.bench import measure_pass_costs
from mlx_lm import load
model, _ = load(sys.argv[1])
out = {"blas": _blas.sgemm_provider() or "bundled reference BLAS"}
for B in (4, 8, 16):
    out[B] = measure_pass_costs(model, B, context=256, reps=5)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="results/blas_ratio.md")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from mlx_dflash.default_pair import ensure_default_target

        model = str(ensure_default_target())
    rows = {}
    for label, flag in (("bundled (netlib reference)", "0"), ("fast (loaded by mlx_dflash)", "1")):
        env = {**os.environ, "MLX_DFLASH_FAST_BLAS": flag}
        res = subprocess.run([sys.executable, "-c", PROBE, model], env=env, check=True,
                             capture_output=True, text=True)
        rows[label] = json.loads(res.stdout.strip().splitlines()[-1])
    lines = [
        "# Verify/decode cost with and without a fast BLAS",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores. Target: SmolLM2-135M-Instruct "
        "float32 (`" + Path(model).name + "`), cache of 256 tokens, best of 5 runs each.",
        "Command: `python experiments/blas_ratio.py`",
        "",
        "| BLAS | library | 1-token decode | 4-token verify | 8-token verify | 16-token verify "
        "| ratio B=4 | ratio B=8 | ratio B=16 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | `{r['blas']}` | {r['4']['decode_s'] * 1e3:.0f} ms | "
            f"{r['4']['verify_s'] * 1e3:.0f} ms | {r['8']['verify_s'] * 1e3:.0f} ms | "
            f"{r['16']['verify_s'] * 1e3:.0f} ms | {r['4']['ratio']:.2f} | {r['8']['ratio']:.2f}"
            f" | {r['16']['ratio']:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
