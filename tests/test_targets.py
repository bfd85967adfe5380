"""Every covered target family: exact forward, exact rollback of every cache kind, and lossless
decoding (greedy token for token against mlx-lm's own decoding, sampled in distribution), also
for 4-bit and 8-bit quantized targets. Models are tiny random ones built from mlx-lm's ModelArgs
(tiny.make_family_target): sliding windows of 8 (4 in the sampling tests) so they wrap."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from test_lossless_greedy import (
    OracleDrafter,
    assert_same_or_near_tie,
    reference,
    speculative,
)
from tiny import (
    FAMILY_TYPES,
    family_config,
    make_drafter,
    make_family_target,
    make_tokenizer,
)

from mlx_dflash import attention, stream_generate
from mlx_dflash.target import PER_POSITION, REPLAY, Target, UnsupportedTargetError


def text_model(model):
    return Target(model, check=False).model


def drafter_for(model, block_size, seed=1):
    return make_drafter(text_model(model), block_size=block_size, layer_ids=(0, 1, 3), seed=seed)


# -- the forward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_forward_equals_model_call(model_type):
    model = make_family_target(model_type)
    n_params = len(tree_flatten(model.parameters()))
    target = Target(model)
    tokens = mx.array([[5, 9, 2, 7, 3, 11, 4, 8, 10, 12, 6, 13, 14]])
    c_ref, c_ours = make_prompt_cache(model), target.make_cache()
    for chunk in (tokens[:, :9], tokens[:, 9:10], tokens[:, 10:]):  # the window wraps
        with attention.on_cpu():  # the attention the target's passes use
            want = model(chunk, cache=c_ref)
        got, features = target.forward(chunk, c_ours, layer_ids=[0, 2, 3])
        assert mx.array_equal(want, got)
        assert features.shape == (1, chunk.shape[1], 3 * target.hidden_size)
    assert len(tree_flatten(model.parameters())) == n_params


def test_gemma_embedding_scale_is_in_embed():
    model = make_family_target("gemma3_text")
    target = Target(model)
    raw = target.inner.embed_tokens(mx.array([3]))
    assert mx.allclose(target.embed(mx.array([3])), raw * 8.0, rtol=1e-2)  # sqrt(64)


@pytest.mark.parametrize("model_type", ["gemma3", "mistral"])
def test_wrapped_and_remapped_model_types(model_type):
    """gemma3 wraps gemma3_text's model; mlx-lm loads mistral with llama.py: both covered."""
    from mlx_lm.utils import _get_classes

    base = "gemma3_text" if model_type == "gemma3" else "llama"
    config = family_config(base, 128, 64, 4, True)
    if model_type == "gemma3":
        config = dict(model_type="gemma3", vocab_size=128, text_config=config)
    else:
        config["model_type"] = "mistral"
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    target = Target(model)
    assert target.model_type == model_type
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    want, _ = reference(model, prompt, 16)
    drafter = make_drafter(target.model, block_size=4, layer_ids=(0, 1, 3))
    got, _, _ = speculative(model, drafter, make_tokenizer(128), prompt, 16, 4)
    assert_same_or_near_tie(model, prompt, got, want)


def test_uncovered_architecture_fails_at_load():
    import importlib

    module = importlib.import_module("mlx_lm.models.starcoder2")
    args = module.ModelArgs.from_dict(dict(
        model_type="starcoder2", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedTargetError, match="not a supported target.*qwen3_5"):
        Target(module.Model(args))


# -- rollback: every cache kind against a fresh prefill of the kept tokens ------------------------
def visible_state(c):
    """What a layer's cache shows to later positions: KV rows in temporal order (a sliding
    window's last max_size - 1, all a later query can see), or the conv + recurrent arrays."""
    if isinstance(c, ArraysCache):
        return list(c.cache)
    if isinstance(c, RotatingKVCache):
        n = min(c.offset, c.max_size - 1)
        return [c._temporal_order(a)[..., c._temporal_order(a).shape[2] - n :, :]
                for a in (c.keys, c.values)]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def cache_difference(got, want) -> float:
    """Largest difference between what two caches show, relative to the largest value;
    float32 runs of the same tokens in other chunkings differ by ~1e-6 (MoE: ~5e-6)."""
    worst = 0.0
    for c, f in zip(got, want):
        assert getattr(c, "offset", None) == getattr(f, "offset", None)
        for a, b in zip(visible_state(c), visible_state(f)):
            assert a.shape == b.shape, type(c).__name__
            scale = max(1.0, mx.abs(b).max().item())
            worst = max(worst, mx.abs(a - b).max().item() / scale)
    return worst


ROLLBACK_CASES = [  # (prompt length, pass length, positions rolled back)
    (3, 4, 2),  # window not full
    (12, 5, 3),  # window full: the rejected tail must not stay in the buffer
    (12, 5, 5),  # the whole pass (as the scheduler's timing passes do)
    (12, 5, 1),
    (12, 1, 1),  # a one-token pass wrote the ring in place
    (5, 1, 1),
]


@pytest.mark.parametrize("model_type,strategy", [
    ("qwen3", REPLAY),  # KV caches
    ("llama", REPLAY),  # rotating + KV
    ("gpt_oss", REPLAY),  # rotating + KV, sinks
    ("gemma3_text", REPLAY),
    ("qwen3_5", REPLAY),  # Gated DeltaNet + KV
    ("qwen3_5", PER_POSITION),
    ("qwen3_5_moe", REPLAY),
    ("qwen3_next", REPLAY),
    ("qwen3_next", PER_POSITION),
])
@pytest.mark.parametrize("prompt_len,pass_len,rejected", ROLLBACK_CASES)
@pytest.mark.parametrize("following_passes", [((7,), (8, 9, 10)), ((7, 8, 9), (10,))])
def test_rollback_equals_fresh_prefill(model_type, strategy, prompt_len, pass_len, rejected,
                                       following_passes):
    model = make_family_target(model_type)
    target = Target(model, recurrent_rollback=strategy)
    rng = np.random.default_rng(prompt_len * 10 + pass_len)
    tokens = rng.integers(3, 128, size=prompt_len + pass_len).tolist()
    prompt, block = mx.array([tokens[:prompt_len]]), mx.array([tokens[prompt_len:]])
    cache = target.make_cache()
    target.hidden_states(prompt, cache, ())
    target.forward(block, cache)
    Target.rollback(cache, rejected)
    kept = tokens[: prompt_len + pass_len - rejected]
    fresh = target.make_cache()
    target.hidden_states(mx.array([kept]), fresh, ())
    assert cache_difference(cache, fresh) < 2e-5
    # ... and the next passes see what a fresh prefill sees, whether one token or several
    # come first (one token after a whole pass cut back from a full window once crashed in
    # mlx-lm's in-place ring update).
    for following in map(list, following_passes):
        got, _ = target.forward(mx.array([following]), cache)
        kept = kept + following
        want = model(mx.array([kept]))[:, -len(following):]
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "qwen3_5", "qwen3_5_moe"])
def test_many_cycles_of_rollback(model_type):
    """Random passes and partial accepts, like a decode, and now and then a whole pass rolled
    back: logits always equal a fresh model's."""
    model = make_family_target(model_type)
    target = Target(model)
    rng = np.random.default_rng(0)
    committed = rng.integers(3, 128, size=6).tolist()
    cache = target.make_cache()
    target.hidden_states(mx.array([committed[:-1]]), cache, ())
    whole = False  # the last pass was rolled back whole: often one token comes next
    for _ in range(40):
        n = 1 if whole and rng.random() < 0.5 else int(rng.integers(1, 7))
        block = [committed[-1]] + rng.integers(3, 128, size=n - 1).tolist()
        logits, _ = target.forward(mx.array([block]), cache)
        want = model(mx.array([committed[:-1] + block]))[:, -n:]
        # float32 summation order differs between a cached pass and a full one (and between
        # CPUs: 1.5e-4 seen on an AMD EPYC); a rollback bug moves logits by ~0.1-1.
        assert mx.allclose(logits, want, rtol=1e-4, atol=5e-4)
        whole = rng.random() < 0.25  # the whole pass, as the scheduler's timing passes do
        if whole:
            Target.rollback(cache, n)
            continue
        accepted = int(rng.integers(0, n))
        Target.rollback(cache, n - 1 - accepted)
        committed += block[1 : 1 + accepted] + [int(rng.integers(3, 128))]
    assert cache[1].offset == len(committed) - 1  # layer 1 attends in every family here


def test_rollback_check_has_power():
    """Rolling back only the KV layers of a hybrid leaves recurrent states far from fresh."""
    target = Target(make_family_target("qwen3_5"))
    tokens = list(range(3, 20))
    cache = target.make_cache()
    target.hidden_states(mx.array([tokens[:12]]), cache, ())
    target.forward(mx.array([tokens[12:]]), cache)
    for c in cache:
        if not isinstance(c, ArraysCache):
            c.trim(3)
    fresh = target.make_cache()
    target.hidden_states(mx.array([tokens[:14]]), fresh, ())
    assert cache_difference(cache, fresh) > 1e-2


def test_rollback_beyond_the_last_pass_is_refused():
    target = Target(make_family_target("qwen3_5"))
    cache = target.make_cache()
    target.hidden_states(mx.array([[3, 4, 5]]), cache, ())
    target.forward(mx.array([[6, 7]]), cache)
    with pytest.raises(ValueError, match="within the last pass"):
        Target.rollback(cache, 3)
    plain = make_prompt_cache(target.model)  # no record of the pass to roll back
    target.forward(mx.array([[6, 7]]), plain)
    with pytest.raises(ValueError):
        Target.rollback(plain, 1)


# -- the scheduler's passes and mixed plain / drafting cycles -----------------------------------
@pytest.mark.parametrize("model_type", ["qwen3_5", "gpt_oss", "gemma3_text"])
def test_scheduler_cycles_on_every_cache_kind(monkeypatch, model_type):
    """Auto mode: the timing passes roll back whole passes over wrapped windows and recurrent
    states; pipelined plain cycles then drafting cycles stay lossless."""
    from mlx_dflash import policy
    from mlx_dflash.schedule import Scheduler, measure_costs

    model = make_family_target(model_type)
    drafter = drafter_for(model, 8)
    costs = measure_costs(Target(model), drafter, 8, reps=1)
    monkeypatch.setattr(policy, "cached_costs", lambda *a: costs)
    pattern = iter([0, 0, 3, 0, 2, 0, 0, 0, 4, 7] * 20)
    monkeypatch.setattr(Scheduler, "choose", lambda self, room, context: min(room, next(pattern)))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want, _ = reference(model, prompt, 40)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, 128, 0.2)
    tokens, stats = [], None
    for r in stream_generate(model, oracle, make_tokenizer(128), prompt, max_tokens=40,
                             copy_drafts=False):
        tokens, stats = tokens + r.tokens, r.stats
    assert_same_or_near_tie(model, prompt, tokens, want)
    assert 0 in stats.draft_lengths and max(stats.draft_lengths) > 1


# -- drafters against these targets ------------------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_check_fits_every_family(model_type):
    from mlx_dflash.drafters import DrafterMismatchError, check_fits

    model = make_family_target(model_type)
    check_fits(drafter_for(model, 4), model)
    for field, value, message in [("hidden_size", 32, "hidden_size"),
                                  ("vocab_size", 129, "vocab_size"),
                                  ("target_layer_ids", [0, 4], "target_layer_ids"),
                                  ("num_target_layers", 6, "num_target_layers")]:
        drafter = drafter_for(model, 4)
        setattr(drafter.args, field, value)
        with pytest.raises(DrafterMismatchError, match=message):
            check_fits(drafter, model)


PUBLISHED_STYLE = {  # drafter config fields published drafters for these targets use
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 1024}),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 1024}),
}


@pytest.mark.parametrize("style", list(PUBLISHED_STYLE))
@pytest.mark.parametrize("model_type", ["qwen3_5", "gpt_oss", "gemma3_text"])
def test_published_drafter_configs_load_and_run(tmp_path, model_type, style):
    from mlx_dflash import load_drafter, save_drafter

    model = make_family_target(model_type)
    drafter = make_drafter(text_model(model), block_size=4, layer_ids=(0, 1, 3), num_layers=2,
                           **PUBLISHED_STYLE[style])
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", model=model)
    assert loaded.args.layer_types == drafter.args.layer_types
    assert loaded.args.rope_scaling == drafter.args.rope_scaling
    prompt = [20, 21, 22, 23, 24, 25, 26, 27, 28]  # every family's reply runs 16 tokens
    want, _ = reference(model, prompt, 16)
    assert len(want) == 16
    got, _, _ = speculative(model, loaded, make_tokenizer(128), prompt, 16, 4)
    assert_same_or_near_tie(model, prompt, got, want)


# -- greedy: token for token equal to mlx-lm's own greedy decoding --------------------------------
def cycle_kinds(model, drafter, tok, prompt, max_tokens, block_size, copy_drafts=True):
    """Speculative tokens, and whether some cycle accepted nothing / everything it drafted."""
    tokens, stats = [], None
    for r in stream_generate(model, drafter, tok, prompt, max_tokens=max_tokens,
                             block_size=block_size, copy_drafts=copy_drafts):
        tokens += r.tokens
        stats = r.stats
    pairs = list(zip(stats.acceptance_lengths, stats.draft_lengths))
    none = any(k > 0 and a == 1 for a, k in pairs)
    every = any(k > 0 and a == k + 1 for a, k in pairs)
    return tokens, none, every


def check_greedy(model, block_size, max_tokens=28):
    tok = make_tokenizer(128)
    drafter = drafter_for(model, block_size)
    rng = np.random.default_rng(block_size)
    saw_none = saw_every = False
    for length, error_rate in [(5, None), (19, 0.0), (11, 0.3)]:
        prompt = rng.integers(3, 128, size=length).tolist()
        want, _ = reference(model, prompt, max_tokens)
        if error_rate is None:  # the random drafter (and copy drafts)
            got, none, every = cycle_kinds(model, drafter, tok, prompt, max_tokens, block_size)
        else:
            oracle = OracleDrafter(drafter, prompt + want, 128, error_rate, seed=length)
            got, none, every = cycle_kinds(model, oracle, tok, prompt, max_tokens, block_size,
                                           copy_drafts=False)
        assert_same_or_near_tie(model, prompt, got, want)
        saw_none, saw_every = saw_none or none, saw_every or every
    assert saw_none and saw_every


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_greedy_matches_mlx_lm(model_type, block_size):
    check_greedy(make_family_target(model_type, tied=model_type != "qwen3"), block_size)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("model_type", ["qwen3_5", "gpt_oss"])
def test_greedy_matches_mlx_lm_4bit(model_type, block_size):
    check_greedy(make_family_target(model_type, bits=4), block_size)


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma3_text"])
def test_greedy_matches_mlx_lm_8bit(model_type):
    check_greedy(make_family_target(model_type, bits=8), 4)


def test_greedy_per_position_rollback():
    from mlx_dflash.target import as_target

    model = make_family_target("qwen3_5")
    tok = make_tokenizer(128)
    target = Target(model, recurrent_rollback=PER_POSITION)
    drafter = drafter_for(model, 4)
    prompt = [5, 6, 7, 8, 9]
    want, _ = reference(model, prompt, 24)
    oracle = OracleDrafter(drafter, prompt + want, 128, 0.3)
    got, _, _ = speculative(target, oracle, tok, prompt, 24, 4)
    assert_same_or_near_tie(model, prompt, got, want)
    assert as_target(target) is target


# -- sampled: in distribution ------------------------------------------------------------------
V = 8


def sampling_target(model_type, bits=None):
    return make_family_target(model_type, vocab_size=V, hidden_size=32 if bits is None else 64,
                              num_layers=2, scale=1.5, window=4, bits=bits)


def check_sampled(model, block_size, n_samples):
    import test_lossless_sampling as ls

    from mlx_dflash.accept import SamplingParams

    drafter = make_drafter(text_model(model), block_size=block_size, layer_ids=(0, 1),
                           mask_token_id=2, seed=7)
    params = SamplingParams(1.0, 1.0, 0)
    joint, marginal4 = ls.exact_joint(model, params)
    old, ls.N_SAMPLES = ls.N_SAMPLES, n_samples
    try:
        counts, counts4, accepted, _ = ls.sample_runs(model, drafter, 1234,
                                                      block_size=block_size, temperature=1.0)
    finally:
        ls.N_SAMPLES = old
    ls.assert_follows(counts, counts4, joint, marginal4)
    assert 0 < accepted < n_samples * 3  # some drafts accepted, some rejected


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_sampled_distribution(model_type, block_size):
    check_sampled(sampling_target(model_type), block_size, 400)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("model_type", ["qwen3_5", "gpt_oss"])
def test_sampled_distribution_4bit(model_type, block_size):
    check_sampled(sampling_target(model_type, bits=4), block_size, 400)
