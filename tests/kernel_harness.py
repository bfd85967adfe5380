"""Run the Metal kernels of mlx_dflash.kernels as C++ on a machine without Metal.

For a KernelSpec this writes the function mx.fast.metal_kernel would generate (MLX's
signature rules: each input as ``const device T*``, a 0-d input as ``const constant T&``,
``<name>_shape`` when the body mentions it, outputs as ``device T*``, then every thread
attribute whose name the body mentions), with the kernel's own header and body text
unchanged, after metal_kernels/harness/metal_shim.h, which stands in for the Metal built-ins
and runs a threadgroup's threads as fibers (see the shim for how threads and barriers are
emulated). It compiles that with g++ into a shared library (cached by a hash of everything
that goes into it) and launches it through ctypes on numpy arrays.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_dflash.kernels import KERNEL_DIR, KernelSpec

SHIM = KERNEL_DIR / "harness" / "metal_shim.h"
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-w"]
ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2, "round_robin": 3}

# The thread attributes MLX passes to a kernel whose source mentions them, with their types.
ATTRIBUTES = {
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}
UNSUPPORTED = ("dispatch_", "quadgroup", "grid_origin", "grid_size", "_strides", "_ndim")

# numpy dtype -> (Metal type name as MLX writes it, numpy dtype the buffer holds)
TYPES = {
    "float32": ("float", np.float32),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),
    "uint32": ("uint32_t", np.uint32),
    "int32": ("int32_t", np.int32),
    "bool": ("bool", np.bool_),
}


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else g++ or c++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
    path = os.environ.get("MLX_DFLASH_HARNESS_CACHE")
    return Path(path) if path else Path(tempfile.gettempdir()) / "mlx_dflash_harness"


@dataclass
class Arg:
    """An input of a launch: the array and the Metal dtype name (bfloat16 is held as uint16)."""

    array: np.ndarray
    dtype: str

    @classmethod
    def of(cls, value, dtype: str | None = None) -> Arg:
        # np.array, not np.ascontiguousarray: that makes a 0-d value 1-d
        if dtype == "bfloat16":
            return cls(np.array(value, dtype=np.uint16, order="C"), "bfloat16")
        array = np.array(value, dtype=dtype, order="C")
        return cls(array, str(array.dtype))


def _template_decl(template: list[tuple[str, object]]) -> tuple[str, str]:
    """('template <int K>', '<16>') for MLX-style template arguments (ints, bools, dtypes)."""
    if not template:
        return "", ""
    params, values = [], []
    for name, value in template:
        if isinstance(value, bool):
            params.append(f"bool {name}")
            values.append("true" if value else "false")
        elif isinstance(value, int):
            params.append(f"int {name}")
            values.append(str(value))
        else:
            params.append(f"typename {name}")
            values.append(TYPES[str(value)][0])
    return f"template <{', '.join(params)}>\n", f"<{', '.join(values)}>"


def translation_unit(spec: KernelSpec, inputs: list[Arg], output_dtypes: list[str],
                     template: list[tuple[str, object]], source: str, header: str,
                     defines: dict[str, object] | None = None) -> str:
    """The C++ text for one kernel instance; launch args come as void* in signature order."""
    for word in UNSUPPORTED:
        if word in source:
            raise NotImplementedError(f"the harness does not emulate {word!r} yet")
    params, calls = [], []
    for name, arg in zip(spec.input_names, inputs):
        ctype = TYPES[arg.dtype][0]
        slot = len(calls)
        if arg.array.ndim == 0:
            params.append(f"const constant {ctype}& {name}")
            calls.append(f"*static_cast<const {ctype}*>(args[{slot}])")
        else:
            params.append(f"const device {ctype}* {name}")
            calls.append(f"static_cast<const {ctype}*>(args[{slot}])")
            if f"{name}_shape" in source:
                params.append(f"const constant int* {name}_shape")
                calls.append(f"static_cast<const int*>(args[{slot + 1}])")
    for name, dtype in zip(spec.output_names, output_dtypes):
        ctype = TYPES[dtype][0]
        params.append(f"device {ctype}* {name}")
        calls.append(f"static_cast<{ctype}*>(args[{len(calls)}])")
    for name, ctype in ATTRIBUTES.items():
        if name in source:
            params.append(f"{ctype} {name}")
            calls.append(f"ids.{name}")
    decl, inst = _template_decl(template)
    return "\n".join([
        *(f"#define {name} {value}" for name, value in (defines or {}).items()),
        f'#include "{SHIM}"',
        '#line 1 "header"',
        header,
        decl + f"void {spec.name}(" + ",\n    ".join(params) + ") {",
        f'#line 1 "{spec.body}"',
        source,
        "}",
        'extern "C" int harness_launch(void** args, unsigned grid, unsigned group, int order,',
        "                              unsigned long long seed, char* error, int error_len) {",
        "  std::string e = harness::launch(grid, group, harness::Order(order), seed,",
        "      [&](const harness::ThreadIds& ids) {",
        f"        {spec.name}{inst}(" + ", ".join(calls) + ");",
        "      });",
        '  std::snprintf(error, error_len, "%s", e.c_str());',
        "  return e.empty() ? 0 : 1;",
        "}",
        "",
    ])


_LIBRARIES: dict[str, ctypes.CDLL] = {}


def build(text: str) -> ctypes.CDLL:
    """Compile a translation unit once (per text, shim and compiler) and load it."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    key = hashlib.sha256("\0".join([text, SHIM.read_text(), cxx, *CXXFLAGS]).encode())
    key = key.hexdigest()[:24]
    if key in _LIBRARIES:
        return _LIBRARIES[key]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"kernel_{key}.so"
    if not library.exists():
        source = directory / f"kernel_{key}.cpp"
        source.write_text(text)
        partial = directory / f"kernel_{key}.{os.getpid()}.so"
        result = subprocess.run([cxx, *CXXFLAGS, str(source), "-o", str(partial)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source} failed:\n{result.stderr[-4000:]}")
        os.replace(partial, library)  # atomic: concurrent test runs share the cache
    lib = ctypes.CDLL(str(library))
    lib.harness_launch.restype = ctypes.c_int
    lib.harness_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_uint,
                                   ctypes.c_int, ctypes.c_ulonglong, ctypes.c_char_p,
                                   ctypes.c_int]
    _LIBRARIES[key] = lib
    return lib


class KernelError(RuntimeError):
    """The harness caught a fault: a barrier not all threads reach, divergent lanes, ..."""


def launch(spec: KernelSpec, inputs: list[Arg], output_shapes: list[tuple[int, ...]],
           output_dtypes: list[str], grid: int, threadgroup: int,
           template: list[tuple[str, object]] | None = None, order: str = "forward",
           seed: int = 0, source: str | None = None, header: str | None = None,
           defines: dict[str, object] | None = None) -> list[np.ndarray]:
    """Run the kernel like mx.fast.metal_kernel(...)(inputs=..., grid=(grid, 1, 1),
    threadgroup=(threadgroup, 1, 1), ...). source / header replace the spec's text (to test
    the harness on a broken copy); defines are macros set before the shim (its modes, e.g.
    DFLASH_HARNESS_SIMD_SKEW). Outputs start as 0xFF bytes, so unwritten values show."""
    source = spec.source() if source is None else source
    header = spec.header() if header is None else header
    lib = build(translation_unit(spec, inputs, output_dtypes, template or [], source, header,
                                 defines))
    keep = []
    for name, arg in zip(spec.input_names, inputs):
        keep.append(arg.array)
        if arg.array.ndim and f"{name}_shape" in source:
            keep.append(np.array(arg.array.shape, dtype=np.int32))
    outputs = [_poisoned(shape, TYPES[dtype][1])
               for shape, dtype in zip(output_shapes, output_dtypes)]
    pointers = (ctypes.c_void_p * (len(keep) + len(outputs)))(
        *[a.ctypes.data for a in keep + outputs])
    error = ctypes.create_string_buffer(1024)
    rc = lib.harness_launch(pointers, grid, threadgroup, ORDERS[order], seed, error, 1024)
    if rc:
        raise KernelError(error.value.decode())
    return outputs


def _poisoned(shape: tuple[int, ...], dtype) -> np.ndarray:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(size, 0xFF, dtype=np.uint8).view(dtype).reshape(shape)


def remove_nth(text: str, pattern: str, n: int) -> str:
    """text without the n-th match of the regex pattern (to break a kernel on purpose)."""
    matches = list(re.finditer(pattern, text))
    m = matches[n]
    return text[: m.start()] + text[m.end():]
