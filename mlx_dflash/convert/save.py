"""Write a drafter (config.json from its family's args, weights, n-gram table) and quantize one
before writing. Loading, which undoes both, is ``mlx_dflash.drafters.load_drafter``."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafters.dflash import DFlashDraftModel
from ..ngram import FILE_NAME as NGRAM_FILE
from .atomic import atomic_output_dir


def quantize_drafter(drafter: DFlashDraftModel, bits: int, group_size: int = 64,
                     path_bits: dict[str, int] | None = None) -> dict:
    """Quantize (affine) the linear and embedding layers whose input width splits into groups,
    and the raw weights the family lists (``raw_weights``: DFlash 2's codebooks, stored as ``X``
    packed, ``X_scales``, ``X_biases``); ``path_bits`` gives other bits to the layers under a
    path prefix (e.g. ``{"markov_head": 4}``). Returns the config entry that
    :func:`save_drafter` needs."""
    path_bits = path_bits or {}
    overrides: dict[str, dict] = {}

    def under(path: str, prefix: str) -> bool:
        return path == prefix or path.startswith(prefix + ".")

    def predicate(path: str, m: nn.Module) -> bool | dict:
        if not (isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % group_size == 0):
            return False
        for prefix, b in path_bits.items():
            if under(path, prefix):
                overrides[path] = {"group_size": group_size, "bits": b}
                return overrides[path]
        return True

    unknown = [p for p in path_bits
               if not any(under(k, p) for k, _ in drafter.named_modules())]
    if unknown:
        raise ValueError(f"no drafter layers under {', '.join(unknown)}")
    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=predicate)
    for module, name in drafter.raw_weights():
        if module[name].shape[-1] % group_size:
            continue
        packed, scales, biases = mx.quantize(module[name], group_size=group_size, bits=bits)
        module[name], module[f"{name}_scales"], module[f"{name}_biases"] = packed, scales, biases
    return {"quantization": {"group_size": group_size, "bits": bits, "mode": "affine",
                             **overrides}}


def save_drafter(drafter: DFlashDraftModel, path: str | Path,
                 extra_config: dict | None = None) -> Path:
    """Write ``config.json`` (the family's layout, ``args.to_config``, updated with
    ``extra_config``) + ``model.safetensors`` (+ the n-gram table it carries), atomically."""
    config = drafter.args.to_config()
    config.update(extra_config or {})
    with atomic_output_dir(Path(path), overwrite=True) as tmp:
        weights = dict(tree_flatten(drafter.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if drafter.ngram is not None:
            drafter.ngram.save(tmp / NGRAM_FILE)
    return Path(path)
