"""Where mlx_dflash keeps what it computes once per machine (converted models, pass timings)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV_VAR = "MLX_DFLASH_HOME"


def cache_root() -> Path:
    """Root of mlx_dflash's cache: ``$MLX_DFLASH_HOME`` or ``~/.cache/mlx_dflash``."""
    env = os.environ.get(HOME_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlx_dflash"
