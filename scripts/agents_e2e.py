"""The real coding agents, end to end, against `mlx-dflash serve` with the default pair.

Starts one server (``--max-context 32768``: the agents' prompts are beyond SmolLM2's 8k), then
through ``mlx-dflash launch AGENT --url ...`` runs each agent found on PATH for a turn and a
second turn of the same conversation (resumed): Claude Code (``claude -p``, then ``-c -p``)
and Codex (``codex exec``, then ``exec resume --last``). Checks that every run exits 0, that
the server's log has no 4xx or 5xx line, and that the second turn's usage counts the first
turn's tokens as cached. Writes a JSON summary (``--out``).

The agents install from npm (``npm install @anthropic-ai/claude-code @openai/codex``; put their
``node_modules/.bin`` on PATH). SmolLM2-135M answers at these lengths with little sense; what
is checked is that the agents and the server understand each other.

    python scripts/agents_e2e.py --out results/agents_e2e_2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = ("Reply with the single word: hello", "Now reply with the single word: goodbye")


def turns(agent: str) -> list[list[str]]:
    """The agent's arguments for the first and the resumed second turn."""
    if agent == "claude":
        return [["-p", PROMPTS[0], "--output-format", "json"],
                ["-c", "-p", PROMPTS[1], "--output-format", "json"]]
    return [["exec", "--skip-git-repo-check", "--json", PROMPTS[0]],
            ["exec", "resume", "--last", "--skip-git-repo-check", "--json", PROMPTS[1]]]


def usage(agent: str, stdout: str) -> dict:
    """(input, cached input, output) tokens of the turn, as the agent reports them."""
    if agent == "claude":
        u = json.loads(stdout.strip().splitlines()[-1]).get("usage", {})
        return {"input": u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0),
                "cached": u.get("cache_read_input_tokens", 0), "output": u.get("output_tokens")}
    for line in stdout.splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("type") == "turn.completed":
            u = event["usage"]
            return {"input": u.get("input_tokens"), "cached": u.get("cached_input_tokens", 0),
                    "output": u.get("output_tokens")}
    return {}


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            if server.poll() is not None:
                sys.exit("the server exited before it was ready")
            time.sleep(1)
    sys.exit("the server was not ready in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="the server's longest reply (the tiny model rambles at 10k tokens)")
    ap.add_argument("--agents", nargs="+", default=["claude", "codex"])
    ap.add_argument("--out", help="write the summary here (JSON)")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.mkdtemp(prefix="agents-e2e-")) / "serve.log"
    serve = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(args.port),
             "--max-context", "32768", "--max-tokens", str(args.max_tokens)]
    server = subprocess.Popen(serve, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    results = []
    try:
        wait_ready(url, server)
        for agent in args.agents:
            if shutil.which(agent) is None:
                print(f"{agent}: not installed, skipped", file=sys.stderr)
                continue
            work = Path(tempfile.mkdtemp(prefix=f"agents-e2e-{agent}-"))
            home = {"HOME": str(work / "home")}  # the agents' own state, not the user's
            (work / "home").mkdir()
            for i, agent_args in enumerate(turns(agent)):
                tic = time.perf_counter()
                run = subprocess.run(
                    [sys.executable, "-m", "mlx_dflash.cli", "launch", agent, "--url", url,
                     "--", *agent_args], cwd=work, capture_output=True, text=True,
                    stdin=subprocess.DEVNULL, env={**os.environ, **home}, timeout=1200)
                row = {"agent": agent, "turn": i + 1, "exit_code": run.returncode,
                       "seconds": round(time.perf_counter() - tic, 1)}
                try:
                    row["usage"] = usage(agent, run.stdout)
                except (ValueError, IndexError):
                    row["usage"] = {}
                if run.returncode != 0:
                    row["stderr_tail"] = run.stderr[-1500:]
                    row["stdout_tail"] = run.stdout[-1500:]
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    errors = [line for line in log.splitlines() if re.search(r'" [45]\d\d ', line)]
    requests = [line for line in log.splitlines() if '"POST /v1/' in line]
    checks = {
        "every run exited 0": all(r["exit_code"] == 0 for r in results),
        "no 4xx / 5xx in the server's log": not errors,
        "second turns count the first turn's tokens as cached": all(
            r["usage"].get("cached", 0) > 0 for r in results if r["turn"] == 2),
    }
    summary = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
               f"{os.cpu_count()} cores", "server": " ".join(serve[3:]),
               "agents": {a: subprocess.run([a, "--version"], capture_output=True,
                                            text=True).stdout.strip()
                          for a in args.agents if shutil.which(a)},
               "runs": results, "requests": len(requests), "log_errors": errors,
               "checks": checks}
    print(json.dumps(checks, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    sys.exit(0 if all(checks.values()) and results else 1)


if __name__ == "__main__":
    main()
