"""Model lifecycle in the server: weights loaded on the first request (not at start), load,
unload, pin and unpin over the API, unloading after an idle time, the memory-fit check that
refuses a model instead of swapping, alternating requests without a reload each time (outputs
equal to one-model serving), and --model-dir."""

import time

import httpx
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_server import TEMPLATE
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer, save_target, zlab_config

from mlx_dflash import load_drafter, save_drafter
from mlx_dflash.server import BackgroundServer, create_app
from mlx_dflash.server.models import lazy_model

V = 96
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


class Loader:
    """Loads a saved pair, counting the loads."""

    def __init__(self, target, drafter, eos=EOS_ID):
        self.target, self.drafter, self.calls, self.eos = target, drafter, 0, eos

    def __call__(self):
        from mlx_lm import load

        self.calls += 1
        model, tok = load(str(self.target))
        tok = TokenizerWrapper(tok._tokenizer, eos_token_ids=[self.eos])
        return model, load_drafter(self.drafter, model=model), tok


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two saved pairs: {name: (target dir, drafter dir)}."""
    root = tmp_path_factory.mktemp("lifecycle")
    out = {}
    for name, seed in (("alpha", 2), ("beta", 7)):
        model = make_target("qwen3", vocab_size=V, seed=seed)
        save_target(model, make_tokenizer(V), root / name, chat_template=TEMPLATE)
        drafter = make_drafter(model, block_size=4)
        save_drafter(drafter, root / f"{name}-drafter", zlab_config(drafter))
        out[name] = (root / name, root / f"{name}-drafter")
    return out


def lazy(saved, names=("alpha", "beta")):
    loaders = {n: Loader(*saved[n]) for n in names}
    models = [lazy_model(n, loaders[n], path=saved[n][0]) for n in names]
    return models, loaders


def chat(server, model, max_tokens=12, **kw):
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **kw})


def card(server, name):
    return httpx.get(f"{server.url}/v1/models/{name}").json()


def post(server, name, action):
    return httpx.post(f"{server.url}/v1/models/{name}/{action}", timeout=120)


def test_weights_load_on_first_use_and_over_the_api(saved):
    models, loaders = lazy(saved)
    with BackgroundServer(create_app(models=models)) as server:
        listed = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["loaded"] for m in listed] == [False, False]  # only tokenizers read
        assert all(m["context_length"] > 0 for m in listed)
        assert loaders["alpha"].calls == loaders["beta"].calls == 0
        assert chat(server, "alpha").status_code == 200
        assert card(server, "alpha")["loaded"] and not card(server, "beta")["loaded"]
        assert "DFlashDraftModel" in card(server, "alpha")["drafter"]
        assert post(server, "alpha", "unload").json()["loaded"] is False
        assert post(server, "beta", "load").json()["loaded"] is True
        pinned = post(server, "beta", "pin").json()
        assert pinned["pinned"] and pinned["loaded"]
        refused = post(server, "beta", "unload")
        assert refused.status_code == 409 and "pinned" in refused.json()["error"]["message"]
        assert post(server, "beta", "unpin").json()["pinned"] is False
        assert post(server, "beta", "unload").json()["loaded"] is False
        assert post(server, "nobody", "load").status_code == 404
        assert loaders["alpha"].calls == 1 and loaders["beta"].calls == 1


def test_a_model_with_requests_is_not_unloaded(saved):
    endless = Loader(*saved["alpha"], eos=V + 1)  # no stop token: only the limit ends it
    models = [lazy_model("alpha", endless, path=saved["alpha"][0])]
    with BackgroundServer(create_app(models=models)) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "model": "alpha", "prompt": "w5 w6 w7", "max_tokens": 4000, "stream": True,
                "temperature": 0}) as stream:
            lines = stream.iter_lines()
            next(lines)  # streaming (kept open: leaving the loop would cancel the request)
            busy = post(server, "alpha", "unload")
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"


def test_alternating_models_load_once_each_and_answer_as_one_model_serving(saved):
    want = {}
    for name in ("alpha", "beta"):  # each served alone
        alone, _ = lazy(saved, (name,))
        with BackgroundServer(create_app(models=alone)) as server:
            want[name] = chat(server, name).json()["choices"][0]["message"]["content"]
    assert want["alpha"] != want["beta"]
    models, loaders = lazy(saved)
    with BackgroundServer(create_app(models=models)) as server:
        for name in ("alpha", "beta", "alpha", "beta", "alpha"):
            got = chat(server, name).json()["choices"][0]["message"]["content"]
            assert got == want[name], name
    assert loaders["alpha"].calls == 1 and loaders["beta"].calls == 1


def test_idle_models_are_unloaded_after_the_ttl_but_not_pinned_ones(saved):
    models, _ = lazy(saved)
    with BackgroundServer(create_app(models=models, ttl=0.5)) as server:
        assert chat(server, "alpha").status_code == 200
        assert post(server, "beta", "pin").json()["pinned"]
        deadline = time.monotonic() + 10
        while card(server, "alpha")["loaded"]:
            assert time.monotonic() < deadline, "alpha was not unloaded after its ttl"
            time.sleep(0.1)
        time.sleep(1.0)
        assert card(server, "beta")["loaded"]  # pinned: stays
        assert chat(server, "alpha").status_code == 200  # and comes back when asked for
        assert card(server, "alpha")["loaded"]


def test_a_model_that_cannot_fit_is_refused_not_swapped(saved):
    models, loaders = lazy(saved)
    app = create_app(models=models)
    app.state.pool.headroom = lambda: 64 << 10  # 64 KiB free
    with BackgroundServer(app) as server:
        r = chat(server, "alpha")
        assert r.status_code == 507, r.text
        message = r.json()["error"]["message"]
        assert "'alpha' needs" in message and "would swap" in message
        assert post(server, "alpha", "load").status_code == 507
        assert loaders["alpha"].calls == 0 and not card(server, "alpha")["loaded"]
    models, _ = lazy(saved)
    with BackgroundServer(create_app(models=models, model_memory=1 << 10)) as server:
        r = chat(server, "beta")
        assert r.status_code == 507 and "--model-memory" in r.json()["error"]["message"]


def test_model_dir_serves_every_model_found_with_auto_drafters(saved, tmp_path):
    from mlx_dflash.cli.serve import _entries

    root = saved["alpha"][0].parent
    entries = _entries([], [], [], None, root)
    assert [e.name for e in entries] == ["alpha", "beta"]  # the drafters' dirs are not models
    assert all(e.drafter is None for e in entries)  # auto
    import typer

    with pytest.raises(typer.Exit):
        _entries([], [], [], None, tmp_path)  # nothing there: a clear error


def test_models_take_turns_a_long_request_does_not_hold_another_models(saved):
    endless = Loader(*saved["alpha"], eos=V + 1)
    model, drafter, tok = endless()
    from mlx_dflash.server.models import served_model

    models = [served_model("alpha", model, drafter, tok),  # never stops before its limit
              lazy_model("beta", Loader(*saved["beta"]), path=saved["beta"][0])]
    with BackgroundServer(create_app(models=models)) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "model": "alpha", "prompt": "w5 w6 w7", "max_tokens": 3000, "stream": True,
                "temperature": 0}) as stream:
            lines = stream.iter_lines()
            next(lines)
            r = chat(server, "beta", max_tokens=8)  # answered while alpha still decodes
            assert r.status_code == 200
            states = httpx.get(f"{server.url}/v1/stats").json()["models"]
            assert states["alpha"]["decoding"] and states["beta"]["loaded"]
            text = "".join(line for line in lines if line.startswith("data: {"))
        assert '"finish_reason": "length"' in text  # alpha ran to its limit, after beta's reply
