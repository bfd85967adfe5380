"""What coding agents send, through the official SDKs: the Responses API (Codex), Anthropic
Messages as Claude Code sends it, chat completions' agent fields, and long prefills a client
leaves.

Greedy replies through `/v1/responses` and `/v1/messages` equal `mlx_dflash.generate` on the same
prompt. Where a tiny model would not think or call a tool on its own, the model's text is
scripted (``stream_generate`` replaced), as in test_server_cache's tool tests. Every streamed
event is validated against the SDK's own types.
"""

from __future__ import annotations

import functools
import json
import time

import anthropic
import httpx
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from typing import Annotated, get_args, get_origin

from test_server_cache import tokenizer  # any role anywhere; tools named up front
from tiny import make_drafter, make_target

from mlx_dflash import batch as batch_mod
from mlx_dflash import generate
from mlx_dflash.decode import GenerationResponse, GenerationStats
from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server import worker as worker_mod
from mlx_dflash.server.models import CacheSettings, served_model
from mlx_dflash.server.prompts import fold_system_messages
from mlx_dflash.target import Target

V = 96
NAME = "tiny-agents"
ROLES = "{'system': 'w20', 'user': 'w21', 'assistant': 'w22', 'tool': 'w23'}"
STRICT_TEMPLATE = (  # a system message first or not at all, as many templates insist
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "{{ " + ROLES + "[m['role']] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w22{% endif %}"
)


def event_types(union):
    """{"response.created": ResponseCreatedEvent, ...}: each SDK event class by its type."""
    members = get_args(get_args(union)[0] if get_origin(union) is Annotated else union)
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in members}


OPENAI_EVENTS, ANTHROPIC_EVENTS = event_types(ResponseStreamEvent), \
    event_types(RawMessageStreamEvent)


def sse_events(response, types):
    """Each ``data:`` line of a stream, validated as the SDK's class for its type."""
    return [types[kind].model_validate_json(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and (kind := json.loads(line[6:])["type"]) != "ping"]


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=V)
    return model, make_drafter(model, block_size=4), tokenizer()


@pytest.fixture(scope="module")
def server(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as srv:
        yield srv


def oa(server):
    return openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)


def an(server):
    return anthropic.Anthropic(api_key="unused", base_url=server.url, max_retries=0)


def reference(pair, convo, max_tokens, tools=None):
    ids = pair[2].apply_chat_template(convo, add_generation_prompt=True,
                                      **({"tools": tools} if tools else {}))
    return generate(*pair, ids, max_tokens=max_tokens), len(ids)


# -- the Responses API -----------------------------------------------------------------------------
def test_responses_greedy_equals_generate(pair, server):
    want, n = reference(pair, [{"role": "system", "content": "w9 w10"},
                               {"role": "user", "content": "w5 w6 w7"}], 10)
    r = oa(server).responses.create(model=NAME, instructions="w9 w10", input="w5 w6 w7",
                                    max_output_tokens=10, temperature=0)
    assert r.output_text == want and r.usage.input_tokens == n
    assert r.status == "completed" or r.incomplete_details.reason == "max_output_tokens"
    # Items: developer messages are system messages, input_text parts are text.
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "w9 w10"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "w5 w6 w7"}]}]
    assert oa(server).responses.create(model=NAME, input=items, max_output_tokens=10,
                                       temperature=0).output_text == want


def test_responses_stream_events_validate(pair, server):
    want, _ = reference(pair, [{"role": "user", "content": "w5 w6"}], 12)
    with httpx.stream("POST", f"{server.url}/v1/responses", json={
            "model": NAME, "input": "w5 w6", "max_output_tokens": 12, "temperature": 0,
            "stream": True}) as r:
        events = sse_events(r, OPENAI_EVENTS)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want


def test_responses_store_and_previous_response_id(pair, server):
    client = oa(server)
    first = client.responses.create(model=NAME, input="w5 w6", max_output_tokens=4,
                                    temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=NAME, input="w7", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    convo = [{"role": "user", "content": "w5 w6"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "w7"}]
    want, n = reference(pair, convo, 4)
    assert second.output_text == want and second.usage.input_tokens == n
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    unstored = client.responses.create(model=NAME, input="w5", max_output_tokens=2,
                                       temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_refuse_what_they_cannot_honour(server):
    client = oa(server)
    with pytest.raises(openai.BadRequestError, match="text.format"):
        client.responses.create(model=NAME, input="w5", max_output_tokens=2,
                                text={"format": {"type": "grammar"}})
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(model=NAME, max_output_tokens=2, input=[{
            "role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])


def scripted(monkeypatch, pieces, **tok):
    """A served model whose reply is ``pieces`` (as decoding would stream them)."""
    def fake_generate(model, drafter, tokenizer, prompt, **kwargs):
        stats = GenerationStats(prompt_tokens=len(prompt), generation_tokens=len(pieces))
        for i, piece in enumerate(pieces):
            yield GenerationResponse(piece, [5], 0, stats,
                                     "stop" if i == len(pieces) - 1 else None)

    monkeypatch.setattr(worker_mod, "stream_generate", fake_generate)
    served = served_model(NAME, make_target("qwen3", vocab_size=V), None, tokenizer(**tok))
    return BackgroundServer(create_app(models=[served], cache=CacheSettings(memory=0),
                                       max_batch=1))


CALL = '<tool_call>{"name": "shell.run", "arguments": {"cmd": "w7"}}</tool_call>'
TOOLS = [{"type": "function", "name": "w41", "parameters": {"type": "object"}},
         {"type": "namespace", "name": "shell", "description": "a namespace",
          "tools": [{"type": "function", "name": "run", "parameters": {"type": "object"}}]},
         {"type": "web_search"}]


def test_responses_tool_round_trip(monkeypatch):
    with scripted(monkeypatch, ["w5 <tool", "_call>", CALL[11:30], CALL[30:]],
                  tool_calling=True) as srv:
        client = oa(srv)
        r = client.responses.create(model=NAME, input="w5", tools=TOOLS)
        msg, call = r.output
        assert msg.type == "message" and msg.content[0].text == "w5 "
        assert (call.type, call.namespace, call.name) == ("function_call", "shell", "run")
        assert json.loads(call.arguments) == {"cmd": "w7"}
        # Streamed: the call's events, then the same items.
        with httpx.stream("POST", f"{srv.url}/v1/responses", json={
                "model": NAME, "input": "w5", "tools": TOOLS, "stream": True}) as s:
            events = sse_events(s, OPENAI_EVENTS)
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds
        assert events[-1].type == "response.completed"
        assert [i.type for i in events[-1].response.output] == ["message", "function_call"]
        with client.responses.stream(model=NAME, input="w5", tools=TOOLS) as stream:
            final = stream.get_final_response()  # the SDK's own stream helper reads it too
        assert [i.type for i in final.output] == ["message", "function_call"]
        # The call's output goes back; the next prompt holds it as a tool message.
        follow = client.responses.create(model=NAME, previous_response_id=r.id, tools=TOOLS,
                                         input=[{"type": "function_call_output",
                                                 "call_id": call.call_id, "output": "w8"}])
        assert follow.output[-1].type == "function_call"
    tok = tokenizer(tool_calling=True)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "w5"},
         {"role": "assistant", "content": "w5 ", "tool_calls": [
             {"id": call.call_id, "type": "function",
              "function": {"name": "shell.run", "arguments": {"cmd": "w7"}}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "w8"}],
        tools=[{"type": "function", "function": {"name": n, "description": "",
                                                 "parameters": {"type": "object"}}}
               for n in ("w41", "shell.run")], add_generation_prompt=True)
    assert follow.usage.input_tokens == len(ids)  # web_search left out of the prompt


# -- Anthropic Messages as Claude Code sends it ---------------------------------------------------
def test_system_messages_inside_messages(pair, server):
    client = an(server)
    messages = [{"role": "user", "content": "w5 w6"},
                {"role": "system", "content": "w9"}]  # as Claude Code puts its reminders
    want, n = reference(pair, [{"role": "system", "content": "w8"}, *messages], 8)
    r = client.messages.create(model=NAME, max_tokens=8, system=[{"type": "text", "text": "w8",
                               "cache_control": {"type": "ephemeral"}}], messages=messages,
                               extra_body={"temperature": 0, "metadata": {"user_id": "u"},
                                           "context_management": {"edits": []},
                                           "output_config": {"effort": "high"},
                                           "thinking": {"type": "adaptive"}},
                               extra_headers={"anthropic-beta": "claude-code-20250219"})
    assert r.content[0].text == want and r.usage.input_tokens + \
        r.usage.cache_read_input_tokens == n
    counted = client.messages.count_tokens(model=NAME, system="w8", messages=messages)
    assert counted.input_tokens == n


def test_system_messages_fold_where_the_template_refuses_them():
    convo = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
             {"role": "system", "content": "c"}, {"role": "assistant", "content": "d"},
             {"role": "system", "content": "e"}, {"role": "user", "content": "f"},
             {"role": "system", "content": "g"}]
    assert fold_system_messages(convo) == [
        {"role": "system", "content": "a"}, {"role": "user", "content": "b"},
        {"role": "assistant", "content": "d"}, {"role": "user", "content": "c\n\ne\n\nf\n\ng"}]
    tok = tokenizer(template=STRICT_TEMPLATE)
    served = served_model(NAME, make_target("qwen3", vocab_size=V), None, tok)
    with BackgroundServer(create_app(models=[served])) as srv:
        n = an(srv).messages.count_tokens(model=NAME, system="w8", messages=[
            {"role": "user", "content": "w5"}, {"role": "system", "content": "w9"}]).input_tokens
    assert n == len(tok.apply_chat_template([{"role": "system", "content": "w8"},
                                             {"role": "user", "content": "w5\n\nw9"}],
                                            add_generation_prompt=True))


def test_the_server_temperature_for_requests_that_name_none(pair):
    want, _ = reference(pair, [{"role": "user", "content": "w5 w6"}], 8)
    with BackgroundServer(create_app(*pair, model_name=NAME, default_temperature=0.0)) as srv:
        r = an(srv).messages.create(model=NAME, max_tokens=8,  # as agents: no temperature
                                    messages=[{"role": "user", "content": "w5 w6"}])
        assert r.content[0].text == want
        named = oa(srv).chat.completions.create(  # a request's own temperature wins
            model=NAME, max_tokens=8, temperature=1.0, seed=3,
            messages=[{"role": "user", "content": "w5 w6"}])
    ids = pair[2].apply_chat_template([{"role": "user", "content": "w5 w6"}],
                                      add_generation_prompt=True)
    assert named.choices[0].message.content == generate(*pair, ids, max_tokens=8,
                                                        temperature=1.0, seed=3)


def test_max_tokens_beyond_the_context_is_cut_to_the_room_left(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME, max_context=40)) as srv:
        with an(srv).messages.stream(model=NAME, max_tokens=32000, extra_body={
                "temperature": 0}, messages=[{"role": "user", "content": "w5 w6 w7"}]) as s:
            r = s.get_final_message()  # (the SDK wants a stream for 32000 tokens)
    n = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 40 - n


def test_thinking_comes_back_as_thinking_blocks(monkeypatch):
    pieces = ["w90 w5", " w6 w9", "1 w7 w8"]  # "w90 w5 w6 w91 w7 w8": think, then answer
    with scripted(monkeypatch, pieces, thinking=True) as srv:  # w90 ... w91: thinking
        client = an(srv)
        kw = dict(model=NAME, max_tokens=20, messages=[{"role": "user", "content": "w5"}])
        r = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in r.content] == ["thinking", "text"]
        assert r.content[0].thinking == " w5 w6 " and r.content[1].text == " w7 w8"
        with httpx.stream("POST", f"{srv.url}/v1/messages", json={**kw, "stream": True}) as s:
            events = sse_events(s, ANTHROPIC_EVENTS)
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
        assert deltas[-1] == "text_delta"
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        # The thinking goes back in the next turn (the template may show it or not).
        follow = client.messages.create(model=NAME, max_tokens=5, messages=[
            {"role": "user", "content": "w5"},
            {"role": "assistant", "content": [r.content[0].model_dump(), {"type": "text",
                                                                        "text": "w7"}]},
            {"role": "user", "content": "w6"}])
        assert follow.stop_reason == "end_turn"
        # Chat completions: reasoning_content beside content, whole and streamed.
        chat = oa(srv).chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                       "content": "w5"}])
        message = chat.choices[0].message
        assert message.reasoning_content == " w5 w6 " and message.content == " w7 w8"
        chunks = list(oa(srv).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "w5"}], stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == " w5 w6 "
        assert "".join(d.content or "" for d in deltas) == " w7 w8"


def test_anthropic_tool_inputs_are_objects_and_server_tools_left_out(monkeypatch):
    call = '<tool_call>{"name": "w41", "arguments": "w7"}</tool_call>'
    with scripted(monkeypatch, [call], tool_calling=True) as srv:
        r = an(srv).messages.create(model=NAME, max_tokens=20, tools=[
            {"name": "w41", "description": "d", "input_schema": {"type": "object"},
             "defer_loading": True},
            {"type": "web_search_20250305", "name": "web_search"}],
            messages=[{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "w5"}, {"type": "image", "source": {}}]}]}])
    assert r.content[-1].type == "tool_use" and r.content[-1].input == {"input": "w7"}


# -- chat completions for agents -------------------------------------------------------------------
def test_chat_tool_choice_and_unsupported_fields(pair, server):
    client = oa(server)
    tools = [{"type": "function", "function": {"name": "w41", "parameters": {}}}]
    msgs = [{"role": "user", "content": "w5"}]
    none = client.chat.completions.create(model=NAME, messages=msgs, tools=tools,
                                          tool_choice="none", max_tokens=2, temperature=0)
    assert none.usage.prompt_tokens == len(pair[2].apply_chat_template(
        msgs, add_generation_prompt=True))  # no tools offered
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=NAME, messages=msgs, tools=tools,
                                       tool_choice="required", max_tokens=2)
    for field, value in [("logprobs", True), ("frequency_penalty", 0.5),
                         ("response_format", {"type": "regex"})]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2,
                                           **{field: value})
    # No max_tokens: until the context ends (or the stop token).
    with BackgroundServer(create_app(*pair, model_name=NAME, max_context=30)) as srv:
        r = oa(srv).chat.completions.create(model=NAME, messages=msgs, temperature=0)
    assert r.usage.completion_tokens == 30 - r.usage.prompt_tokens or \
        r.choices[0].finish_reason == "stop"


def test_forced_tool_call_opens_the_reply(monkeypatch):
    with scripted(monkeypatch, ['{"name": "w41", "arguments": {"q": 1}}</tool_call>', " w5"],
                  tool_calling=True) as srv:
        r = oa(srv).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "w5"}],
            tools=[{"type": "function", "function": {"name": "w41", "parameters": {}}},
                   {"type": "function", "function": {"name": "w42", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "w41"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "w41" and r.choices[0].message.content == " w5"


# -- a client that leaves during a long prefill ----------------------------------------------------
@pytest.mark.parametrize("max_batch", [8, 1], ids=["batched", "one-at-a-time"])
@pytest.mark.parametrize("stream", [False, True])
def test_leaving_during_prefill_frees_the_engine_within_a_chunk(pair, monkeypatch, stream,
                                                                 max_batch):
    """Batched: the prefill runs a chunk a step; one at a time (stream_generate): it checks
    the client between its chunks."""
    chunks = []
    real_hidden_states = Target.hidden_states

    def slow_hidden_states(self, tokens, *args, **kwargs):
        if tokens.shape[1] == 32:  # a prefill chunk (not the scheduler's timing passes)
            chunks.append(32)
            time.sleep(0.15)
        return real_hidden_states(self, tokens, *args, **kwargs)

    monkeypatch.setattr(Target, "hidden_states", slow_hidden_states)
    init = worker_mod.BatchedEngine.__init__

    def small_steps(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.prefill_step = 32  # 1,000 prompt tokens: 32 chunks

    monkeypatch.setattr(worker_mod.BatchedEngine, "__init__", small_steps)
    monkeypatch.setattr(worker_mod, "stream_generate",
                        functools.partial(worker_mod.stream_generate, prefill_step_size=32))
    prompt = " ".join(f"w{5 + i % 80}" for i in range(1000))
    with BackgroundServer(create_app(*pair, model_name=NAME, max_batch=max_batch)) as srv:
        worker, jobs = srv.app.state.worker, []
        submit = worker.submit
        monkeypatch.setattr(worker, "submit", lambda job: jobs.append(job) or submit(job))
        body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                time.sleep(0.5)
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while jobs[-1].outcome is None or worker.pending:
            assert time.monotonic() < deadline, "the engine is still busy"
            time.sleep(0.05)
        assert jobs[-1].outcome == "cancelled"
        assert len(chunks) < 16, chunks  # it left after a few chunks, not at the end
        # The server serves on.
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": "w5 w6",
                                                          "stream": False})
        assert r.status_code == 200


def test_a_long_prefill_streams_message_start_and_pings(pair, monkeypatch):
    """message_start goes out when the prefill begins, then pings keep the stream alive."""
    from mlx_dflash.server import app as app_mod

    real_prefill = batch_mod.prefill

    def slow_prefill(target, tokens, *args):
        time.sleep(0.1)
        return real_prefill(target, tokens, *args)

    monkeypatch.setattr(batch_mod, "prefill", slow_prefill)
    monkeypatch.setattr(app_mod, "KEEPALIVE_S", 0.05)
    init = worker_mod.BatchedEngine.__init__

    def small_steps(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.prefill_step = 32

    monkeypatch.setattr(worker_mod.BatchedEngine, "__init__", small_steps)
    content = " ".join(f"w{5 + i % 80}" for i in range(300))
    with BackgroundServer(create_app(*pair, model_name=NAME)) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/messages", json={
                "model": NAME, "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": content}]}) as r:
            kinds = [line[len("event: "):] for line in r.iter_lines()
                     if line.startswith("event: ")]
    first_block = kinds.index("content_block_start")
    assert kinds[0] == "message_start" and kinds[1:first_block].count("ping") >= 2
    assert kinds[-1] == "message_stop"
