"""The drafters shipped inside the package (mlx_dflash/assets/drafters/NAME)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFTER = "smollm2-135m-dspark-b7"  # the default pair's drafter
ROOT = Path(__file__).resolve().parent.parent / "assets" / "drafters"


def drafter_dir(name: str = DEFAULT_DRAFTER) -> Path:
    """A shipped drafter's directory (it may not exist)."""
    return ROOT / name


def shipped_drafters() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir() if (p / "config.json").exists()) if \
        ROOT.exists() else []


def resolve_drafter(name_or_path: str) -> str:
    """A shipped drafter's name maps to its directory; anything else is a path or hub id."""
    return str(drafter_dir(name_or_path)) if name_or_path in shipped_drafters() else name_or_path
