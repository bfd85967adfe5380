"""Load: 8 concurrent streaming clients x 5 requests each against one server, half of them on
the OpenAI chat endpoint and half on Anthropic's /v1/messages.

Every greedy reply must equal the sequential `mlx_dflash.generate` output (the single worker
serializes the model, so concurrency must not change a token), nothing may fail, and memory
must come back to where it was after a warm-up (less what the prefix cache holds, which stays
under its budget).
"""

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import mlx.core as mx
import openai
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import generate
from mlx_dflash.server import BackgroundServer, create_app

V = 96
NAME = "tiny-load"
CLIENTS, ROUNDS = 8, 5


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def work(client_id: int, rounds: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs differ per client and round, so replies cannot be mixed up."""
    return [(f"w{5 + client_id} w{30 + r} w{60 + (client_id * 7 + r) % 30}", 12 + 2 * r)
            for r in range(rounds)]


def run_clients(url: str, rounds: int) -> tuple[dict, list]:
    results, errors = {}, []

    def openai_stream(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
        stream = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] in ("stop", "length") and chunks[-1].usage is not None
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def anthropic_stream(client: anthropic.Anthropic, prompt: str, max_tokens: int) -> str:
        with client.messages.stream(model=NAME, max_tokens=max_tokens,
                                    messages=[{"role": "user", "content": prompt}],
                                    extra_body={"temperature": 0}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens
        return text

    def one_client(cid: int) -> None:
        if cid % 2:
            client = anthropic.Anthropic(api_key="unused", base_url=url, max_retries=0,
                                         timeout=120)
            ask = anthropic_stream
        else:
            client = openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0,
                                   timeout=120)
            ask = openai_stream
        try:
            for prompt, max_tokens in work(cid, rounds):
                results[(prompt, max_tokens)] = ask(client, prompt, max_tokens)
        except Exception as e:  # noqa: BLE001 (collected and reported by the test)
            errors.append(repr(e))
        finally:
            client.close()

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one_client, range(CLIENTS)))
    return results, errors


def test_concurrent_streaming_clients():
    model = make_target("qwen3", vocab_size=V)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(V)  # no chat template: the server joins the message contents
    want = {(p, n): generate(model, drafter, tok, p, max_tokens=n)
            for cid in range(CLIENTS) for p, n in work(cid, ROUNDS)}

    app = create_app(model, drafter, tok, model_name=NAME)
    with BackgroundServer(app) as server:
        _, errors = run_clients(server.url, 1)  # warm-up: compile, caches, client pools
        assert not errors, errors
        store = app.state.pool.get(NAME).prefix_cache
        gc.collect()
        cached = store.nbytes  # the prefix cache's entries: bounded by its budget, not leaked
        rss_before, active_before = rss_bytes() - cached, mx.get_active_memory() - cached

        pending, done = [], threading.Event()

        def sample_queue() -> None:
            while not done.is_set():
                pending.append(httpx.get(f"{server.url}/health").json()["pending"])
                time.sleep(0.02)

        sampler = threading.Thread(target=sample_queue)
        sampler.start()
        tic = time.perf_counter()
        try:
            results, errors = run_clients(server.url, ROUNDS)
        finally:
            done.set()
            sampler.join()
        elapsed = time.perf_counter() - tic
        assert not errors, errors
        assert len(results) == CLIENTS * ROUNDS
        assert results == want
        assert max(pending) >= 2, "requests never queued up: the clients did not overlap"

        while server.app.state.worker.pending:
            time.sleep(0.01)
        gc.collect()
        cached = store.nbytes
        rss_after, active_after = rss_bytes() - cached, mx.get_active_memory() - cached
        assert store.nbytes <= store.max_bytes
    print(f"\n{CLIENTS * ROUNDS} streams in {elapsed:.1f} s; rss {rss_before / 2**20:.0f} -> "
          f"{rss_after / 2**20:.0f} MiB; mlx active {active_before} -> {active_after} B")
    assert rss_after <= 1.10 * rss_before
    assert active_after <= 1.10 * active_before + 2**20
