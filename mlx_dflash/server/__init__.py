"""OpenAI-compatible HTTP server (FastAPI) for DFlash speculative decoding: `mlx-dflash serve`."""

from .app import create_app
from .background import BackgroundServer

__all__ = ["BackgroundServer", "create_app"]
