"""Drafter checkpoints in the z-lab layout: keys, config fields, and clear load errors."""

import json

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
