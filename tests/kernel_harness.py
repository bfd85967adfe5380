"""Run the Metal kernels of mlx_dflash.kernels as C++ on a machine without Metal.

Two ways in: ``capture`` / ``launch_generated`` take the Metal source MLX generates for a real
wrapper's launch (printed by mx.export_function with kernels.PRINT_SOURCE on) and run it with
the wrapper's own inputs, grid and threadgroup; ``launch`` writes the function
mx.fast.metal_kernel would generate for a KernelSpec (MLX's signature rules), for random shapes
and broken copies of the sources. Either text is compiled after
metal_kernels/harness/metal_shim.h, which stands in for the Metal built-ins and runs a
threadgroup's threads as fibers or OS threads (``Mode``: see the shim), with g++ (clang for
the address-space mode) into a shared library cached by a hash of everything that goes into
it, and launched through ctypes on numpy arrays.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

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


def clang() -> str | None:
    """clang++ for the address-space mode ($CLANGXX, else clang++ on PATH), or None."""
    return os.environ.get("CLANGXX") or shutil.which("clang++")


@dataclass(frozen=True)
class Mode:
    """How strictly a launch emulates the GPU (metal_kernels/harness/metal_shim.h). The first
    four are chosen per launch (one compiled library runs them all); address_spaces compiles
    another library, with clang."""

    garbage: bool = True  # threadgroup memory starts as NaN floats / 0xA5 bytes, not zeros
    switch_on_shared: bool = False  # fibers may switch at every threadgroup-memory access
    check_sites: bool = True  # lanes in one collective must call it from the same line
    os_threads: bool = False  # one std::thread per GPU thread, real barriers and atomics
    address_spaces: bool = False  # device/constant/threadgroup distinct types (clang)

    @property
    def flags(self) -> int:
        return (self.garbage * 1 | self.switch_on_shared * 2 | self.check_sites * 4
                | self.os_threads * 8)


STRICT = Mode(switch_on_shared=True)  # with the shuffled order: the most interleavings


# For test modules that build kernels: skip them where there is no compiler.
needs_compiler = pytest.mark.skipif(
    compiler() is None, reason="no C++ compiler (g++, c++ or $CXX) to build the kernel harness")


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
            calls.append(f"*(const constant {ctype}*)args[{slot}]")
        else:
            params.append(f"const device {ctype}* {name}")
            calls.append(f"(const device {ctype}*)args[{slot}]")
            if f"{name}_shape" in source:
                params.append(f"const constant int* {name}_shape")
                calls.append(f"(const constant int*)args[{slot + 1}]")
    for name, dtype in zip(spec.output_names, output_dtypes):
        ctype = TYPES[dtype][0]
        params.append(f"device {ctype}* {name}")
        calls.append(f"(device {ctype}*)args[{len(calls)}]")
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
        *_launcher(f"{spec.name}{inst}", calls),
    ])


_LIBRARIES: dict[str, ctypes.CDLL] = {}


def build(text: str, address_spaces: bool = False) -> ctypes.CDLL:
    """Compile a translation unit once (per text, shim and compiler) and load it; with
    address_spaces, by clang with Metal's address spaces as distinct types."""
    cxx = clang() if address_spaces else compiler()
    if cxx is None:
        raise RuntimeError("no clang++" if address_spaces else "no C++ compiler")
    if address_spaces:
        text = "#define DFLASH_HARNESS_ADDRESS_SPACES 1\n" + text
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
                                   ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
                                   ctypes.c_char_p, ctypes.c_int]
    _LIBRARIES[key] = lib
    return lib


class KernelError(RuntimeError):
    """The harness caught a fault: a barrier not all threads reach, divergent lanes, ..."""


def launch(spec: KernelSpec, inputs: list[Arg], output_shapes: list[tuple[int, ...]],
           output_dtypes: list[str], grid: int, threadgroup: int,
           template: list[tuple[str, object]] | None = None, order: str = "forward",
           seed: int = 0, source: str | None = None, header: str | None = None,
           defines: dict[str, object] | None = None, mode: Mode = Mode()) -> list[np.ndarray]:
    """Run the kernel like mx.fast.metal_kernel(...)(inputs=..., grid=(grid, 1, 1),
    threadgroup=(threadgroup, 1, 1), ...). source / header replace the spec's text (to test
    the harness on a broken copy); defines are macros set before the shim (its modes, e.g.
    DFLASH_HARNESS_SIMD_SKEW). Outputs start as 0xFF bytes, so unwritten values show."""
    source = spec.source() if source is None else source
    header = spec.header() if header is None else header
    lib = build(translation_unit(spec, inputs, output_dtypes, template or [], source, header,
                                 defines), mode.address_spaces)
    keep = []
    for name, arg in zip(spec.input_names, inputs):
        keep.append(arg.array)
        if arg.array.ndim and f"{name}_shape" in source:
            keep.append(np.array(arg.array.shape, dtype=np.int32))
    outputs = [_poisoned(shape, TYPES[dtype][1])
               for shape, dtype in zip(output_shapes, output_dtypes)]
    return _run(lib, keep + outputs, outputs, grid, threadgroup, order, seed, mode)


def launch_verify(spec: KernelSpec, inputs: list[Arg], drafts: np.ndarray, positions: int,
                  threads: int, **kw) -> list[np.ndarray]:
    """A verify kernel launched as its wrapper does (a threadgroup of ``threads`` per row and
    position), its per-position outputs turned into (accepted_len [B], next_token [B])."""
    B = drafts.shape[0]
    n_outputs = len(spec.output_names)
    raw = launch(spec, inputs, [(B, positions)] * n_outputs, ["uint32"] * n_outputs,
                 grid=B * positions * threads, threadgroup=threads, **kw)
    return settle(spec, raw, drafts)


def settle(spec: KernelSpec, outputs: list[np.ndarray], drafts: np.ndarray
           ) -> list[np.ndarray]:
    """A verify kernel's per-position outputs as its wrapper returns them
    (kernels.first_rejection); other kernels' outputs as they are."""
    import mlx.core as mx
    from mlx_dflash import kernels

    if spec == kernels.VERIFY_GREEDY:
        tokens = mx.array(outputs[0])
        passes = kernels.greedy_passes(mx.array(drafts), tokens)
    elif spec in (kernels.VERIFY_SAMPLE_DENSE, kernels.VERIFY_SAMPLE_CANDIDATES):
        passes, tokens = mx.array(outputs[0])[:, :-1], mx.array(outputs[1])
    else:
        return outputs
    return [np.array(a) for a in kernels.first_rejection(passes, tokens)]


def _poisoned(shape: tuple[int, ...], dtype) -> np.ndarray:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.full(size, 0xFF, dtype=np.uint8).view(dtype).reshape(shape)


def remove_nth(text: str, pattern: str, n: int) -> str:
    """text without the n-th match of the regex pattern (to break a kernel on purpose)."""
    matches = list(re.finditer(pattern, text))
    m = matches[n]
    return text[: m.start()] + text[m.end():]


# ---------------------------------------------------------------------------------------------
# The kernels as MLX generates them: the real wrappers (mlx_dflash.kernels) launch each kernel
# inside mx.export_function with PRINT_SOURCE on, which makes MLX print the Metal source it
# generates; that text, translated only as far as C++ needs, runs here with the wrappers' own
# inputs, grid and threadgroup.


@dataclass
class Param:
    """One parameter of a generated kernel: its type as MLX writes it, and its name."""

    type: str
    name: str


@dataclass
class Generated:
    """One launch of a wrapper: the kernel's generated source and the launch's arguments."""

    spec: KernelSpec
    text: str  # the generated Metal source, as printed
    kernel: str  # custom_kernel_<name>_<dtype codes>
    params: list[Param]
    template_args: str  # "<16>", or "" for a kernel without a template
    inputs: dict[str, np.ndarray]  # by input name, as the wrapper passed them (padded)
    input_dtypes: dict[str, str]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[str]

    @property
    def signature(self) -> str:
        return self.kernel + "(" + ", ".join(f"{p.type} {p.name}" for p in self.params) + ")"


class _Recorder:
    """Stands in for the object mx.fast.metal_kernel returns: records each call's arguments;
    ``run`` says whether to launch the real kernel (inside export_function: to print the
    source) or to return zeros (outside it: to read the inputs' values)."""

    def __init__(self, spec, real, calls, run):
        self.spec, self.real, self.calls, self.run = spec, real, calls, run

    def __call__(self, **kwargs):
        self.calls.append((self.spec, kwargs))
        if self.run:
            return self.real(**kwargs)
        import mlx.core as mx
        return [mx.zeros(s, dtype=d) for s, d in zip(kwargs["output_shapes"],
                                                       kwargs["output_dtypes"])]


def _numpy(a) -> tuple[np.ndarray, str]:
    import mlx.core as mx
    from mlx_dflash.kernels import dtype_name
    name = dtype_name(a.dtype)
    if name == "bfloat16":
        return np.array(a.view(mx.uint16)), name
    return np.array(a), name


def _stdout_of(fn) -> str:
    """What fn writes to the process's stdout (fd 1, C level included)."""
    import sys
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


_GENERATED = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", re.S)
_KERNEL = re.compile(r"\[\[kernel\]\] void (custom_kernel_\w+)\((.*?)\) \{", re.S)
_INSTANCE = re.compile(r"^template \[\[host_name\(.*?\)\]\] \[\[kernel\]\] "
                       r"decltype\((\w+)(<.*?>)\) \1<.*?>;\s*$", re.M)
_ATTRIBUTE = re.compile(r"[ \t]*\[\[\w+(\([^()]*\))?\]\]")


def capture(call) -> list[Generated]:
    """The kernels a call of a Metal wrapper launches. ``call(*arrays)`` is run twice: with the
    kernels stubbed, to read the inputs the wrapper makes (padding, dummies, scalars), and
    inside mx.export_function with PRINT_SOURCE on, for MLX's generated source. ``call`` takes
    no arguments; it is traced with none (its arrays are constants of the export)."""
    import mlx.core as mx
    from mlx_dflash import kernels

    real_kernel = kernels._kernel
    calls: list = []

    def stub(run):
        return lambda spec: _Recorder(spec, real_kernel(spec), calls, run)

    try:
        kernels._kernel = stub(False)
        outputs = call()
        mx.eval([o for o in outputs if o is not None])
        values = list(calls)
        calls.clear()
        kernels._kernel = stub(True)
        kernels.PRINT_SOURCE = True
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "f.mlxfn")
            printed = _stdout_of(lambda: mx.export_function(
                path, lambda: [o for o in call() if o is not None]))
    finally:
        kernels._kernel = real_kernel
        kernels.PRINT_SOURCE = False
    sources = _GENERATED.findall(printed)
    if len(sources) != len(values) or len(calls) != len(values):
        raise RuntimeError(f"{len(values)} launches, {len(calls)} traced, {len(sources)} "
                           f"sources printed:\n{printed[:2000]}")
    out = []
    for (spec, kw), (spec2, kw2), (name, text) in zip(values, calls, sources):
        assert spec == spec2 and name == spec.name, (spec, spec2, name)
        for key in ("grid", "threadgroup", "output_shapes", "template"):
            assert kw.get(key) == kw2.get(key), key
        m = _KERNEL.search(text)
        params = []
        for raw in m.group(2).split(","):
            words = _ATTRIBUTE.sub("", raw).strip().rsplit(None, 1)
            params.append(Param(words[0], words[1]))
        inst = _INSTANCE.search(text)
        arrays = [_numpy(a) for a in kw["inputs"]]
        out.append(Generated(
            spec=spec, text=text, kernel=m.group(1), params=params,
            template_args=inst.group(2) if inst else "",
            inputs={n: a for n, (a, _) in zip(spec.input_names, arrays)},
            input_dtypes={n: d for n, (_, d) in zip(spec.input_names, arrays)},
            grid=tuple(kw["grid"]), threadgroup=tuple(kw["threadgroup"]),
            output_shapes=[tuple(s) for s in kw["output_shapes"]],
            output_dtypes=[kernels.dtype_name(d) for d in kw["output_dtypes"]]))
    return out


def generated_unit(gen: Generated, defines: dict[str, object] | None = None) -> str:
    """The C++ text for a generated kernel: MLX's text with its [[...]] attributes and
    explicit instantiations removed (the launcher instantiates the template by calling it),
    and a launcher binding each parameter by name."""
    text = _INSTANCE.sub("", gen.text)
    text = _ATTRIBUTE.sub("", text)
    calls, slot = [], 0
    for p in gen.params:
        if p.name in ATTRIBUTES:
            calls.append(f"ids.{p.name}")
            continue
        # C-style casts: they also cast into a named address space (the clang mode)
        if p.type.endswith("&"):
            calls.append(f"*({p.type[:-1].strip()}*)args[{slot}]")
        else:
            calls.append(f"({p.type})args[{slot}]")
        slot += 1
    return "\n".join([
        *(f"#define {name} {value}" for name, value in (defines or {}).items()),
        f'#include "{SHIM}"',
        f'#line 1 "{gen.spec.name} (generated)"',
        text,
        *_launcher(f"{gen.kernel}{gen.template_args}", calls),
    ])


def _launcher(call: str, args: list[str]) -> list[str]:
    return [
        'extern "C" int harness_launch(void** args, unsigned grid, unsigned group, int order,',
        "                              unsigned long long seed, int flags, char* error,",
        "                              int error_len) {",
        "  std::string e = harness::launch(grid, group, harness::Order(order), seed, flags,",
        "      [&](const harness::ThreadIds& ids) {",
        f"        {call}(" + ", ".join(args) + ");",
        "      });",
        '  std::snprintf(error, error_len, "%s", e.c_str());',
        "  return e.empty() ? 0 : 1;",
        "}",
        "",
    ]


def launch_generated(gen: Generated, order: str = "forward", seed: int = 0,
                     defines: dict[str, object] | None = None, mode: Mode = Mode(),
                     text: str | None = None) -> list[np.ndarray]:
    """Run a captured launch: the wrapper's inputs, grid and threadgroup; outputs (in the
    spec's order) start as 0xFF bytes. text replaces the generated source (a broken copy)."""
    (gx, gy, gz), (tx, ty, tz) = gen.grid, gen.threadgroup
    if (gy, gz, ty, tz) != (1, 1, 1, 1) or gx % tx:
        raise NotImplementedError(f"a 1-D launch only: grid {gen.grid}, group {gen.threadgroup}")
    if text is not None:
        gen = replace(gen, text=text)
    lib = build(generated_unit(gen, defines), mode.address_spaces)
    outputs = [_poisoned(shape, TYPES[dtype][1])
               for shape, dtype in zip(gen.output_shapes, gen.output_dtypes)]
    by_name = dict(zip(gen.spec.output_names, outputs))
    buffers = []
    for p in gen.params:
        if p.name in ATTRIBUTES:
            continue
        if p.name in gen.inputs:
            buffers.append(np.ascontiguousarray(gen.inputs[p.name]))
        elif p.name in by_name:
            buffers.append(by_name[p.name])
        elif p.name.endswith("_shape") and p.name[:-6] in gen.inputs:
            buffers.append(np.array(gen.inputs[p.name[:-6]].shape, dtype=np.int32))
        else:
            raise NotImplementedError(f"no binding for parameter {p.type} {p.name}")
    return _run(lib, buffers, outputs, gx, tx, order, seed, mode)


def _run(lib, buffers, outputs, grid, group, order, seed, mode):
    pointers = (ctypes.c_void_p * len(buffers))(*[a.ctypes.data for a in buffers])
    error = ctypes.create_string_buffer(1024)
    rc = lib.harness_launch(pointers, grid, group, ORDERS[order], seed, mode.flags, error, 1024)
    if rc:
        raise KernelError(error.value.decode())
    return outputs
