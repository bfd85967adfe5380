"""Run by tests/test_distributed.py under ``mlx.launch`` (two ranks, ring backend): the server
with its target split across the ranks. Rank 0 serves over HTTP; rank 1 follows its engine
steps. Clients send requests at once (greedy, one ended by a stop string, one that hangs up
mid-stream, a sampled one), then repeat two prompts (continued from the prefix cache, small
enough to evict). Rank 0 writes what the clients got to the JSON file named on the command
line.

Usage: distributed_serve.py OUT.json"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import mlx_dflash  # noqa: E402,F401 (before mlx: the fast BLAS)
import mlx.core as mx  # noqa: E402
from test_server_batch import run_clients, stream_completion  # noqa: E402
from tiny import make_drafter, make_target, make_tokenizer  # noqa: E402

from mlx_dflash import distributed  # noqa: E402
from mlx_dflash.server import BackgroundServer, create_app  # noqa: E402
from mlx_dflash.server.models import CacheSettings  # noqa: E402
from mlx_dflash.server.ranks import follow  # noqa: E402

V = 96
# name -> (family, how it is split, max_batch: 1 runs the one-at-a-time engine)
SERVED = {"qwen3": ("qwen3", "tensor", 3), "qwen2": ("qwen2", "pipeline", 3),
          "qwen2-sequential": ("qwen2", "pipeline", 1)}
PROMPTS = ["w5 w6 w7", "w9 w10 w9 w10 w9", "w40 w41 w42 w43 w44 w45", "w3"]
MAX_TOKENS = 14
CACHE_BYTES = 60_000  # a few entries: the repeats evict (sizes are rank 0's on every rank)


def complete(url: str, prompt: str, **body) -> str:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0][
        "text"]


def main(out_path: str) -> None:
    group = distributed.init()
    assert group is not None and group.size() == 2, "run me with mlx.launch -n 2"
    mx.random.seed(distributed.common_seed(None))
    results = {}
    for name, (family, how, max_batch) in SERVED.items():
        model = make_target(family, vocab_size=V)
        drafter = make_drafter(model, block_size=4)
        assert distributed.shard_target(model, mode=how) == how
        app = create_app(model, drafter, make_tokenizer(V), model_name="m", max_batch=max_batch,
                         cache=CacheSettings(memory=CACHE_BYTES))
        if not distributed.is_root():
            follow(app.state.worker)
            continue
        with BackgroundServer(app) as srv:
            got = run_clients([(complete, srv.url, p) for p in PROMPTS]
                              + [(stream_completion, srv.url, "w7 w8", 400, 3)])  # hangs up
            stop = got[1].split()[2]  # a word of that reply: it ends the reply before it
            got.append(complete(srv.url, PROMPTS[1], stop=[stop]))
            got.append(complete(srv.url, "w11 w12", temperature=1.0, seed=3))
            got += [complete(srv.url, p) for p in PROMPTS[:2]]  # the prefix cache
        results[name] = got
    if distributed.is_root():
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
