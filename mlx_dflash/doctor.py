"""``mlx-dflash doctor``: what this machine gives the package, and what is wrong with it.

Each check is a :class:`Finding` (ok, info, warn or fail, with what to do about a warning or a
failure). The command exits non-zero when any check fails.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from . import __version__, kernels
from .paths import cache_root

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
LOW_HEADROOM = 2 << 30  # less free memory than this: warn
ReportLine = Callable[[str], None]


@dataclass
class Finding:
    check: str
    status: str  # OK, INFO, WARN or FAIL
    detail: str
    fix: str | None = None


def check_platform() -> list[Finding]:
    import mlx_lm

    system, machine = platform.system(), platform.machine()
    out = [Finding("platform", INFO, f"{system} {platform.release()} {machine}, Python "
                   f"{platform.python_version()}, mlx-dflash {__version__}, MLX {mx.__version__}, "
                   f"mlx-lm {mlx_lm.__version__}")]
    if system == "Darwin" and machine != "arm64":
        out.append(Finding("platform", FAIL, "MLX runs on Apple silicon; this Mac is "
                           f"{machine}", "use a Mac with an M-series chip"))
    try:
        a = mx.ones((64, 64))
        mx.eval(a @ a)
        out.append(Finding("mlx", OK, f"runs on {mx.default_device()}"))
    except Exception as e:  # noqa: BLE001 (any failure is the finding)
        out.append(Finding("mlx", FAIL, f"a 64x64 matmul failed: {type(e).__name__}: {e}",
                           "reinstall mlx (on Linux: pip install 'mlx[cpu]')"))
    return out


def check_metal(metal: bool | None = None) -> list[Finding]:
    metal = mx.metal.is_available() if metal is None else metal
    if metal:
        info = mx.device_info()
        name = info.get("device_name", "Apple GPU")
        memory = info.get("memory_size", 0) / 2**30
        return [Finding("metal", OK, f"{name}, {memory:.0f} GiB unified memory")]
    if platform.system() == "Darwin":
        return [Finding("metal", FAIL, "Metal is not available to MLX on this Mac",
                        "check that mlx was installed for macOS arm64 (pip install mlx)")]
    return [Finding("metal", INFO, "no Metal here: MLX runs on the CPU, and the package's "
                    "kernels take their pure-MLX path (same outputs)")]


def check_kernels(metal: bool | None = None,
                  check: Callable[[kernels.Variant], str | None] = kernels.check
                  ) -> list[Finding]:
    """Each kernel variant's first-use check where there is a Metal GPU (``check``: the
    check to run; tests pass a failing one), and the MLX path of each everywhere."""
    variants = kernels.decode_variants()
    failed = []
    for v in variants:  # the pure-MLX twin runs on every machine
        try:
            mx.eval(kernels.run(v, kernels.example(v), metal=False))
        except Exception as e:  # noqa: BLE001
            failed.append(f"{v} (MLX path): {type(e).__name__}: {e}")
    metal = kernels._metal_gpu() if metal is None else metal
    forced = os.environ.get(kernels.ENV_SWITCH, "").strip().lower()
    if metal and forced != "mlx":
        failed += [f"{v}: {error}" for v in variants if (error := check(v)) is not None]
    if failed:
        return [Finding("kernels", FAIL, f"{len(failed)} of {len(variants)} variants failed: "
                        + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else ""),
                        f"decoding falls back to the MLX path (same outputs, slower); set "
                        f"{kernels.ENV_SWITCH}=mlx to skip the Metal kernels, and report this "
                        "report with the JSON of scripts/bench_kernels.py")]
    where = ("Metal kernels, each checked against its MLX twin" if metal and forced != "mlx"
             else "the MLX path" + (f" ({kernels.ENV_SWITCH}=mlx)" if forced == "mlx" else ""))
    return [Finding("kernels", OK, f"{len(variants)} variants run: {where}")]


def check_blas() -> list[Finding]:
    if not sys.platform.startswith("linux"):
        return [Finding("blas", INFO, "Apple's Accelerate (MLX's own)" if sys.platform ==
                        "darwin" else "MLX's own")]
    from . import _blas

    provider = _blas.sgemm_provider() or "unknown"
    name = Path(provider).name
    if "openblas" in name or "mkl" in name or "blis" in name:
        return [Finding("blas", OK, f"float32 matmuls through {name}")]
    return [Finding("blas", FAIL, f"float32 matmuls through {name}: the reference BLAS makes "
                    "speculative decoding slower than plain decoding on this CPU",
                    "apt-get install libopenblas0-pthread (or set MLX_DFLASH_BLAS=/path/to/"
                    "libopenblas.so), and import mlx_dflash before mlx")]


def check_memory(headroom: int | None = None) -> list[Finding]:
    from .schedule import memory_headroom

    free = memory_headroom() if headroom is None else headroom
    detail = f"{free / 2**30:.1f} GiB free for MLX"
    if free < LOW_HEADROOM:
        return [Finding("memory", WARN, detail + ": long contexts and wide verify passes "
                        "will be cut short", "close other programs or serve a smaller model")]
    return [Finding("memory", OK, detail)]


def check_cache(root: Path | None = None) -> list[Finding]:
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root):
            pass
    except OSError as e:
        return [Finding("cache", FAIL, f"{root} is not writable: {e}",
                        "set MLX_DFLASH_HOME to a writable directory")]
    costs = sorted((root / "costs").glob("*.json")) if (root / "costs").exists() else []
    pairs = [p for p in costs if not p.name.endswith(".batch.json")]
    broken = [p.name for p in pairs if not _readable(p)]
    out = [Finding("cache", OK, f"{root}: pass costs measured for {len(pairs)} model pairs "
                   "(`doctor --model M` shows a pair's)")]
    if broken:
        out.append(Finding("cache", WARN, f"unreadable pass-cost files: {', '.join(broken)}",
                           "nothing to do: they are measured anew when used"))
    return out


def _readable(path: Path) -> bool:
    try:
        return "verify_s" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def check_pair(model: object, drafter: object, label: str) -> list[Finding]:
    """What the scheduler would choose for a loaded pair: its pass costs (measured now if not
    cached) and the drafts it verifies at a few context lengths, before any acceptance is
    observed (each request then learns its own)."""
    from .drafters.base import LookupDrafts, drafting, verify_width
    from .schedule import Scheduler, bytes_per_verified_token, cached_costs
    from .target import as_target

    target = as_target(model)
    width = verify_width(drafter)
    chosen, lookups = drafting(drafter), isinstance(drafter, LookupDrafts)
    if chosen is None and not lookups:
        return [Finding("pair", INFO, f"{label}: nothing is drafted (the target alone)")]
    costs = cached_costs(target, chosen, width, 4096)
    scheduler = Scheduler(costs, width - 1, bytes_per_verified_token(target), drafts=not lookups)
    out = []
    for context in (256, 1024, 4096):
        decode = costs.verify(1, context)
        verify = ", ".join(f"{n} tokens {costs.verify(n, context) / decode:.2f}x"
                           for n in (2, 4, width) if n <= width)
        out.append(Finding("pair", OK, f"{label} at {context} tokens of context: a decode "
                           f"{decode * 1e3:.1f} ms; a verify of {verify}; " + (
                               "lookup drafts only (verified where they pay)" if lookups else
                               f"the drafter's pass {costs.draft(width - 1, context) / decode:.2f}"
                               f"x; the scheduler's first choice: "
                               f"{scheduler.choose(width - 1, context)} drafts")))
    return out


def diagnose(extra: Iterable[Finding] = ()) -> list[Finding]:
    return [*check_platform(), *check_metal(), *check_kernels(), *check_blas(),
            *check_memory(), *check_cache(), *extra]


MARKS = {OK: "ok  ", INFO: "    ", WARN: "warn", FAIL: "FAIL"}


def report(findings: list[Finding], write: ReportLine = print) -> int:
    """Print the findings; 1 if any failed, else 0."""
    for f in findings:
        write(f"[{MARKS[f.status]}] {f.check}: {f.detail}")
        if f.fix and f.status in (WARN, FAIL):
            write(f"       fix: {f.fix}")
    failed = [f.check for f in findings if f.status == FAIL]
    write(f"{len(failed)} problem(s): {', '.join(failed)}" if failed else "no problems found")
    return 1 if failed else 0
