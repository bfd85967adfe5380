"""``--drafter auto`` and lookup drafts only: the table's entries against the published
layouts, the choice for a target that matches by hub id or by shape, one that matches
nothing (lookups only, said), a published drafter not cached while offline (named with the
command that fetches it), and lookup-only decoding lossless alone and batched."""

import json

import numpy as np
import pytest
from test_lossless_greedy import reference
from tiny import make_drafter, make_target, make_tokenizer, save_target, zlab_config

from mlx_dflash import stream_generate
from mlx_dflash.batch import BatchEngine
from mlx_dflash.drafters import published as pub
from mlx_dflash.drafters.base import LookupDrafts
from mlx_dflash.drafters.shipped import DEFAULT_DRAFTER, drafter_dir


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's default taps: evenly spaced from layer 1 to layer L - 3 (REFERENCE b1)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]


def test_the_table_fits_the_published_layouts():
    entries = pub.published()
    assert len({p.target for p in entries}) >= 8
    for p in entries:
        assert p.family in pub.FAMILY_ORDER and p.source
        if p.shape is None or p.layout is None:
            continue
        model_type, hidden, layers, vocab = p.shape
        layout = p.layout
        assert layout["vocab_size"] == vocab, p
        ids = layout["target_layer_ids"]
        if ids is not None:
            assert 0 <= min(ids) and max(ids) < layers, p
            if p.source == "z-lab":  # z-lab's own rule for its taps
                assert ids == build_target_layer_ids(layers, len(ids)), p
    shipped = [p for p in entries if p.drafter == f"shipped:{DEFAULT_DRAFTER}"][0]
    config = json.loads((drafter_dir(DEFAULT_DRAFTER) / "config.json").read_text())
    assert shipped.layout["block_size"] == config["block_size"]
    assert shipped.layout["target_layer_ids"] == config["target_layer_ids"]
    assert shipped.shape[2] == config["num_target_layers"]
    assert shipped.shape[3] == config["vocab_size"] == shipped.layout["vocab_size"]
    assert shipped.cached


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table of our own (pub.TABLE) for tiny targets; returns a function adding entries."""
    path = tmp_path / "drafters.json"
    data = {"targets": []}

    def add(target, shape, drafter, family="dflash"):
        data["targets"].append({"target": target, "shape": shape, "drafters": [
            {"drafter": str(drafter), "family": family, "source": "test", "layout": None}]})
        path.write_text(json.dumps(data))
        pub.published.cache_clear()

    monkeypatch.setattr(pub, "TABLE", path)
    add("nobody/none", None, "nobody/nothing")
    yield add
    pub.published.cache_clear()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A saved tiny target and a saved drafter that fits it."""
    root = tmp_path_factory.mktemp("auto")
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(model.args.vocab_size)
    save_target(model, tok, root / "target")
    drafter = make_drafter(model, block_size=4)
    from mlx_dflash.convert.save import save_drafter

    save_drafter(drafter, root / "drafter", zlab_config(drafter))
    return model, root / "target", root / "drafter"


def shape_of(target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    return dict(zip(pub.SHAPE_KEYS, pub.target_shape(config)))


def test_a_target_matching_the_table_gets_its_drafter(table, tiny_pair):
    model, target_dir, drafter_dir_ = tiny_pair
    table("acme/tiny-target", shape_of(target_dir), drafter_dir_)
    drafter, choice = pub.choose("acme/tiny-target", target_dir, model)  # by hub id
    assert choice.entry is not None and "matched by hub id" in choice.reason
    assert drafter.source_path == drafter_dir_
    drafter, choice = pub.choose(str(target_dir), target_dir, model)  # a copy: by its shape
    assert "matched by shape" in choice.reason and drafter.source_path == drafter_dir_
    assert "DFlashDraftModel" in pub.describe(drafter)


def test_an_unknown_target_gets_lookups_and_is_told(table, tiny_pair):
    model, target_dir, _ = tiny_pair
    drafter, choice = pub.choose(str(target_dir), target_dir, model)
    assert isinstance(drafter, LookupDrafts) and choice.drafter == pub.LOOKUP
    assert "no published drafter is known" in choice.reason and "qwen3" in choice.reason
    assert choice.label == "lookup drafts only" == pub.describe(drafter)


def test_offline_a_published_drafter_not_here_is_named_with_its_fetch_command(
        table, tiny_pair, monkeypatch):
    model, target_dir, _ = tiny_pair
    table("acme/tiny-target", shape_of(target_dir), "acme/not-downloaded")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1
    drafter, choice = pub.choose("acme/tiny-target", target_dir, model)
    assert isinstance(drafter, LookupDrafts)
    assert "hf download acme/not-downloaded" in choice.reason


def test_a_published_drafter_that_does_not_fit_is_passed_over(table, tiny_pair, tmp_path):
    model, target_dir, _ = tiny_pair
    other = make_target("qwen3", hidden_size=32, seed=5)  # another hidden size
    from mlx_dflash.convert.save import save_drafter

    wrong = make_drafter(other, block_size=4)
    save_drafter(wrong, tmp_path / "wrong", zlab_config(wrong))
    table("acme/tiny-target", shape_of(target_dir), tmp_path / "wrong")
    drafter, choice = pub.choose("acme/tiny-target", target_dir, model)
    assert isinstance(drafter, LookupDrafts) and "does not fit" in choice.reason


def test_lookup_drafts_only_are_lossless_alone_and_batched():
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(model.args.vocab_size)
    rng = np.random.default_rng(0)
    base = rng.integers(3, model.args.vocab_size, size=30).tolist()
    prompts = [base + base[:15], base[5:] + base[5:20]]
    copies = 0
    for prompt in prompts:
        want, _ = reference(model, prompt, 40)
        got = []
        for r in stream_generate(model, LookupDrafts(), tok, prompt, max_tokens=40):
            got += r.tokens
        assert got == want
        copies += r.stats.copy_cycles
    engine = BatchEngine(model, LookupDrafts(), tok, max_batch=2)
    ids = [engine.submit(p, max_tokens=40) for p in prompts]
    out = {i: [] for i in ids}
    while not engine.idle:
        for i, r in engine.step():
            out[i] += r.tokens
    for i, prompt in zip(ids, prompts):
        assert out[i] == reference(model, prompt, 40)[0]
    assert copies > 0  # lookups were verified, not just plain decoding


def test_generate_names_the_choice_and_models_lists_the_table(tiny_pair, tmp_path):
    import subprocess
    import sys

    _, target_dir, _ = tiny_pair
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "generate", "--model",
                          str(target_dir), "-n", "8", "--no-chat-template", "w5 w6 w7"],
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MLX_DFLASH_HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Drafter (auto): lookup drafts only: no published drafter is known" in run.stderr
    assert "drafter: lookup drafts only" in run.stderr  # the stats line
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "models"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "z-lab/Qwen3-8B-DFlash-b16" in run.stdout
    assert f"shipped:{DEFAULT_DRAFTER}" in run.stdout


def test_the_server_serves_a_target_with_lookups_only():
    import httpx
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from test_server import TEMPLATE
    from tiny import EOS_ID

    from mlx_dflash.server import BackgroundServer, create_app

    model = make_target("qwen3", vocab_size=96, seed=2)
    hf = make_tokenizer(96)._tokenizer
    hf.chat_template = TEMPLATE
    tok = TokenizerWrapper(hf, eos_token_ids=[EOS_ID])
    prompt = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"
    with BackgroundServer(create_app(model, LookupDrafts(), tok, model_name="m")) as server:
        assert httpx.get(f"{server.url}/v1/models/m").json()["drafter"] == "lookup drafts only"
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": prompt, "max_tokens": 30, "temperature": 0}).json()
    want, _ = reference(model, tok.encode(prompt), 30)
    assert r["choices"][0]["text"] == tok.decode(want)


def test_lookups_only_through_the_prefix_cache():
    from mlx_dflash import PrefixCache, stream_generate_cached

    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(model.args.vocab_size)
    base = np.random.default_rng(1).integers(3, model.args.vocab_size, size=30).tolist()
    prompt = base + base[:15]
    store = PrefixCache(1 << 30)
    got, last = [], None
    for last in stream_generate_cached(store, model, LookupDrafts(), tok, prompt, max_tokens=30):
        got += last.tokens
    assert got == reference(model, prompt, 30)[0]
    assert last.stats.copy_cycles > 0 and last.stats.drafter == "lookup drafts only"
