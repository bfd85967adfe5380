"""`mlx-dflash` command line: one module per subcommand, all registered on `app`."""

from .. import _blas

_blas.load_fast_blas()

from . import generate  # noqa: E402,F401  (registers the command)
from .app import app  # noqa: E402

for _name in ("chat", "serve", "convert", "bench", "train"):
    try:
        __import__(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:  # a subcommand not built yet
        if e.name != f"{__name__}.{_name}":
            raise


def main() -> None:
    app()
