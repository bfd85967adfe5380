"""Prefix caches: continuing from a stored pair prefills only the new tokens and changes nothing.

Every reply through the store must equal a fresh ``stream_generate`` on the same prompt (greedy;
sampled with the same seed), for plain KV, sliding-window and recurrent (Gated DeltaNet) targets.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_drafter, make_family_target, make_target, make_tokenizer

from mlx_dflash.decode import stream_generate, stream_generate_cached
from mlx_dflash.fingerprint import pair_fingerprint as fingerprint
from mlx_dflash.pair_cache import PairCache
from mlx_dflash.prefix_cache import DiskCache, PrefixCache, usable_prefix
from mlx_dflash.target import Target

V = 96
PREFIX = [(i * 7 + 3) % 90 + 5 for i in range(1000)]  # a long shared system prompt


def tiny_pair(model_type):
    if model_type == "qwen3":
        model = make_target("qwen3", vocab_size=V)
        return model, make_drafter(model, block_size=4)
    model = make_family_target(model_type, vocab_size=V)
    text = Target(model, check=False).model
    return model, make_drafter(text, block_size=4, layer_ids=(0, 1, 3))


def run(gen):
    tokens, last = [], None
    for r in gen:
        tokens += r.tokens
        last = r
    return tokens, last.stats


def fresh(pair, prompt, seed, **kw):
    mx.random.seed(seed)
    return run(stream_generate(*pair, make_tokenizer(V), prompt, **kw))[0]


def cached(store, pair, prompt, seed, **kw):
    mx.random.seed(seed)
    return run(stream_generate_cached(store, *pair, make_tokenizer(V), prompt, **kw))


@pytest.fixture(scope="module", params=["qwen3", "llama", "gemma3_text", "gpt_oss", "qwen3_5"])
def family(request):
    return request.param, tiny_pair(request.param)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reuse_is_lossless(family, temperature):
    """Shared system prompt, then a second turn of the first conversation."""
    model_type, pair = family
    kw = dict(max_tokens=16, temperature=temperature)
    store = PrefixCache(1 << 30)
    system_end = len(PREFIX)
    a = PREFIX + [40, 41, 42]  # every family's three replies run 8 tokens or more
    out_a, stats_a = cached(store, pair, a, 1, checkpoints=[system_end], **kw)
    assert stats_a.cached_tokens == 0 and stats_a.prefilled_tokens == len(a)
    assert out_a == fresh(pair, a, 1, **kw)

    b = PREFIX + [20, 21, 22, 23]
    out_b, stats_b = cached(store, pair, b, 2, checkpoints=[system_end], **kw)
    assert out_b == fresh(pair, b, 2, **kw)
    assert stats_b.cached_tokens == len(PREFIX)  # cut back (KV) or a checkpoint (the others)
    assert stats_b.prefilled_tokens == 4

    c = a + out_a + [30, 31]  # the conversation goes on
    out_c, stats_c = cached(store, pair, c, 3, **kw)
    assert out_c == fresh(pair, c, 3, **kw)
    assert min(len(out_a), len(out_b), len(out_c)) >= 4  # replies, not stops at once
    if model_type == "qwen3":  # cut back to the reply: only the new turn
        assert stats_c.prefilled_tokens == 2
    else:  # the reply's state if it is a prefix of c (not when it ended on a stop token)
        assert stats_c.cached_tokens in (len(c) - 2, len(a) - 1)


def test_stream_generate_continues_a_pair():
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    cache = PairCache()
    a = PREFIX[:200]
    out_a, stats = run(stream_generate(*pair, tok, a, max_tokens=12, prompt_cache=cache))
    held = a + out_a  # every generated token (and any verified past the limit)
    assert cache.tokens[: len(held)] == held
    assert cache.target[0].offset == len(cache.tokens) == cache.drafter[0].offset
    b = cache.tokens + [40, 41]
    out_b, stats = run(stream_generate(*pair, tok, b, max_tokens=12, prompt_cache=cache))
    assert stats.cached_tokens == len(b) - 2 and stats.prefilled_tokens == 2
    assert out_b == fresh(pair, b, 0, max_tokens=12)
    with pytest.raises(ValueError, match="proper prefix"):
        next(stream_generate(*pair, tok, [5, 6], max_tokens=2, prompt_cache=cache))


def test_closing_early_cuts_kv_caches_back():
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    cache = PairCache()
    gen = stream_generate(*pair, tok, PREFIX[:100], max_tokens=200, prompt_cache=cache,
                          block_size=4)
    seen = []
    for r in gen:
        seen += r.tokens
        if len(seen) >= 6:
            break
    gen.close()
    assert cache.tokens == (PREFIX[:100] + seen)[: len(cache.tokens)]
    assert cache.target[0].offset == len(cache.tokens) == cache.drafter[0].offset
    b = cache.tokens + [50, 51]
    out, _ = run(stream_generate(*pair, tok, b, max_tokens=10, prompt_cache=cache))
    assert out == fresh(pair, b, 0, max_tokens=10)


def test_closing_early_leaves_recurrent_caches_unnamed():
    pair = tiny_pair("qwen3_5")
    store = PrefixCache(1 << 30)
    gen = stream_generate_cached(store, *pair, make_tokenizer(V), PREFIX[:50], max_tokens=200)
    assert next(gen).finish_reason is None
    gen.close()
    # Only the checkpoint where the prompt ends is kept: the cut-off reply cannot be named.
    assert [len(e.ids) for e in store._entries.values()] == [49]


def test_fork_is_independent():
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    cache = PairCache()
    run(stream_generate(*pair, tok, PREFIX[:50], max_tokens=4, prompt_cache=cache))
    before = [np.array(c.state[0][..., : c.offset, :]) for c in cache.target]
    fork = cache.fork(keep=20)
    assert fork.tokens == cache.tokens[:20] and fork.target[0].offset == 20
    run(stream_generate(*pair, tok, fork.tokens + [7, 8, 9], max_tokens=8, prompt_cache=fork))
    after = [np.array(c.state[0][..., : c.offset, :]) for c in cache.target]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_usable_prefix_rules():
    ids, prompt = np.array([1, 2, 3, 4]), np.array([1, 2, 3, 9, 9])
    assert usable_prefix(ids, True, prompt) == 3  # cut back to the common part
    assert usable_prefix(ids, False, prompt) == 0  # a recurrent state only where it ends
    assert usable_prefix(ids[:3], False, prompt) == 3
    assert usable_prefix(ids, True, ids) == 3  # one token is always left to prefill
    assert usable_prefix(ids, False, ids) == 0


def test_memory_stays_under_the_budget():
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    budget = 3 << 20
    store = PrefixCache(budget)
    run(stream_generate_cached(store, *pair, tok, PREFIX[:300], max_tokens=4))
    per_entry = store.nbytes
    assert 0 < per_entry < budget
    mx.clear_cache()
    base = mx.get_active_memory()
    peak = 0
    for i in range(50):
        rng = np.random.default_rng(i)
        prompt = rng.integers(5, V, size=300).tolist()  # different from the first token on
        run(stream_generate_cached(store, *pair, tok, prompt, max_tokens=4))
        assert store.nbytes <= budget
        mx.clear_cache()
        peak = max(peak, mx.get_active_memory())
    assert 2 <= len(store) < 50  # the oldest went out
    assert peak - base <= budget + (1 << 20), (peak - base, budget)


# -- the disk tier --------------------------------------------------------------------------------
def test_disk_tier_survives_a_restart_and_skips_bad_files(tmp_path, caplog):
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    fp = fingerprint(*pair)
    a, b = PREFIX[:400] + [10, 11], PREFIX[:400] + [20, 21, 22]
    out_a, _ = run(stream_generate_cached(PrefixCache(1 << 30, directory=tmp_path,
                                                      fingerprint=fp), *pair, tok, a,
                                          max_tokens=8))
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1 and not list(tmp_path.rglob(".*"))  # no temporary files left

    restarted = PrefixCache(1 << 30, directory=tmp_path, fingerprint=fp)
    out_b, stats = cached(restarted, pair, b, 0, max_tokens=8)
    assert stats.cached_tokens == 400 and out_b == fresh(pair, b, 0, max_tokens=8)

    other = PrefixCache(1 << 30, directory=tmp_path, fingerprint="another pair")
    assert other.fetch(b)[1] == 0  # another pair's entries are not seen

    for f in tmp_path.rglob("*.safetensors"):  # truncate every entry
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="mlx_dflash.prompt_cache"):
        damaged = PrefixCache(1 << 30, directory=tmp_path, fingerprint=fp)
        out, stats = cached(damaged, pair, b, 0, max_tokens=8)
    assert "truncated" in caplog.text and stats.cached_tokens == 0 and out == out_b


def test_disk_tier_checks_what_it_loads(tmp_path, caplog):
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    fp = fingerprint(*pair)
    store = PrefixCache(1 << 30, directory=tmp_path, fingerprint=fp)
    run(stream_generate_cached(store, *pair, tok, PREFIX[:100], max_tokens=4))
    (path,) = list(tmp_path.rglob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the data
    path.write_bytes(bytes(data))
    disk = DiskCache(tmp_path, fp)
    assert len(disk) == 1
    with caplog.at_level(logging.WARNING, logger="mlx_dflash.prompt_cache"):
        assert disk.load(path.stem) is None
    assert "checksum" in caplog.text and len(disk) == 0

    other_dir = DiskCache(tmp_path, "another pair").dir
    (other_dir / path.name).write_bytes(path.read_bytes())  # a file of this pair, misplaced
    (other_dir / "garbage.safetensors").write_bytes(b"not a cache at all")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_dflash.prompt_cache"):
        assert len(DiskCache(tmp_path, "another pair")) == 0
    assert "saved for another model" in caplog.text and "garbage" in caplog.text


def test_disk_budget_evicts_oldest(tmp_path):
    pair = tiny_pair("qwen3")
    tok = make_tokenizer(V)
    store = PrefixCache(0, directory=tmp_path, fingerprint=fingerprint(*pair))  # disk only
    run(stream_generate_cached(store, *pair, tok, PREFIX[:200], max_tokens=4))
    one = store.disk.nbytes
    store.disk.max_bytes = int(2.5 * one)
    for i in range(4):
        run(stream_generate_cached(store, *pair, tok, [60 + i] + PREFIX[:199], max_tokens=4))
        assert store.disk.nbytes <= store.disk.max_bytes
    assert len(store.disk) == 2 and len(store) == 0
    prompt = [63] + PREFIX[:199] + [7, 8]  # the newest file: used although memory holds none
    out, stats = cached(store, pair, prompt, 0, max_tokens=4)
    assert stats.cached_tokens == 200 and out == fresh(pair, prompt, 0, max_tokens=4)


@pytest.mark.parametrize("family", ["dspark", "dflash2"])
def test_reuse_is_lossless_with_other_drafter_families(family):
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    model = make_target("qwen3", vocab_size=V)
    pair = (model, make_dspark(model) if family == "dspark" else make_dflash2(model))
    store = PrefixCache(1 << 30)
    a, b = PREFIX[:300] + [10, 11], PREFIX[:300] + [20, 21, 22]
    for prompt, seed in ((a, 1), (b, 2), (a + [40], 3)):
        for temperature in (0.0, 1.0):
            out, _ = cached(store, pair, prompt, seed, max_tokens=12, temperature=temperature)
            assert out == fresh(pair, prompt, seed, max_tokens=12, temperature=temperature)
    assert cached(store, pair, b + [41], 4, max_tokens=4)[1].cached_tokens >= len(b)
