"""Drafter loading: read config.json, pick the family by `architectures`, load, check weights."""

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
from .dflash2 import DFlash2DraftModel
from .dspark import DSparkDraftModel
from .layers import DraftArgs
from .shipped import drafter_dir, shipped_drafters

# DeepSpec writes Qwen3DSparkModel (fields at the top level); SpecForge-style exports write
# DSparkDraftModel with the fields in dflash_config. DraftArgs.from_config reads both.
FAMILIES = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel,
            "Qwen3DSparkModel": DSparkDraftModel, "DSparkDraftModel": DSparkDraftModel}
NOT_YET = {"Gemma4DSparkModel": "Gemma 4 DSpark"}


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
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch in NOT_YET:
        raise NotImplementedError(
            f"{path}: {NOT_YET[arch]} drafters ({arch}) are not supported yet")
    if arch not in FAMILIES:
        raise ValueError(
            f"{path}: unknown drafter architecture '{arch}' (supported: {', '.join(FAMILIES)})"
        )
    drafter = FAMILIES[arch](DraftArgs.from_config(config))

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"drafter directory {path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(f))
    # Some exports carry the target's embedding/head; the drafter always uses the target's own.
    weights = {
        k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))
    }
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


def check_fits(drafter: DFlashDraftModel, model: Any) -> None:
    """Raise DrafterMismatchError naming the first way the drafter does not fit the target."""
    from ..target import Target

    target = model if isinstance(model, Target) else Target(model, check=False)
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
    if a.hidden_size != target.hidden_size:
        raise DrafterMismatchError(
            f"drafter hidden_size {a.hidden_size} does not match the target's {target.hidden_size}"
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


def drafter_config(drafter: DFlashDraftModel) -> dict:
    """The config.json for a drafter: z-lab layout for DFlash, DeepSpec's for DSpark."""
    a = drafter.args
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": a.block_size,
        "dflash_config": {"target_layer_ids": a.target_layer_ids,
                          "mask_token_id": a.mask_token_id},
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "num_target_layers": a.num_target_layers,
        "tie_word_embeddings": False,
    }
    if a.verify_block_size is not None:
        config["verify_block_size"] = a.verify_block_size
    if a.draft_vocab_size:
        config["dflash_config"]["draft_vocab_size"] = a.draft_vocab_size
    if a.sliding_window is not None:
        config["layer_types"] = a.layer_types
        config["sliding_window"] = a.sliding_window
    if isinstance(drafter, DFlash2DraftModel):
        config["architectures"] = ["DFlash2DraftModel"]
        config["is_causal"] = bool(drafter.layers[0].is_causal)
        config["dflash_config"].update(
            block_size=config.pop("block_size"), conv_kernel_size=a.conv_kernel_size,
            conv_group_size=a.conv_group_size, selector_rank=a.selector_rank,
            selector_top_k=a.selector_top_k, output_multiplier=a.output_multiplier,
            final_logit_softcapping=a.final_logit_softcapping)
    if isinstance(drafter, DSparkDraftModel):
        fields = config.pop("dflash_config")
        config.update(fields, architectures=["Qwen3DSparkModel"], markov_rank=a.markov_rank,
                      enable_confidence_head=a.enable_confidence_head,
                      num_anchors=a.extra.get("num_anchors", 512))
        if a.markov_rank:
            config["markov_head_type"] = a.markov_head_type
        if a.enable_confidence_head:
            config["confidence_head_with_markov"] = a.confidence_head_with_markov
        if a.confidence_temperatures:
            config["confidence_temperatures"] = a.confidence_temperatures
        if a.confidence_offsets and any(a.confidence_offsets):
            config["confidence_offsets"] = a.confidence_offsets
    return config


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


def quantize_drafter(drafter: DFlashDraftModel, bits: int, group_size: int = 64,
                     path_bits: dict[str, int] | None = None) -> dict:
    """Quantize (affine) the linear and embedding layers whose input width splits into groups,
    and a DFlash 2 drafter's codebooks (raw tensors: stored as ``X`` packed, ``X_scales``,
    ``X_biases``); ``path_bits`` gives other bits to the layers under a path prefix (e.g.
    ``{"markov_head": 4}``). Returns the config entry that :func:`save_drafter` needs."""
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
    selector = getattr(drafter, "candidate_selector", None)
    for name in ("predecessor_codebook", "successor_codebook") if selector else ():
        if selector[name].shape[-1] % group_size:
            continue
        packed, scales, biases = mx.quantize(selector[name], group_size=group_size, bits=bits)
        selector[name], selector[f"{name}_scales"], selector[f"{name}_biases"] = (
            packed, scales, biases)
    return {"quantization": {"group_size": group_size, "bits": bits, "mode": "affine",
                             **overrides}}


def save_drafter(drafter: DFlashDraftModel, path: str | Path, extra_config: dict | None = None):
    """Write ``config.json`` + ``model.safetensors`` in the z-lab layout (atomically)."""
    from ..convert.atomic import atomic_output_dir

    config = drafter_config(drafter)
    config.update(extra_config or {})
    with atomic_output_dir(Path(path), overwrite=True) as tmp:
        weights = dict(tree_flatten(drafter.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if drafter.ngram is not None:
            drafter.ngram.save(tmp / NGRAM_FILE)
    return Path(path)


__all__ = ["DFlashDraftModel", "DFlash2DraftModel", "DSparkDraftModel", "DraftArgs",
           "DrafterMismatchError", "check_fits", "load_drafter", "quantize_drafter",
           "save_drafter", "drafter_config"]
