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
from test_lossless_sampling import V, assert_drafter_samples_the_target
from tiny import family_config, make_family_target, make_target, make_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.drafters.mtp import MTPDraftModel, build, load_mtp_drafter

PROMPT = [7, 8, 9, 3, 4, 5, 7, 8]
# mlx-lm's qwen3_next sanitize adds 1 to these (Hugging Face stores them zero-centred)
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def make_mtp(model, seed=4):
    """An MTP module with random weights, its norms away from 1 (so the +1 convention counts)."""
    mx.random.seed(seed)
    mtp = build(model)
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
    if (name.endswith(ZERO_CENTRED + ("language_model.norm.weight",))
            or name in ("model.norm.weight", "mtp.norm.weight")) and value.ndim == 1:
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


def convert_and_load(hf, out, mtp):
    """``mlx-dflash convert target HF OUT``, then the target and its MTP drafter from OUT (whose
    weights must be ``mtp``'s)."""
    from mlx_lm import load

    make_tokenizer(128)._tokenizer.save_pretrained(str(hf))
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "convert", "target", str(hf),
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Kept the MTP head" in run.stderr
    target, _ = load(str(out))
    draft = load_mtp_drafter(out, target)
    want = dict(tree_flatten(mtp.parameters()))
    for k, v in tree_flatten(draft.parameters()):
        assert mx.allclose(v, want[k], atol=1e-6), k
    return target, draft


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
    assert_drafter_samples_the_target(small, mtp, 11, 0.9, block_size=3)


def fused_experts(weights):
    """Qwen3.5 MoE's Hugging Face layout of the experts: gate and up fused, [E, 2I, H]."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp.gate_proj." in k:
            up = weights[k.replace("gate_proj", "up_proj")]
            out[k.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")] = \
                mx.concatenate([v, up], axis=-2)
        elif ".switch_mlp.down_proj." in k:
            out[k.replace("switch_mlp.down_proj.weight", "experts.down_proj")] = v
        elif ".switch_mlp.up_proj." not in k:
            out[k] = v
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_mtp_head_converted_decodes_as_the_target(tmp_path, model_type):
    """Qwen3.5, dense and MoE: the language model under model.language_model.*, the MTP head
    under mtp.*, the config's fields in text_config, an MoE's experts fused."""
    model = make_family_target(model_type, seed=1)
    mtp = make_mtp(model.language_model)
    def hf_name(name, value):  # the experts stay stacked here: fused_experts fuses them
        return {name: value} if ".switch_mlp." in name else to_hf(name, value, 0)

    weights = {}
    for k, v in tree_flatten(model.parameters()):
        name = k.replace("language_model.model.", "model.language_model.", 1)
        weights.update(hf_name(name.replace("language_model.lm_head", "lm_head"), v))
    for k, v in tree_flatten(mtp.parameters()):
        if k != "final_norm.weight":
            weights.update(hf_name("mtp." + k, v))
    hf = tmp_path / "hf"
    hf.mkdir()
    mx.save_safetensors(str(hf / "model.safetensors"), fused_experts(weights))
    text = {**family_config(model_type, 128, 64, 4, True), "model_type": f"{model_type}_text"}
    (hf / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": text,
                                                "tie_word_embeddings": True}))
    target, draft = convert_and_load(hf, tmp_path / "mlx", mtp)
    ref = reference(target, PROMPT, 16)[0]
    got = []
    for r in stream_generate(target, draft, make_tokenizer(128), PROMPT, max_tokens=16,
                             block_size=3, copy_drafts=False):
        got += r.tokens
    assert got == ref and r.stats.drafted_tokens > 0


def test_targets_without_an_mtp_head_are_refused(converted, tmp_path):
    model, _, out = converted
    with pytest.raises(FileNotFoundError, match="has no mtp.safetensors"):
        load_mtp_drafter(tmp_path, model)
    with pytest.raises(NotImplementedError, match="model type 'qwen3'"):
        build(make_target("qwen3"))
    mx.save_safetensors(str(tmp_path / "mtp.safetensors"), {"fc.weight": mx.zeros((64, 128))})
    with pytest.raises(ValueError, match="does not fit a qwen3_next MTP module: lacks"):
        load_mtp_drafter(tmp_path, model)


# -- DeepSeek-V3: the MTP layer is model.layers.N (mlx-lm drops layer 61: the real depth) ------
DEEPSEEK = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=128,
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=61,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
    num_experts_per_tok=2, first_k_dense_replace=61, moe_layer_freq=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, num_nextn_predict_layers=1)


def deepseek_to_hf(weights, num_experts):
    """mlx-lm deepseek_v3 tensors as the Hugging Face checkpoint stores them: experts apart,
    MLA's embed_q / unembed_out joined back into kv_b_proj."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            out.update({k.replace("switch_mlp", f"experts.{e}"): v[e] for e in range(num_experts)})
        elif k.endswith(".embed_q.weight"):
            wv = weights[k.replace("embed_q", "unembed_out")]  # [heads, v_dim, lora]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)  # [heads, nope + v, lora]
            out[k.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, kv_b.shape[-1])
        elif not k.endswith(".unembed_out.weight"):
            out[k] = v
    return out


def test_deepseek_v3_mtp_layer_converted_decodes_as_the_target(tmp_path):
    from mlx.utils import tree_map
    from mlx_lm.models import deepseek_v3

    mx.random.seed(0)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(DEEPSEEK))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mtp = make_mtp(model)
    E, N = DEEPSEEK["n_routed_experts"], DEEPSEEK["num_hidden_layers"]
    weights = deepseek_to_hf(dict(tree_flatten(model.parameters())), E)
    layer = {("model.layers.0." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
             for k, v in tree_flatten(mtp.parameters()) if k != "final_norm.weight"}
    layer = deepseek_to_hf(layer, E)
    weights.update({f"model.layers.{N}." + (k[len("model.layers.0."):]
                                            if k.startswith("model.layers.0.") else k): v
                    for k, v in layer.items()})
    weights[f"model.layers.{N}.embed_tokens.weight"] = model.model.embed_tokens.weight
    weights[f"model.layers.{N}.shared_head.head.weight"] = model.lm_head.weight
    hf = tmp_path / "hf"
    hf.mkdir()
    mx.save_safetensors(str(hf / "model.safetensors"), weights)
    (hf / "config.json").write_text(json.dumps(DEEPSEEK))
    target, draft = convert_and_load(hf, tmp_path / "mlx", mtp)
    # a prompt the random target does not end at once
    prompt = next(p for p in ([7, 8, 9, 3], [11, 12, 13, 14], [40, 41, 42], [3, 4, 5], [20, 21])
                  if len(reference(target, p, 16)[0]) > 8)
    ref = reference(target, prompt, 16)[0]
    got = []
    for r in stream_generate(target, draft, make_tokenizer(128), prompt, max_tokens=16,
                             block_size=3, copy_drafts=False):
        got += r.tokens
    assert got == ref and len(ref) > 0 and r.stats.drafted_tokens > 0


def test_an_mtp_layer_of_an_unsupported_type_is_named(tmp_path):
    """GLM-4.5 keeps its MTP layer as DeepSeek-V3 does (model.layers.N, num_nextn_predict_layers):
    found and named as not supported yet (``convert target`` then converts the target without
    it, saying so)."""
    from mlx_dflash.convert.mtp import extract_mtp

    config = {"model_type": "glm4_moe", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {"model.layers.1.mlp.weight": mx.zeros((2, 2)),
                         "model.layers.2.eh_proj.weight": mx.zeros((2, 4))})
    with pytest.raises(NotImplementedError, match="model type 'glm4_moe' is not supported yet"):
        extract_mtp(tmp_path, tmp_path / "out")
    config["num_nextn_predict_layers"] = 0  # no MTP layer declared: nothing to keep
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert extract_mtp(tmp_path, tmp_path / "out") == 0


def test_auto_picks_the_targets_own_mtp_head(converted):
    from mlx_lm import load

    from mlx_dflash.drafters.mtp import MTPDraftModel
    from mlx_dflash.drafters.published import MTP, choose

    _, _, out = converted
    target, _ = load(str(out))
    drafter, choice = choose(str(out), out, target)
    assert isinstance(drafter, MTPDraftModel) and choice.drafter == MTP
    assert "multi-token-prediction head" in choice.reason
