"""/metrics (Prometheus' text format), /v1/stats, CORS and the log file: each counter moves by
what the requests did."""

import threading

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from test_server import MESSAGES, NAME, pair, wait_idle  # noqa: F401 (pair: a fixture)

from mlx_dflash.server import BackgroundServer, create_app


def scrape(server) -> dict:
    """{(sample name, frozenset of labels): value}."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def test_counters_follow_the_requests(pair):  # noqa: F811
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        client = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
        usage = []
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                           temperature=0)
        usage.append(r.usage.completion_tokens)
        chunks = list(client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=9, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage.append(chunks[-1].usage.completion_tokens)
        results = []

        def one(n):
            results.append(client.completions.create(model=NAME, prompt="w5 w6", max_tokens=n,
                                                     temperature=0).usage.completion_tokens)

        threads = [threading.Thread(target=one, args=(n,)) for n in (5, 7, 11)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        usage += results
        # A streamed request the client leaves early: cancelled.
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
                "model": NAME, "prompt": "w5 w6 w7", "max_tokens": 4000, "stream": True,
                "temperature": 0}) as stream:
            for _ in stream.iter_lines():
                break
        wait_idle(server)
        m = scrape(server)
        assert total(m, "mlx_dflash_requests_total", endpoint="/v1/chat/completions",
                     outcome="done") == 2
        assert total(m, "mlx_dflash_requests_total", endpoint="/v1/completions",
                     outcome="done") == 3
        assert total(m, "mlx_dflash_requests_total", outcome="cancelled") == 1
        assert total(m, "mlx_dflash_generated_tokens_total") == sum(usage)
        assert total(m, "mlx_dflash_time_to_first_token_seconds_count") == 5
        assert total(m, "mlx_dflash_accepted_tokens_total") <= total(
            m, "mlx_dflash_drafted_tokens_total")
        assert total(m, "mlx_dflash_drafted_tokens_total", source="drafter") > 0
        assert total(m, "mlx_dflash_batch_rows_count") > 0
        assert total(m, "mlx_dflash_running_requests") == 0
        assert total(m, "mlx_dflash_memory_bytes", kind="active") > 0
        assert total(m, "mlx_dflash_kernels", backend="mlx") == 1
        stats = httpx.get(f"{server.url}/v1/stats").json()
        assert stats["models"][NAME]["loaded"] and stats["running"] == 0
        assert sum(stats["totals"]["generated_tokens"].values()) == sum(usage)
        text = httpx.get(f"{server.url}/metrics").text
        assert "w5" not in text  # no prompt or reply text in the metrics


def test_cors_preflight_and_the_key():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

    model = make_target("qwen3", vocab_size=96)
    tok = TokenizerWrapper(make_tokenizer(96)._tokenizer, eos_token_ids=[EOS_ID])
    app = create_app(model, make_drafter(model, block_size=4), tok, model_name=NAME,
                     api_key="k", allowed_origins=["http://ok.test"])
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with BackgroundServer(app) as server:
        url = f"{server.url}/v1/chat/completions"
        ok = httpx.options(url, headers={"Origin": "http://ok.test", **preflight})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://ok.test"
        bad = httpx.options(url, headers={"Origin": "http://evil.test", **preflight})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 2}
        no_key = httpx.post(url, json=body, headers={"Origin": "http://ok.test"})
        assert no_key.status_code == 401
        with_key = httpx.post(url, json=body, headers={"Origin": "http://ok.test",
                                                       "Authorization": "Bearer k"})
        assert with_key.status_code == 200
        assert with_key.headers["access-control-allow-origin"] == "http://ok.test"


def test_no_cors_by_default(pair):  # noqa: F811
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        r = httpx.options(f"{server.url}/v1/chat/completions",
                          headers={"Origin": "http://ok.test",
                                   "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
