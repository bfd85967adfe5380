"""The server decodes concurrent requests together (the batch engine in its worker): each
client gets exactly its solo output, a client that leaves mid-stream leaves the others intact,
and requests beyond what memory holds wait their turn instead of failing."""

import json
import threading

import httpx
import mlx.core as mx
import numpy as np
import pytest
from test_server import LONG_RUNNER, NAME, _record_jobs, _wait_outcome, reference
from test_server import pair as pair  # noqa: F401 (the tiny served pair, a fixture)

from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server import worker as worker_mod

RNG = np.random.default_rng(5)
PROMPTS = [" ".join(f"w{t}" for t in RNG.integers(5, 90, size=n)) for n in
           (3, 9, 1, 17, 6, 12, 4)]
MAX_TOKENS = [12, 25, 7, 30, 18, 9, 22]


@pytest.fixture()
def most_running(monkeypatch):
    """The most requests the batch engine ran in one step."""
    seen = [0]
    step = worker_mod.BatchedEngine.step

    def counting_step(self):
        seen[0] = max(seen[0], len(self.running))
        out = step(self)
        seen[0] = max(seen[0], len(self.running))
        return out

    monkeypatch.setattr(worker_mod.BatchedEngine, "step", counting_step)
    return seen


def stream_completion(url: str, prompt: str, max_tokens: int, leave_after: int | None = None
                      ) -> str:
    """A streaming client; ``leave_after``: hang up after that many chunks."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text, chunks = "", 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            text += choices[0]["text"] if choices else ""
            chunks += 1
            if leave_after is not None and chunks == leave_after:
                break
    return text


def run_clients(targets) -> list:
    results = [None] * len(targets)

    def run(i, fn, *args):
        results[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, *t)) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_eight_streaming_clients_at_once_get_their_solo_outputs(pair, most_running, monkeypatch):
    with BackgroundServer(create_app(*pair, model_name=NAME, max_batch=8)) as srv:
        jobs = _record_jobs(srv, monkeypatch)
        clients = [(stream_completion, srv.url, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        clients.append((stream_completion, srv.url, LONG_RUNNER, 4000, 3))  # leaves early
        texts = run_clients(clients)
        leaver = next(j for j in jobs if j.max_tokens == 4000)
        assert _wait_outcome(leaver) == "cancelled"
        health = httpx.get(f"{srv.url}/health").json()
    for prompt, n, text in zip(PROMPTS, MAX_TOKENS, texts):
        assert text == reference(pair, prompt, n)
    assert most_running[0] >= 4  # they did decode together
    assert health["running"] == 0 and health["waiting"] == 0


def test_many_long_requests_under_a_small_memory_limit_wait_and_complete(pair, most_running):
    prompts = [" ".join(f"w{t}" for t in RNG.integers(5, 90, size=40)) for _ in range(16)]
    with BackgroundServer(create_app(*pair, model_name=NAME, max_batch=16)) as srv:
        body = {"model": NAME, "prompt": "w5", "max_tokens": 2, "temperature": 0}
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)  # warm: costs measured
        mx.clear_cache()
        reserve = 256 << 20  # what the engine leaves free for everything but the rows
        limit = mx.get_active_memory() + reserve + (2 << 20)  # rows of a few requests
        old = mx.set_memory_limit(limit)
        mx.reset_peak_memory()
        try:
            def complete(prompt):
                r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
                    "model": NAME, "prompt": prompt, "max_tokens": 120, "temperature": 0})
                return r.status_code, r.json()["choices"][0]["text"]

            out = run_clients([(complete, p) for p in prompts])
            peak = mx.get_peak_memory()
        finally:
            mx.set_memory_limit(old)
    assert all(status == 200 for status, _ in out)
    for prompt, (_, text) in zip(prompts, out):
        assert text == reference(pair, prompt, 120)
    assert 1 < most_running[0] < 16 and peak <= limit


def test_concurrent_clients_with_tree_drafts_get_their_solo_outputs(pair, most_running,
                                                                    monkeypatch):
    """``create_app(tree=...)`` (``mlx-dflash serve --tree``): the batch engine verifies trees
    for every drafting request; each client still gets its solo output."""
    tree_passes = []
    tree_pass = worker_mod.BatchedEngine._tree_pass
    monkeypatch.setattr(worker_mod.BatchedEngine, "_tree_pass",
                        lambda self, *a: tree_passes.append(1) or tree_pass(self, *a))
    with BackgroundServer(create_app(*pair, model_name=NAME, max_batch=8, tree=4)) as srv:
        clients = [(stream_completion, srv.url, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        texts = run_clients(clients)
    for prompt, n, text in zip(PROMPTS, MAX_TOKENS, texts):
        assert text == reference(pair, prompt, n)
    assert most_running[0] >= 2 and tree_passes
