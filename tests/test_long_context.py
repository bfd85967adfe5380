"""Long contexts: the drafter's context window and quantized KV caches, lossless."""

import mlx.core as mx
import numpy as np
import pytest
from test_dflash2 import make_dflash2
from test_dspark import make_dspark
from test_lossless_greedy import assert_same_or_near_tie, reference
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import (
    BatchEngine,
    PrefixCache,
    load_drafter,
    quantize_kv,
    save_drafter,
    stream_generate,
    stream_generate_cached,
)
from mlx_dflash.target import Target

WINDOW = 8


def _context(model, drafter, tokens):
    """The drafter's context cache after the target read ``tokens`` (and their features)."""
    target = Target(model)
    _, feats = target.hidden_states(mx.array(tokens)[None], target.make_cache(),
                                    drafter.target_layer_ids)
    cache = drafter.make_cache()
    drafter.commit(feats, cache, mx.array(tokens)[None])
    return target, cache


def _batched(engine, prompts, n=40):
    """Every prompt's reply through the batch engine, all submitted at once."""
    ids = [engine.submit(p, max_tokens=n) for p in prompts]
    out = {i: [] for i in ids}
    while not engine.idle:
        for rid, r in engine.step():
            out[rid] += r.tokens
    return [out[i] for i in ids]


def _block(drafter, target, feats):
    """The block's hidden states over a context of these target features."""
    cache = drafter.make_cache()
    drafter.commit(feats, cache)
    return drafter.block_hidden(target, mx.array([5]), cache, drafter.block_size)


def test_the_window_hides_the_context_before_it():
    """With a window of W, the drafts depend on the last W context positions alone: other
    features before them leave the block's hidden states as they were; a change inside the
    window, or any change without a window, moves them."""
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    target = Target(model)
    tokens = mx.array(np.random.default_rng(0).integers(3, 128, size=40))[None]
    _, feats = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)
    noise = mx.random.normal(feats.shape, key=mx.random.key(3))
    early = mx.concatenate([noise[:, :20], feats[:, 20:]], axis=1)  # differs before the window
    late = mx.concatenate([feats[:, :-3], noise[:, -3:]], axis=1)  # differs inside it
    whole = _block(drafter, target, feats)
    assert not mx.allclose(whole, _block(drafter, target, early), atol=1e-5)
    drafter.args.context_window = WINDOW
    windowed = _block(drafter, target, feats)
    assert not mx.allclose(windowed, whole, atol=1e-5)
    assert mx.allclose(windowed, _block(drafter, target, early), atol=1e-5)
    assert not mx.allclose(windowed, _block(drafter, target, late), atol=1e-5)


@pytest.mark.parametrize("make", [make_drafter, make_dspark, make_dflash2])
def test_batched_drafting_keeps_each_requests_window(make):
    """One batched pass over contexts of several lengths (shorter than the window, longer)
    gives each request what its own pass gives."""
    model = make_target("qwen3")
    drafter = make(model, block_size=4, context_window=WINDOW)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (5, 23, 41)]
    caches, singles = [], []
    for p in prompts:
        target, cache = _context(model, drafter, p)
        caches.append(cache)
        singles.append(drafter.block_hidden(target, mx.array([5]), cache, drafter.block_size))
    batched = drafter.block_hidden_batch(target, mx.array([5, 5, 5]), caches,
                                         drafter.block_size)
    for i, single in enumerate(singles):
        assert mx.allclose(batched[i], single, atol=1e-5), i


@pytest.mark.parametrize("make", [make_drafter, make_dspark, make_dflash2])
def test_greedy_is_lossless_past_the_drafters_window(make):
    """Prompts and replies far longer than the window: equal to the target's own greedy
    output, alone and batched."""
    model = make_target("qwen3")
    drafter = make(model, block_size=6, context_window=WINDOW)
    tok = make_tokenizer(128)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (30, 70)]
    wants = [reference(model, p, 40)[0] for p in prompts]
    for p, want in zip(prompts, wants):
        got = [t for r in stream_generate(model, drafter, tok, p, max_tokens=40) for t in r.tokens]
        assert_same_or_near_tie(model, p, got, want)
    for p, got, want in zip(prompts, _batched(BatchEngine(model, drafter, tok), prompts), wants):
        assert_same_or_near_tie(model, p, got, want)


def test_the_window_is_kept_in_the_config(tmp_path):
    """A drafter saved with a window loads with it; z-lab's name for it is read too."""
    import json

    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4, context_window=512)
    save_drafter(drafter, tmp_path / "d")
    assert load_drafter(tmp_path / "d", model=model).args.context_window == 512
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    del config["context_window"]
    config["sliding_window_size"] = 1024
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    assert load_drafter(tmp_path / "d", model=model).args.context_window == 1024


# -- quantized KV caches -------------------------------------------------------------------------
@pytest.fixture
def quantized():
    """A tiny target whose KV caches are quantized to 4 bits (head_dim 32: groups of 32)."""
    model = make_target("qwen3", heads=2, kv_heads=1)
    quantize_kv(model, 4, group_size=32)
    yield model
    quantize_kv(model, None)


def _run(model, drafter, tok, prompt, n=40, **kw):
    return [t for r in stream_generate(model, drafter, tok, prompt, max_tokens=n, **kw)
            for t in r.tokens]


@pytest.mark.parametrize("make", [make_drafter, make_dspark])
def test_quantized_kv_is_lossless_against_the_quantized_target(quantized, make):
    """Greedy and seeded sampling with 4-bit KV caches: equal to plain decoding with the same
    caches (not to the full-precision target's), with chains, fixed blocks, trees, the batch
    engine and the prefix cache."""
    model = quantized
    drafter = make(model, block_size=6)
    tok = make_tokenizer(128)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (12, 60, 300)]
    assert type(Target(model).make_cache()[0]).__name__ == "QuantizedKVCache"
    plain = [_run(model, None, tok, p) for p in prompts]
    quantize_kv(model, None)
    assert [_run(model, None, tok, p) for p in prompts] != plain  # the quantization shows
    quantize_kv(model, 4, group_size=32)
    for p, want in zip(prompts, plain):
        assert _run(model, drafter, tok, p) == want
        assert _run(model, drafter, tok, p, block_size=4) == want
        assert _run(model, drafter, tok, p, tree="auto") == want
        seeded = _run(model, None, tok, p, temperature=1.0, seed=3)
        assert _run(model, drafter, tok, p, temperature=1.0, seed=3) == seeded
    assert _batched(BatchEngine(model, drafter, tok), prompts) == plain
    store = PrefixCache(1 << 30)
    for _ in range(2):  # the second continues from the first's quantized caches
        got = [t for r in stream_generate_cached(store, model, drafter, tok, prompts[1],
                                                 max_tokens=40) for t in r.tokens]
        assert got == plain[1]


def test_quantized_kv_takes_less_memory_and_refuses_what_it_cannot_do():
    from mlx_dflash.schedule import kv_bytes_per_position

    model = make_target("qwen3", heads=2, kv_heads=1)
    full = kv_bytes_per_position(Target(model))
    quantize_kv(model, 4, group_size=32)
    assert kv_bytes_per_position(Target(model)) < full / 4
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_kv(model, 7)
    with pytest.raises(ValueError, match="does not divide the target's head dimension 32"):
        quantize_kv(model, 4, group_size=64)
    quantize_kv(model, None)
    assert kv_bytes_per_position(Target(model)) == full


def test_quantized_caches_admit_more_requests_under_the_same_memory(monkeypatch):
    """A memory budget that holds two full-precision rows holds more 4-bit ones: the batch
    engine's admission counts the packed bytes, and every output stays the quantized target's."""
    import mlx_dflash.batch as batch

    model = make_target("qwen3", heads=2, kv_heads=1)
    tok = make_tokenizer(128)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, size=40).tolist() for _ in range(6)]
    drafter = make_drafter(model, block_size=6)

    def most_at_once(budget_rows: float) -> tuple[int, list]:
        engine = BatchEngine(model, drafter, tok, max_batch=8, block_size=6, reserve_bytes=0)
        full_bytes = 4 * 2 * 4 * 1 * 32  # float32 K and V, 4 layers, 1 KV head of 32
        budget = int(budget_rows * 2 * full_bytes * (40 + 20 + 6))
        monkeypatch.setattr(batch, "memory_headroom",
                            lambda: budget - sum(layer.nbytes for layer in engine.cache))
        ids = [engine.submit(p, max_tokens=20) for p in prompts]
        out, most = {i: [] for i in ids}, 0
        while not engine.idle:
            for rid, r in engine.step():
                out[rid] += r.tokens
            most = max(most, len(engine.running))
        return most, [out[i] for i in ids]

    assert Target(model).num_layers == 4
    assert most_at_once(2.5)[0] == 2
    quantize_kv(model, 4, group_size=32)
    most, outs = most_at_once(2.5)
    assert most >= 4
    assert outs == [_run(model, None, tok, p, n=20) for p in prompts]
    quantize_kv(model, None)
