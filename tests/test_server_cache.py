"""The server's prefix cache, several models, and tool calls.

Requests that share a long prefix prefill only the new tokens (``cached_tokens`` in usage) and
reply exactly what a fresh run replies; the disk tier survives a restart; memory stays under the
budget; models are served by name and unloaded least recently used first.
"""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

from mlx_dflash import generate
from mlx_dflash.decode import GenerationResponse, GenerationStats
from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server import worker as worker_mod
from mlx_dflash.server.models import CacheSettings, lazy_model, served_model

V = 96
NAME = "tiny-cache"
# Roles are words of the tiny vocabulary; the generation prompt opens an assistant turn as a
# rendered assistant message does, so a conversation's next prompt extends the last one.
TEMPLATE = (
    "{% if tools %}w40 {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{{ {'system': 'w20', 'user': 'w21', 'assistant': 'w22', 'tool': 'w23'}[m['role']] }} "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w22{% endif %}"
)
SYSTEM = " ".join(f"w{(i * 7 + 3) % 90 + 5}" for i in range(1000))  # 1,000 shared tokens


def tokenizer(tool_calling=False, template=TEMPLATE, thinking=False):
    """The tiny tokenizer with ``template``; ``tool_calling``: mlx-lm's JSON tool-call format;
    ``thinking``: w90 and w91 stand in for <think> and </think>."""
    hf = make_tokenizer(V)._tokenizer
    hf.chat_template = template
    extra = {}
    if tool_calling:
        extra = dict(tool_call_start=json_tools.tool_call_start,
                     tool_call_end=json_tools.tool_call_end,
                     tool_parser=json_tools.parse_tool_call)
    tok = TokenizerWrapper(hf, eos_token_ids=[EOS_ID], **extra)
    if thinking:
        tok._think_start, tok._think_end = "w90", "w91"
        tok._think_start_tokens, tok._think_end_tokens = (90,), (91,)
    return tok


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=V)
    return model, make_drafter(model, block_size=4), tokenizer()


def chat_ids(tok, user, system=SYSTEM):
    return tok.apply_chat_template([{"role": "system", "content": system},
                                    {"role": "user", "content": user}],
                                   add_generation_prompt=True)


def reference(pair, ids, max_tokens, seed=None, **kw):
    return generate(*pair, ids, max_tokens=max_tokens, seed=seed, **kw)


def chat(client, user, max_tokens=12, **kw):
    return client.chat.completions.create(
        model=NAME, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        **kw)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_shared_prefix_prefills_only_new_tokens(pair, sampled):
    kw = dict(temperature=1.0, seed=77) if sampled else dict(temperature=0)
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        first = chat(client, "w5 w6 w7", **kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = chat(client, "w8 w9", **kw)
    ids1, ids2 = chat_ids(pair[2], "w5 w6 w7"), chat_ids(pair[2], "w8 w9")
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert shared > 1000
    assert second.usage.prompt_tokens == len(ids2)
    assert second.usage.prompt_tokens_details.cached_tokens == shared  # prefilled: the rest
    seed = kw.get("seed")
    extra = dict(temperature=1.0) if sampled else {}
    assert first.choices[0].message.content == reference(pair, ids1, 12, seed, **extra)
    assert second.choices[0].message.content == reference(pair, ids2, 12, seed, **extra)


def test_conversation_continues_from_its_reply(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w5 w6"}]
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                               temperature=0).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "w7"}]
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                           temperature=0)
    ids = pair[2].apply_chat_template(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens <= 4
    assert r.choices[0].message.content == reference(pair, ids, 10)


def test_disk_tier_survives_a_restart(pair, tmp_path, caplog):
    settings = CacheSettings(memory=1 << 30, directory=str(tmp_path))
    with BackgroundServer(create_app(*pair, model_name=NAME, cache=settings)) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        chat(client, "w5 w6 w7", temperature=0)
    assert list(tmp_path.rglob("*.safetensors"))

    want = reference(pair, chat_ids(pair[2], "w8 w9"), 12)
    with BackgroundServer(create_app(*pair, model_name=NAME, cache=settings)) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        r = chat(client, "w8 w9", temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 1000  # read back from disk
    assert r.choices[0].message.content == want

    for f in tmp_path.rglob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:-100])  # cut short
    with caplog.at_level(logging.WARNING, logger="mlx_dflash.prompt_cache"):
        with BackgroundServer(create_app(*pair, model_name=NAME, cache=settings)) as server:
            client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1",
                                   max_retries=0)
            r = chat(client, "w8 w9", temperature=0)
    assert "truncated" in caplog.text
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message.content == want


def test_memory_stays_under_the_cache_budget(pair):
    budget = 2 << 20
    app = create_app(*pair, model_name=NAME, cache=CacheSettings(memory=budget))
    with BackgroundServer(app) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        client.completions.create(model=NAME, prompt=[5] * 300, max_tokens=2)
        store = app.state.pool.get(NAME).prefix_cache
        mx.clear_cache()
        base = mx.get_active_memory()
        for i in range(50):
            prompt = np.random.default_rng(i).integers(5, V, size=300).tolist()
            client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
            assert store.nbytes <= budget
        mx.clear_cache()
        grown = mx.get_active_memory() - base
    assert 2 <= len(store) < 50
    assert grown <= budget + (1 << 20), grown


# -- several models --------------------------------------------------------------------------
def tiny_loader(seed, loads):
    def load():
        loads.append(seed)
        model = make_target("qwen3", vocab_size=V, seed=seed)
        return model, make_drafter(model, block_size=4, seed=seed + 1), tokenizer()

    return load


def test_several_models_by_name_with_lru_unloading():
    loads = []
    a = lazy_model("a", tiny_loader(0, loads))
    b = lazy_model("b", tiny_loader(10, loads))
    want = {name: generate(*tiny_loader(seed, [])(), "w5 w6 w7", max_tokens=8)
            for name, seed in (("a", 0), ("b", 10))}
    assert want["a"] != want["b"]
    app = create_app(models=[a, b], model_memory=int(1.5 * a.nbytes))
    assert app.state.pool.loaded() == ["a"]  # b was loaded once (to know it), then unloaded
    with BackgroundServer(app) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        assert [m.id for m in client.models.list()] == ["a", "b"]
        for name in ("a", "b", "a", "b"):
            r = client.completions.create(model=name, prompt="w5 w6 w7", max_tokens=8,
                                          temperature=0)
            assert r.choices[0].text == want[name] and r.model == name
            assert httpx.get(f"{server.url}/health").json()["loaded"] == [name]
        with pytest.raises(openai.NotFoundError, match="'a', 'b'"):
            client.completions.create(model="c", prompt="w5", max_tokens=2)
    assert loads == [0, 10, 10, 0, 10]


def test_models_config_file(tmp_path):
    from mlx_dflash.server.models import read_models_config

    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": [
        {"name": "small", "model": "/m/small", "drafter": "/d/small", "block_size": 8},
        {"name": "plain", "model": "/m/other", "drafter": "none"}]}))
    entries = read_models_config(path)
    assert [(e.name, e.model, e.drafter, e.block_size) for e in entries] == [
        ("small", "/m/small", "/d/small", 8), ("plain", "/m/other", "none", None)]
    path.write_text(json.dumps([{"name": "x", "model": "/m", "extra": 1}]))
    with pytest.raises(ValueError, match="model 0"):
        read_models_config(path)


# -- tools ----------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "w41", "description": "look up",
                                           "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "w41", "arguments": {"q": "w7"}}</tool_call>'


def test_tools_go_into_the_template(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        r = client.chat.completions.create(model=NAME, tools=TOOLS, max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "w5"}])
    ids = pair[2].apply_chat_template([{"role": "user", "content": "w5"}], tools=TOOLS,
                                      add_generation_prompt=True)
    assert ids[:2] == pair[2].encode("w40 w41", add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == reference(pair, ids, 6)
    assert r.choices[0].message.tool_calls is None  # mlx-lm knows no format for this tokenizer


@pytest.fixture()
def tool_server(monkeypatch):
    """A server whose model 'says' some text, then a tool call (in pieces, as decoding does)."""
    pieces = ["w5 ", "w6 <tool", "_call>", CALL[len("<tool_call>"):20], CALL[20:]]

    def fake_generate(model, drafter, tokenizer, prompt, **kwargs):
        stats = GenerationStats(prompt_tokens=len(prompt), generation_tokens=5)
        for i, piece in enumerate(pieces):
            yield GenerationResponse(piece, [5], 0, stats, "stop" if i == 4 else None)

    monkeypatch.setattr(worker_mod, "stream_generate", fake_generate)
    model = make_target("qwen3", vocab_size=V)
    served = served_model(NAME, model, None, tokenizer(tool_calling=True))
    with BackgroundServer(create_app(models=[served], cache=CacheSettings(memory=0),
                                     max_batch=1)) as srv:
        yield srv


def test_tool_calls_come_back_in_openai_shape(tool_server):
    client = openai.OpenAI(api_key="unused", base_url=f"{tool_server.url}/v1", max_retries=0)
    kw = dict(model=NAME, tools=TOOLS, messages=[{"role": "user", "content": "w5"}])
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "w5 w6 "
    assert call.function.name == "w41" and json.loads(call.function.arguments) == {"q": "w7"}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert text == "w5 w6 " and [c.function.name for c in calls] == ["w41"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools in the request the text comes back as it is.
    r = client.chat.completions.create(model=NAME, messages=kw["messages"])
    assert r.choices[0].message.content == "w5 w6 " + CALL


def test_tool_calls_come_back_in_anthropic_shape(tool_server):
    client = anthropic.Anthropic(api_key="unused", base_url=tool_server.url, max_retries=0)
    tools = [{"name": "w41", "description": "look up", "input_schema": {"type": "object"}}]
    kw = dict(model=NAME, max_tokens=20, tools=tools,
              messages=[{"role": "user", "content": "w5"}])
    r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.content[0].text == "w5 w6 "
    assert r.content[1].name == "w41" and r.content[1].input == {"q": "w7"}
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"q": "w7"} and final.stop_reason == "tool_use"
    # A tool result in the next turn goes into the template as a tool message.
    follow = kw["messages"] + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": r.content[1].id,
                                           "name": "w41", "input": {"q": "w7"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[1].id,
                                      "content": "w9"}]}]
    assert client.messages.create(**{**kw, "messages": follow}).stop_reason == "tool_use"


# -- the command line ------------------------------------------------------------------------
def _serve(args, port):
    import os
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *args], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.2)


def _stop(proc):
    import signal

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_serve_several_models_with_a_disk_cache(tmp_path):
    import socket

    from mlx_lm import load
    from tiny import save_target

    from mlx_dflash import load_drafter, save_drafter

    dirs = {}
    for name, seed in (("a", 0), ("b", 10)):
        model = make_target("qwen3", vocab_size=V, seed=seed)
        dirs[name] = save_target(model, make_tokenizer(V), tmp_path / name)
    save_drafter(make_drafter(make_target("qwen3", vocab_size=V), block_size=4), tmp_path / "d")
    prompt = " ".join(["w7"] * 200) + " w8 w9"
    want = {}
    for name, drafter in (("a", tmp_path / "d"), ("b", None)):
        model, tok = load(str(dirs[name]))
        want[name] = generate(model, load_drafter(str(drafter)) if drafter else None, tok, prompt,
                              max_tokens=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--model", str(dirs["a"]), "--drafter", str(tmp_path / "d"), "--model-name", "a",
            "--model", str(dirs["b"]), "--drafter", "none", "--model-name", "b",
            "--cache-dir", str(tmp_path / "cache"), "--cache-memory", "64MB",
            "--cache-disk", "1GB"]
    url = f"http://127.0.0.1:{port}/v1"
    proc = _serve(args, port)
    try:
        client = openai.OpenAI(api_key="unused", base_url=url, max_retries=0)
        assert [m.id for m in client.models.list()] == ["a", "b"]
        for name in ("a", "b"):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            assert r.choices[0].text == want[name]
    finally:
        _stop(proc)
    proc = _serve(args, port)  # a restart: the prefixes come back from disk
    try:
        client = openai.OpenAI(api_key="unused", base_url=url, max_retries=0)
        for name in ("a", "b"):
            r = client.completions.create(model=name, prompt=prompt + " w10", max_tokens=8,
                                          temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens >= 202, name
    finally:
        _stop(proc)


def test_sizes_and_model_options():
    from typer.testing import CliRunner

    from mlx_dflash.cli import app
    from mlx_dflash.cli.common import parse_size

    assert parse_size("2GB") == 2 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("0") == 0 and parse_size("1.5k") == 1500
    with pytest.raises(ValueError):
        parse_size("lots")
    runner = CliRunner()
    for args, words in ((["--model", "a", "--model", "b", "--drafter", "d"], "one --drafter"),
                        (["--model", "a", "--model-name", "x", "--model-name", "y"],
                         "one --model-name"),
                        (["--cache-memory", "lots"], "--cache-memory"),
                        (["--models-config", "m.json", "--model", "a"], "replaces")):
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code == 2 and words in result.output, result.output


def test_tool_call_splitter_holds_back_split_markers():
    from mlx_dflash.server.tools import ToolCallSplitter

    s = ToolCallSplitter("<tool_call>", "</tool_call>")
    assert s.feed("hi <to") == "hi " and s.feed("ol_call>{\"a\"") == "" and s.calls == []
    assert s.feed(": 1}</tool_call> bye <") == " bye " and s.calls == ['{"a": 1}']
    assert s.flush() == "<"
    s = ToolCallSplitter("<tool_call>", "</tool_call>")
    s.feed("<tool_call>{\"cut off")
    assert s.flush() == "" and s.calls == ['{"cut off']  # counted, as mlx-lm does
