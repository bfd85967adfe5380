"""A soak run of `mlx-dflash serve`: agent-shaped requests across the three APIs, 8 at a time,
some cancelled mid-stream or dropped mid-prefill.

Agent-shaped: a long shared system prompt (a coding agent's, ~2k tokens) with a few tools, then
a short user turn; greedy, so every completed reply must equal that conversation's solo reply
(taken first, one request at a time). Requests go to `/v1/chat/completions`, `/v1/responses` and
`/v1/messages` in turn, streamed or not; every fifth is a client that leaves: a stream closed
after its first events, or a non-streamed request dropped after 0.3 s (mid-prefill when its
prompt is new). Checks: every request ends (a reply, or a cancellation that the server sees:
/health back to 0 pending), no 5xx, every reply equal to its solo run, and the server's MLX
memory (/health: weights, caches, the prefix cache) after the run within 5% of its level after
the solo runs (the prefix cache is bounded by --cache-memory, so it is full by then). The
process's RSS is reported beside it.

    python scripts/soak_server.py --requests 300 --out results/soak_server_2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mlx_dflash.cli.launch import wait_ready

SYSTEM = ("You are a coding agent running in a terminal. You read files, run commands and "
          "edit code to finish the user's task. Keep answers short. ") * 60  # ~2k tokens
TASKS = ["List the files in this directory.", "What does the main function do?",
         "Fix the failing test in tests/test_io.py.", "Explain the build script.",
         "Rename the variable x to count.", "Why is the server slow?",
         "Write a docstring for parse_args.", "Which Python version is needed?",
         "Add a --verbose flag.", "Summarise the README in one line.",
         "What is 17 * 23?", "Translate 'hello' to French.", "Name three sorting algorithms.",
         "What is a mutex?", "Say hi.", "How do I undo the last git commit?"]
MAX_TOKENS = 24


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def request(api: str, task: str, stream: bool) -> tuple[str, dict]:
    """The request for ``task`` through ``api``: (path, body)."""
    if api == "chat":
        return "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream, "messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": task}]}
    if api == "responses":
        return "/v1/responses", {
            "model": "SmolLM2-135M-Instruct", "max_output_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, "store": False, "instructions": SYSTEM,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": task}]}]}
    return "/v1/messages", {
        "model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": stream, "system": [{"type": "text", "text": SYSTEM,
                                      "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": task}]}


def reply_text(api: str, body: dict) -> str:
    if api == "chat":
        return body["choices"][0]["message"]["content"] or ""
    if api == "responses":
        return "".join(p["text"] for item in body["output"] if item["type"] == "message"
                       for p in item["content"])
    return "".join(b.get("text", "") for b in body["content"])


def streamed_text(api: str, lines: list[str]) -> str:
    out = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if api == "chat":
            out += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        elif api == "responses" and event.get("type") == "response.output_text.delta":
            out.append(event["delta"])
        elif api == "messages" and event.get("type") == "content_block_delta":
            out.append(event["delta"].get("text", ""))
    return "".join(out)


def run_one(url: str, api: str, task: str, stream: bool, leave: bool) -> dict:
    path, body = request(api, task, stream)
    row = {"api": api, "task": task, "stream": stream, "leave": leave}
    tic = time.perf_counter()
    try:
        if stream:
            with httpx.stream("POST", url + path, json=body, timeout=600) as r:
                row["status"] = r.status_code
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if leave and len(lines) >= 4:
                        break  # the client leaves mid-stream
                if not leave:
                    row["text"] = streamed_text(api, lines)
        else:
            r = httpx.post(url + path, json=body, timeout=0.3 if leave else 600)
            row["status"] = r.status_code
            if r.status_code == 200:
                row["text"] = reply_text(api, r.json())
    except httpx.ReadTimeout:
        row["status"] = "left"
    row["seconds"] = round(time.perf_counter() - tic, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--cache-memory", default="1GB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "serve.log"
    serve = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(args.port),
             "--cache-memory", args.cache_memory]
    server = subprocess.Popen(serve, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    rng = random.Random(args.seed)
    try:
        wait_ready(url, server, log_path)
        solo = {task: run_one(url, "chat", task, False, False)["text"] for task in TASKS}
        rss_before, health_before = rss_bytes(server.pid), httpx.get(url + "/health").json()
        plan = [(("chat", "responses", "messages")[i % 3], rng.choice(TASKS), rng.random() < 0.5,
                 i % 5 == 4) for i in range(args.requests)]
        tic = time.perf_counter()
        done: list[dict] = []
        lock = threading.Lock()

        def go(item):
            row = run_one(url, *item)
            with lock:
                done.append(row)
                if len(done) % 25 == 0:
                    print(f"{len(done)}/{len(plan)} requests", file=sys.stderr, flush=True)
            return row

        with ThreadPoolExecutor(args.concurrency) as pool:
            rows = list(pool.map(go, plan))
        wall = time.perf_counter() - tic
        for _ in range(120):  # the cancelled ones leave the engine within a step or a chunk
            health = httpx.get(url + "/health").json()
            if health["pending"] == 0:
                break
            time.sleep(0.5)
        time.sleep(2)
        rss_after, health = rss_bytes(server.pid), httpx.get(url + "/health").json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    completed = [r for r in rows if not r["leave"]]
    mismatches = [{**r, "solo": solo[r["task"]]} for r in completed
                  if r.get("text") != solo[r["task"]]]
    active = [h["memory"]["active"] for h in (health_before, health)]
    log = log_path.read_text(errors="replace")
    checks = {
        "every kept request got a 200": all(r.get("status") == 200 for r in completed),
        "no 5xx in the server's log": '" 5' not in log,
        "nothing left running or waiting": health["pending"] == 0,
        "every completed greedy reply equals its solo run": not mismatches,
        "MLX memory back within 5% of its level after the solo runs":
            active[1] <= 1.05 * active[0],
    }
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "server": " ".join(serve[3:]), "requests": len(rows), "concurrency": args.concurrency,
        "left_early": sum(r["leave"] for r in rows), "wall_s": round(wall, 1),
        "by_api": {api: sum(r["api"] == api for r in rows) for api in
                   ("chat", "responses", "messages")},
        "mlx_active_after_solo_mb": round(active[0] / 2**20, 1),
        "mlx_active_after_run_mb": round(active[1] / 2**20, 1),
        "prefix_cache_after_solo_mb": round(sum(health_before["prefix_cache"].values()) / 2**20),
        "prefix_cache_after_run_mb": round(sum(health["prefix_cache"].values()) / 2**20),
        "rss_after_solo_mb": round(rss_before / 2**20, 1),
        "rss_after_run_mb": round(rss_after / 2**20, 1),
        "mismatched": len(mismatches), "mismatches": mismatches[:5], "checks": checks,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
