"""`mlx-dflash serve`: the OpenAI-compatible server, driven by the official `openai` client.

A real uvicorn server runs in a background thread on a free loopback port, serving a tiny random
float32 pair; greedy replies must equal `mlx_dflash.generate` on the same (chat-templated) prompt.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

from mlx_dflash import generate, save_drafter
from mlx_dflash.decode import GenerationResponse, GenerationStats
from mlx_dflash.prompts import encode_prompt
from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server import worker as worker_mod
from mlx_dflash.server.models import ModelPool, ServedModel
from mlx_dflash.server.prompts import chat_prompt_ids
from mlx_dflash.server.schemas import ChatMessage
from mlx_dflash.server.stops import StopMatcher

V = 96
NAME = "tiny-dflash"
TEMPLATE = (
    "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w4{% endif %}"
)
# Greedy from this prompt never meets the stop token: 4000 tokens take ~30 s, so only a
# cancellation ends it within seconds.
LONG_RUNNER = "w5 w6 w7"
MESSAGES = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=V)
    drafter = make_drafter(model, block_size=4)
    hf = make_tokenizer(V)._tokenizer
    hf.chat_template = TEMPLATE
    return model, drafter, TokenizerWrapper(hf, eos_token_ids=[EOS_ID])


@pytest.fixture(scope="module")
def server(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)


def reference(pair, prompt, max_tokens, **kwargs):
    model, drafter, tok = pair
    return generate(model, drafter, tok, prompt, max_tokens=max_tokens, **kwargs)


def chat_reference(pair, max_tokens, messages=MESSAGES):
    ids = pair[2].apply_chat_template(messages, add_generation_prompt=True)
    return reference(pair, ids, max_tokens)


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while httpx.get(f"{server.url}/health").json()["pending"]:
        assert time.monotonic() < deadline, "the worker did not go idle"
        time.sleep(0.02)


# --- happy paths ------------------------------------------------------------------------------


def test_chat_matches_generate(pair, client):
    want = chat_reference(pair, 12)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop")
    n_prompt = len(pair[2].apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    stats = r.model_extra["dflash"]
    assert stats["block_size"] == 4 and stats["drafted_tokens"] >= stats["accepted_tokens"] >= 0
    assert stats["mean_acceptance_length"] >= 1 and stats["tokens_per_second"] > 0


def test_chat_streaming_matches_generate(pair, client):
    want = chat_reference(pair, 16)
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("length", "stop") and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert "mean_acceptance_length" in chunks[-1].model_extra["dflash"]


def test_completions_match_generate(pair, client):
    want = reference(pair, "w5 w6 w7", 14)
    r = client.completions.create(model=NAME, prompt="w5 w6 w7", max_tokens=14, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.prompt_tokens == 3 and r.model_extra["dflash"]["cycles"] >= 1
    stream = client.completions.create(model=NAME, prompt="w5 w6 w7", max_tokens=14,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want
    for prompt in ([5, 6, 7], ["w5 w6 w7"], [[5, 6, 7]]):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=14, temperature=0)
        assert r.choices[0].text == want


def test_raw_sse_framing(server):
    body = {"model": NAME, "prompt": "w8 w9", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    json.loads(events[0][len("data: "):])


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == NAME


def test_stop_strings(pair, client):
    want = reference(pair, "w5 w6 w7", 12)
    words = want.split()
    assert len(words) >= 4, want
    stop = f" {words[2]}"
    cut = want[: want.find(stop)]
    r = client.completions.create(model=NAME, prompt="w5 w6 w7", max_tokens=12, temperature=0,
                                  stop=[" nothing-like-this", stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=NAME, prompt="w5 w6 w7", max_tokens=12,
                                       temperature=0, stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_matcher_holds_back_split_stops():
    m = StopMatcher(["abc", "xy"])
    assert m.feed("hello a") == ("hello ", False)
    assert m.feed("b") == ("", False)
    assert m.feed("cd") == ("", True)
    m = StopMatcher(["abc"])
    assert m.feed("zab") == ("z", False) and m.feed("x") == ("abx", False) and m.flush() == ""
    assert StopMatcher(["q"]).feed("aqbq") == ("a", True)


def test_seeded_sampling_is_reproducible(pair, client):
    kwargs = dict(model=NAME, prompt="w11 w12", max_tokens=10, temperature=1.0, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b == reference(pair, "w11 w12", 10, temperature=1.0, seed=1234)
    # The same reply from the target alone: a seeded reply depends on the seed alone.
    assert a == generate(pair[0], None, pair[2], "w11 w12", max_tokens=10, temperature=1.0,
                         seed=1234)


def test_chat_without_template_joins_contents():
    tok = make_tokenizer(V)
    msgs = [ChatMessage(role="user", content="w5 w6"), ChatMessage(role="user", content="w7")]
    assert chat_prompt_ids(tok, msgs) == encode_prompt(tok, "w5 w6\nw7")


def test_context_defaults_to_the_target_config(pair):
    assert create_app(*pair, model_name=NAME).state.max_context == 4096
    assert create_app(*pair, model_name=NAME, max_context=77).state.max_context == 77


# --- the worker -------------------------------------------------------------------------------


def test_worker_runs_jobs_on_one_thread_in_arrival_order(monkeypatch):
    seen, running = [], []

    def fake_generate(model, drafter, tokenizer, prompt, **kwargs):
        running.append(1)
        assert len(running) == 1, "two jobs ran at once"
        seen.append((prompt[0], threading.get_ident()))
        time.sleep(0.005)
        running.pop()
        stats = GenerationStats(prompt_tokens=1, generation_tokens=1)
        yield GenerationResponse(f"t{prompt[0]}", [5], 0, stats, "length")

    monkeypatch.setattr(worker_mod, "stream_generate", fake_generate)
    w = worker_mod.ModelWorker(stand_in_pool(), max_batch=1)

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [w.submit(worker_mod.Job(prompt=[i], max_tokens=1, loop=loop)) for i in range(8)]
        out = []
        for job in jobs:
            events = [await job.events.get() for _ in range(3)]
            assert isinstance(events[0], worker_mod.Started)
            out.append((events[1].text, events[2].finish_reason))
        return out

    try:
        out = asyncio.run(run())
    finally:
        w.stop()
    assert out == [(f"t{i}", "length") for i in range(8)]
    assert [p for p, _ in seen] == list(range(8))
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_stop_cancels_running_and_queued_jobs(monkeypatch):
    def endless(model, drafter, tokenizer, prompt, **kwargs):
        stats = GenerationStats(prompt_tokens=1)
        while True:
            time.sleep(0.005)
            yield GenerationResponse("x", [5], 0, stats)

    monkeypatch.setattr(worker_mod, "stream_generate", endless)
    w = worker_mod.ModelWorker(stand_in_pool(), max_batch=1)

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [w.submit(worker_mod.Job(prompt=[i], max_tokens=9, loop=loop)) for i in range(3)]
        assert isinstance(await jobs[0].events.get(), worker_mod.Started)  # the first one runs
        assert isinstance(await jobs[0].events.get(), worker_mod.Delta)
        tic = time.monotonic()
        await asyncio.to_thread(w.stop)
        assert time.monotonic() - tic < 5
        for job in jobs:
            while isinstance(event := await job.events.get(), worker_mod.Delta):
                pass
            assert isinstance(event, worker_mod.Failed) and "shutting down" in event.message
        return [job.outcome for job in jobs]

    assert asyncio.run(run()) == ["cancelled", None, None]


def stand_in_pool():
    """A pool whose one model is None: for workers whose stream_generate is replaced."""
    return ModelPool([ServedModel("stand-in", make_tokenizer(V), 64, V)])


def _record_jobs(server, monkeypatch):
    worker = server.app.state.worker
    jobs, submit = [], worker.submit
    monkeypatch.setattr(worker, "submit", lambda job: jobs.append(job) or submit(job))
    return jobs


def _wait_outcome(job, timeout=10.0):
    deadline = time.monotonic() + timeout
    while job.outcome is None:
        assert time.monotonic() < deadline, "the job never ended"
        time.sleep(0.02)
    return job.outcome


def test_disconnect_mid_stream_cancels_the_job(server, monkeypatch):
    jobs = _record_jobs(server, monkeypatch)
    body = {"model": NAME, "prompt": LONG_RUNNER, "max_tokens": 4000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 3:
                break
    assert _wait_outcome(jobs[-1]) == "cancelled"
    wait_idle(server)


def test_disconnect_while_waiting_cancels_the_job(server, monkeypatch):
    jobs = _record_jobs(server, monkeypatch)
    body = {"model": NAME, "prompt": LONG_RUNNER, "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    assert _wait_outcome(jobs[-1]) == "cancelled"
    wait_idle(server)


# --- bad input: OpenAI-style 4xx, and the server keeps serving ----------------------------------

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
OK_COMP = {"model": NAME, "prompt": "w5", "max_tokens": 2}
LONG = " ".join(["w5"] * 4100)

BAD = [
    # (id, path, body (dict, or raw text), status, param, words in the message)
    ("malformed-json", CHAT, '{"model": "tiny-dflash", "messages": [', 400, None, ["JSON"]),
    ("not-an-object", CHAT, "[1, 2]", 400, None, ["object"]),
    ("empty-body", COMP, "", 400, None, []),
    ("missing-model", CHAT, {"messages": OK_CHAT["messages"]}, 400, "model", ["model"]),
    ("missing-messages", CHAT, {"model": NAME}, 400, "messages", ["messages"]),
    ("missing-prompt", COMP, {"model": NAME}, 400, "prompt", ["prompt"]),
    ("max-tokens-str", COMP, {**OK_COMP, "max_tokens": "12"}, 400, "max_tokens", []),
    ("temperature-str", CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature", []),
    ("stream-str", CHAT, {**OK_CHAT, "stream": "yes"}, 400, "stream", []),
    ("messages-str", CHAT, {**OK_CHAT, "messages": "w5"}, 400, "messages", []),
    ("bad-role", CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "w5"}]}, 400,
     "messages[0].role", []),
    ("stop-int", COMP, {**OK_COMP, "stop": 5}, 400, "stop", []),
    ("unknown-model", CHAT, {**OK_CHAT, "model": "gpt-9"}, 404, "model", ["gpt-9", NAME]),
    ("negative-max-tokens", COMP, {**OK_COMP, "max_tokens": -3}, 400, "max_tokens", []),
    ("zero-max-tokens", CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens", []),
    ("over-limit-max-tokens", COMP, {**OK_COMP, "max_tokens": 5000}, 400, "max_tokens",
     ["5000", "4096"]),
    ("over-limit-max-completion-tokens", CHAT, {**OK_CHAT, "max_completion_tokens": 10**6},
     400, "max_completion_tokens", ["4096"]),
    ("empty-messages", CHAT, {**OK_CHAT, "messages": []}, 400, "messages", []),
    ("chat-prompt-too-long", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]},
     400, "messages", ["4096", "4102"]),
    ("prompt-too-long", COMP, {**OK_COMP, "prompt": LONG}, 400, "prompt", ["4096", "4100"]),
    ("empty-prompt", COMP, {**OK_COMP, "prompt": ""}, 400, "prompt", ["no tokens"]),
    ("token-out-of-vocab", COMP, {**OK_COMP, "prompt": [5, 999]}, 400, "prompt", ["999"]),
    ("negative-token", COMP, {**OK_COMP, "prompt": [5, -1]}, 400, "prompt[1]", []),
    ("batch-of-prompts", COMP, {**OK_COMP, "prompt": ["w5", "w6"]}, 400, "prompt", ["one"]),
    ("top-p-zero", COMP, {**OK_COMP, "top_p": 0}, 400, "top_p", []),
    ("negative-temperature", COMP, {**OK_COMP, "temperature": -1}, 400, "temperature", []),
    ("n-two", CHAT, {**OK_CHAT, "n": 2}, 400, "n", []),
]


@pytest.mark.parametrize("path,body,status,param,words", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input(server, path, body, status, param, words):
    kwargs = {"json": body} if isinstance(body, dict) else {
        "content": body, "headers": {"content-type": "application/json"}}
    r = httpx.post(f"{server.url}{path}", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    for word in words:
        assert word in err["message"], err["message"]
    ok = httpx.post(f"{server.url}{path}", json=OK_CHAT if path == CHAT else OK_COMP)
    assert ok.status_code == 200, ok.text


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError, match=NAME):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)


def test_unknown_path_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(pair):
    app = create_app(*pair, model_name=NAME, api_key="sekret")
    with BackgroundServer(app) as srv:
        url = f"{srv.url}/v1"
        bad = openai.OpenAI(api_key="wrong", base_url=url, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{url}/completions", json=OK_COMP)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/completions", content="{broken",
                       headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        good = openai.OpenAI(api_key="sekret", base_url=url, max_retries=0)
        assert good.completions.create(**OK_COMP).choices[0].text
        assert httpx.get(f"{srv.url}/health").status_code == 200  # liveness stays open


def test_internal_errors_are_500_and_the_server_survives(server, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(worker_mod.BatchedEngine, "_cycle", crash)  # a crash mid-decoding
    r = httpx.post(f"{server.url}{COMP}", json=OK_COMP)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", f"{server.url}{COMP}", json={**OK_COMP, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "server_error" in events[-2] and events[-1] == "data: [DONE]"
    monkeypatch.undo()

    worker = server.app.state.worker
    monkeypatch.setattr(worker, "submit", crash)  # a crash in the request handler itself
    r = httpx.post(f"{server.url}{COMP}", json=OK_COMP)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.post(f"{server.url}{COMP}", json=OK_COMP).status_code == 200


# --- the command line -------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command(tmp_path):
    from mlx.utils import tree_flatten

    model = make_target("qwen3", vocab_size=V)
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target_dir.mkdir()
    mx.save_safetensors(str(target_dir / "model.safetensors"),
                        dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    (target_dir / "config.json").write_text(json.dumps(config))
    make_tokenizer(V)._tokenizer.save_pretrained(str(target_dir))
    save_drafter(make_drafter(model, block_size=4), drafter_dir)

    port = _free_port()
    env = {**os.environ, "MLX_DFLASH_API_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", str(target_dir),
         "--drafter", str(drafter_dir), "--port", str(port), "--model-name", "disk",
         "--block-size", "3", "--log-level", "info", "--log-file", str(tmp_path / "logs/s.log"),
         "--allowed-origins", "http://ok.test"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(api_key="k1", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
        r = c.completions.create(model="disk", prompt="w5 w6 w7", max_tokens=10, temperature=0)
        from mlx_lm import load

        from mlx_dflash import load_drafter

        disk_model, disk_tok = load(str(target_dir))
        want = generate(disk_model, load_drafter(str(drafter_dir), model=disk_model), disk_tok,
                        "w5 w6 w7", max_tokens=10, block_size=3)
        assert r.choices[0].text == want and r.model_extra["dflash"]["block_size"] == 3
        preflight = httpx.options(f"http://127.0.0.1:{port}/v1/completions", headers={
            "Origin": "http://ok.test", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200  # --allowed-origins: no key asked of a preflight
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    logged = (tmp_path / "logs/s.log").read_text()  # --log-file: one line per request
    assert "'disk': 3 prompt tokens" in logged and "finish length" in logged, logged
