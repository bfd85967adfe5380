"""The dashboard's server side: the page and its headers, what /v1/stats gives it, and the
chat's token origins (how each piece of streamed text came), cut as stop strings cut text."""

import json

import httpx
import mlx.core as mx
from test_server import MESSAGES, NAME, pair  # noqa: F401 (pair: a fixture)

from mlx_dflash.cycle import COPY, DRAFTER, FORCED, TARGET, Cycle
from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server.stops import Origins


def stream_origins(server, **extra):
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 20, "temperature": 0,
            "stream": True, **extra}
    content, origins = "", []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            origins += chunk.get("origins", [])
            if chunk["choices"]:
                content += chunk["choices"][0]["delta"].get("content") or ""
    return content, origins


def test_cycle_origins_name_each_committed_token():
    cycle = Cycle(mx.array([0]), 3, DRAFTER, mx.array([0]), mx.array([0]), None,
                  forced=(True, False, True))
    assert cycle.origins(2) == [FORCED, DRAFTER, TARGET]
    assert Cycle(mx.array([0]), 2, COPY, mx.array([0]), mx.array([0]), None).origins(2) == [
        COPY, COPY, TARGET]
    assert Cycle(mx.array([0]), 0, "plain", mx.array([0]), mx.array([0]), None).origins(0) == [
        TARGET]


def test_origins_follow_the_text_the_stop_matcher_lets_out():
    origins = Origins()
    origins.feed([("drafter", "abc"), ("target", "de")])
    assert origins.take("ab") == [("drafter", "ab")]
    assert origins.take("cd") == [("drafter", "c"), ("target", "d")]
    origins.feed([("copy", "fg")])
    assert origins.take("efg") == [("target", "e"), ("copy", "fg")]


def test_token_origins_join_to_the_streamed_content(pair):  # noqa: F811
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        content, origins = stream_origins(server, token_origins=True)
        assert content and content == "".join(text for _, text in origins)
        assert {o for o, _ in origins} <= {"target", "drafter", "copy", "ngram", "tree",
                                           "forced"}
        stop = content.split()[3]
        cut, cut_origins = stream_origins(server, token_origins=True, stop=[stop])
        assert cut == content[: content.index(stop)] == "".join(t for _, t in cut_origins)
        plain, none = stream_origins(server)  # only when asked for
        assert plain == content and none == []


def test_the_page_needs_no_key_and_forbids_inline_script(pair):  # noqa: F811
    with BackgroundServer(create_app(*pair, model_name=NAME, api_key="k")) as server:
        page = httpx.get(f"{server.url}/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert "<script>" not in page.text  # the script is a file of its own
        assert httpx.get(f"{server.url}/dashboard/static/dashboard.js").status_code == 200
        assert httpx.get(f"{server.url}/v1/stats").status_code == 401
        stats = httpx.get(f"{server.url}/v1/stats", headers={"Authorization": "Bearer k"})
        assert stats.json()["models"][NAME]["drafter"] == "DFlashDraftModel"
        assert httpx.get(f"{server.url}/").json()["dashboard"] == "/dashboard"
