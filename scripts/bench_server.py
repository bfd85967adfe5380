"""The server under concurrent clients: N streaming clients at once against a server that
batches them (``--max-batch N``) and one that serves them one at a time (``--max-batch 1``).

The servers run in this process on the default pair (or --model / --drafter), one at a time,
on a loopback port; each round sends the same N eval prompts (chat-templated, greedy) to one
server and then the other. Reports total wall time, time to first token and per-request latency, and
checks that every reply is the same from both.

    python scripts/bench_server.py --clients 8 --rounds 2 --max-tokens 64 \
        --json results/bench_server_smollm2_cpu_DATE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import mlx_dflash  # noqa: F401, I001  (first: it loads the fast BLAS before mlx)
import httpx
import mlx.core as mx

from mlx_dflash.cli.common import load_pair
from mlx_dflash.drafters.shipped import DEFAULT_DRAFTER, resolve_drafter
from mlx_dflash.prompts import read_prompts
from mlx_dflash.server import BackgroundServer, create_app

DATASETS = Path("../shared/datasets")
FILES = ["eval_code_humaneval.jsonl", "eval_math_gsm8k.jsonl", "eval_chat_sharegpt.jsonl"]
NAME = "bench"


def stream_chat(url: str, text: str, max_tokens: int, tic: float) -> dict:
    """One streaming chat request: its reply, first-token and finish times from ``tic``."""
    body = {"model": NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    reply, first, tokens = "", None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk["choices"]
            if choices and (piece := choices[0]["delta"].get("content")):
                first = first if first is not None else time.perf_counter() - tic
                reply += piece
    return {"reply": reply, "tokens": tokens, "ttft": first,
            "latency": time.perf_counter() - tic}


def one_round(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[dict]]:
    """All prompts sent at once; (wall seconds, each request's figures)."""
    out: list[dict | None] = [None] * len(prompts)
    tic = time.perf_counter()

    def run(i: int) -> None:
        out[i] = stream_chat(url, prompts[i], max_tokens, tic)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - tic, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="groups of prompts (interleaved)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    texts = [row["prompt"] for f in FILES for row in read_prompts(DATASETS / f, args.clients)]
    groups = [texts[i::args.rounds][: args.clients] for i in range(args.rounds)]
    model, drafter, tokenizer = load_pair(args.model, resolve_drafter(args.drafter)
                                          if args.drafter else None)
    batch_sizes = {f"max-batch {args.clients}": args.clients, "max-batch 1": 1}
    figures = {name: {"seconds": 0.0, "ttft": [], "latency": [], "tokens": 0}
               for name in batch_sizes}
    replies: dict[str, list[str]] = {name: [] for name in batch_sizes}
    for group in groups:
        for name, max_batch in batch_sizes.items():
            # One server at a time (two in one process slow each other down).
            app = create_app(model, drafter, tokenizer, model_name=NAME, max_batch=max_batch)
            with BackgroundServer(app) as server:
                one_round(server.url, group[:2], 4)  # warm: pass timings, the first prefill
                seconds, out = one_round(server.url, group, args.max_tokens)
            f = figures[name]
            f["seconds"] += seconds
            f["ttft"] += [o["ttft"] for o in out if o["ttft"] is not None]
            f["latency"] += [o["latency"] for o in out]
            f["tokens"] += sum(o["tokens"] for o in out)
            replies[name] += [o["reply"] for o in out]
    servers = batch_sizes
    names = list(servers)
    same = sum(a == b for a, b in zip(replies[names[0]], replies[names[1]]))
    results = {
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                    "mlx": mx.__version__},
        "settings": {"clients": args.clients, "rounds": args.rounds,
                     "max_tokens": args.max_tokens, "greedy": True, "streaming": True,
                     "drafter": args.drafter or DEFAULT_DRAFTER,
                     "model": args.model or "default (SmolLM2-135M-Instruct, float32)"},
        "replies_equal": f"{same}/{len(replies[names[0]])}",
        "servers": {name: {
            "wall_seconds": f["seconds"],
            "tokens_per_s": f["tokens"] / f["seconds"],
            "ttft_mean_s": statistics.mean(f["ttft"]),
            "latency_p50_s": statistics.median(f["latency"]),
            "latency_max_s": max(f["latency"]),
        } for name, f in figures.items()},
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
