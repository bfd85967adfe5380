"""The target's own MTP head as a drafter: a tiny Qwen3-Next checkpoint in Hugging Face's layout
with ``mtp.*`` weights, converted by ``mlx-dflash convert target`` (which keeps them beside the
model), decodes losslessly with ``--drafter mtp`` (greedy equal to the target's, sampled in
distribution); a target without them, or of another family, is refused by name."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from test_lossless_greedy import reference
from test_lossless_sampling import V, assert_follows, exact_joint, sample_runs
from tiny import family_config, make_family_target, make_target, make_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.drafters.mtp import MTPDraftModel, load_mtp_drafter

PROMPT = [7, 8, 9, 3, 4, 5, 7, 8]
# mlx-lm's qwen3_next sanitize adds 1 to these (Hugging Face stores them zero-centred)
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def make_mtp(model, seed=4):
    """An MTP module with random weights, its norms away from 1 (so the +1 convention counts)."""
    mx.random.seed(seed)
    mtp = MTPDraftModel(model)
    mtp.update({k: v for k, v in _unflatten(
        [(k, v + 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(mtp.parameters())
         if k.endswith("norm.weight") and k != "final_norm.weight"]).items()})
    mtp.final_norm.weight = model.model.norm.weight
    mx.eval(mtp.parameters())
    return mtp


def _unflatten(items):
    from mlx.utils import tree_unflatten

    return tree_unflatten(items)


def to_hf(name, value, num_experts):
    """One mlx-lm qwen3_next tensor as the Hugging Face checkpoint stores it (the inverse of
    mlx-lm's sanitize): experts apart, zero-centred norms, conv1d [C, 1, K]."""
    if ".switch_mlp." in name:
        return {name.replace("switch_mlp", f"experts.{e}"): value[e] for e in range(num_experts)}
    if (name.endswith(ZERO_CENTRED) or name in ("model.norm.weight", "mtp.norm.weight")) \
            and value.ndim == 1:
        return {name: value - 1.0}
    if name.endswith("conv1d.weight"):
        return {name: value.moveaxis(2, 1)}
    return {name: value}


def write_hf_checkpoint(model, mtp, path):
    """A Qwen3-Next checkpoint as Hugging Face publishes one: its config, the model's weights
    and the MTP module's under ``mtp.*``, split over two shards with an index."""
    path.mkdir()
    E = model.args.num_experts
    main, extra = {}, {}
    for k, v in tree_flatten(model.parameters()):
        main.update(to_hf(k, v, E))
    for k, v in tree_flatten(mtp.parameters()):
        if k != "final_norm.weight":
            extra.update(to_hf("mtp." + k, v, E))
    mx.save_safetensors(str(path / "model-00001-of-00002.safetensors"), main)
    mx.save_safetensors(str(path / "model-00002-of-00002.safetensors"), extra)
    weight_map = {**dict.fromkeys(main, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(extra, "model-00002-of-00002.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = family_config("qwen3_next", 128, 64, 4, True)
    config.update(architectures=["Qwen3NextForCausalLM"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    make_tokenizer(128)._tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the original target, its MTP module, the converted directory)."""
    root = tmp_path_factory.mktemp("mtp")
    model = make_family_target("qwen3_next", seed=1)
    mtp = make_mtp(model)
    hf = write_hf_checkpoint(model, mtp, root / "hf")
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "convert", "target", str(hf),
                          str(root / "mlx")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Kept the MTP head" in run.stderr
    return model, mtp, root / "mlx"


def test_convert_keeps_the_mtp_head_as_mlx_reads_it(converted):
    from mlx_lm import load

    model, mtp, out = converted
    target, _ = load(str(out))
    loaded = load_mtp_drafter(out, target)
    want = dict(tree_flatten(mtp.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        assert mx.allclose(v, want[k], atol=1e-6), k


def test_greedy_with_the_mtp_head_is_the_targets_own(converted):
    from mlx_lm import load

    from mlx_dflash.cli.common import load_pair

    _, _, out = converted
    target, draft, tok = load_pair(str(out), "mtp")  # what --drafter mtp loads
    assert isinstance(draft, MTPDraftModel)
    want = reference(target, PROMPT, 24)[0]
    for block_size in (2, 4):
        got = []
        for r in stream_generate(target, draft, make_tokenizer(128), PROMPT, max_tokens=24,
                                 block_size=block_size, copy_drafts=False):
            got += r.tokens
        assert got == want and r.stats.drafted_tokens > 0
    assert load(str(out))[0] is not None


def test_sampled_with_the_mtp_head_follows_the_target():
    small = make_family_target("qwen3_next", vocab_size=V, hidden_size=32, seed=3, scale=1.5)
    mtp = make_mtp(small, seed=5)
    params = SamplingParams(0.9, 1.0, 0)
    joint, marginal4 = exact_joint(small, params)
    counts, counts4, accepted, _ = sample_runs(small, mtp, 11, block_size=3, temperature=0.9,
                                               copy_drafts=False)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def test_targets_without_an_mtp_head_are_refused(converted, tmp_path):
    model, _, out = converted
    with pytest.raises(FileNotFoundError, match="has no mtp.safetensors"):
        load_mtp_drafter(tmp_path, model)
    with pytest.raises(NotImplementedError, match="model type 'qwen3'"):
        MTPDraftModel(make_target("qwen3"))
    mx.save_safetensors(str(tmp_path / "mtp.safetensors"), {"fc.weight": mx.zeros((64, 128))})
    with pytest.raises(ValueError, match="does not fit a qwen3_next MTP module: lacks"):
        load_mtp_drafter(tmp_path, model)
