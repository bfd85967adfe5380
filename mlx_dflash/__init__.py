"""mlx-dflash: lossless block-parallel speculative decoding for MLX."""

from ._blas import load_fast_blas

load_fast_blas()  # must run before the first `import mlx` in the process

from .batch import BatchEngine, batch_generate  # noqa: E402
from .convert.save import save_drafter  # noqa: E402
from .decode import (  # noqa: E402
    GenerationResponse,
    GenerationStats,
    generate,
    stream_generate,
    stream_generate_cached,
)
from .default_pair import load_default  # noqa: E402
from .drafters import DrafterMismatchError, load_drafter  # noqa: E402
from .drafters.base import LookupDrafts  # noqa: E402
from .drafters.mtp import load_mtp_drafter  # noqa: E402
from .grammar import Grammar, GrammarError  # noqa: E402
from .pair_cache import PairCache  # noqa: E402
from .prefix_cache import PrefixCache  # noqa: E402
from .target import Target, quantize_kv  # noqa: E402

__version__ = "0.1.0"


__all__ = [
    "BatchEngine",
    "DrafterMismatchError",
    "GenerationResponse",
    "GenerationStats",
    "Grammar",
    "GrammarError",
    "LookupDrafts",
    "PairCache",
    "PrefixCache",
    "Target",
    "batch_generate",
    "generate",
    "load_default",
    "load_drafter",
    "load_mtp_drafter",
    "quantize_kv",
    "save_drafter",
    "stream_generate",
    "stream_generate_cached",
    "__version__",
]
