"""Convert a Hugging Face DFlash drafter checkpoint into an MLX drafter directory.

The output keeps the z-lab layout (``config.json`` + ``model.safetensors``) that ``load_drafter``
reads. Optionally the linear layers are quantized (``nn.quantize``, affine) and the scheme is
recorded as ``quantization`` in config.json; everything that is not quantized (norms, quantization
scales and biases) is stored in ``dtype``, float32 by default, so the drafter's activations stay
float32: float16 activations overflow in the drafter and break acceptance on older chips.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafters import load_drafter, resolve_path, speculators
from .atomic import atomic_output_dir
from .save import quantize_drafter

DTYPES = ("float32", "bfloat16", "float16")
BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports in affine mode
GROUP_SIZES = (32, 64, 128)
# Carried along if present (ngram.npz: the drafter's n-gram table, see ngram.py).
_EXTRA_FILES = ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "ngram.npz")


def convert_drafter(
    src: str | Path,
    out: str | Path,
    bits: int | None = None,
    group_size: int = 64,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Convert the drafter at ``src`` (local dir or hub id) into an MLX drafter dir at ``out``.

    ``bits`` quantizes every linear layer whose input size is a multiple of ``group_size``.
    The directory is written atomically (nothing is left at ``out`` on failure or interrupt) and
    is loaded back with ``load_drafter`` before it is moved into place.

    Raises:
        ValueError: bad ``bits`` / ``group_size`` / ``dtype``, a source that is already quantized,
            or a checkpoint that ``load_drafter`` rejects.
        FileNotFoundError / NotADirectoryError: ``src`` is not a drafter directory or hub id.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if bits is not None and bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if bits is not None and group_size not in GROUP_SIZES:
        raise ValueError(
            f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        # Fail before the (slow) load; atomic_output_dir checks again.
        raise FileExistsError(
            f"output directory already exists: {out} (pass overwrite=True to replace it)"
        )

    src_dir = resolve_path(src)
    if src_dir.resolve() == out.resolve():
        raise ValueError(f"source and output are the same directory: {out}")
    _say(progress, f"Loading drafter {src} ...")
    # load_drafter first: it names a missing config, bad JSON, missing or unexpected weights.
    drafter = load_drafter(src_dir)
    config = json.loads((src_dir / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise ValueError(
            f"{src_dir} is already quantized; convert from the original (unquantized) checkpoint"
        )
    drafter.set_dtype(getattr(mx, dtype))

    quantized = 0
    if bits is not None:

        def quantizable(path: str, module: nn.Module) -> bool:
            # mx.quantize groups along the input dimension, which must split into whole groups.
            return isinstance(module, (nn.Linear, nn.Embedding)) and \
                module.weight.shape[-1] % group_size == 0

        quantized = sum(1 for p, m in drafter.named_modules() if quantizable(p, m))
        if quantized == 0:
            raise ValueError(
                f"no linear layer of {src_dir} has an input size divisible by group size "
                f"{group_size}; try a smaller --group-size"
            )
        _say(progress, f"Quantizing {quantized} layers to {bits} bits (group {group_size})")
        quantize_drafter(drafter, bits, group_size)  # DFlash 2's codebooks too

    weights = dict(tree_flatten(drafter.parameters()))
    mx.eval(weights)
    # Keep the source config as published (fields like output_multiplier or auto_map survive);
    # only the storage dtype and the quantization scheme change. A speculators config is
    # written as ours: the weights now carry our names.
    if speculators.is_speculators(config):
        config = speculators.read_config(config, str(src_dir))
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = dtype
    if bits is not None:
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _EXTRA_FILES:
            if (src_dir / name).is_file():
                shutil.copyfile(src_dir / name, tmp / name)
        load_drafter(tmp)  # never publish a directory that does not load
    size = sum(v.nbytes for v in weights.values()) / 1e6
    _say(progress, f"Wrote {out} ({size:.1f} MB, {dtype}"
         + (f", {quantized} layers at {bits} bits" if bits else "") + ")")
    return out


LAYOUTS = ("zlab", "speculators")


def export_drafter(src: str | Path, out: str | Path, to: str, target: str | None = None,
                   overwrite: bool = False, progress: bool = False) -> Path:
    """Write the drafter at ``src`` in a layout other engines load: ``to`` "zlab" (z-lab's
    DFlash: the reference, dflash-mlx, mlx-dspark; a reduced vocabulary is expanded to the
    full one, as that layout has none) or "speculators" (vLLM's: a reduced vocabulary as
    ``d2t`` / ``t2d``). ``target`` (an mlx-lm model dir or hub id): needed where the layout
    carries the target's weights (speculators' DFlash and DSpark), and to check the export
    against it. Atomic, and loaded back before it is moved into place."""
    if to not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {to!r}")
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"output directory already exists: {out} (pass overwrite=True to replace it)")
    model = None
    if target is not None:
        from mlx_lm import load

        _say(progress, f"Loading target {target} ...")
        model, _ = load(target)
    _say(progress, f"Loading drafter {src} ...")
    drafter = load_drafter(src, model=model)
    if to == "zlab":
        if drafter.family != "dflash":
            raise ValueError(f"z-lab's layout holds DFlash drafters; this one is "
                             f"{drafter.family} (write it with --to speculators)")
        config = drafter.args.to_config()
        config["dflash_config"].pop("draft_vocab_size", None)
        weights = {k: v for k, v in tree_flatten(drafter.parameters()) if k != "draft_vocab"}
        if drafter.vocab_ids is not None:
            _say(progress, "Expanding the reduced vocabulary to the target's (z-lab's layout "
                 "has none): drafts may differ, decoding stays lossless")
    else:
        config, weights = speculators.write(drafter, model, verifier=target)
    mx.eval(weights)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        load_drafter(tmp, model=model)  # never publish a directory that does not load
    _say(progress, f"Wrote {out} ({to} layout)")
    return out


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
