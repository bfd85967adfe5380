"""Keep a Hugging Face checkpoint's MTP weights beside its mlx-lm conversion.

mlx-lm's conversion drops ``mtp.*``; this reads them from the checkpoint's safetensors (only
the shards that hold them, by the index), sanitizes them as mlx-lm sanitizes the model's own
layers (Qwen3-Next: the experts stacked into ``switch_mlp``, the zero-centred norms + 1) and
writes ``mtp.safetensors`` without the prefix (drafters/mtp.py reads it).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..drafters.mtp import FAMILIES, SIDECAR

# Qwen3-Next's RMSNorms scale by (1 + weight); mlx-lm's stores 1 + weight (its sanitize).
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def _shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({src / f for k, f in weight_map.items() if k.startswith("mtp.")})
    return sorted(src.glob("*.safetensors"))


def extract_mtp(src: str | Path, out: str | Path, dtype: str | None = None) -> int:
    """Write ``out/mtp.safetensors`` from the Hugging Face checkpoint at ``src``; returns how
    many tensors it holds (0: the checkpoint has no MTP weights, nothing is written)."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    config = config.get("text_config", config)
    weights: dict[str, mx.array] = {}
    for shard in _shards(src):
        weights.update({k[len("mtp."):]: v for k, v in mx.load(str(shard)).items()
                        if k.startswith("mtp.")})
    if not weights:
        return 0
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise NotImplementedError(f"{src}: keeping the MTP weights of model type '{model_type}' "
                                  f"is not supported yet ({', '.join(FAMILIES)} are)")
    _stack_experts(weights, config.get("num_experts", 0))
    for k, v in weights.items():
        if (k.endswith(_ZERO_CENTRED) or k == "norm.weight") and v.ndim == 1:
            weights[k] = v + 1.0
    if dtype is not None:
        weights = {k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
    mx.save_safetensors(str(out / SIDECAR), weights, metadata={"format": "mlx"})
    return len(weights)


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
