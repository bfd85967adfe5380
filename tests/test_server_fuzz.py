"""Schemathesis fuzzing of the live server from its own OpenAPI schema: never a 5xx.

Valid and invalid bodies (wrong types, missing fields, out-of-range numbers) are generated for
every operation with a fixed seed; a small context keeps any generation short. String `model`
fields are set to the served name so that valid bodies get as far as generating. Every 4xx must
carry an OpenAI-style error body (Anthropic-style under /v1/messages).
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

from mlx_dflash.server import BackgroundServer, create_app

V = 64
MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def server():
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2)
    hf = make_tokenizer(V)._tokenizer
    hf.chat_template = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}w4"
    tok = TokenizerWrapper(hf, eos_token_ids=[EOS_ID])  # a template: empty chats still encode
    app = create_app(model, make_drafter(model, block_size=4, layer_ids=(0, 1)), tok,
                     model_name="fuzz", max_context=48, default_max_tokens=8)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    config = SchemathesisConfig(seed=0)
    config.projects.default.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=MAX_EXAMPLES, deterministic=True, database="none",
    )
    schema = schemathesis.openapi.from_dict(server.app.openapi(), config=config)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "fuzz"  # random names only meet the 404 (tested in test_server.py)
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        if case.path == "/v1/messages":
            assert body["type"] == "error" and set(error) == {"type", "message"}


def test_the_messages_endpoint_is_fuzzed(api_schema):
    paths = {op.ok().path for op in api_schema.get_all_operations()}
    assert {"/v1/messages", "/v1/chat/completions", "/v1/completions"} <= paths
