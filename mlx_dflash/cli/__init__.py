"""`mlx-dflash` command line: one module per subcommand, all registered on `app`."""

from .. import _blas

_blas.load_fast_blas()

from . import bench, chat, convert, doctor, generate, launch, models, serve, train  # noqa: E402,F401,I001  (registers them)
from .app import app  # noqa: E402


def main() -> None:
    app()
