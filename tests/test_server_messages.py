"""`POST /v1/messages` (Anthropic's Messages API), driven by the official `anthropic` client.

The client sends no sampling fields in this version (temperature etc. were removed from its
signature); they travel in ``extra_body``, as older clients send them. Greedy replies must equal
`mlx_dflash.generate` on the same chat-templated prompt; bad requests get Anthropic-style 4xx.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

from mlx_dflash import generate
from mlx_dflash.server import BackgroundServer, create_app

V = 96
NAME = "tiny-messages"
TEMPLATE = (
    "{% for m in messages %}"
    "{{ {'system': 'w20', 'user': 'w21', 'assistant': 'w22'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w22{% endif %}"
)
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=V)
    hf = make_tokenizer(V)._tokenizer
    hf.chat_template = TEMPLATE
    return model, make_drafter(model, block_size=4), TokenizerWrapper(hf, eos_token_ids=[EOS_ID])


@pytest.fixture(scope="module")
def server(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME, api_key="k")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(api_key="k", base_url=server.url, max_retries=0)


def reference(pair, messages, max_tokens, system=None):
    convo = ([{"role": "system", "content": system}] if system else []) + messages
    ids = pair[2].apply_chat_template(convo, add_generation_prompt=True)
    return generate(*pair, ids, max_tokens=max_tokens), len(ids)


def test_reply_matches_generate(pair, client):
    want, n_prompt = reference(pair, USER, 12, system="w9 w10")
    r = client.messages.create(model=NAME, max_tokens=12, system="w9 w10", messages=USER,
                               extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == NAME
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == n_prompt and u.output_tokens >= 1
    assert r.id.startswith("msg_")


def test_streaming_matches_generate(pair, client):
    want, _ = reference(pair, USER, 16)
    with client.messages.stream(model=NAME, max_tokens=16, messages=USER,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    events = list(client.messages.create(model=NAME, max_tokens=16, messages=USER, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_text_blocks_and_system_blocks(pair, client):
    want, _ = reference(pair, USER, 10, system="w9 w10")
    r = client.messages.create(
        model=NAME, max_tokens=10, extra_body=GREEDY,
        system=[{"type": "text", "text": "w9 "}, {"type": "text", "text": "w10"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w6"},
                                               {"type": "text", "text": " w7"}]}])
    assert r.content[0].text == want


def test_stop_sequences(pair, client):
    want, _ = reference(pair, USER, 12)
    words = want.split()
    assert len(words) >= 4, want
    stop = f" {words[2]}"
    r = client.messages.create(model=NAME, max_tokens=12, messages=USER, extra_body=GREEDY,
                               stop_sequences=[" nothing-like-this", stop])
    assert r.content[0].text == want[: want.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(model=NAME, max_tokens=12, messages=USER, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want[: want.find(stop)] and final.stop_sequence == stop


def test_cached_tokens_in_usage(client):
    messages = [{"role": "user", "content": " ".join(["w11"] * 300)}]
    client.messages.create(model=NAME, max_tokens=4, messages=messages, extra_body=GREEDY)
    again = messages + [{"role": "assistant", "content": "w12"},
                        {"role": "user", "content": "w13"}]
    r = client.messages.create(model=NAME, max_tokens=4, messages=again, extra_body=GREEDY)
    assert r.usage.cache_read_input_tokens >= 300 and r.usage.input_tokens <= 6


def test_raw_event_framing(server):
    body = {"model": NAME, "max_tokens": 5, "messages": USER, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                      headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    for e in events:  # "event: <type>" then "data: {... "type": <type> ...}"
        head, data = e.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == head[len("event: "):]
    start = json.loads(events[0].split("\n")[1][6:])["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens"}


# -- bad requests: Anthropic-style errors --------------------------------------------------------
OK = {"model": NAME, "max_tokens": 4, "messages": USER}
BAD = [
    # (id, body (dict, or raw text), status, error type, words in the message)
    ("malformed-json", '{"model": "x", "messages": [', 400, "invalid_request_error", ["JSON"]),
    ("missing-max-tokens", {k: v for k, v in OK.items() if k != "max_tokens"}, 400,
     "invalid_request_error", ["max_tokens"]),
    ("missing-messages", {"model": NAME, "max_tokens": 4}, 400, "invalid_request_error",
     ["messages"]),
    ("empty-messages", {**OK, "messages": []}, 400, "invalid_request_error", ["messages"]),
    ("bad-role", {**OK, "messages": [{"role": "tool", "content": "w5"}]}, 400,
     "invalid_request_error", ["role"]),
    ("image-block", {**OK, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "invalid_request_error", []),
    ("temperature-above-1", {**OK, "temperature": 1.5}, 400, "invalid_request_error",
     ["temperature"]),
    ("max-tokens-zero", {**OK, "max_tokens": 0}, 400, "invalid_request_error", ["max_tokens"]),
    ("stop-sequences-str", {**OK, "stop_sequences": "w5"}, 400, "invalid_request_error",
     ["stop_sequences"]),
    # Anthropic's wording, which Claude Code's compaction recognises.
    ("prompt-too-long", {**OK, "messages": [{"role": "user", "content": " ".join(["w5"] * 4100)}]},
     400, "invalid_request_error", ["prompt is too long: ", " tokens > 4095 maximum"]),
    ("unknown-model", {**OK, "model": "claude-9"}, 404, "not_found_error", ["claude-9", NAME]),
]


@pytest.mark.parametrize("body,status,kind,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests(server, body, status, kind, words):
    headers = {"x-api-key": "k", "content-type": "application/json"}
    payload = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/messages", content=payload, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    for word in words:
        assert word in err["error"]["message"], err["error"]["message"]
    assert httpx.post(f"{server.url}/v1/messages", json=OK, headers=headers).status_code == 200


def test_client_errors(server):
    bad = anthropic.Anthropic(api_key="wrong", base_url=server.url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=NAME, max_tokens=4, messages=USER)
    r = httpx.post(f"{server.url}/v1/messages", json=OK)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(api_key="k", base_url=server.url, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        good.messages.create(model="nope", max_tokens=4, messages=USER)
    with pytest.raises(anthropic.BadRequestError):
        good.messages.create(model=NAME, max_tokens=4, messages=[])
