"""Fused kernels for the per-cycle steps: verification and DFlash 2 path selection.

On an Apple GPU every small MLX op in a cycle is its own launch; each step here is one Metal
kernel instead (sources in the repository's top-level ``metal_kernels/``, shipped inside the
package). Every kernel has a pure-MLX path computing the same function, which runs where there
is no Metal, and against which the kernels are tested (tests/test_kernel_harness.py compiles
the kernel sources as C++ on any machine).

The choice is made once per process (:func:`backend`): the kernels where Metal is available
and the GPU is the default device, the MLX path otherwise; ``MLX_DFLASH_KERNELS=metal`` or
``=mlx`` forces one. Each kernel variant (:class:`Variant`: what MLX compiles apart) is checked
against its MLX twin at first use, eagerly, on small inputs at the largest threadgroup the
decode loop launches; if one fails to compile, to run or to agree, the rest of the process runs
the MLX path, after one warning (with ``=metal``, an error instead). Past that first check
nothing here syncs with the host.

Randomness comes in as uniforms in [0, 1), so both paths are deterministic functions of their
inputs; the callers draw them with ``mx.random.uniform``.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

# The package's link to the repository's metal_kernels/ (a copy of it inside a wheel).
KERNEL_DIR = Path(__file__).parent / "metal_kernels"

ENV_SWITCH = "MLX_DFLASH_KERNELS"


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as mx.fast.metal_kernel takes it: a body file, header files, argument names."""

    name: str
    body: str
    headers: tuple[str, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def source(self) -> str:
        return (KERNEL_DIR / self.body).read_text()

    def header(self) -> str:
        return "".join((KERNEL_DIR / h).read_text() for h in self.headers)


# The verify kernels give one result per position (a threadgroup each, so that a row's
# positions run side by side); first_rejection turns them into the step's outputs.
VERIFY_GREEDY = KernelSpec(
    "dflash_verify_greedy", "verify_greedy.metal", ("common.h",), ("logits",), ("tokens",))
VERIFY_SAMPLE_DENSE = KernelSpec(
    "dflash_verify_sample_dense", "verify_sample_dense.metal", ("common.h", "verify.h"),
    ("logits", "drafts", "draft_probs", "uniforms", "inv_temperature", "top_k"),
    ("passes", "tokens"))
VERIFY_SAMPLE_CANDIDATES = KernelSpec(
    "dflash_verify_sample_candidates", "verify_sample_candidates.metal", ("common.h", "verify.h"),
    ("logits", "drafts", "cand_ids", "cand_probs", "uniforms", "inv_temperature", "top_k"),
    ("passes", "tokens"))
SAMPLE_ROWS = KernelSpec(
    "dflash_sample_rows", "sample_rows.metal", ("common.h", "verify.h"),
    ("logits", "uniforms", "inv_temperature", "top_k"), ("tokens",))
PATH_SELECT_GREEDY = KernelSpec(
    "dflash_path_select_greedy", "path_select_greedy.metal", ("common.h", "path_select.h"),
    ("first", "rest", "n_steps"), ("picks",))
PATH_SELECT_SAMPLE = KernelSpec(
    "dflash_path_select_sample", "path_select_sample.metal", ("common.h", "path_select.h"),
    ("first", "rest", "uniforms", "n_steps", "inv_temperature"), ("picks", "probs"))
SPECS = (VERIFY_GREEDY, VERIFY_SAMPLE_DENSE, VERIFY_SAMPLE_CANDIDATES, SAMPLE_ROWS,
         PATH_SELECT_GREEDY, PATH_SELECT_SAMPLE)

# path_select holds one candidate per lane of a simdgroup.
MAX_PATH_CANDIDATES = 32

STEPS = ("verify_greedy", "verify_sample", "verify_sample_candidates", "sample_rows",
         "path_select")


@dataclass(frozen=True)
class Variant:
    """One kernel as MLX compiles it apart: by its inputs' dtypes, their address spaces
    (constant for dummies and small inputs) and its template. Named by what decides those:
    the step, the logits' dtype, whether there are drafts (path_select: more than one step;
    sample_rows: always), the candidates K and, for path_select, whether it samples."""

    step: str
    dtype: str = "float32"
    drafted: bool = True
    candidates: int = 0
    sampled: bool = False

    def __str__(self) -> str:
        parts = [self.step, self.dtype]
        if self.step != "sample_rows":
            parts.append("drafts" if self.drafted else "no drafts")
        if self.candidates:
            parts.append(f"K={self.candidates}")
        if self.step == "path_select":
            parts.append("sampled" if self.sampled else "greedy")
        return " ".join(parts)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


_backend: str | None = None  # "metal" | "mlx", once decided
_forced = False  # MLX_DFLASH_KERNELS=metal: a failing kernel is an error, not a fallback
_checked: set[Variant] = set()  # variants that ran and agreed with their MLX twins


def backend() -> str:
    """"metal" or "mlx", decided once per process (a kernel variant failing its first-use
    check turns "metal" into "mlx" for the rest of it)."""
    global _backend, _forced
    if _backend is None:
        choice = os.environ.get(ENV_SWITCH, "").strip().lower()
        if choice not in ("", "auto", "metal", "mlx"):
            raise ValueError(f"{ENV_SWITCH} must be metal, mlx or auto, got {choice!r}")
        if choice == "metal" and not _metal_gpu():
            raise RuntimeError(f"{ENV_SWITCH}=metal, but there is no Metal GPU (or it is not "
                               "MLX's default device)")
        _forced = choice == "metal"
        if choice in ("metal", "mlx"):
            _backend = choice
        else:
            _backend = "metal" if _metal_gpu() else "mlx"
    return _backend


def reset_backend() -> None:
    """Forget the choice and the checked variants (the next call decides anew)."""
    global _backend, _forced
    _backend, _forced = None, False
    _checked.clear()


def _use_metal(variant: Variant) -> bool:
    """Whether this call runs the kernel: the backend is Metal and the variant has passed its
    first-use check against its MLX twin (run now, eagerly, if it has not)."""
    global _backend
    if backend() != "metal":
        return False
    if variant not in _checked:
        error = check(variant)
        if error is not None:
            message = (f"mlx_dflash: the Metal kernel {variant} failed its first-use check: "
                       f"{error}")
            if _forced:
                raise RuntimeError(f"{message} ({ENV_SWITCH}=metal)")
            _backend = "mlx"
            warnings.warn(f"{message}. This process runs the MLX path instead (same outputs, "
                          "slower); please report it with the JSON of "
                          "scripts/bench_kernels.py.", RuntimeWarning, stacklevel=3)
            return False
        _checked.add(variant)
    return True


def _metal_gpu() -> bool:
    """Metal is there and MLX runs ops on the GPU by default (not after
    ``mx.set_default_device(mx.cpu)``, where a kernel launch would fail)."""
    return mx.metal.is_available() and mx.default_device().type == mx.gpu


@functools.cache
def _kernel(spec: KernelSpec):
    return mx.fast.metal_kernel(
        name=spec.name, input_names=list(spec.input_names),
        output_names=list(spec.output_names), source=spec.source(), header=spec.header())


# True: each launch prints the Metal source MLX generates for it (the CI check reads it).
PRINT_SOURCE = False


def _launch(spec: KernelSpec, inputs: list[mx.array], groups: int, threads: int,
            output_shapes: list, output_dtypes: list, template: list | None = None
            ) -> list[mx.array]:
    """``groups`` threadgroups of ``threads`` each. Every array input holds at least
    MIN_DEVICE_ELEMENTS elements: MLX passes smaller ones in ``constant`` memory, which would
    make another compiled variant of the kernel."""
    inputs = [_device_sized(a) for a in inputs]
    options = {"template": template} if template else {}
    return _kernel(spec)(inputs=inputs, grid=(groups * threads, 1, 1),
                         threadgroup=(threads, 1, 1), output_shapes=output_shapes,
                         output_dtypes=output_dtypes, verbose=PRINT_SOURCE, **options)


@functools.lru_cache
def _scalar(value: float | int, dtype: mx.Dtype) -> mx.array:
    """A cached 0-d array, which a kernel gets as a constant."""
    return mx.array(value, dtype=dtype)


def row_threads(vocab: int, most: int = 1024) -> int:
    """Threads of a threadgroup that scans one vocabulary row (whole simdgroups)."""
    return min(most, max(32, vocab // 8 // 32 * 32))


# The sampling kernels keep more per thread (radix counts, candidates); fewer threads keep them
# under a pipeline's thread limit (untested on a GPU: tune with scripts/bench_kernels.py).
SAMPLE_THREADS = 512


# ---------------------------------------------------------------------------------------------
# The MLX path: the same functions in MLX ops.


def top_k_mask(x: mx.array, k: int) -> mx.array:
    """The k largest values of each row of x [..., V]; of the values equal to the k-th
    largest, the lowest ids (mlx-lm's apply_top_k leaves that choice unspecified)."""
    V = x.shape[-1]
    kth = mx.partition(x, V - k, axis=-1)[..., V - k : V - k + 1]
    above = x > kth
    ties = x == kth
    room = k - above.astype(mx.int32).sum(axis=-1, keepdims=True)
    return above | (ties & (mx.cumsum(ties.astype(mx.int32), axis=-1) <= room))


# Sums over a vocabulary go in blocks: one float32 sum over 150k values on the CPU is off by
# ~1e-4 relative (every probability with it), a sum of block sums by ~1e-6.
SUM_BLOCK = 1024


@functools.lru_cache
def _block_size(n: int) -> int:
    """A block size near SUM_BLOCK that divides n (no padding copy), else SUM_BLOCK."""
    for size in range(SUM_BLOCK, 2 * SUM_BLOCK + 1):
        if n % size == 0:
            return size
    return SUM_BLOCK


def _blocks(x: mx.array) -> mx.array:
    """x [..., N] -> [..., blocks, size], zero-padded when no size near SUM_BLOCK divides N."""
    n = x.shape[-1]
    size = _block_size(n)
    pad = -n % size
    if pad:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, size)


def blocked_sum(x: mx.array) -> mx.array:
    """Sum over the last axis (kept), in blocks."""
    if x.shape[-1] <= SUM_BLOCK:
        return x.sum(axis=-1, keepdims=True)
    return _blocks(x).sum(axis=-1).sum(axis=-1, keepdims=True)


def blocked_cumsum(x: mx.array) -> mx.array:
    """Cumulative sum over the last axis, in blocks."""
    n = x.shape[-1]
    if n <= SUM_BLOCK:
        return mx.cumsum(x, axis=-1)
    within = mx.cumsum(_blocks(x), axis=-1)
    before = mx.cumsum(within[..., -1], axis=-1, inclusive=False)
    return (within + before[..., None]).reshape(*x.shape[:-1], -1)[..., :n]


def target_probs(logits: mx.array, temperature: float, top_k: int = 0) -> mx.array:
    """softmax(x / T) over the top-k tokens (all when top_k is 0), x the float32 logits."""
    x = logits.astype(mx.float32)
    scaled = x * (1.0 / temperature)
    if 0 < top_k < x.shape[-1]:
        scaled = mx.where(top_k_mask(x, top_k), scaled, -mx.inf)
    e = mx.exp(scaled - scaled.max(axis=-1, keepdims=True))
    return e / blocked_sum(e)


def sample_index(weights: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse CDF: per row of weights [B, N] (>= 0, some positive) the first index whose
    cumulative weight exceeds u * total and whose own weight is positive; the last positive
    index when rounding leaves none. uniforms [B] in [0, 1). -> uint32 [B].

    The total is the last cumulative weight, not a separate sum: were they to differ by
    rounding, the difference would go to the last token."""
    positive = weights > 0
    cumulative = blocked_cumsum(weights)
    hit = (cumulative > uniforms[:, None] * cumulative[:, -1:]) & positive
    last = weights.shape[-1] - 1 - mx.argmax(positive[:, ::-1], axis=-1)
    return mx.where(hit.any(axis=-1), mx.argmax(hit, axis=-1), last).astype(mx.uint32)


def first_rejection(passes: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """passes [B, L]: whether each draft passes its own position's test; tokens [B, L+1]: the
    token each position emits if the row stops there. -> (accepted_len [B], next_token [B]),
    uint32: the drafts before the first that fails, and the token of that position."""
    B, L = passes.shape
    if L:
        accepted = mx.cumprod(passes.astype(mx.int32), axis=-1).sum(axis=-1)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)
    token = mx.take_along_axis(tokens, accepted[:, None], axis=-1)[:, 0]
    return accepted.astype(mx.uint32), token.astype(mx.uint32)


def greedy_passes(drafts: mx.array, tokens: mx.array) -> mx.array:
    """Each draft [B, L] equals the argmax of its position (tokens [B, L+1])."""
    return drafts.astype(mx.uint32) == tokens[:, : drafts.shape[-1]]


def verify_greedy_mlx(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """MLX path of :func:`verify_greedy`."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)  # [B, L+1]
    return first_rejection(greedy_passes(drafts, tokens), tokens)


def _verify_sample_mlx(logits, drafts, uniforms, temperature, top_k, q_of_drafts, residual_at):
    """The rejection step, given q at the drafts [B, L] and the residual of a row."""
    B, P, _ = logits.shape
    L = P - 1
    p = target_probs(logits, temperature, top_k)  # [B, L+1, V]
    if L:
        idx = drafts.astype(mx.int32)[..., None]
        p_d = mx.take_along_axis(p[:, :L], idx, axis=-1)[..., 0]
        accept = uniforms[:, :L] * q_of_drafts(idx) < p_d
        accepted = mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)
    p_row = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = residual_at(p_row, accepted) if L else p_row
    # Zero residual mass only happens when p == q; then p itself is the right distribution.
    mass = blocked_sum(residual)
    weights = mx.where(mass > 0, residual, p_row)
    return accepted.astype(mx.uint32), sample_index(weights, uniforms[:, L])


def _proposal_row(table: mx.array, accepted: mx.array,
                  drafted: int) -> tuple[mx.array, mx.array]:
    """Row ``accepted`` of table [B, L, ...] (the last where accepted == L), and whether that
    position has a proposal at all [B, 1] (not the bonus position)."""
    row = mx.minimum(accepted, drafted - 1)[:, None, None]
    present = (accepted < drafted)[:, None]
    return mx.take_along_axis(table, row, axis=1)[:, 0], present


def verify_sample_mlx(logits: mx.array, drafts: mx.array, draft_probs: mx.array,
                      uniforms: mx.array, temperature: float = 1.0,
                      top_k: int = 0) -> tuple[mx.array, mx.array]:
    """MLX path of :func:`verify_sample`."""
    L = drafts.shape[-1]

    def q_of_drafts(idx):
        return mx.take_along_axis(draft_probs, idx, axis=-1)[..., 0]

    def residual_at(p_row, accepted):
        q, present = _proposal_row(draft_probs, accepted, L)
        return mx.maximum(p_row - q * present, 0.0)

    return _verify_sample_mlx(logits, drafts, uniforms, temperature, top_k, q_of_drafts,
                              residual_at)


def verify_sample_candidates_mlx(logits: mx.array, drafts: mx.array, cand_ids: mx.array,
                                 cand_probs: mx.array, uniforms: mx.array,
                                 temperature: float = 1.0,
                                 top_k: int = 0) -> tuple[mx.array, mx.array]:
    """MLX path of :func:`verify_sample_candidates`."""
    L = drafts.shape[-1]
    cand_ids = cand_ids.astype(mx.uint32)

    def q_of_drafts(idx):
        hits = cand_ids == idx.astype(mx.uint32)
        return (hits * cand_probs).sum(axis=-1)

    def residual_at(p_row, accepted):
        ids, _ = _proposal_row(cand_ids, accepted, L)
        q, present = _proposal_row(cand_probs, accepted, L)
        ids = ids.astype(mx.int32)
        p_at = mx.take_along_axis(p_row, ids, axis=-1)
        return mx.put_along_axis(p_row, ids, mx.maximum(p_at - q * present, 0.0), axis=-1)

    return _verify_sample_mlx(logits, drafts, uniforms, temperature, top_k, q_of_drafts,
                              residual_at)


def sample_rows_mlx(logits: mx.array, uniforms: mx.array, temperature: float = 1.0,
                    top_k: int = 0) -> mx.array:
    """MLX path of :func:`sample_rows`."""
    return sample_index(target_probs(logits, temperature, top_k), uniforms)


def argmax_rows_mlx(logits: mx.array) -> mx.array:
    """MLX path of :func:`argmax_rows`."""
    return mx.argmax(logits, axis=-1).astype(mx.uint32)


def path_select_mlx(first: mx.array, rest: mx.array, uniforms: mx.array | None = None,
                    temperature: float = 0.0) -> tuple[mx.array, mx.array | None]:
    """MLX path of :func:`path_select`."""
    greedy = temperature == 0
    rows, picks, probs = first, [], []
    for t in range(rest.shape[1] + 1):
        if t:  # the scores given the pick at t-1
            rows = mx.take_along_axis(rest[:, t - 1], picks[-1][:, None, None], axis=1)[:, 0]
        if greedy:
            picks.append(mx.argmax(rows, axis=-1).astype(mx.uint32))
        else:
            q = mx.softmax(rows.astype(mx.float32) * (1.0 / temperature), axis=-1)
            probs.append(q)
            picks.append(sample_index(q, uniforms[:, t]))
    return mx.stack(picks, axis=1), None if greedy else mx.stack(probs, axis=1)


# ---------------------------------------------------------------------------------------------
# The Metal path: one launch per call.


# MLX passes an input of fewer elements than this as `constant` (a 0-d one as a reference).
MIN_DEVICE_ELEMENTS = 8


def _dummy(dtype: mx.Dtype) -> mx.array:
    """Stands in for an empty input (no drafts), in the input's own dtype so that the kernel
    compiled is the one the full input uses: the kernel never reads it."""
    return _zeros(MIN_DEVICE_ELEMENTS, dtype)


@functools.lru_cache
def _zeros(n: int, dtype: mx.Dtype) -> mx.array:
    return mx.zeros((n,), dtype=dtype)


def _device_sized(a: mx.array) -> mx.array:
    """0-d inputs stay (constants by design); others padded flat to MIN_DEVICE_ELEMENTS. The
    kernels index these inputs by row and position, never by their shapes."""
    if a.ndim == 0 or a.size >= MIN_DEVICE_ELEMENTS:
        return a
    return mx.concatenate([a.reshape(-1), _zeros(MIN_DEVICE_ELEMENTS - a.size, a.dtype)])


def verify_greedy_metal(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Metal path of :func:`verify_greedy`."""
    B, P, V = logits.shape
    (tokens,) = _launch(VERIFY_GREEDY, [logits], B * P, row_threads(V),
                        output_shapes=[(B, P)], output_dtypes=[mx.uint32])
    return first_rejection(greedy_passes(drafts, tokens), tokens)


def _verify_sample_metal(spec, logits, drafts, proposal, uniforms, temperature, top_k,
                         template):
    B, P, V = logits.shape
    empty = P == 1
    inputs = [logits, _dummy(mx.uint32) if empty else drafts.astype(mx.uint32)]
    inputs += [_dummy(a.dtype) if empty else a for a in proposal]
    inputs += [uniforms.astype(mx.float32), _scalar(1.0 / temperature, mx.float32),
               _scalar(top_k if 0 < top_k < V else 0, mx.int32)]
    passes, tokens = _launch(spec, inputs, B * P, row_threads(V, SAMPLE_THREADS),
                             output_shapes=[(B, P), (B, P)],
                             output_dtypes=[mx.uint32, mx.uint32], template=template)
    return first_rejection(passes[:, : P - 1], tokens)


def verify_sample_metal(logits, drafts, draft_probs, uniforms, temperature=1.0, top_k=0):
    """Metal path of :func:`verify_sample`."""
    return _verify_sample_metal(VERIFY_SAMPLE_DENSE, logits, drafts,
                                [draft_probs.astype(mx.float32)], uniforms, temperature,
                                top_k, None)


def verify_sample_candidates_metal(logits, drafts, cand_ids, cand_probs, uniforms,
                                   temperature=1.0, top_k=0):
    """Metal path of :func:`verify_sample_candidates`."""
    proposal = [cand_ids.astype(mx.uint32), cand_probs.astype(mx.float32)]
    return _verify_sample_metal(VERIFY_SAMPLE_CANDIDATES, logits, drafts, proposal, uniforms,
                                temperature, top_k, [("K", cand_ids.shape[-1])])


def sample_rows_metal(logits, uniforms, temperature=1.0, top_k=0):
    """Metal path of :func:`sample_rows`."""
    R, V = logits.shape
    (tokens,) = _launch(SAMPLE_ROWS, [logits, uniforms.astype(mx.float32),
                                      _scalar(1.0 / temperature, mx.float32),
                                      _scalar(top_k if 0 < top_k < V else 0, mx.int32)],
                        R, row_threads(V, SAMPLE_THREADS), output_shapes=[(R,)],
                        output_dtypes=[mx.uint32])
    return tokens


def argmax_rows_metal(logits):
    """Metal path of :func:`argmax_rows`: verify_greedy's kernel, whose per-position argmax
    is this."""
    R, V = logits.shape
    (tokens,) = _launch(VERIFY_GREEDY, [logits[None]], R, row_threads(V),
                        output_shapes=[(1, R)], output_dtypes=[mx.uint32])
    return tokens[0]


def path_select_metal(first, rest, uniforms=None, temperature=0.0):
    """Metal path of :func:`path_select`."""
    B, K = first.shape
    n = rest.shape[1] + 1
    rest = rest.astype(mx.float32) if n > 1 else _dummy(mx.float32)
    first = first.astype(mx.float32)
    if temperature == 0:
        (picks,) = _launch(PATH_SELECT_GREEDY, [first, rest, _scalar(n, mx.int32)], B, 32,
                           output_shapes=[(B, n)], output_dtypes=[mx.uint32],
                           template=[("K", K)])
        return picks, None
    picks, probs = _launch(
        PATH_SELECT_SAMPLE, [first, rest, uniforms.astype(mx.float32), _scalar(n, mx.int32),
                             _scalar(1.0 / temperature, mx.float32)], B, 32,
        output_shapes=[(B, n), (B, n, K)], output_dtypes=[mx.uint32, mx.float32],
        template=[("K", K)])
    return picks, probs


# ---------------------------------------------------------------------------------------------
# The first-use check: each variant on small inputs, next to its MLX twin. The CI check
# (tests/test_kernel_variants.py) and scripts/bench_kernels.py use the same variants and inputs.
#
# The inputs have clear margins: one token per position carries most of the probability, and
# the uniforms fall well inside it, so float rounding cannot decide a sample.

# Large enough that every kernel launches its largest threadgroup (row_threads' cap).
CHECK_VOCAB = 8 * 1024
DTYPES = ("float32", "bfloat16", "float16")
CANDIDATES = (1, 16)  # copied blocks; DFlash 2's walk and DSpark's Markov walk


def decode_variants() -> list[Variant]:
    """Every variant the decode loop can launch: each step with and without drafts, logits
    in float32, bfloat16 and float16, the candidate counts it uses, the walk greedy and
    sampled."""
    out = []
    for dtype in DTYPES:
        for drafted in (False, True):
            out.append(Variant("verify_greedy", dtype, drafted))
            out.append(Variant("verify_sample", dtype, drafted))
            out += [Variant("verify_sample_candidates", dtype, drafted, K) for K in CANDIDATES]
        out.append(Variant("sample_rows", dtype))
    out += [Variant("path_select", "float32", drafted, 16, sampled)
            for drafted in (False, True) for sampled in (False, True)]
    return out


def example(variant: Variant, drafts: int = 3, vocab: int = CHECK_VOCAB,
            seed: int = 0) -> dict[str, Any]:
    """Arguments of the variant's step (``drafts`` drafts when it has any; path_select:
    ``drafts + 1`` steps), with clear margins: at each position one token carries ~95% of
    the target's probability; the drafts follow it except the last one, which the target
    rejects, so both the accepting and the residual branches run."""
    rng = np.random.default_rng(seed)
    L = drafts if variant.drafted else 0
    if variant.step == "path_select":
        K, n = variant.candidates, L + 1
        first = rng.standard_normal((1, K)).astype(np.float32)
        first[0, 3 % K] += 12.0
        rest = rng.standard_normal((1, n - 1, K, K)).astype(np.float32)
        rest[..., np.arange(K), (np.arange(K) * 5 + 1) % K] += 12.0
        args = {"first": mx.array(first), "rest": mx.array(rest)}
        if variant.sampled:
            args["uniforms"] = mx.array(np.full((1, n), 0.5, np.float32))
            args["temperature"] = 0.8
        return args
    peaks = (np.arange(L + 1) * 17 + 5) % vocab
    logits = rng.standard_normal((1, L + 1, vocab)).astype(np.float32) * 0.5
    logits[0, np.arange(L + 1), peaks] += 12.0
    if variant.step == "sample_rows":  # L + 1 rows (a tree's anchor and L nodes)
        return {"logits": mx.array(logits[0]).astype(getattr(mx, variant.dtype)),
                "uniforms": mx.array(np.linspace(0.35, 0.65, L + 1).astype(np.float32)),
                "temperature": 1.0, "top_k": 5}
    draft_ids = peaks[:L].copy()
    if L:
        draft_ids[-1] = (draft_ids[-1] + 1) % vocab  # the target rejects it
    args = {"logits": mx.array(logits).astype(getattr(mx, variant.dtype)),
            "drafts": mx.array(draft_ids[None].astype(np.uint32))}
    if variant.step == "verify_greedy":
        return args
    if variant.step == "verify_sample":
        q = np.full((1, L, vocab), 0.1 / (vocab - 1), np.float32)
        q[0, np.arange(L), draft_ids] = 0.9
        args["draft_probs"] = mx.array(q)
    else:
        K = variant.candidates
        ids = (draft_ids[:, None] + np.arange(K)[None] * 31) % vocab
        probs = np.full((L, K), 0.1 / max(K - 1, 1), np.float32)
        probs[:, 0] = 0.9 if K > 1 else 1.0
        args["cand_ids"] = mx.array(ids[None].astype(np.uint32))
        args["cand_probs"] = mx.array(probs[None])
    args["uniforms"] = mx.array(np.full((1, L + 1), 0.5, np.float32))
    args["temperature"], args["top_k"] = 1.0, 5
    return args


def run(variant: Variant, args: dict[str, Any], metal: bool) -> list[mx.array]:
    """The variant's step on ``args`` by the kernel (``metal``) or by its MLX twin (lazy)."""
    suffix = "metal" if metal else "mlx"
    out = globals()[f"{variant.step}_{suffix}"](**args)
    if isinstance(out, mx.array):
        return [out]
    return [a for a in out if a is not None]


def check(variant: Variant) -> str | None:
    """None when the kernel compiles, runs and agrees with its twin; else what went wrong."""
    args = example(variant)
    want = run(variant, args, metal=False)
    mx.eval(want)
    try:
        got = run(variant, args, metal=True)
        mx.eval(got)
    except Exception as e:  # a compile error, a launch MLX refuses: any failure falls back
        return f"{type(e).__name__}: {e}"
    return disagreement(got, want)


def disagreement(got: list[mx.array], want: list[mx.array]) -> str | None:
    """How a kernel's outputs differ from its twin's (tokens equal, proposals within 1e-5),
    or None."""
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return f"output shape {g.shape}, expected {w.shape}"
        if mx.issubdtype(w.dtype, mx.floating):
            if not mx.allclose(g, w, atol=1e-5).item():
                return "proposals differ from the MLX path's"
        elif not mx.array_equal(g, w).item():
            return f"tokens {g.tolist()}, expected {w.tolist()}"
    return None


# ---------------------------------------------------------------------------------------------
# The functions the decode loop calls: the kernel where there is Metal, else the MLX path.


def verify_greedy(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification. logits [B, L+1, V] (the target's, after the anchor and each
    draft), drafts [B, L] -> (accepted_len [B], next_token [B]), uint32: the drafts accepted
    (the longest prefix equal to the argmax of its position; lowest id among equal maxima, as
    mx.argmax) and the argmax at the first mismatch, or at position L (the bonus)."""
    if _use_metal(Variant("verify_greedy", dtype_name(logits.dtype), drafts.shape[-1] > 0)):
        return verify_greedy_metal(logits, drafts)
    return verify_greedy_mlx(logits, drafts)


def verify_sample(logits: mx.array, drafts: mx.array, draft_probs: mx.array,
                  uniforms: mx.array, temperature: float = 1.0,
                  top_k: int = 0) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling (Leviathan et al.). logits [B, L+1, V]; drafts [B, L]
    sampled from draft_probs [B, L, V]; uniforms [B, L+1] in [0, 1).

    p_i = softmax(x_i / T) over the top-k tokens (:func:`top_k_mask`; all when top_k is 0).
    Draft i is accepted while uniforms[:, i] * q_i(d_i) < p_i(d_i). At the first rejection i
    the token is sampled from max(p_i - q_i, 0) (p_i when that has no mass), after L
    acceptances from p_L, by inverse CDF with uniforms[:, L] (:func:`sample_index`).
    -> (accepted_len [B], next_token [B]), uint32."""
    if _use_metal(Variant("verify_sample", dtype_name(logits.dtype), drafts.shape[-1] > 0)):
        return verify_sample_metal(logits, drafts, draft_probs, uniforms, temperature, top_k)
    return verify_sample_mlx(logits, drafts, draft_probs, uniforms, temperature, top_k)


def verify_sample_candidates(logits: mx.array, drafts: mx.array, cand_ids: mx.array,
                             cand_probs: mx.array, uniforms: mx.array,
                             temperature: float = 1.0,
                             top_k: int = 0) -> tuple[mx.array, mx.array]:
    """:func:`verify_sample` for a proposal on K candidates per position: cand_ids [B, L, K]
    (distinct within a position) with probabilities cand_probs [B, L, K], zero elsewhere."""
    if _use_metal(Variant("verify_sample_candidates", dtype_name(logits.dtype),
                          drafts.shape[-1] > 0, cand_ids.shape[-1])):
        return verify_sample_candidates_metal(logits, drafts, cand_ids, cand_probs, uniforms,
                                              temperature, top_k)
    return verify_sample_candidates_mlx(logits, drafts, cand_ids, cand_probs, uniforms,
                                        temperature, top_k)


def sample_rows(logits: mx.array, uniforms: mx.array, temperature: float = 1.0,
                top_k: int = 0) -> mx.array:
    """One independent draw per row of logits [R, V] from p = softmax(x / T) over the top-k
    tokens (:func:`top_k_mask`; all when top_k is 0), by inverse CDF with uniforms [R]
    (:func:`sample_index`). -> uint32 [R]. The target's choice after each node of a tree."""
    if _use_metal(Variant("sample_rows", dtype_name(logits.dtype))):
        return sample_rows_metal(logits, uniforms, temperature, top_k)
    return sample_rows_mlx(logits, uniforms, temperature, top_k)


def argmax_rows(logits: mx.array) -> mx.array:
    """The argmax of each row of logits [R, V] (lowest id among equal maxima, NaN above all,
    as mx.argmax) -> uint32 [R]: verify_greedy's kernel where there is Metal."""
    if _use_metal(Variant("verify_greedy", dtype_name(logits.dtype), True)):
        return argmax_rows_metal(logits)
    return argmax_rows_mlx(logits)


def path_select(first: mx.array, rest: mx.array, uniforms: mx.array | None = None,
                temperature: float = 0.0) -> tuple[mx.array, mx.array | None]:
    """The DFlash 2 selector walk over the K candidates of n positions. first [B, K]: scores of
    position 1's candidates from the anchor; rest [B, n-1, K, K]: scores of position t+1's
    candidates given each candidate of position t. At temperature 0 each pick is the argmax
    given the previous pick; else it is sampled from softmax(scores / T) by inverse CDF with
    uniforms [B, n]. -> (picks [B, n] uint32, the proposals [B, n, K] or None)."""
    K = first.shape[-1]
    if K <= MAX_PATH_CANDIDATES and _use_metal(
            Variant("path_select", "float32", rest.shape[1] > 0, K, temperature != 0)):
        return path_select_metal(first, rest, uniforms, temperature)
    return path_select_mlx(first, rest, uniforms, temperature)
