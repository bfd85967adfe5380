"""DFlash 2: sublayer convolutions and the path selector; lossless; published checkpoints."""

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
from mlx_dflash.drafters import DFlash2DraftModel
from mlx_dflash.drafters.dflash2 import GroupedConv, walk_path
from mlx_dflash.target import Target

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=4)


def make_dflash2(model, trained=True, vocab=None, **kw):
    """A DFlash 2 drafter; ``trained``: conv and selector weights away from the identity."""
    options = dict(DFLASH2, draft_vocab_size=len(vocab) if vocab else None)
    options.update(kw)
    drafter = make_drafter(model, cls=DFlash2DraftModel, **options)
    if vocab:
        drafter.set_draft_vocab(mx.array(vocab))
    if trained:
        mx.random.seed(9)
        sel = drafter.candidate_selector
        sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape)
        sel.predecessor_codebook = mx.random.normal(sel.predecessor_codebook.shape)
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                w = conv.kernel_projection.weight
                conv.kernel_projection.weight = 0.3 * mx.random.normal(w.shape)
                conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(
                    conv.base_kernel.shape)
        mx.eval(drafter.parameters())
    return drafter


def test_conv_stays_inside_each_block():
    conv = GroupedConv(2, taps=2, group_size=1, block_size=3)
    conv.base_kernel = mx.array([[[0.0, 0.0], [1.0, 1.0]]] * 2)  # the shifted tap only
    x = mx.arange(1, 13, dtype=mx.float32).reshape(2, 3, 2)  # two blocks of three
    y, post = conv.prepare(x)
    assert y.tolist() == [[[0, 0], [1, 2], [3, 4]], [[0, 0], [7, 8], [9, 10]]]
    assert post.shape == (2, 3, 2, 2)
    ident = GroupedConv(8, taps=2, group_size=4, block_size=4)
    z = mx.random.normal((3, 4, 8))
    assert mx.array_equal(ident.finish(ident.prepare(z)[0], ident.prepare(z)[1]), z)


def test_untrained_dflash2_proposes_what_dflash_proposes():
    model = make_target("qwen3", seed=4)
    dflash = make_drafter(model, block_size=6, num_layers=2)
    dflash2 = make_dflash2(model, trained=False, block_size=6, num_layers=2)
    dflash2.load_weights(list(tree_flatten(dflash.parameters())), strict=False)
    target = Target(model)
    tokens = mx.array([list(range(5, 25))])
    _, feats = target.hidden_states(tokens, None, dflash.target_layer_ids)
    for n in (3, 12, 19):
        c1, c2 = dflash.make_cache(), dflash2.make_cache()
        dflash.commit(feats[:, :n], c1)
        dflash2.commit(feats[:, :n], c2)
        anchor = tokens[0, n : n + 1].astype(mx.uint32)
        d1 = dflash.propose(target, anchor, c1, 6, 5, SamplingParams()).drafts
        d2 = dflash2.propose(target, anchor, c2, 6, 5, SamplingParams()).drafts
        assert d1.tolist() == d2.tolist()
    tok = make_tokenizer(128)
    runs = [[r.accepted for r in stream_generate(model, d, tok, [9, 10, 11], max_tokens=30,
                                                 block_size=6, copy_drafts=False)]
            for d in (dflash, dflash2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_dflash2_is_lossless_and_walk_matches_the_scores(reduced):
    model = make_target("qwen3", seed=4)
    vocab = np.random.default_rng(1).permutation(128)[:50].tolist() if reduced else None
    drafter = make_dflash2(model, vocab=vocab)
    tok = make_tokenizer(128)
    for block in (2, 4, 8):
        for prompt in ([5], [9, 10, 11, 12], list(range(3, 40))):
            want, _ = reference(model, prompt, 24)
            got = []
            for r in stream_generate(model, drafter, tok, prompt, max_tokens=24,
                                     block_size=block, copy_drafts=False):
                got += r.tokens
            assert got == want
    # The walk picks, at each position, the best candidate given the previous pick: the same
    # as the teacher-forced scores when the previous tokens are the picks.
    target = Target(model)
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    _, feats = target.hidden_states(tokens, None, drafter.target_layer_ids)
    cache = drafter.make_cache()
    drafter.commit(feats[:, :6], cache)
    drafts = drafter.propose(target, mx.array([11], dtype=mx.uint32), cache, 8, 7,
                             SamplingParams()).drafts
    block = mx.array([[11] + [drafter.mask_token_id] * 7])
    prev = mx.concatenate([mx.array([11]), drafts[:-1]])[None]
    _, (scores, cand) = drafter.train_logits(target, feats[:, :6], block, mx.array([6]), prev)
    idx = mx.take_along_axis(cand[0], mx.argmax(scores[0], axis=-1)[:, None], axis=-1)[:, 0]
    mapped = drafter.vocab_ids[idx] if reduced else idx
    assert mapped.tolist() == drafts.tolist()


def test_walk_samples_from_the_softmax_of_the_scores():
    first = mx.array([0.0, 1.0, 2.0])
    rest = mx.zeros((1, 3, 3))
    picks, q = walk_path(first, rest, temperature=0.5)
    assert q.shape == (2, 3)
    assert np.allclose(np.array(q[0]), np.exp([0, 2, 4]) / np.exp([0, 2, 4]).sum(), atol=1e-6)
    assert walk_path(first, rest)[0].tolist()[0] == 2


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_dflash2_follows_the_target(temperature, top_p):
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_dflash2(model, layer_ids=(0, 1), block_size=4, seed=7, selector_top_k=3,
                           conv_group_size=8)
    joint, marginal4 = exact_joint(model, SamplingParams(temperature, top_p, 0))
    counts, counts4, accepted, _ = sample_runs(model, drafter, 11, temperature=temperature,
                                               top_p=top_p, block_size=4, copy_drafts=False)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def published_dir(path, drafter):
    """A checkpoint as SpecForge / SGLang publish DFlash 2 (their fields and weight names)."""
    a = drafter.args
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
        "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size,
        "num_target_layers": a.num_target_layers, "rms_norm_eps": a.rms_norm_eps,
        "rope_parameters": {"rope_theta": a.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "dflash_config": {"block_size": a.block_size, "conv_kernel_size": 2,
                          "conv_group_size": a.conv_group_size, "selector_rank": a.selector_rank,
                          "selector_top_k": a.selector_top_k, "mask_token_id": a.mask_token_id,
                          "target_layer_ids": a.target_layer_ids,
                          "final_logit_softcapping": 20.0, "output_multiplier": 0.5},
    }
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(drafter.parameters()))
    weights["embed_tokens.weight"] = mx.zeros((a.vocab_size, a.hidden_size))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def test_published_checkpoint_loads_and_round_trips(tmp_path):
    model = make_target("qwen3", seed=4)
    drafter = make_dflash2(model)
    keys = {k for k, _ in tree_flatten(drafter.parameters())}
    assert {"layers.0.attention_conv.base_kernel", "layers.0.attention_conv.kernel_projection."
            "weight", "layers.0.mlp_conv.base_kernel", "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= keys
    loaded = load_drafter(published_dir(tmp_path / "pub", drafter), model=model)
    assert isinstance(loaded, DFlash2DraftModel)
    a = loaded.args
    assert (a.conv_kernel_size, a.selector_top_k, a.output_multiplier,
            a.final_logit_softcapping) == (2, 4, 0.5, 20.0)
    tok = make_tokenizer(128)
    want, _ = reference(model, [9, 10, 11], 20)
    got = [t for r in stream_generate(model, loaded, tok, [9, 10, 11], max_tokens=20,
                                      copy_drafts=False) for t in r.tokens]
    assert got == want
    again = load_drafter(save_drafter(loaded, tmp_path / "ours"), model=model)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    for (k, v), (k2, v2) in zip(tree_flatten(loaded.parameters()),
                                tree_flatten(again.parameters())):
        assert k == k2 and mx.array_equal(v, v2)
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    del config["dflash_config"]["selector_rank"]
    (tmp_path / "pub" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="selector_rank"):
        load_drafter(tmp_path / "pub")


@pytest.mark.parametrize("how", ["export", "convert"])
def test_quantized_codebooks_load_and_stay_lossless(tmp_path, how):
    from mlx_dflash.convert.drafter import convert_drafter
    from mlx_dflash.convert.save import quantize_drafter

    model = make_target("qwen3", seed=4)
    drafter = make_dflash2(model, selector_rank=64)
    before = {n: drafter.candidate_selector[n] for n in ("predecessor_codebook",
                                                          "successor_codebook")}
    if how == "export":  # scripts/export_drafter.py
        config = quantize_drafter(drafter, bits=8)
        save_drafter(drafter, tmp_path / "q8", extra_config=config)
    else:  # mlx-dflash convert drafter SRC OUT --bits 8, from the published layout
        convert_drafter(published_dir(tmp_path / "pub", drafter), tmp_path / "q8", bits=8,
                        group_size=32)
    stored = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    assert stored["candidate_selector.successor_codebook"].dtype == mx.uint32
    loaded = load_drafter(tmp_path / "q8", model=model, dequantize=True)
    for name, want in before.items():
        got = loaded.candidate_selector[name]
        assert got.shape == want.shape and got.dtype == mx.float32
        assert mx.abs(got - want).max().item() <= 0.01 * mx.abs(want).max().item()
    tok = make_tokenizer(128)
    want, _ = reference(model, [9, 10, 11], 20)
    got = [t for r in stream_generate(model, loaded, tok, [9, 10, 11], max_tokens=20,
                                      copy_drafts=False) for t in r.tokens]
    assert got == want
