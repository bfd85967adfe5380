"""Load a fast BLAS on Linux before MLX is imported.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS (about 8 GFLOP/s), which makes a
16-token verify cost ~13x a 1-token decode, so speculation cannot win. Loading an optimized
library that exports plain ``cblas_sgemm`` with ``RTLD_GLOBAL`` before ``libmlx.so`` is loaded
makes the dynamic linker bind MLX's BLAS calls to it instead.

Turn it off with ``MLX_DFLASH_FAST_BLAS=0``; point it at a library with ``MLX_DFLASH_BLAS=PATH``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from pathlib import Path

# Debian/Ubuntu `libopenblas0-pthread` (and the openmp/serial variants), then generic names.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded_blas: str | None = None
"""Path of the fast BLAS this module loaded, or None."""


def _find_library() -> str | None:
    explicit = os.environ.get("MLX_DFLASH_BLAS")
    if explicit:
        if not Path(explicit).exists():
            raise FileNotFoundError(f"MLX_DFLASH_BLAS points to a missing file: {explicit}")
        return explicit
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    return ctypes.util.find_library("openblas")


def load_fast_blas() -> str | None:
    """Load a fast BLAS globally (Linux only). Returns its path, or None if none was loaded."""
    global loaded_blas
    if loaded_blas is not None:
        return loaded_blas
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get("MLX_DFLASH_FAST_BLAS", "1").lower() in ("0", "false", "no", "off"):
        return None
    path = _find_library()
    if path is None:
        warnings.warn(
            "mlx_dflash: no fast BLAS found; MLX will use the slow reference BLAS. "
            "Install one (Debian/Ubuntu: apt-get install libopenblas0-pthread) or set "
            "MLX_DFLASH_BLAS=/path/to/libopenblas.so.",
            stacklevel=2,
        )
        return None
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx_dflash: mlx was imported before mlx_dflash, so the fast BLAS cannot take "
            "effect in this process; import mlx_dflash first.",
            stacklevel=2,
        )
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    loaded_blas = path
    return path


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def sgemm_provider() -> str | None:
    """The library file that global symbol lookup binds ``cblas_sgemm`` to (what MLX uses)."""
    if not sys.platform.startswith("linux"):
        return None
    process = ctypes.CDLL(None)
    try:
        symbol = process.cblas_sgemm
    except AttributeError:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    info = _DlInfo()
    if not libc.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode())
