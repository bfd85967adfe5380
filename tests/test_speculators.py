"""vLLM's "speculators" layout, read and written: EAGLE-3, DFlash and DSpark checkpoints in that
layout (its config fields and weight names, from the speculators source) load as the same
drafter as ours and decode losslessly; `convert drafter --to speculators | zlab` writes
checkpoints that load back; what the layout cannot say is refused by name."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from test_eagle3 import PROMPT, make_eagle3
from test_lossless_greedy import reference
from test_lossless_sampling import V, assert_drafter_samples_the_target
from tiny import make_drafter, make_target, make_tokenizer, save_target

from mlx_dflash import load_drafter, save_drafter, stream_generate
from mlx_dflash.drafters import DSparkDraftModel
from mlx_dflash.drafters.speculators import write
from mlx_dflash.target import Target


def layer_config(drafter, model_type):
    a = drafter.args
    return {"model_type": model_type, "hidden_size": a.hidden_size,
            "num_hidden_layers": a.num_hidden_layers,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
            "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size,
            "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
            "max_position_embeddings": 4096, "hidden_act": "silu", "attention_bias": False}


def speculators_config(drafter, kind, speculative_tokens, **fields):
    """config.json as speculators writes one (SpeculatorModelConfig: the discriminator, the
    nested layer config, the proposal methods and the verifier)."""
    return {
        "architectures": [{"eagle3": "Eagle3Speculator", "dflash": "DFlashSpeculator",
                           "dspark": "DSparkSpeculator"}.get(kind, "PEagleSpeculator")],
        "model_type": "speculator_model",
        "speculators_model_type": kind,
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer_config(drafter, "llama" if kind == "eagle3"
                                                 else "qwen3"),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/qwen3", "architectures": ["Qwen3ForCausalLM"]},
        },
        **fields,
    }


def save(path, config, weights):
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


def same_weights(a, b):
    wa, wb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert wa.keys() == wb.keys()
    return all(mx.array_equal(wa[k], wb[k]) for k in wa)


def greedy(model, drafter, prompt=PROMPT, n=24, **kw):
    out = []
    for r in stream_generate(model, drafter, make_tokenizer(model.args.vocab_size), prompt,
                             max_tokens=n, copy_drafts=False, **kw):
        out += r.tokens
    return out


@pytest.fixture(scope="module")
def model():
    return make_target("qwen3", seed=2)


def test_eagle3_in_the_speculators_layout(model, tmp_path):
    """``layers.0.*`` instead of ``midlayer.*``, the embedding kept, the tap ids counted from
    a layer's input (ours + 1), the drafts per cycle in the proposal method."""
    made = make_eagle3(model, vocab_ids=list(range(0, 128, 2)), block_size=4)
    weights = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v
               for k, v in tree_flatten(made.parameters())}
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight
    config = speculators_config(made, "eagle3", 3, draft_vocab_size=64,
                                norm_before_residual=False, target_hidden_size=None,
                                eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    loaded = load_drafter(save(tmp_path / "e3", config, weights), model=model)
    assert same_weights(made, loaded)
    assert loaded.target_layer_ids == [0, 1, 2] and loaded.block_size == 4
    assert greedy(model, loaded) == reference(model, PROMPT, 24)[0]
    # and written back by the exporter: the same checkpoint
    config2, weights2 = write(loaded)
    assert config2["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert set(weights2) == set(weights) - {"embed_tokens.weight"}


def test_eagle3_1_feeds_the_normed_state_back(model, tmp_path):
    """speculators' ``norm_output`` ("Eagle 3.1"): each step hands on its normed output, and
    the head reads it as it is; decoding stays the target's, chains and trees alike."""
    from mlx_dflash.target import Target

    made = make_eagle3(model, block_size=4)
    weights = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v
               for k, v in tree_flatten(made.parameters())}
    config = speculators_config(made, "eagle3", 3, norm_output=True,
                                eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    loaded = load_drafter(save(tmp_path / "e31", config, weights), model=model)
    assert loaded.args.feed_normed and write(loaded)[0]["norm_output"] is True
    assert greedy(model, loaded) == greedy(model, loaded, tree=4) == \
        reference(model, PROMPT, 24)[0]
    from mlx_lm.models.cache import KVCache

    target = Target(model)
    tokens = mx.array([PROMPT], dtype=mx.uint32)
    hidden = mx.random.normal((1, len(PROMPT), model.args.hidden_size))
    fed = loaded.step(target, tokens, hidden, KVCache())
    assert mx.allclose(fed, loaded.norm(loaded.midlayer(target.embed(tokens), hidden,
                                                        KVCache())), atol=1e-5)
    assert mx.allclose(loaded.logits(target, fed), loaded.lm_head(fed), atol=1e-5)


def test_dflash_in_the_speculators_layout(model, tmp_path):
    """A reduced vocabulary as d2t / t2d, the target's embedding and head rows carried along
    (dropped on load: ours reads the target's own)."""
    made = make_drafter(model, block_size=4, layer_ids=(0, 2), draft_vocab_size=64)
    ids = mx.array(list(range(1, 128, 2)))
    made.set_draft_vocab(ids)
    weights = {k: v for k, v in tree_flatten(made.parameters()) if k != "draft_vocab"}
    target = Target(model)
    weights.update({"embed_tokens.weight": model.model.embed_tokens.weight,
                    "lm_head.weight": target.head_rows(ids),
                    "d2t": ids.astype(mx.int64) - mx.arange(64, dtype=mx.int64),
                    "t2d": mx.zeros((128,), dtype=mx.bool_).at[ids].add(True)})
    config = speculators_config(made, "dflash", 3, draft_vocab_size=64, block_size=4,
                                aux_hidden_state_layer_ids=[1, 3], mask_token_id=2,
                                target_hidden_size=None, sample_from_anchor=False)
    path = save(tmp_path / "df", config, weights)
    loaded = load_drafter(path, model=model)
    assert same_weights(made, loaded) and loaded.target_layer_ids == [0, 2]
    assert greedy(model, loaded, block_size=4) == greedy(model, made, block_size=4) == \
        reference(model, PROMPT, 24)[0]
    config2, weights2 = write(loaded, model)
    assert config2["aux_hidden_state_layer_ids"] == [1, 3] and set(weights2) == set(weights)
    assert mx.array_equal(weights2["d2t"], weights["d2t"])
    assert mx.array_equal(weights2["t2d"], weights["t2d"])


def test_dspark_in_the_speculators_layout_samples_in_distribution(tmp_path):
    small = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    made = make_drafter(small, block_size=4, layer_ids=(0, 1), seed=7, cls=DSparkDraftModel,
                        markov_rank=8, enable_confidence_head=True)
    config, weights = write(made, small)
    assert config["sample_from_anchor"] is True and config["markov_rank"] == 8
    # g inputs, g drafts (the anchor slot predicts the first)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    loaded = load_drafter(save(tmp_path / "ds", config, weights), model=small)
    assert same_weights(made, loaded)
    assert_drafter_samples_the_target(small, loaded, 5, 0.8, block_size=4)


def test_dspark_heads_with_an_anchor_only_slot_and_a_reduced_vocabulary(model, tmp_path):
    """speculators' earlier DSpark heads name no sample_from_anchor: a block of 5 slots
    proposing 4 tokens keeps its first slot for the anchor; with a reduced vocabulary their
    Markov W1 has a row per target id. Ours (a row per draft id and one for the rest),
    written in that layout and read back, drafts the same tokens, also after an anchor
    outside the vocabulary, and decodes losslessly, greedy and sampled."""
    from test_dspark import make_dspark

    from mlx_dflash.accept import SamplingParams

    vocab = list(range(0, 128, 2))
    made = make_dspark(model, "gated", vocab, sample_from_anchor=False)
    config, weights = write(made, model)
    assert config["block_size"] == 5 and config["sample_from_anchor"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert weights["markov_head.markov_w1.weight"].shape[0] == 128  # a row per target id
    del config["sample_from_anchor"]  # as the earlier heads: the block settles it
    loaded = load_drafter(save(tmp_path / "ds", config, weights), model=model)
    assert loaded.max_drafts == 4 and loaded.args.markov_w1_target_rows
    target = Target(model)
    tokens = mx.array([PROMPT])
    _, feats = target.hidden_states(tokens, None, made.target_layer_ids)
    for anchor in (6, 7):  # in the draft vocabulary, and outside it
        proposals = []
        for d in (made, loaded):
            cache = d.make_cache()
            d.commit(feats, cache, tokens)
            proposals.append(d.propose(target, mx.array([anchor], dtype=mx.uint32), cache, 5,
                                       4, SamplingParams()))
        ours, theirs = proposals
        assert ours.drafts.tolist() == theirs.drafts.tolist(), anchor
        # the confidence head reads W1's row of each previous token, the anchor's included
        assert mx.allclose(ours.confidence, theirs.confidence, atol=1e-5).item(), anchor
    assert greedy(model, loaded) == reference(model, PROMPT, 24)[0]
    for tokens_, block, anchor_first in [(5, 5, True), (None, 5, False)]:
        c = speculators_config(made, "dspark", tokens_, aux_hidden_state_layer_ids=[1, 3],
                               mask_token_id=2, block_size=block, markov_rank=16)
        assert load_drafter(save(tmp_path / f"c{tokens_}", c, dict(tree_flatten(
            make_dspark(model, sample_from_anchor=anchor_first).parameters()))),
            model=model).max_drafts == (5 if anchor_first else 4)


def test_speculators_checkpoints_convert_and_quantize(model, tmp_path):
    """``convert drafter`` on a speculators checkpoint (EAGLE-3; DSpark with a reduced
    vocabulary and an anchor-only slot) writes ours, quantized if asked, and it decodes as
    the target does."""
    from test_dspark import make_dspark

    from mlx_dflash.convert.drafter import convert_drafter

    made = {"eagle3": make_eagle3(model, vocab_ids=list(range(0, 128, 2))),
            "dspark": make_dspark(model, vocab=list(range(0, 128, 2)), sample_from_anchor=False)}
    for name, drafter in made.items():
        config, weights = write(drafter, model)
        src = save(tmp_path / name, config, weights)
        for bits in (None, 8):
            out = convert_drafter(src, tmp_path / f"{name}-{bits}", bits=bits, group_size=32)
            converted = json.loads((out / "config.json").read_text())
            assert "speculators_model_type" not in converted
            loaded = load_drafter(out, model=model)
            assert loaded.max_drafts == drafter.max_drafts
            assert greedy(model, loaded) == reference(model, PROMPT, 24)[0], (name, bits)


def test_reduced_vocabulary_dspark_samples_in_distribution_through_the_layout(tmp_path):
    small = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    made = make_drafter(small, block_size=4, layer_ids=(0, 1), seed=7, cls=DSparkDraftModel,
                        markov_rank=8, enable_confidence_head=True, draft_vocab_size=6,
                        sample_from_anchor=False)
    made.set_draft_vocab(mx.arange(6))
    config, weights = write(made, small)
    loaded = load_drafter(save(tmp_path / "ds", config, weights), model=small)
    assert loaded.args.markov_w1_target_rows and loaded.max_drafts == 3
    assert_drafter_samples_the_target(small, loaded, 5, 0.8, block_size=4)


def test_what_the_layouts_cannot_say_is_refused(model, tmp_path):
    made = make_eagle3(model)
    base = dict(tree_flatten(made.parameters()))
    cases = [
        (speculators_config(made, "peagle", 3), NotImplementedError, "type 'peagle'"),
        (speculators_config(made, "dflash", 3, aux_hidden_state_layer_ids=[1, 3],
                            mask_token_id=2, sample_from_anchor=True), NotImplementedError,
         "sample_from_anchor true"),
        (speculators_config(made, "dflash", 3), ValueError, "needs aux_hidden_state_layer_ids"),
        (speculators_config(made, "dspark", 3, aux_hidden_state_layer_ids=[1, 3],
                            mask_token_id=2, block_size=5), ValueError,
         "a dspark block of 5 slots cannot propose 3 speculative_tokens"),
    ]
    for i, (config, error, said) in enumerate(cases):
        with pytest.raises(error, match=said):
            load_drafter(save(tmp_path / str(i), config, base), model=model)


def test_convert_exports_load_back(model, tmp_path):
    """``mlx-dflash convert drafter SRC OUT --to zlab | speculators``: a reduced-vocabulary
    DFlash drafter written without its draft_vocab tensor (z-lab's layout, full vocabulary)
    and as speculators (with the target's rows); both load and decode losslessly."""
    tok = make_tokenizer(128)
    target_dir = save_target(model, tok, tmp_path / "target")
    made = make_drafter(model, block_size=4, layer_ids=(0, 2), draft_vocab_size=64)
    made.set_draft_vocab(mx.array(list(range(0, 128, 2))))
    save_drafter(made, tmp_path / "ours")
    cli = [sys.executable, "-m", "mlx_dflash.cli", "convert", "drafter", str(tmp_path / "ours")]
    zlab = subprocess.run([*cli, str(tmp_path / "zlab"), "--to", "zlab"], capture_output=True,
                          text=True, timeout=120)
    assert zlab.returncode == 0, zlab.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "zlab" / "model.safetensors"), "np") as f:
        assert "draft_vocab" not in f.keys()
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert "draft_vocab_size" not in config["dflash_config"]
    assert greedy(model, load_drafter(tmp_path / "zlab", model=model), block_size=4) == \
        reference(model, PROMPT, 24)[0]
    refused = subprocess.run([*cli, str(tmp_path / "spec"), "--to", "speculators"],
                             capture_output=True, text=True, timeout=120)
    assert "needs its target" in refused.stderr and not (tmp_path / "spec").exists()
    spec = subprocess.run([*cli, str(tmp_path / "spec"), "--to", "speculators", "--target",
                           str(target_dir)], capture_output=True, text=True, timeout=120)
    assert spec.returncode == 0, spec.stderr
    loaded = load_drafter(tmp_path / "spec", model=model)
    assert same_weights(made, loaded)


def test_speculators_eagle3_and_dflash_sample_in_distribution(tmp_path):
    """Both with a reduced vocabulary (ids 0-5 of 8, as d2t / t2d), written in the speculators
    layout and loaded back: sampled output follows the target's exact joint."""
    small = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    eagle = make_eagle3(small, vocab_ids=list(range(6)), block_size=4, layer_ids=(0, 1, 1),
                        seed=7)
    dflash = make_drafter(small, block_size=4, layer_ids=(0, 1), seed=7, draft_vocab_size=6)
    dflash.set_draft_vocab(mx.arange(6))
    for name, made in (("eagle3", eagle), ("dflash", dflash)):
        config, weights = write(made, small)
        loaded = load_drafter(save(tmp_path / name, config, weights), model=small)
        assert same_weights(made, loaded) and loaded.vocab_ids.tolist() == list(range(6))
        assert_drafter_samples_the_target(small, loaded, 13, 1.0, block_size=4)
