"""The block scheduler: how many drafts to verify each cycle on this machine.

Per cycle it picks the K that maximises expected tokens per second,
``(1 + sum_(j<=K) a_j) / (T_draft + T_verify(1+K, context))``, where ``a_j`` is the chance that
the first j drafts all survive (the drafter's calibrated confidences where it has them, as far
as this request's verified drafts bear them out, else the recent acceptance rate by position)
and the pass times are measured once per model and machine
(cached on disk). K = 0 is plain decoding: when speculation does not pay it decodes plainly
(the drafter's context stays current, it is fed by every verify) and probes again every
``probe_every`` cycles. K is also capped by free memory, so a cycle never asks for more than
there is. Decisions use only what earlier cycles measured, so output stays lossless.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from . import attention, distributed
from .accept import SamplingParams
from .drafters.base import Drafter, propose_all
from .fingerprint import target_fingerprint
from .paths import cache_root
from .target import Target, each_part, head_dim
from .tree import Calibration

# Pass costs are measured at these context lengths: attention grows with the context, and a
# wide verify pass's grows faster than a decode's (on a CPU, MLX's attention is nearly linear in
# the queries), so the best block at 16k is not the best at 1k. Between them, interpolated;
# beyond the last, extended along its last segment (attention is linear in the context).
CONTEXTS = (128, 1024, 4096, 16384)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # ... and at these token counts
PREFILLED = 256  # a snapshot prefills this much for real; longer contexts repeat its K/V


@dataclass
class PassCosts:
    verify_s: dict[int, list[float]]  # context -> seconds of a pass of sizes[i] tokens
    draft_s: float  # seconds of a drafter pass at the shortest context (a block drafter's)
    contexts: tuple[int, ...] = ()  # the verify_s keys, in order (by default)
    sizes: tuple[int, ...] = SIZES
    draft_step_s: float = 0.0  # a chain drafter's (chain.py): each draft after the first
    # a drafter pass at each of ``contexts`` (its attention over the context grows too);
    # None: draft_s at every length
    draft_by_context: list[float] | None = None

    def __post_init__(self):
        self.contexts = tuple(self.contexts) or tuple(sorted(self.verify_s))

    def draft(self, k: int, context: int = 0) -> float:
        """Seconds of drafting ``k`` tokens at this context."""
        first = (self.draft_s if self.draft_by_context is None
                 else along(context, self.contexts, self.draft_by_context))
        return first + self.draft_step_s * max(k - 1, 0)

    def verify(self, n: int, context: int) -> float:
        """Seconds of an n-token target pass at this context."""
        return along(context, self.contexts,
                     [float(np.interp(n, self.sizes, self.verify_s[c])) for c in self.contexts])


def along(context: int, contexts: Sequence[int], values: Sequence[float]) -> float:
    """``values`` measured at ``contexts``, at ``context``: linear between them, flat below the
    first, along the last segment's slope (never falling) beyond the last."""
    if len(contexts) == 1 or context <= contexts[-1]:
        return float(np.interp(context, contexts, values))
    slope = max(values[-1] - values[-2], 0.0) / (contexts[-1] - contexts[-2])
    return float(values[-1] + slope * (context - contexts[-1]))


def best_time(fn: Any, reps: int) -> float:
    """Best-of-``reps`` seconds of ``fn()`` after one warm-up call."""
    return best_times([fn], reps)[0]


def best_times(fns: Sequence[Any], rounds: int) -> list[float]:
    """Best-of-``rounds`` seconds of each of ``fns``, after one warm-up call each, timed in turn
    within every round: a noisy moment then slows every pass a little instead of one pass
    a lot, so the ratios between them (which decide K) stay steady."""
    for fn in fns:
        fn()  # warm-up: compilation, allocation
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            tic = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - tic)
    return best


def snapshot_passes(target: Target, drafter: Drafter | None, context: int, max_tokens: int,
                    sizes: tuple[int, ...] | None = None) -> list[Any]:
    """The passes the snapshot times over a ``context``-token cache: a target pass of each of
    ``sizes`` tokens (default ``_sizes(max_tokens)``; rolled back whole), then one drafter pass
    drafting ``max_tokens - 1`` tokens (none when ``drafter`` is None)."""
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    cache = target.make_cache()
    tokens = mx.zeros((1, min(context, PREFILLED)), dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, cache, layer_ids)
    draft_cache = []
    if drafter is not None:
        draft_cache = drafter.make_cache()
        drafter.commit(feats, draft_cache, tokens)
    for c in [*cache, *draft_cache]:
        stretch(c, context)
    mx.eval([c.state for c in cache + draft_cache])

    def target_pass(n: int) -> None:
        mx.eval(target.forward(mx.ones((1, n), dtype=mx.uint32), cache, layer_ids))
        target.rollback(cache, n)

    def draft_pass(k: int) -> None:
        anchor = mx.zeros((1,), dtype=mx.uint32)
        proposal = propose_all(drafter, target, [anchor], [draft_cache], max_tokens, [k],
                               [SamplingParams()])[0]  # as the decode loop builds it
        mx.eval(proposal.drafts)  # the walk too (DSpark, DFlash 2)

    passes = [lambda n=n: target_pass(n) for n in (sizes or _sizes(max_tokens))]
    if drafter is None:
        return passes
    passes.append(lambda: draft_pass(max_tokens - 1))
    if chained(drafter):  # its cost grows with the drafts: one draft too
        passes.append(lambda: draft_pass(1))
    return passes


def stretch(c: Any, context: int) -> None:
    """A full-attention KV cache made to hold ``context`` positions by repeating what it holds:
    a pass over it costs what one over real text would, without a prefill of that length
    (minutes on a CPU at 16k). Other caches (windows, recurrent states) are left as they are:
    their cost does not grow past what they hold."""
    if type(c) not in (KVCache, QuantizedKVCache) or c.keys is None or c.offset >= context:
        return
    held = c.offset
    reps = -(-context // held)

    def repeated(a: mx.array) -> mx.array:
        return mx.tile(a[..., :held, :], (1, 1, reps, 1))[..., :context, :]

    c.keys, c.values = each_part(repeated, c.keys), each_part(repeated, c.values)
    c.offset = context


def chained(drafter: Drafter) -> bool:
    """Whether the drafter drafts one token a step (its cost grows with the drafts)."""
    return bool(getattr(drafter, "chained", False))


def _costs_at(target: Target, drafter: Drafter | None, context: int, max_tokens: int, rounds: int,
              timed: tuple[int, ...] | None = None):
    """(seconds of a target pass of each size, of the first draft, of each draft after it) at
    ``context``: a block drafter's pass is all first draft. ``timed``: the sizes actually
    timed (the others interpolated); all by default."""
    sizes = _sizes(max_tokens)
    timed = timed or sizes
    times = best_times(snapshot_passes(target, drafter, context, max_tokens, timed), rounds)
    n = len(timed)
    verify = np.interp(sizes, timed, times[:n]).tolist()
    if drafter is None:  # lookups only: no drafter pass
        return verify, 0.0, 0.0
    full, *one = times[n:]
    if not one:
        return verify, full, 0.0
    step = max(full - one[0], 0.0) / max(max_tokens - 2, 1)
    return verify, one[0], step


def _sizes(max_tokens: int) -> tuple[int, ...]:
    return tuple(n for n in SIZES if n < max_tokens) + (max_tokens,)


def measure_costs(target: Target, drafter: Drafter | None, max_tokens: int, reps: int = 5,
                  contexts: tuple[int, ...] = CONTEXTS) -> PassCosts:
    """Best-of-``reps`` time of a target pass of 1..max_tokens tokens at each context length,
    and of one drafter pass, all timed in turn within each round (``best_times``)."""
    # The long contexts' passes take seconds each on a CPU: fewer rounds there, and a few
    # sizes (1, 2, 4 and the widest; the others interpolated, within ~10% where measured).
    long_sizes = tuple(n for n in _sizes(max_tokens) if n in (1, 2, 4) or n == max_tokens)
    measured = {c: _costs_at(target, drafter, c, max_tokens, reps) if c <= 1024 else
                _costs_at(target, drafter, c, max_tokens, min(reps, 3), long_sizes)
                for c in contexts}
    _, draft, step = measured[contexts[0]]
    return PassCosts({c: m[0] for c, m in measured.items()}, draft, contexts,
                     _sizes(max_tokens), step, [measured[c][1] for c in contexts])


def _cache_file(target: Target, drafter: Drafter | None, max_tokens: int) -> Path:
    # "interleaved": snapshots timed pass after pass (before best_times) are measured anew.
    split = [f"ranks{distributed.group().size()}"] if distributed.group() is not None else []
    key = json.dumps(["propose", "interleaved", target_fingerprint(target),
                      *(drafter.pass_key() if drafter is not None else ("no drafter",)),
                      max_tokens, platform.node(),
                      platform.machine(), mx.__version__, str(mx.default_device()),
                      os.environ.get("MLX_DFLASH_FAST_BLAS", "1"),
                      "cpu attention" if attention.enabled() else "mlx attention", *split],
                     sort_keys=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / "costs" / f"{name}.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _cached(path: Path, read: Callable[[dict], Any], measure: Callable[[], Any],
            to_json: Callable[[Any], dict], flat: Callable[[Any], list[float]],
            unflat: Callable[[np.ndarray], Any], size: int) -> Any:
    """Costs read from ``path`` (``read``: None when they do not fit), or measured and written
    there. Across machines (distributed.py) every rank takes rank 0's: read on rank 0, or
    measured by all ranks together (the split passes need every rank), then sent as ``size``
    numbers (``flat`` / ``unflat``)."""
    data = _read_json(path) if distributed.is_root() else None
    try:
        costs = read(data) if data is not None else None
    except (KeyError, ValueError, TypeError, AttributeError):  # another version's file
        costs = None
    measured = not distributed.from_root([costs is not None])[0]
    if measured:
        costs = measure()
    if distributed.group() is not None:
        values = flat(costs) if distributed.is_root() else np.zeros(size)
        costs = unflat(distributed.from_root(values).astype(float))
    if measured and distributed.is_root():
        _write_json(path, to_json(costs))
    return costs


def contexts_for(reach: int) -> tuple[int, ...]:
    """The contexts pass costs are measured at for requests that reach ``reach`` tokens: those
    up to 1024 always, the longer ones up to the first at or past ``reach`` (a long context's
    passes take seconds each to time on a CPU: only when a request needs them)."""
    contexts = [c for c in CONTEXTS if c <= 1024]
    for c in CONTEXTS[len(contexts):]:
        if contexts[-1] >= reach:
            break
        contexts.append(c)
    return tuple(contexts)


def cached_costs(target: Target, drafter: Drafter | None, max_tokens: int, reach: int = 0
                 ) -> PassCosts:
    """The pass costs for this model pair and machine, measured on first use (a few seconds)
    at the contexts a request reaching ``reach`` tokens needs (``contexts_for``; more when the
    cache already has them). Across machines (distributed.py) every rank takes rank 0's."""
    sizes = _sizes(max_tokens)
    contexts = contexts_for(reach)
    n = len(contexts)

    def read(data: dict) -> PassCosts | None:
        costs = PassCosts({int(k): v for k, v in data["verify_s"].items()}, data["draft_s"],
                          tuple(data["contexts"]), tuple(data["sizes"]),
                          data.get("draft_step_s", 0.0), data["draft_by_context"])
        if costs.sizes != sizes or costs.contexts[:n] != contexts:
            return None  # measured for another width, or not as far: measured anew
        times = [t for ctx in contexts for t in costs.verify_s[ctx]]
        if drafter is not None:
            times.append(costs.draft_s)
        if min(times) <= 0:  # a broken measurement: measured anew
            return None
        return replace(costs, verify_s={c: costs.verify_s[c] for c in contexts},
                       contexts=contexts, draft_by_context=costs.draft_by_context[:n])

    def measure() -> PassCosts:
        if distributed.is_root():
            import sys

            print(f"Timing target and drafter passes for the block scheduler up to {contexts[-1]}"
                  " tokens of context (once per model pair and machine) ...", file=sys.stderr,
                  flush=True)
        return measure_costs(target, drafter, max_tokens, contexts=contexts)

    def unflat(v: np.ndarray) -> PassCosts:
        verify = v[: n * len(sizes)].reshape(n, len(sizes))
        draft_step, draft = v[n * len(sizes)], v[n * len(sizes) + 1:]
        return PassCosts({c: verify[i].tolist() for i, c in enumerate(contexts)},
                         float(draft[0]), contexts, sizes, float(draft_step), draft.tolist())

    return _cached(_cache_file(target, drafter, max_tokens), read, measure, asdict,
                   lambda c: [v for ctx in contexts for v in c.verify_s[ctx]]
                   + [c.draft_step_s, *c.draft_by_context],
                   unflat, n * len(sizes) + 1 + n)


_run_headroom: list[int] = []  # across machines: the smallest over the ranks, read once


def memory_headroom() -> int:
    """Bytes the process may still allocate: Metal's recommended working set (or the memory
    limit elsewhere) minus what MLX holds now. Across machines (distributed.py): the smallest
    over the ranks at the first call, for the whole run (so that every rank decides alike)."""
    if distributed.group() is not None:
        if not _run_headroom:
            _run_headroom.append(int(distributed.smallest(_local_headroom())))
        return _run_headroom[0]
    return _local_headroom()


def _local_headroom() -> int:
    limit = 0
    if mx.metal.is_available():
        limit = int(mx.device_info().get("max_recommended_working_set_size", 0))
    limit = limit or int(mx.get_memory_limit())
    return limit - int(mx.get_active_memory())


def bytes_per_verified_token(target: Target) -> int:
    """Working memory one more verified token needs: its logits, its activations through a
    layer, and its K/V in every layer (float32 upper bound)."""
    args = target.model.args
    return (4 * (3 * target.vocab_size + 8 * getattr(args, "intermediate_size",
                                                      4 * args.hidden_size))
            + kv_bytes_per_position(target))


def kv_bytes_per_position(target: Target) -> int:
    """Bytes one position's keys and values take in every layer (float32 upper bound; with
    quantized caches, the packed values plus a float32 scale and bias per group)."""
    args = target.model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    per_value = 4.0
    if target.kv_quantization is not None:
        bits, group = target.kv_quantization
        per_value = bits / 8 + 2 * 4 / group
    return int(per_value * 2 * target.num_layers * heads * head_dim(args))


class Scheduler:
    """Chooses K (drafts to verify) per cycle; ``observe`` feeds back what was accepted."""

    def __init__(
        self,
        costs: PassCosts,
        max_drafts: int,
        token_bytes: int,
        probe_every: int = 16,
        reserve_bytes: int = 256 << 20,
        headroom: Any = None,  # a function; default memory_headroom
        drafts: bool = True,  # False: no drafter (it sizes lookups against plain decoding)
    ):
        self.costs, self.max_drafts = costs, max_drafts
        self.drafts = drafts
        self.token_bytes, self.reserve_bytes = token_bytes, reserve_bytes
        self.headroom = headroom
        self.probe_every, self.probe_gap = probe_every, probe_every
        self.accept_rate = np.full(max_drafts, 0.5)  # P(draft j survives | drafts < j did)
        self.seen = np.zeros(max_drafts)  # cycles that reached position j
        self.confidence: np.ndarray | None = None  # the drafter's last survival scores
        self.calibration = Calibration()  # ... and how far this request bears them out
        self.plain_cycles = 0
        self.probing = False

    def survival(self) -> np.ndarray:
        """a_j, j = 1..max_drafts: the chance that the first j drafts all survive."""
        if self.confidence is not None and len(self.confidence) >= self.max_drafts:
            # the last cycle's, stale, as this request's verified drafts bear them out
            return np.cumprod(self.calibration(self.confidence[: self.max_drafts]))
        return np.cumprod(self.accept_rate)

    def memory_cap(self) -> int:
        """Most drafts the free memory allows (0: verify the anchor alone)."""
        free = (self.headroom or memory_headroom)() - self.reserve_bytes
        return int(max(0, min(self.max_drafts, free // self.token_bytes - 1)))

    def _best(self, limit: int, context: int) -> tuple[int, float]:
        """(drafts, expected tokens per second) of the best drafter cycle, plain included."""
        a = self.survival()
        verify = self.costs.verify
        best_k, best = 0, 1.0 / verify(1, context)  # plain decoding's tokens per second
        for k in range(1, limit + 1 if self.drafts else 1):
            rate = (1.0 + a[:k].sum()) / (self.costs.draft(k, context) + verify(k + 1, context))
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def lookup_length(self, probs: Sequence[float], room: int, context: int) -> int:
        """How many tokens of a looked-up block to verify (0: none): the most expected tokens
        per second, given P(step | steps before) of each, if that beats the drafter's best
        cycle (a lookup needs no drafter pass)."""
        drafter_limit = min(self.max_drafts, room, self.memory_cap())
        limit = min(len(probs), drafter_limit)
        if limit <= 0:
            return 0
        a = np.cumprod(np.asarray(probs[:limit], dtype=np.float64))
        # The drafter's cycle is not bounded by how far the lookup reaches.
        best_n, best = 0, self._best(drafter_limit, context)[1]
        for n in range(1, limit + 1):
            rate = (1.0 + a[:n].sum()) / self.costs.verify(n + 1, context)
            if rate > best:
                best_n, best = n, rate
        return best_n

    def limit(self, room: int) -> int:
        """Most drafts this cycle may verify: the drafter's, the room left, the memory's."""
        return min(self.max_drafts, room, self.memory_cap())

    def choose(self, room: int, context: int) -> int:
        limit = self.limit(room)
        if limit <= 0 or not self.drafts:
            return 0
        return self.probe(self._best(limit, context)[0], limit)

    def probe(self, chosen: int, limit: int) -> int:
        """``chosen``, unless plain cycles have run ``probe_gap`` times in a row: then a
        probe at ``limit`` (the text may have changed)."""
        self.probing = False
        if chosen == 0:
            self.plain_cycles += 1
            if self.plain_cycles >= self.probe_gap:
                self.plain_cycles, self.probing = 0, True
                return limit
        else:
            self.plain_cycles = 0
        return chosen

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float] | None = None,
                decay: float = 0.15) -> None:
        """Update the per-position survival rates from one cycle (positions reached only).

        A running mean at first (one failure already counts), a moving average after that; a
        failed probe doubles the wait for the next one (up to 8x), a paying one resets it."""
        for j in range(min(drafted, accepted + 1, self.max_drafts)):
            step = max(decay, 1.0 / (self.seen[j] + 2))
            self.accept_rate[j] += step * (float(j < accepted) - self.accept_rate[j])
            self.seen[j] += 1
        if self.probing and drafted > 0:  # the probe's own cycle (a plain one may come first)
            self.probing, paid = False, accepted > 0
            self.probe_gap = self.probe_every if paid else min(2 * self.probe_gap,
                                                                8 * self.probe_every)
        if confidence is not None:
            self.confidence = np.asarray(confidence, dtype=np.float64)
            reached = min(drafted, accepted + 1, len(self.confidence))  # drafts judged
            self.calibration.observe(self.confidence[:reached], np.arange(reached) < accepted)


# -- one verify budget across a batch ------------------------------------------------------------
BATCH_ROWS = (1, 2, 4, 8)  # batched pass costs are measured at these row counts, interpolated
BATCH_CONTEXT = 256


@dataclass
class BatchCosts:
    """What a batched target pass costs relative to one row of the same width (measured once
    per model pair and machine), on top of a single request's :class:`PassCosts`."""

    single: PassCosts
    ratio: dict[int, list[float]]  # rows -> T(rows, width) / T(1, width) for each of sizes
    sizes: tuple[int, ...]
    rows: tuple[int, ...] = BATCH_ROWS
    # rows -> one drafter pass for that many requests / one for one (None: one pass each)
    draft_ratio: dict[int, float] | None = None

    def draft(self, rows: int, context: int = 0) -> float:
        """Seconds of drafting for ``rows`` requests (one batched drafter pass) whose contexts
        are ``context`` long: the short-context pass scaled by the rows, plus each row's own
        attention over its context."""
        if rows == 0:
            return 0.0
        single = self.single.draft(1)
        growth = self.single.draft(1, context) - single
        if self.draft_ratio is None:
            return rows * (single + growth)
        return single * self._scale(rows, [self.draft_ratio[r] for r in self.rows]) + rows * growth

    def verify(self, rows: int, width: int, context: int) -> float:
        """Seconds of a target pass over ``rows`` rows of ``width`` tokens at ``context``: the
        ratios were measured at a short context; what the context adds (attention) every row
        pays on its own."""
        by_rows = [float(np.interp(width, self.sizes, self.ratio[r])) for r in self.rows]
        short = self.single.verify(width, self.single.contexts[0])
        grown = self.single.verify(width, context) - short  # the row's attention over its context
        return short * self._scale(rows, by_rows) + rows * grown

    def _scale(self, rows: int, by_rows: list[float]) -> float:
        """A ratio measured at ``self.rows``, at ``rows``: interpolated, and beyond what was
        measured linear in the rows."""
        if rows > self.rows[-1]:
            return by_rows[-1] * rows / self.rows[-1]
        return float(np.interp(rows, self.rows, by_rows))


def measure_batch_ratios(target: Target, max_tokens: int, reps: int = 3) -> dict[int, list[float]]:
    """T(rows, width) / T(1, width) at ``BATCH_CONTEXT`` for ``BATCH_ROWS`` and ``_sizes``."""
    from .batch_cache import make_batch_cache

    single = target.make_cache()
    target.hidden_states(mx.zeros((1, BATCH_CONTEXT), dtype=mx.uint32), single, ())
    rows_caches = {}
    for rows in BATCH_ROWS:
        cache = make_batch_cache(target)
        for _ in range(rows):
            cache.add_row(single)
        mx.eval(cache.state)
        rows_caches[rows] = cache

    def batched_pass(rows: int, n: int) -> None:
        cache = rows_caches[rows]
        mx.eval(target.forward(mx.ones((rows, n), dtype=mx.uint32), cache)[0])
        cache.discard()

    sizes = _sizes(max_tokens)
    fns = [lambda r=r, n=n: batched_pass(r, n) for r in BATCH_ROWS for n in sizes]
    times = best_times(fns, reps)
    per_rows = {r: times[i * len(sizes):(i + 1) * len(sizes)] for i, r in enumerate(BATCH_ROWS)}
    return {r: [t / one for t, one in zip(per_rows[r], per_rows[1])] for r in BATCH_ROWS}


def measure_draft_ratios(target: Target, drafter: Drafter, max_tokens: int, reps: int = 3
                         ) -> dict[int, float]:
    """One drafter pass for ``rows`` requests (``propose_all``) over one for one request, at
    ``BATCH_CONTEXT``, for ``BATCH_ROWS``."""

    tokens = mx.zeros((1, BATCH_CONTEXT), dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)
    contexts = []
    for _ in range(BATCH_ROWS[-1]):
        cache = drafter.make_cache()
        drafter.commit(feats, cache, tokens)
        contexts.append(cache)
    mx.eval([c.state for cache in contexts for c in cache])
    K = min(max_tokens - 1, drafter.max_drafts)

    def draft_pass(rows: int) -> None:
        anchors = [mx.zeros((1,), dtype=mx.uint32)] * rows
        proposals = propose_all(drafter, target, anchors, contexts[:rows], max_tokens,
                                [K] * rows, [SamplingParams()] * rows)
        mx.eval([p.drafts for p in proposals])

    times = best_times([lambda r=r: draft_pass(r) for r in BATCH_ROWS], reps)
    return {r: t / times[0] for r, t in zip(BATCH_ROWS, times)}


def cached_batch_costs(target: Target, drafter: Drafter, max_tokens: int, reach: int = 0
                       ) -> BatchCosts:
    """A batch's pass costs for this model pair and machine, measured on first use (a single
    request's as far as ``reach``: see cached_costs). Across machines (distributed.py) every
    rank takes rank 0's."""
    single = cached_costs(target, drafter, max_tokens, reach)
    sizes, rows = _sizes(max_tokens), BATCH_ROWS

    def read(data: dict) -> BatchCosts | None:
        costs = BatchCosts(single, {int(k): v for k, v in data["ratio"].items()},
                           tuple(data["sizes"]), tuple(data["rows"]),
                           {int(k): v for k, v in data["draft_ratio"].items()})
        if min(min(r) for r in costs.ratio.values()) <= 0:  # a broken measurement
            return None
        return costs if (costs.sizes, costs.rows) == (sizes, rows) else None

    def measure() -> BatchCosts:
        return BatchCosts(single, measure_batch_ratios(target, max_tokens), sizes,
                          draft_ratio=measure_draft_ratios(target, drafter, max_tokens))

    def unflat(v: np.ndarray) -> BatchCosts:
        ratio = v[: len(rows) * len(sizes)].reshape(len(rows), len(sizes))
        return BatchCosts(single, {r: ratio[i].tolist() for i, r in enumerate(rows)}, sizes,
                          rows, dict(zip(rows, v[-len(rows):].tolist())))

    return _cached(_cache_file(target, drafter, max_tokens).with_suffix(".batch.json"), read,
                   measure, lambda c: {"ratio": c.ratio, "sizes": c.sizes, "rows": c.rows,
                                       "draft_ratio": c.draft_ratio},
                   lambda c: [v for r in rows for v in c.ratio[r]]
                   + [c.draft_ratio[r] for r in rows],
                   unflat, len(rows) * (len(sizes) + 1))


def plan_batch(schedulers: Sequence[Scheduler], rooms: Sequence[int],
               looked_up: Sequence[np.ndarray | None], context: int, costs: BatchCosts
               ) -> list[int]:
    """Tokens to verify after each request's anchor in one batched pass, from one budget
    (:func:`plan_nodes`). A request's candidates are its drafter's next drafts, by its
    calibrated confidence or acceptance rates, or a looked-up block: ``looked_up[i]``, the
    chance that each of its first j tokens all survive (None: none looked up; no drafter pass
    to pay). With one request and no lookup this is what :meth:`Scheduler.choose` chooses."""
    limits = [min(len(a), s.max_drafts, room) if a is not None else s.limit(room)
              for s, room, a in zip(schedulers, rooms, looked_up)]
    survival = [(s.survival() if a is None else a)[:lim]
                for s, lim, a in zip(schedulers, limits, looked_up)]
    counts = plan_nodes(survival, [a is not None for a in looked_up], context, costs)
    return [s.probe(k, lim) if a is None and lim > 0 else k
            for s, k, lim, a in zip(schedulers, counts, limits, looked_up)]


def plan_nodes(survival: Sequence[np.ndarray], looked_up: Sequence[bool], context: int,
               costs: BatchCosts) -> list[int]:
    """How many of each request's candidate nodes one batched pass verifies after its anchor:
    the pass width and the drafting requests that maximise the batch's expected committed
    tokens per second, ``(rows + expected accepted) / (T_verify(rows, width) + T_draft(m))``
    with ``m`` requests drafting in one drafter pass.

    ``survival[i]`` lists request i's candidate nodes with the chance that each survives
    verification (its whole path accepted), parents first, in falling order: a chain's j-th
    draft (the first j all survive) or a tree's nodes sorted by path probability (every prefix
    of that list is a subtree). k nodes take a row of k + 1 tokens and add their chances to
    the expected accepted tokens. Looked-up requests pay no drafter pass: they verify as many
    nodes as the pass is wide."""
    rows = len(survival)
    limits = [len(a) for a in survival]
    gains = [np.concatenate([[0.0], np.cumsum(a)]) for a in survival]
    best_rate, best = rows / costs.verify(rows, 1, context), [0] * rows
    for width in range(2, 1 + max(limits, default=0) + 1):
        verify = costs.verify(rows, width, context)
        gain = sum(gains[i][min(width - 1, limits[i])] for i in range(rows) if looked_up[i])
        ranked = sorted(((gains[i][min(width - 1, limits[i])], i) for i in range(rows)
                         if limits[i] > 0 and not looked_up[i]), reverse=True)
        for m in range(len(ranked) + 1):  # the m likeliest drafting requests draft
            if m:
                gain += ranked[m - 1][0]
            rate = (rows + gain) / (verify + costs.draft(m, context))
            if rate > best_rate:
                drafting = {i for _, i in ranked[:m]}
                best_rate, best = rate, [min(width - 1, limits[i])
                                         if looked_up[i] or i in drafting else 0
                                         for i in range(rows)]
    return best
