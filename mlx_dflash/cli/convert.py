"""`mlx-dflash convert {drafter,gguf,target}`: produce MLX directories, all-or-nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import app, fail

convert_app = typer.Typer(
    help="Convert checkpoints to MLX: DFlash drafters, GGUF targets, Hugging Face targets. "
    "Outputs are written atomically: a failed or interrupted run leaves nothing behind.",
    no_args_is_help=True,
)
app.add_typer(convert_app, name="convert")

_DTYPES = ("float32", "bfloat16", "float16")
_BITS = (2, 3, 4, 5, 6, 8)
_GROUP_SIZES = (32, 64, 128)


def _check_output(out: str, overwrite: bool) -> None:
    # Checked up front so a long load is not wasted; the converters check again when writing.
    if Path(out).expanduser().exists() and not overwrite:
        fail(f"output directory already exists: {out} (pass --overwrite to replace it)")


def _check_choice(name: str, value: object, choices: tuple) -> None:
    if value is not None and value not in choices:
        fail(f"{name} must be one of {', '.join(map(str, choices))}, got {value}")


@convert_app.command("drafter")
def drafter_cmd(
    src: str = typer.Argument(..., metavar="SRC",
                              help="Drafter checkpoint: local dir or Hugging Face repo id."),
    out: str = typer.Argument(..., metavar="OUT", help="Output directory (z-lab layout; loads "
                              "with load_drafter / --drafter)."),
    bits: Optional[int] = typer.Option(
        None, "--bits", help="Quantize the linear layers to this many bits (4 or 8 recommended; "
        "2, 3, 5, 6 also accepted). Default: no quantization."),
    group_size: int = typer.Option(64, "--group-size", help="Quantization group size "
                                   "(32, 64 or 128)."),
    dtype: str = typer.Option(
        "float32", "--dtype", help="Storage dtype of everything not quantized (norms, scales). "
        "float32 keeps the drafter's activations in float32; float16 activations can break "
        "acceptance on older chips."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUT."),
    to: str = typer.Option(
        "mlx", "--to", help="Layout to write: 'mlx' (ours, loads with --drafter), 'zlab' "
        "(z-lab's DFlash: its reference, dflash-mlx, mlx-dspark) or 'speculators' (vLLM)."),
    target: Optional[str] = typer.Option(
        None, "--target", help="The drafter's target (dir or hub id): needed by --to "
        "speculators for DFlash and DSpark drafters (the layout carries the target's "
        "embedding and head rows), and to check the export against it."),
) -> None:
    """Convert a drafter checkpoint (DFlash, DFlash 2, DSpark, EAGLE-3; z-lab, SpecForge,
    DeepSpec or speculators layouts) into an MLX drafter directory, or export one (--to)."""
    _check_choice("--to", to, ("mlx", "zlab", "speculators"))
    if to != "mlx":
        if bits is not None:
            fail("--bits quantizes for MLX; other layouts are written unquantized")
        _check_output(out, overwrite)
        from ..convert.drafter import export_drafter

        try:
            export_drafter(src, out, to, target=target, overwrite=overwrite, progress=True)
        except (FileNotFoundError, NotADirectoryError, FileExistsError, ValueError,
                NotImplementedError) as e:
            fail(str(e))
        return
    _check_choice("--bits", bits, _BITS)
    _check_choice("--group-size", group_size, _GROUP_SIZES)
    _check_choice("--dtype", dtype, _DTYPES)
    _check_output(out, overwrite)
    from ..convert.drafter import convert_drafter

    try:
        convert_drafter(src, out, bits=bits, group_size=group_size, dtype=dtype,
                        overwrite=overwrite, progress=True)
    except (FileNotFoundError, NotADirectoryError, FileExistsError, ValueError,
            NotImplementedError) as e:
        fail(str(e))


@convert_app.command("gguf")
def gguf_cmd(
    src: str = typer.Argument(..., metavar="SRC.gguf",
                              help="A llama.cpp .gguf file (llama, qwen2, qwen3)."),
    out: str = typer.Argument(..., metavar="OUT", help="Output mlx-lm model directory."),
    dtype: str = typer.Option("float32", "--dtype", help="Dtype of the dequantized weights."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUT."),
) -> None:
    """Convert a GGUF target model into an mlx-lm directory (weights dequantized)."""
    _check_choice("--dtype", dtype, _DTYPES)
    if not Path(src).expanduser().exists():
        fail(f"GGUF file not found: {src}")
    _check_output(out, overwrite)
    from ..convert.gguf import convert_gguf

    try:
        convert_gguf(Path(src).expanduser(), Path(out).expanduser(), dtype=dtype,
                     overwrite=overwrite, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        fail(str(e))


@convert_app.command("target")
def target_cmd(
    hf_path: str = typer.Argument(..., metavar="HF_PATH",
                                  help="Hugging Face model: local dir or repo id."),
    out: str = typer.Argument(..., metavar="OUT", help="Output mlx-lm model directory."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the model."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight (default 4; "
                                         "implies -q)."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="Dtype of the non-quantized weights (default: the checkpoint's)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUT."),
) -> None:
    """Convert a Hugging Face target model with mlx_lm.convert (written atomically)."""
    _check_choice("--q-bits", q_bits, _BITS)
    _check_choice("--q-group-size", q_group_size, _GROUP_SIZES)
    _check_choice("--dtype", dtype, _DTYPES)
    local = Path(hf_path).expanduser()
    if local.exists():
        if not local.is_dir():
            fail(f"target path is not a directory: {hf_path}")
    elif hf_path.startswith((".", "/", "~")) or hf_path.count("/") != 1:
        fail(f"target directory not found: {hf_path} (nor is it a Hugging Face repo id)")
    _check_output(out, overwrite)
    quantize = quantize or q_bits is not None
    from mlx_lm.convert import convert
    from mlx_lm.utils import _download

    from ..convert.atomic import atomic_output_dir
    from ..convert.mtp import extract_mtp

    try:
        with atomic_output_dir(Path(out).expanduser(), overwrite=overwrite) as tmp:
            tmp.rmdir()  # mlx_lm.convert refuses an existing directory; it creates its own
            convert(str(local) if local.exists() else hf_path, str(tmp), quantize=quantize,
                    q_group_size=q_group_size if quantize else None,
                    q_bits=(q_bits or 4) if quantize else None, dtype=dtype)
            # mlx-lm drops the MTP head: kept beside the model for --drafter mtp
            try:
                kept = extract_mtp(local if local.exists() else _download(hf_path), tmp, dtype)
            except NotImplementedError as e:  # the target itself converted: keep it
                kept = 0
                typer.secho(f"warning: {e}; the target is converted without it",
                            fg=typer.colors.YELLOW, err=True)
            if kept:
                typer.echo(f"Kept the MTP head ({kept} tensors) in mtp.safetensors "
                           "(--drafter mtp)", err=True)
    except (FileExistsError, NotImplementedError) as e:
        fail(str(e))
    except Exception as e:  # mlx_lm / huggingface-hub raise many kinds: name it, no traceback
        fail(f"could not convert {hf_path}: {type(e).__name__}: {e}")
    typer.echo(f"Wrote {out}", err=True)
