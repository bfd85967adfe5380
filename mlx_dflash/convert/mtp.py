"""Keep a Hugging Face checkpoint's MTP weights beside its mlx-lm conversion.

mlx-lm's conversion drops them (Qwen3-Next's ``mtp.*``, DeepSeek-V3's ``model.layers.N.*``);
this reads them from the checkpoint's safetensors (only the shards that hold them, by the
index), sanitizes them as mlx-lm sanitizes the model's own layers (Qwen3-Next: the experts
stacked (or, Qwen3.5 MoE, split) into ``switch_mlp``, the zero-centred norms + 1; DeepSeek-V3:
mlx-lm's own sanitize of
the layer) and writes ``mtp.safetensors`` without the prefix (drafters/mtp.py reads it).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..drafters.mtp import FAMILIES, SIDECAR

# Qwen3-Next's RMSNorms scale by (1 + weight); mlx-lm's stores 1 + weight (its sanitize).
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def extract_mtp(src: str | Path, out: str | Path, dtype: str | None = None) -> int:
    """Write ``out/mtp.safetensors`` from the Hugging Face checkpoint at ``src``; returns how
    many tensors it holds (0: the checkpoint has no MTP weights, nothing is written)."""
    src, out = Path(src), Path(out)
    top = json.loads((src / "config.json").read_text())
    config = top.get("text_config", top)  # Qwen3.5: the language model's fields
    model_type = top.get("model_type")
    # Qwen3-Next, Qwen3.5: mtp.*; DeepSeek-V3 (and GLM-4.5): the decoder layer after the
    # last, model.layers.N.*
    prefixes = ["mtp."]
    if model_type == "deepseek_v3" or config.get("num_nextn_predict_layers"):
        prefixes.append(f"model.layers.{config.get('num_hidden_layers')}.")
    weights: dict[str, mx.array] = {}
    for prefix in prefixes:
        for shard in _shards(src, prefix):
            weights.update({k[len(prefix):]: v for k, v in mx.load(str(shard)).items()
                            if k.startswith(prefix)})
        if weights:
            break
    if not weights:
        return 0
    if model_type not in FAMILIES:
        raise NotImplementedError(f"{src}: keeping the MTP weights of model type '{model_type}' "
                                  f"is not supported yet ({', '.join(FAMILIES)} are)")
    if model_type == "deepseek_v3":
        weights = _deepseek_layer(weights, config)
    else:
        _stack_experts(weights, config.get("num_experts", 0))
        _split_fused_experts(weights)
        for k, v in weights.items():
            if (k.endswith(_ZERO_CENTRED) or k == "norm.weight") and v.ndim == 1:
                weights[k] = v + 1.0
    if dtype is not None:
        weights = {k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    mx.save_safetensors(str(out / SIDECAR), weights, metadata={"format": "mlx"})
    return len(weights)


def _deepseek_layer(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """DeepSeek-V3's MTP layer: its own norms and projection as they are; its decoder layer
    through mlx-lm's own sanitize (experts stacked, kv_b_proj split for MLA), as layer 0 of a
    one-layer model; the shared embedding and head (the target's) dropped."""
    from types import SimpleNamespace

    from mlx_lm.models import deepseek_v3

    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    kept = {k: v for k, v in weights.items() if k.startswith(own)}
    layer = {f"model.layers.0.{k}": v for k, v in weights.items()
             if not k.startswith(own + ("embed_tokens.", "shared_head.head."))}
    args = deepseek_v3.ModelArgs.from_dict({**config, "num_hidden_layers": 1})
    layer = deepseek_v3.Model.sanitize(SimpleNamespace(args=args), layer)
    kept.update({"layers.0." + k[len("model.layers.0."):]: v for k, v in layer.items()})
    return kept


def _shards(src: Path, prefix: str) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({src / f for k, f in weight_map.items() if k.startswith(prefix)})
    return sorted(src.glob("*.safetensors"))


def _split_fused_experts(weights: dict[str, mx.array]) -> None:
    """Qwen3.5 MoE stores its experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj``): as mlx-lm's ``switch_mlp`` (its qwen3_5_moe sanitize)."""
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = weights.pop(key)
        mid = gate_up.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(
            f"{prefix}.experts.down_proj")


def _stack_experts(weights: dict[str, mx.array], num_experts: int) -> None:
    """``layers.N.mlp.experts.E.P.weight`` -> ``layers.N.mlp.switch_mlp.P.weight`` [E, ...]."""
    layers = {k.split(".")[1] for k in weights if ".mlp.experts.0." in k}
    for n in layers:
        for part in ("gate_proj", "up_proj", "down_proj"):
            prefix = f"layers.{n}.mlp"
            keys = [f"{prefix}.experts.{e}.{part}.weight" for e in range(num_experts)]
            if all(k in weights for k in keys):
                weights[f"{prefix}.switch_mlp.{part}.weight"] = mx.stack(
                    [weights.pop(k) for k in keys])
