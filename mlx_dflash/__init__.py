"""mlx-dflash: lossless block-parallel speculative decoding for MLX."""

from ._blas import load_fast_blas

load_fast_blas()  # must run before the first `import mlx` in the process

from .decode import GenerationResponse, GenerationStats, generate, stream_generate  # noqa: E402
from .default_pair import load_default  # noqa: E402
from .convert.save import save_drafter  # noqa: E402
from .drafters import DrafterMismatchError, load_drafter  # noqa: E402
from .target import Target  # noqa: E402

__version__ = "0.1.0"


__all__ = [
    "DrafterMismatchError",
    "GenerationResponse",
    "GenerationStats",
    "Target",
    "generate",
    "load_default",
    "load_drafter",
    "save_drafter",
    "stream_generate",
    "__version__",
]
