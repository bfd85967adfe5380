"""DSpark: anchor-first blocks, Markov walk, confidence head; lossless; DeepSpec checkpoints."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_lossless_greedy import reference
from test_lossless_sampling import V, assert_follows, exact_joint, sample_runs
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import load_drafter, save_drafter, stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.drafters import DSparkDraftModel
from mlx_dflash.target import Target


def make_dspark(model, kind="vanilla", vocab=None, **kw):
    options = dict(block_size=5, layer_ids=(0, 2), markov_rank=16, markov_head_type=kind,
                   enable_confidence_head=True, draft_vocab_size=len(vocab) if vocab else None)
    options.update(kw)
    drafter = make_drafter(model, cls=DSparkDraftModel, **options)
    if vocab:
        drafter.set_draft_vocab(mx.array(vocab))
    # Random weights at a scale where the Markov bias matters.
    drafter.markov_head.update({"markov_w2": {"weight": drafter.markov_head.markov_w2.weight
                                              * 30}})
    return drafter


def assert_lossless_and_walk_is_training(model, drafter, candidates=0):
    """Greedy output is the target's, and the greedy walk is what teacher forcing scores when
    the drafts are the labels."""
    K = drafter.max_drafts
    tok = make_tokenizer(128)
    for prompt in ([5], [9, 10, 11, 12], list(range(3, 40))):
        got = []
        for r in stream_generate(model, drafter, tok, prompt, max_tokens=24, block_size=9,
                                 copy_drafts=False):
            got += r.tokens
            assert r.stats.block_size == K + 1  # K drafts at most
        assert got == reference(model, prompt, 24)[0]
    target = Target(model)
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    _, feats = target.hidden_states(tokens, None, drafter.target_layer_ids)
    cache = drafter.make_cache()
    drafter.commit(feats[:, :6], cache)
    proposal = drafter.propose(target, mx.array([11], dtype=mx.uint32), cache, 5, K,
                               SamplingParams())
    drafts = proposal.drafts
    assert proposal.confidence.shape == (K,)
    block = mx.array([[11] + [drafter.mask_token_id] * (drafter.block_size - 1)])
    prev = mx.concatenate([mx.array([11]), drafts[:-1]])[None]
    logits, conf = drafter.train_logits(target, feats[:, :6], block, mx.array([6]), prev,
                                        candidates)
    assert logits.shape[1] == K
    idx = mx.argmax(logits[0], axis=-1)
    mapped = drafter.vocab_ids[idx] if drafter.vocab_ids is not None else idx
    assert mapped.tolist() == drafts.tolist()
    assert mx.allclose(mx.sigmoid(conf[0]), proposal.confidence, atol=1e-5)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("candidates", [0, 3])
def test_greedy_dspark_is_lossless_and_walk_matches_training(kind, reduced, candidates):
    model = make_target("qwen3", seed=4)
    vocab = np.random.default_rng(1).permutation(128)[:50].tolist() if reduced else None
    drafter = make_dspark(model, kind, vocab)
    drafter.walk_candidates = candidates  # 3: each walk step picks among 3 tokens
    assert drafter.max_drafts == 5  # g = 5 inputs, 5 drafts
    assert_lossless_and_walk_is_training(model, drafter, candidates)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_an_anchor_only_slot_and_a_markov_table_over_target_ids(kind):
    """speculators' earlier DSpark heads: the anchor slot is the anchor's alone (5 slots, 4
    drafts) and, with a reduced vocabulary, W1 has a row per target id."""
    model = make_target("qwen3", seed=4)
    vocab = np.random.default_rng(1).permutation(128)[:50].tolist()
    drafter = make_dspark(model, kind, vocab, sample_from_anchor=False,
                          markov_w1_target_rows=True)
    assert drafter.markov_head.markov_w1.weight.shape[0] == 128 and drafter.max_drafts == 4
    assert_lossless_and_walk_is_training(model, drafter)


@pytest.mark.parametrize("candidates,reduced", [(0, False), (2, False), (3, True)])
def test_sampled_dspark_follows_the_target(candidates, reduced):
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    joint, marginal4 = exact_joint(model, SamplingParams(1.0, 1.0, 0))
    # reduced: a draft vocabulary without the target's favourite token
    favourite = int(np.argmax(joint.sum(axis=(1, 2))))
    vocab = [i for i in range(V) if i != favourite] if reduced else None
    drafter = make_dspark(model, "vanilla", vocab, layer_ids=(0, 1), block_size=3, seed=7)
    drafter.walk_candidates = candidates  # 2: proposals are zero outside 2 tokens a slot
    counts, counts4, accepted, _ = sample_runs(model, drafter, 11, temperature=1.0,
                                               block_size=4, copy_drafts=False)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def deepspec_dir(path, drafter, model):
    """A checkpoint as DeepSpec writes one: top-level fields, embed/lm_head copies included."""
    a = drafter.args
    path.mkdir()
    weights = dict(tree_flatten(drafter.parameters()))
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight
    weights["lm_head.weight"] = model.model.embed_tokens.weight
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
              "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
              "num_attention_heads": a.num_attention_heads, "head_dim": a.head_dim,
              "num_key_value_heads": a.num_key_value_heads, "num_hidden_layers": 1,
              "num_target_layers": a.num_target_layers, "vocab_size": a.vocab_size,
              "rms_norm_eps": a.rms_norm_eps, "rope_parameters": {"rope_theta": 10000.0},
              "block_size": a.block_size, "mask_token_id": a.mask_token_id,
              "target_layer_ids": a.target_layer_ids, "num_anchors": 512,
              "enable_confidence_head": True, "confidence_head_with_markov": True,
              "markov_rank": 16, "markov_head_type": "Vanilla", "tie_word_embeddings": False,
              "layer_types": ["full_attention"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_deepspec_checkpoint_loads_and_round_trips(tmp_path):
    model = make_target("qwen3")
    drafter = make_dspark(model)
    loaded = load_drafter(deepspec_dir(tmp_path / "ds", drafter, model), model=model)
    assert isinstance(loaded, DSparkDraftModel) and loaded.args.markov_head_type == "vanilla"
    assert loaded.confidence_head.proj.weight.shape == (1, 64 + 16)
    for (k, v), (k2, v2) in zip(tree_flatten(drafter.parameters()),
                                tree_flatten(loaded.parameters())):
        assert k == k2 and mx.array_equal(v, v2)
    save_drafter(loaded, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 16
    assert config["target_layer_ids"] == [0, 2] and "dflash_config" not in config
    again = load_drafter(tmp_path / "ours", model=model)
    assert isinstance(again, DSparkDraftModel)


def test_calibration_temperatures_and_offsets_apply_and_round_trip(tmp_path):
    model = make_target("qwen3")
    drafter = make_dspark(model)
    drafter.args.confidence_temperatures = [2.0, 0.5]
    drafter.args.confidence_offsets = [0.5, -1.0]
    logits = mx.array([1.0, 1.0, 3.0])  # the third position reuses the last fitted values
    expected = mx.sigmoid(mx.array([1.0 / 2.0 + 0.5, 1.0 / 0.5 - 1.0, 3.0 / 0.5 - 1.0]))
    assert mx.allclose(drafter.calibrated(logits), expected)
    save_drafter(drafter, tmp_path / "d")
    again = load_drafter(tmp_path / "d", model=model)
    assert again.args.confidence_offsets == [0.5, -1.0]
    assert mx.allclose(again.calibrated(logits), expected)


def test_markov_head_at_other_bits_round_trips_and_stays_lossless(tmp_path):
    """The shipped drafter stores its Markov tables at 4 bits, the rest at 8 (file size)."""
    import mlx.nn as nn

    from mlx_dflash.convert.save import quantize_drafter

    model = make_target("qwen3", seed=4)
    drafter = make_dspark(model, "vanilla", markov_rank=32)
    want, _ = reference(model, [9, 10, 11, 12], 24)
    with pytest.raises(ValueError, match="no drafter layers under markov"):
        quantize_drafter(drafter, 8, group_size=32, path_bits={"markov": 4})
    extra = quantize_drafter(drafter, 8, group_size=32, path_bits={"markov_head": 4})
    q = extra["quantization"]
    assert q["bits"] == 8 and q["markov_head.markov_w2"] == {"group_size": 32, "bits": 4}
    save_drafter(drafter, tmp_path / "d", extra_config=extra)
    loaded = load_drafter(tmp_path / "d", model=model, dequantize=False)
    assert loaded.markov_head.markov_w2.bits == 4 and loaded.markov_head.markov_w1.bits == 4
    assert isinstance(loaded.fc, nn.QuantizedLinear) and loaded.fc.bits == 8
    # The candidate walk reads W2 rows straight from the quantized table.
    w2 = loaded.markov_head.markov_w2
    rows = mx.array([[3, 17], [100, 0]])
    full = mx.dequantize(w2.weight, w2.scales, w2.biases, w2.group_size, w2.bits)
    assert mx.allclose(loaded.markov_head.w2_rows(rows), full[rows])
    for d in (loaded, load_drafter(tmp_path / "d", model=model, dequantize=True)):
        got = []
        for r in stream_generate(model, d, make_tokenizer(128), [9, 10, 11, 12],
                                 max_tokens=24, copy_drafts=False):
            got += r.tokens
        assert got == want
