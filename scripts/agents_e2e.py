"""The real coding agents, end to end, against `mlx-dflash serve` with the default pair.

Starts one server (``--max-context 32768``, as ``launch`` does: agents' prompts grow past 8k
tokens over a session; ``--temp 0.6`` for the requests that name none, as agents send), then
through ``mlx-dflash launch AGENT --url ...`` runs each agent found on PATH for a turn and a
second turn of the same conversation (resumed): Claude Code (``claude -p``, then ``-c -p``),
Codex (``codex exec``, then ``exec resume --last``) and opencode (``opencode run``, then
``run --continue``), in two profiles:

- ``full``: the agents as they ship (with SmolLM2's chat template, which leaves tools out,
  Claude Code's first request is 3.1k tokens and Codex's 4.6k; with a template that renders
  tools they are 10-15k). SmolLM2-135M often rambles after these instructions until the
  server's ``--max-tokens``, which Claude Code and Codex report as an error (exit 1): what is
  checked here is that every request is understood (no 4xx / 5xx) and that the second turn
  continues from the first turn's tokens.
- ``short``: the agents' own flags shrink their prompts to what the model can read (Claude
  Code ``--system-prompt`` and ``--tools ""``; Codex ``model_instructions_file`` without its
  multi-agent and web-search tools, about 800 tokens; opencode's prompt is about 2k tokens
  as it ships): here both turns of a session must also exit 0, in at least one of
  ``--sessions`` sessions per agent (the tiny model sometimes rambles to the cap here too;
  every session is recorded).

Writes a JSON summary (``--out``). The agents install from npm (``npm install
@anthropic-ai/claude-code @openai/codex opencode-ai``; put their ``node_modules/.bin`` on
PATH).

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
from pathlib import Path

from mlx_dflash.cli.launch import wait_ready

PROMPTS = ("Reply with the single word: hello", "Now reply with the single word: goodbye")


REQUEST_LINE = re.compile(r"(\d+) prompt tokens \((\d+) cached\), (\d+) generated, "
                          r"([\d.]+) tokens/s, mean acceptance [\d.]+, finish (\w+)")
SHORT_SYSTEM = "You are a concise assistant. Answer in one short sentence."


def turns(agent: str, profile: str, work: Path) -> list[list[str]]:
    """The agent's arguments for the first and the resumed second turn."""
    if agent == "opencode":
        return [["run", PROMPTS[0]], ["run", "--continue", PROMPTS[1]]]
    if agent == "claude":
        short = ["--system-prompt", SHORT_SYSTEM, "--tools", ""] if profile == "short" else []
        return [["-p", PROMPTS[0], "--output-format", "json", *short],
                ["-c", "-p", PROMPTS[1], "--output-format", "json", *short]]
    short = []
    if profile == "short":
        (work / "instructions.md").write_text(SHORT_SYSTEM + "\n")
        short = ["-c", f'model_instructions_file="{work / "instructions.md"}"',
                 "-c", "features.multi_agent=false", "-c", "tools.web_search=false"]
    return [["exec", *short, "--skip-git-repo-check", "--json", PROMPTS[0]],
            ["exec", "resume", *short, "--last", "--skip-git-repo-check", "--json",
             PROMPTS[1]]]


def scrub(text: str, work: Path) -> str:
    return text.replace(str(work), "<work>").replace(tempfile.gettempdir(), "<tmp>")


def usage(agent: str, stdout: str) -> dict:
    """(input, cached input, output) tokens of the turn, as the agent reports them."""
    if agent == "opencode":
        return {}  # it prints the reply only; the server's log has the counts
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-tokens", type=int, default=512,
                    help="the server's longest reply (the tiny model sometimes rambles)")
    ap.add_argument("--temp", type=float, default=0.6,
                    help="the server's temperature for requests that name none (the agents "
                         "name none); at the APIs' default, 1.0, SmolLM2-135M rambles to the "
                         "cap in most of Codex's turns (results/agents_e2e_2026-12-06_temp1.json)")
    ap.add_argument("--sessions", type=int, default=3,
                    help="two-turn sessions per agent in the short profile (the tiny model "
                         "sometimes rambles to --max-tokens: each session is recorded)")
    ap.add_argument("--agents", nargs="+", default=["claude", "codex", "opencode"])
    ap.add_argument("--profiles", nargs="+", default=["short", "full"],
                    choices=["short", "full"])
    ap.add_argument("--out", help="write the summary here (JSON)")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.mkdtemp(prefix="agents-e2e-")) / "serve.log"
    serve = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(args.port),
             "--max-context", "32768", "--max-tokens", str(args.max_tokens)]
    serve += ["--temp", str(args.temp)] if args.temp is not None else []
    server = subprocess.Popen(serve, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    results = []
    try:
        wait_ready(url, server, log_path)
        sessions = [(p, a, k) for p in args.profiles for a in args.agents
                    for k in range(args.sessions if p == "short" else 1)]
        for profile, agent, session in sessions:
            if shutil.which(agent) is None:
                print(f"{agent}: not installed, skipped", file=sys.stderr)
                continue
            work = Path(tempfile.mkdtemp(prefix=f"agents-e2e-{agent}-"))
            home = {"HOME": str(work / "home")}  # the agents' own state, not the user's
            (work / "home").mkdir()
            for i, agent_args in enumerate(turns(agent, profile, work)):
                tic, seen = time.perf_counter(), log_path.stat().st_size
                run = subprocess.run(
                    [sys.executable, "-m", "mlx_dflash.cli", "launch", agent, "--url", url,
                     "--", *agent_args], cwd=work, capture_output=True, text=True,
                    stdin=subprocess.DEVNULL, env={**os.environ, **home}, timeout=1200)
                row = {"agent": agent, "profile": profile, "session": session + 1,
                       "turn": i + 1,
                       "exit_code": run.returncode,
                       "seconds": round(time.perf_counter() - tic, 1)}
                try:
                    row["usage"] = usage(agent, run.stdout)
                except (ValueError, IndexError):
                    row["usage"] = {}
                with open(log_path, "rb") as f:  # the server's line for each request
                    f.seek(seen)
                    row["requests"] = [
                        dict(zip(("prompt", "cached", "generated", "tokens_per_s", "finish"),
                                 (int(m[1]), int(m[2]), int(m[3]), float(m[4]), m[5])))
                        for m in REQUEST_LINE.finditer(f.read().decode(errors="replace"))]
                if run.returncode != 0:  # (this machine's temporary paths left out)
                    row["stderr_tail"] = scrub(run.stderr[-1500:], work)
                    row["stdout_tail"] = scrub(run.stdout[-1500:], work)
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    errors = [line for line in log.splitlines() if re.search(r'" [45]\d\d ', line)]
    requests = [line for line in log.splitlines() if '"POST /v1/' in line]
    completed = {(r["agent"], r["session"]) for r in results if r["profile"] == "short"
                 and r["turn"] == 2 and r["exit_code"] == 0 and any(
                     o["exit_code"] == 0 for o in results if o["profile"] == "short"
                     and o["turn"] == 1 and (o["agent"], o["session"]) == (r["agent"],
                                                                           r["session"]))}
    checks = {
        "short profile: every agent completed a two-turn session (both turns exit 0)": all(
            any(a == agent for a, _ in completed) for agent in {r["agent"] for r in results}),
        "no 4xx / 5xx in the server's log": not errors,
        "second turns continue from the first turn's tokens (prefix cache)": all(
            r["requests"] and r["requests"][0]["cached"] > 0 for r in results
            if r["turn"] == 2),
    }
    summary = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
               f"{os.cpu_count()} cores", "server": " ".join(serve[3:]),
               "agents": {a: subprocess.run([a, "--version"], capture_output=True,
                                            text=True).stdout.strip()
                          for a in args.agents if shutil.which(a)},
               "short_sessions_completed": {a: sum(c == a for c, _ in completed)
                                            for a in args.agents},
               "runs": results, "requests": len(requests), "log_errors": errors,
               "checks": checks}
    print(json.dumps(checks, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    sys.exit(0 if all(checks.values()) and results else 1)


if __name__ == "__main__":
    main()
