"""The same benchmark on two revisions of the package, run alternately on one machine: the
decode path's speed before and after a change, side by side.

The revision given by --before is checked out into a temporary git worktree; each round runs
the command once with that tree's package and once with this checkout's (``PYTHONPATH``, from
a neutral working directory, so the editable install does not shadow it). In the command,
``mlx-dflash`` runs the chosen tree's CLI, ``{json}`` is a fresh results file per run and
``{tree}`` the chosen tree's root (for its scripts/). Writes every run's JSON and, for
``mlx-dflash bench`` results, tok/s per domain and variant with the after / before ratio.

    python scripts/bench_revisions.py --before a10b999 --rounds 2 \\
        --json results/bench_revisions_token-origins_2026-12-07.json -- \\
        mlx-dflash bench --prompts ../shared/datasets/eval_code_humaneval.jsonl ... \\
        --block-size 4 --max-tokens 96 --limit 4 --json {json}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(command: list[str], tree: Path, out: Path) -> dict:
    argv = [a.replace("{json}", str(out)).replace("{tree}", str(tree)) for a in command]
    if argv[0] == "mlx-dflash":
        argv = [sys.executable, "-m", "mlx_dflash.cli"] + argv[1:]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    probe = subprocess.run([sys.executable, "-c", "import mlx_dflash; print(mlx_dflash.__file__)"],
                           env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if not probe.stdout.startswith(str(tree)):
        sys.exit(f"the package imported from {probe.stdout.strip()!r}, not from {tree}")
    print(f"[{tree.name}] {' '.join(argv)}", file=sys.stderr, flush=True)
    subprocess.run(argv, env=env, cwd=tempfile.gettempdir(), check=True)
    return json.loads(out.read_text())


def relative(command: list[str]) -> list[str]:
    """The command as it is recorded: paths inside the repo relative to it, shared/ as ../."""
    return [a.replace(str(ROOT) + "/", "").replace(str(ROOT.parent) + "/", "../")
            for a in command]


def tokens_per_s(result: dict) -> dict[str, float]:
    """'domain/variant' -> tok/s, from an ``mlx-dflash bench`` JSON (else empty)."""
    out = {}
    for domain, d in result.get("domains", {}).items():
        if "plain" in d:
            out[f"{domain}/plain"] = d["plain"]["tokens_per_s"]
        for variant, v in d.get("speculative", {}).items():
            out[f"{domain}/{variant}"] = v["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the revision to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    before_rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout.strip()
    after_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "mlx_dflash"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / f"before-{before_rev}"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), before_rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            for i in range(args.rounds):
                for side, root in (("before", tree), ("after", ROOT)):
                    runs[side].append(run(command, root, Path(tmp) / f"{side}-{i}.json"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    summary = {}
    for key in tokens_per_s(runs["after"][0]):
        b = statistics.median(tokens_per_s(r)[key] for r in runs["before"])
        a = statistics.median(tokens_per_s(r)[key] for r in runs["after"])
        summary[key] = {"before_tok_s": round(b, 2), "after_tok_s": round(a, 2),
                        "after_over_before": round(a / b, 3)}
        print(f"{key:24s} {b:7.2f} -> {a:7.2f} tok/s  {a / b:.3f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "before": before_rev, "after": after_rev + ("+uncommitted" if dirty else ""),
        "rounds": args.rounds, "order": "before then after, each round",
        "command": relative(command), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
