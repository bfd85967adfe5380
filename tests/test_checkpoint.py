"""Drafter checkpoints in the z-lab layout: keys, config fields, and clear load errors."""

import json
from dataclasses import replace

import mlx.core as mx
import pytest
from tiny import make_drafter, make_target, zlab_config

from mlx_dflash import DrafterMismatchError, load_drafter, save_drafter

ZLAB_KEYS = [
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
]


def zlab_checkpoint(tmp_path, drafter, **config_changes):
    """Write a checkpoint exactly as z-lab publishes it (their config fields and key names)."""
    from mlx.utils import tree_flatten

    config = zlab_config(drafter)
    for key, value in config_changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    path = tmp_path / "drafter"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(drafter.parameters()))
    assert sorted(k for k in weights if k.startswith(("layers.0", "fc", "hidden", "norm"))) == \
        sorted(ZLAB_KEYS)
    mx.save_safetensors(str(path / "model.safetensors"),
                        {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    return path


def test_zlab_layout_loads_and_drafts_identically(tmp_path):
    model = make_target("qwen3", num_layers=4)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 3))
    drafter.set_dtype(mx.bfloat16)
    loaded = load_drafter(zlab_checkpoint(tmp_path, drafter), model=model)
    assert loaded.block_size == 8 and loaded.target_layer_ids == [0, 3]
    assert loaded.mask_token_id == 2
    from mlx.utils import tree_flatten

    for (k1, v1), (k2, v2) in zip(tree_flatten(drafter.parameters()),
                                  tree_flatten(loaded.parameters())):
        assert k1 == k2 and mx.array_equal(v1, v2)


def test_save_drafter_round_trip(tmp_path):
    model = make_target("llama", num_layers=3)
    drafter = make_drafter(model, block_size=4, layer_ids=(1, 2), num_layers=2)
    save_drafter(drafter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 2}
    loaded = load_drafter(tmp_path / "out", model=model)
    assert loaded.args.num_hidden_layers == 2


@pytest.mark.parametrize(
    "change,message",
    [
        ({"target_layer_ids": [0, 4]}, "target_layer_ids [0, 4] do not fit the target's 4 layers"),
        ({"num_target_layers": 36}, "num_target_layers=36"),
        ({"vocab_size": 151936}, "vocab_size 151936 does not match the target's 128"),
        ({"mask_token_id": 500}, "mask_token_id 500 is outside"),
    ],
)
def test_mismatch_errors_name_the_problem(tmp_path, change, message):
    model = make_target("qwen3", num_layers=4)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 3))
    path = zlab_checkpoint(tmp_path, drafter, **change)
    with pytest.raises(DrafterMismatchError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_drafter(path, model=model)


def test_hidden_size_mismatch(tmp_path):
    model = make_target("qwen3", hidden_size=64)
    other = make_target("qwen3", hidden_size=32)
    path = zlab_checkpoint(tmp_path, make_drafter(other, layer_ids=(0, 1)))
    with pytest.raises(DrafterMismatchError, match="hidden_size 32 does not match the target's 64"):
        load_drafter(path, model=model)


def test_missing_weight_and_bad_paths(tmp_path):
    model = make_target("qwen3")
    path = zlab_checkpoint(tmp_path, make_drafter(model, layer_ids=(0, 1)))
    weights = mx.load(str(path / "model.safetensors"))
    del weights["layers.0.mlp.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="lacks weights: layers.0.mlp.up_proj.weight"):
        load_drafter(path)
    with pytest.raises(FileNotFoundError, match="drafter directory not found"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_drafter(tmp_path / "empty")


def test_unsupported_family_is_named(tmp_path):
    model = make_target("qwen3")
    path = zlab_checkpoint(tmp_path, make_drafter(model, layer_ids=(0, 1)),
                           architectures=["Gemma4DSparkModel"])
    with pytest.raises(NotImplementedError, match="Gemma 4 DSpark"):
        load_drafter(path)


def test_hub_id_uses_huggingface_hub(tmp_path, monkeypatch):
    """A hub id goes through huggingface_hub.snapshot_download (here a local stand-in)."""
    model = make_target("qwen3")
    path = zlab_checkpoint(tmp_path, make_drafter(model, layer_ids=(0, 1)))
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(repo_id)
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert load_drafter("z-lab/tiny-DFlash", model=model).block_size == 8
    assert calls == ["z-lab/tiny-DFlash"]


def test_verify_block_size_default_round_trips(tmp_path):
    from tiny import make_tokenizer

    from mlx_dflash import stream_generate

    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 1), verify_block_size=3)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", model=model)
    assert loaded.block_size == 8 and loaded.args.verify_block_size == 3
    # It is the fixed block when the scheduler is off (the scheduler picks its own).
    *_, last = stream_generate(model, loaded, make_tokenizer(128), [4, 5], max_tokens=6,
                               schedule=False, copy_drafts=False)
    assert last.stats.block_size == 3 and max(last.stats.draft_lengths) == 2


def test_shipped_drafters_load_by_name():
    from mlx_dflash.drafters.shipped import shipped_drafters

    names = shipped_drafters()
    assert {"smollm2-135m-dspark-b7", "smollm2-135m-dflash-b16",
            "smollm2-135m-dflash2-b16"} <= set(names)
    for name in names:  # each loads (and dequantizes) from its name alone
        assert load_drafter(name).args.hidden_size == 576
    with pytest.raises(FileNotFoundError, match="shipped drafters: smollm2"):
        load_drafter("smollm2-135m-nope")


# config.json as each family wrote it before the families owned their args (key order included).
_BASE = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 128,
         "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None,
         "max_position_embeddings": 40960, "num_target_layers": 4, "tie_word_embeddings": False}
WRITTEN = {
    "dflash": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"target_layer_ids": [0, 3], "mask_token_id": 2,
                          "draft_vocab_size": 40},
        **_BASE, "num_hidden_layers": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "verify_block_size": 3, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 5},
    "dspark_bare": {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "block_size": 5,
        **_BASE, "target_layer_ids": [0, 2], "mask_token_id": 2, "markov_rank": 0,
        "enable_confidence_head": False, "num_anchors": 512},
    "dspark": {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "block_size": 5,
        **_BASE, "verify_block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 2,
        "draft_vocab_size": 40, "markov_rank": 16, "enable_confidence_head": True,
        "num_anchors": 512, "markov_head_type": "gated", "confidence_head_with_markov": False,
        "confidence_temperatures": [2.0, 0.5], "confidence_offsets": [0.5, -1.0]},
    "dflash2": {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
        "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 2,
                          "draft_vocab_size": 40, "block_size": 8, "conv_kernel_size": 3,
                          "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4,
                          "output_multiplier": 0.5, "final_logit_softcapping": 30.0},
        **_BASE, "num_hidden_layers": 2, "verify_block_size": 6,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
        "is_causal": True},
}


def _written_drafters():
    from mlx_dflash.drafters import DFlash2DraftModel, DSparkDraftModel

    model = make_target("qwen3", num_layers=4)
    sliding = dict(num_layers=2, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=5)
    dflash = make_drafter(model, block_size=8, layer_ids=(0, 3), verify_block_size=3,
                          rope_scaling={"rope_type": "linear", "factor": 2.0}, **sliding)
    dflash.set_draft_vocab(mx.arange(40))
    return {
        "dflash": dflash,
        "dspark_bare": make_drafter(model, cls=DSparkDraftModel, block_size=5),
        "dspark": make_drafter(model, cls=DSparkDraftModel, block_size=5, markov_rank=16,
                               markov_head_type="gated", enable_confidence_head=True,
                               confidence_head_with_markov=False, draft_vocab_size=40,
                               verify_block_size=4, confidence_temperatures=[2.0, 0.5],
                               confidence_offsets=[0.5, -1.0]),
        "dflash2": make_drafter(model, cls=DFlash2DraftModel, conv_kernel_size=3,
                                conv_group_size=8, selector_rank=8, selector_top_k=4,
                                draft_vocab_size=40, output_multiplier=0.5,
                                final_logit_softcapping=30.0, verify_block_size=6, **sliding),
    }


@pytest.mark.parametrize("name", list(WRITTEN))
def test_each_family_writes_its_config_json_unchanged(tmp_path, name):
    drafter = _written_drafters()[name]
    save_drafter(drafter, tmp_path / "d")
    text = (tmp_path / "d" / "config.json").read_text()
    assert text == json.dumps(WRITTEN[name], indent=2) + "\n"
    # Its family reads it back to the same args (DFlash 2 writes out its first layer's
    # is_causal) and writes the same file again.
    loaded = load_drafter(tmp_path / "d")
    assert type(loaded) is type(drafter)
    assert replace(loaded.args, is_causal=None) == replace(drafter.args, is_causal=None)
    assert json.dumps(loaded.args.to_config()) == json.dumps(WRITTEN[name])


def test_shipped_configs_are_what_their_family_writes():
    from mlx_dflash.drafters.registry import ARCHITECTURES
    from mlx_dflash.drafters.shipped import drafter_dir, shipped_drafters

    for name in shipped_drafters():
        config = json.loads((drafter_dir(name) / "config.json").read_text())
        cls = ARCHITECTURES[config["architectures"][0]]
        written = cls.args_class.from_config(config).to_config()
        if "quantization" in config:
            written["quantization"] = config["quantization"]
        assert json.dumps(written) == json.dumps(config), name


def test_registry_families_load_what_they_write_and_train():
    """Every registered family loads the architecture its args write, and training can build
    one from the registry alone."""
    from mlx_dflash.drafters.registry import ARCHITECTURES, FAMILIES, drafter_family
    from mlx_dflash.target import Target
    from mlx_dflash.train.loop import TrainConfig, new_drafter

    assert set(FAMILIES) == {"dflash", "dspark", "dflash2", "eagle3"}
    assert ARCHITECTURES["DSparkDraftModel"] is ARCHITECTURES["Qwen3DSparkModel"] \
        is FAMILIES["dspark"]
    model = make_target("qwen3", num_layers=4)
    with pytest.raises(ValueError, match="an EAGLE-3 drafter has one layer"):
        TrainConfig("", "", family="eagle3", num_layers=2)
    for name, cls in FAMILIES.items():
        assert drafter_family(name) is cls and cls.family == name
        assert ARCHITECTURES[cls.args_class.architecture] is cls
        config = TrainConfig(store_dir="", out_dir="", family=name, block_size=4,
                             num_layers=1, mask_token_id=2, markov_rank=8, selector_rank=8,
                             selector_top_k=4, conv_group_size=8, init_from_target=False)
        assert config.gamma == cls.train_gamma and config.aux_weight == cls.train_aux_weight
        drafter = new_drafter(Target(model), config, [0, 2])
        assert type(drafter) is cls and type(drafter.args) is cls.args_class
    assert TrainConfig("", "", family="dspark").gamma == 4.0
    assert TrainConfig("", "", family="dflash2", gamma=5.0).gamma == 5.0
    with pytest.raises(ValueError, match="unknown drafter family 'eagle'"):
        TrainConfig("", "", family="eagle")
    with pytest.raises(ValueError, match="markov_head_type 'lstm'"):
        TrainConfig("", "", family="dspark", markov_head_type="lstm")
