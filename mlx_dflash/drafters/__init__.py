"""Drafter loading: read config.json, pick the family by `architectures` (see registry.py), load,
check weights. Saving and quantizing are in mlx_dflash.convert.save."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..ngram import FILE_NAME as NGRAM_FILE
from ..ngram import NgramTable
from .dflash import DFlashDraftModel
from .dflash2 import DFlash2Args, DFlash2DraftModel
from .dspark import DSparkArgs, DSparkDraftModel
from .eagle3 import Eagle3Args, Eagle3DraftModel
from .base import LookupDrafts
from .layers import DraftArgs
from . import speculators
from .registry import ARCHITECTURES, FAMILIES, NOT_YET, drafter_family
from .shipped import drafter_dir, shipped_drafters


class DrafterMismatchError(ValueError):
    """The drafter does not fit the target (layers, hidden size, vocabulary)."""


def resolve_path(path_or_hf_repo: str | Path) -> Path:
    """A local directory, the name of a drafter shipped in the package, or a Hugging Face Hub
    repo id fetched with huggingface-hub."""
    path = Path(path_or_hf_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"drafter path is not a directory: {path}")
        return path
    text = str(path_or_hf_repo)
    if text in shipped_drafters():
        return drafter_dir(text)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"drafter directory not found: {text} (shipped drafters: "
                                f"{', '.join(shipped_drafters())})")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.md"])
        )
    except Exception as e:  # offline, unknown repo, gated repo: say which
        raise FileNotFoundError(
            f"drafter '{text}' is not a local directory and could not be fetched from the "
            f"Hugging Face Hub: {type(e).__name__}: {e}"
        ) from e


def load_drafter(
    path_or_hf_repo: str | Path,
    model: Any = None,
    dtype: mx.Dtype | None = None,
    dequantize: bool | None = None,
) -> DFlashDraftModel:
    """Load a drafter checkpoint (z-lab layout); with ``model`` (the target), check it fits.

    ``dtype`` defaults to the target's compute dtype (a bfloat16 checkpoint next to a float32
    target runs in float32: on CPUs only float32 matmuls are fast). A quantized checkpoint is
    dequantized when ``dequantize`` says so, by default where there is no Metal GPU (MLX's
    CPU quantized matmuls run several times slower than float32 through a fast BLAS)."""
    path = resolve_path(path_or_hf_repo)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"drafter directory {path} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"drafter config {config_file} is not valid JSON: {e}") from e
    source = config
    if speculators.is_speculators(config):  # vLLM's layout: read as ours
        config = speculators.read_config(config, str(path))
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch in NOT_YET:
        raise NotImplementedError(
            f"{path}: {NOT_YET[arch]} drafters ({arch}) are not supported yet")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unknown drafter architecture '{arch}' "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    cls = ARCHITECTURES[arch]
    args = cls.args_class.from_config(config)
    if not args.target_layer_ids:  # EAGLE-3 without eagle_config: SpecForge's default taps
        if model is None:
            raise ValueError(f"{path}: the config names no target layers to read "
                             "(eagle_config.eagle_aux_hidden_state_layer_ids); load it with "
                             "its target to use the default ones")
        from .eagle3 import default_layer_ids

        args.target_layer_ids = default_layer_ids(_target(model).num_layers)
    drafter = cls(args)

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"drafter directory {path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(f))
    if source is not config:
        weights = speculators.read_weights(source, weights)
    # Some exports carry the target's embedding/head; the drafter always uses the target's
    # embedding, and its head unless the family has a head of its own (EAGLE-3).
    shared = ("embed_tokens.",) if getattr(cls, "own_head", False) else ("embed_tokens.",
                                                                          "lm_head.")
    weights = {k: v for k, v in weights.items() if not k.startswith(shared)}
    quant = config.get("quantization")
    if quant:
        _dequantize_raw(weights, quant)
        nn.quantize(
            drafter,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            # mlx-lm's convention: a path's own entry overrides the defaults (a layer at 4 bits)
            class_predicate=lambda p, m: f"{p}.scales" in weights
            and (quant[p] if isinstance(quant.get(p), dict) else True),
        )
    expected = {k for k, _ in tree_flatten(drafter.parameters())}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing:
        raise ValueError(f"drafter checkpoint {path} lacks weights: {', '.join(missing[:8])}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        raise ValueError(f"drafter checkpoint {path} has unexpected weights: "
                         f"{', '.join(unexpected[:8])}")
    drafter.load_weights(list(weights.items()))
    _check_draft_vocab(drafter, path)
    if quant and (not mx.metal.is_available() if dequantize is None else dequantize):
        from mlx_lm.utils import dequantize_model

        dequantize_model(drafter)
    if dtype is None and model is not None:
        from ..target import Target

        dtype = (model if isinstance(model, Target) else Target(model, check=False)).dtype
    if dtype is not None:
        drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    drafter.eval()
    drafter.source_path = path
    if (path / NGRAM_FILE).exists():
        drafter.ngram = NgramTable.load(path / NGRAM_FILE)
        drafter.ngram.check_vocab(drafter.args.vocab_size, str(path))
    if model is not None:
        check_fits(drafter, model)
    return drafter


def _target(model: Any) -> Any:
    from ..target import Target

    return model if isinstance(model, Target) else Target(model, check=False)


def _check_draft_vocab(drafter: Any, path: Path) -> None:
    """EAGLE-3's two maps of its reduced vocabulary must agree (d2t: draft id -> target id
    offset; t2d: which target ids it holds)."""
    if "d2t" not in drafter:
        return
    ids, held = drafter.vocab_ids, drafter.t2d
    if (int(ids.min()) < 0 or int(ids.max()) >= held.shape[0]
            or not bool(mx.all(ids[1:] > ids[:-1])) or not bool(mx.all(held[ids]))
            or int(held.sum()) != ids.shape[0]):
        raise ValueError(f"drafter checkpoint {path}: d2t and t2d do not describe the same "
                         "draft vocabulary (d2t[i] + i must be the increasing target ids that "
                         "t2d marks)")


def check_fits(drafter: DFlashDraftModel, model: Any) -> None:
    """Raise DrafterMismatchError naming the first way the drafter does not fit the target."""
    if isinstance(drafter, LookupDrafts):  # nothing drafted: nothing to fit
        return
    target = _target(model)
    a = drafter.args
    ids = a.target_layer_ids
    if not ids or min(ids) < 0 or max(ids) >= target.num_layers:
        raise DrafterMismatchError(
            f"drafter target_layer_ids {ids} do not fit the target's {target.num_layers} layers "
            f"(valid ids are 0..{target.num_layers - 1})"
        )
    if a.num_target_layers is not None and a.num_target_layers != target.num_layers:
        raise DrafterMismatchError(
            f"drafter was trained for a target with num_target_layers={a.num_target_layers}, "
            f"but the target has {target.num_layers} layers"
        )
    reads = getattr(a, "target_hidden_size", None) or a.hidden_size  # the target features' width
    if reads != target.hidden_size:
        raise DrafterMismatchError(
            f"drafter hidden_size {reads} does not match the target's {target.hidden_size}"
        )
    if a.vocab_size != target.vocab_size:
        raise DrafterMismatchError(
            f"drafter vocab_size {a.vocab_size} does not match the target's {target.vocab_size}"
        )
    vocab = drafter.vocab_ids
    if vocab is not None and (int(vocab.max()) >= target.vocab_size or int(vocab.min()) < 0):
        raise DrafterMismatchError(
            f"drafter draft_vocab holds ids up to {int(vocab.max())}, outside the target's "
            f"vocabulary (size {target.vocab_size})"
        )
    if not 0 <= a.mask_token_id < target.vocab_size:
        raise DrafterMismatchError(
            f"drafter mask_token_id {a.mask_token_id} is outside the target's vocabulary "
            f"(size {target.vocab_size})"
        )


def _dequantize_raw(weights: dict[str, mx.array], quant: dict) -> None:
    """Raw tensors stored quantized (``X`` packed, ``X_scales``, ``X_biases``: DFlash 2's
    codebooks, see scripts/export_drafter.py) back to float, in place. Their rows are gathered,
    never multiplied as a matrix, so nothing is lost by holding them dequantized."""
    for key in [k for k in weights if k.endswith("_scales")]:
        name = key[: -len("_scales")]
        if name in weights and name + "_biases" in weights:
            weights[name] = mx.dequantize(weights[name], weights.pop(key),
                                          weights.pop(name + "_biases"),
                                          group_size=quant["group_size"], bits=quant["bits"])


__all__ = ["ARCHITECTURES", "DFlash2Args", "DFlash2DraftModel", "DFlashDraftModel", "DSparkArgs",
           "DSparkDraftModel", "DraftArgs", "DrafterMismatchError", "Eagle3Args",
           "Eagle3DraftModel", "FAMILIES", "NOT_YET",
           "check_fits", "drafter_family", "load_drafter", "resolve_path"]
