"""Structured output through the server: chat completions ``response_format``, Responses
``text.format`` and Anthropic ``output_config.format`` hold the reply to a JSON schema, as
``generate(..., grammar=...)`` writes it; what cannot be enforced is a 400 naming it."""

import json

import httpx
import jsonschema
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_grammar import SCHEMA, WORDS
from tiny import make_drafter, make_target, make_text_tokenizer

from mlx_dflash import Grammar, generate
from mlx_dflash.server import BackgroundServer, create_app

NAME = "tiny-json"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def pair():
    tok = make_text_tokenizer(WORDS)
    tok._tokenizer.chat_template = TEMPLATE
    model = make_target("qwen3", vocab_size=len(tok.vocab), seed=5)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    return model, drafter, TokenizerWrapper(tok._tokenizer, eos_token_ids=[0])


@pytest.fixture(scope="module")
def server(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as srv:
        yield srv


def expected(pair, grammar, max_tokens=120):
    model, drafter, tok = pair
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return generate(model, drafter, tok, ids, max_tokens=max_tokens, grammar=grammar)


def test_chat_completions_json_schema(pair, server):
    client = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                  "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120,
                                       temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    assert text == expected(pair, Grammar.json_schema(SCHEMA))
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=120, temperature=0, response_format=fmt,
        stream=True) if c.choices)
    assert streamed == text
    obj = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60,
                                         temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content == expected(pair, Grammar.json_object(), 60)


def test_responses_text_format(pair, server):
    client = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
    r = client.responses.create(model=NAME, input=MESSAGES[0]["content"],
                                max_output_tokens=120, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pet",
                                                 "schema": SCHEMA, "strict": True}})
    assert r.output_text == expected(pair, Grammar.json_schema(SCHEMA))
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_anthropic_output_format(pair, server):
    r = httpx.post(f"{server.url}/v1/messages", json={
        "model": NAME, "max_tokens": 120, "temperature": 0, "messages": MESSAGES,
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["content"][0]["text"]
    assert text == expected(pair, Grammar.json_schema(SCHEMA))


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "response_format.json_schema.schema", "strng"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be a JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "regex"}}, "response_format.type",
     "'regex'"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": "{}"}}},
     "text.format.schema", "must be a JSON schema"),
    ("/v1/messages", {"output_config": {"format": {"type": "xml"}}},
     "output_config.format.type", "'xml'"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(server, path, body, param, words):
    base = {"model": NAME, "max_tokens": 8}
    base |= ({"input": "hi"} if path == "/v1/responses" else {"messages": MESSAGES})
    if path == "/v1/responses":
        base["max_output_tokens"] = base.pop("max_tokens")
    r = httpx.post(f"{server.url}{path}", json=base | body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error.get("param", param) == param, error


TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server():
    """A model whose tool calls are JSON between <tool_call> markers (mlx-lm's json_tools)."""
    from mlx_lm.tool_parsers import json_tools

    tok = make_text_tokenizer(WORDS + ("<tool_call>", "</tool_call>", "get_weather", "city"))
    tok._tokenizer.chat_template = TEMPLATE
    wrapper = TokenizerWrapper(tok._tokenizer, eos_token_ids=[0],
                               tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                               tool_parser=json_tools.parse_tool_call)
    model = make_target("qwen3", vocab_size=len(tok.vocab), seed=5)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    with BackgroundServer(create_app(model, drafter, wrapper, model_name=NAME)) as srv:
        yield srv


def test_strict_tool_calls_keep_to_their_schema(tool_server):
    """tool_choice required with a strict tool: the call the reply opens is held to the
    tool's parameters (a random model's call parses and validates every time); a tool that
    is not strict is left free."""
    client = openai.OpenAI(api_key="x", base_url=f"{tool_server.url}/v1", max_retries=0)
    params = TOOL["function"]["parameters"]
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=80,
                                           tools=[TOOL], tool_choice="required",
                                           temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", r.choices[0].message
        jsonschema.validate(json.loads(calls[0].function.arguments), params)
    loose = {"type": "function", "function": {**TOOL["function"], "strict": False}}
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40,
                                       tools=[loose], tool_choice="required", temperature=0)
    assert not r.choices[0].message.tool_calls  # a random model's free call does not parse
    # The Responses API's function tools (strict by default there when set) and Anthropic's.
    fn = TOOL["function"]
    r = client.responses.create(model=NAME, input="weather?", max_output_tokens=80,
                                temperature=1.0, extra_body={"seed": 1}, tool_choice="required",
                                tools=[{"type": "function", "name": fn["name"],
                                        "parameters": params, "strict": True}])
    call = next(item for item in r.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), params)
    r = httpx.post(f"{tool_server.url}/v1/messages", timeout=60, json={
        "model": NAME, "max_tokens": 80, "temperature": 1.0, "seed": 2, "messages": MESSAGES,
        "tool_choice": {"type": "any"},
        "tools": [{"name": fn["name"], "input_schema": params, "strict": True}]})
    use = next(b for b in r.json()["content"] if b["type"] == "tool_use")
    jsonschema.validate(use["input"], params)
