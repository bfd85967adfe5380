"""The model worker: one thread owns the models and runs every job, many at once.

MLX and the decode loop are not meant to run on two threads at once, so one thread runs an
engine over the jobs of one served model: the batch engine (continuous batching: jobs join and
leave between its steps, one target pass verifies them all), or, for targets it cannot hold or
with ``max_batch=1``, :class:`SequentialEngine` (one job at a time, in arrival order). Jobs for
another model wait until the engine has drained, and then it is that model's turn. The thread
also loads and unloads models (``ModelPool``) and keeps each model's prefix cache. Results go
back to the event loop through ``loop.call_soon_threadsafe`` so streaming never blocks it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import ctypes.util
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import mlx.core as mx

from .. import distributed
from ..batch import BatchEngine, BatchNotSupported
from ..grammar import Grammar
from ..decode import GenerationResponse, check_tree, stream_generate, stream_generate_cached
from ..policy import COPY_DRAFTS
from ..target import as_target
from .models import ModelPool
from .ranks import LeadingEngine, send
from .metrics import Metrics
from .stops import Origins, StopMatcher

log = logging.getLogger("mlx_dflash.server")


@dataclass
class Started:
    """The prompt is in: how many of its tokens came from the prefix cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Delta:
    """A new piece of text; with ``Job.origins``, the same text in runs of how it came."""

    text: str
    pieces: list[tuple[str, str]] | None = None


@dataclass
class Done:
    """The end of a job: why it stopped and its statistics."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    dflash: dict[str, Any]
    cached_tokens: int = 0  # prompt tokens continued from the prefix cache (not prefilled)
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass
class Failed:
    """The job crashed inside the model; the worker itself carries on."""

    message: str


Event = Started | Delta | Done | Failed


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    model: str | None = None  # a served model's name (None: the default one)
    checkpoints: list[int] = field(default_factory=list)  # see stream_generate_cached
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output (structured.py)
    endpoint: str = ""  # the API path it came from (for the metrics)
    origins: bool = False  # stream each text's origins (drafted, copied, the target's own)
    id: int = field(default_factory=lambda: next(_job_ids))  # for the dashboard's views
    arrived: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None  # seconds from arrival to its first token
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # None: the client left
    cancelled: threading.Event = field(default_factory=threading.Event)
    outcome: str | None = None  # set by the worker: "done", "cancelled" or "failed"

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, checkpoints=self.checkpoints,
                    grammar=self.grammar)

    def push(self, event: Event) -> None:
        """Hand an event to the request's event loop (called from the worker thread)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class Engine(Protocol):
    """What the worker drives: requests in, ``(request id, response)`` out, a step at a time."""

    idle: bool
    running_ids: list[int]  # requests that would fail with a failing step
    waiting_ids: list[int]  # queued requests a failing step leaves untouched
    last_pass: tuple[int, int] | None  # (rows, tokens a row) of the last batched pass

    def submit(self, prompt: Sequence[int], **sampling: Any) -> int: ...
    def step(self) -> list[tuple[int, GenerationResponse]]: ...
    def cancel(self, request_id: int) -> None: ...
    def prompt_started(self, request_id: int) -> tuple[int, int] | None: ...
    def watch(self, request_id: int, cancelled: threading.Event) -> None: ...


class ModelBusy(Exception):
    """The model has requests running or queued (it cannot be unloaded now)."""


@dataclass
class _Call:
    """Work for the worker thread between engine steps (loading, unloading a model)."""

    fn: Any
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            self.future.set_exception(e)


class _Abandoned(Exception):
    """A request's client left during its prefill (SequentialEngine)."""


class BatchedEngine(BatchEngine):
    """The batch engine over a served model (its prefix cache included)."""

    def watch(self, request_id: int, cancelled: threading.Event) -> None:
        pass  # its prefill runs a chunk a step: cancellations are seen between steps

    def __init__(self, served: Any, copy_drafts: bool, max_batch: int,
                 tree: int | str | None = None):
        super().__init__(served.model, served.drafter, served.tokenizer, max_batch=max_batch,
                         block_size=served.block_size, copy_drafts=copy_drafts,
                         prefix_cache=served.prefix_cache, tree=tree)

    @property
    def running_ids(self) -> list[int]:
        return [r.id for r in self.running]

    @property
    def waiting_ids(self) -> list[int]:
        return [r.id for r in self.waiting]


class SequentialEngine:
    """One request at a time through ``stream_generate`` (through the model's prefix cache
    when it has one), in arrival order: for targets the batch engine cannot hold."""

    last_pass = None  # one request at a time: no batched pass

    def __init__(self, served: Any, copy_drafts: bool, tree: int | str | None = None):
        self.served, self.copy_drafts, self.tree = served, copy_drafts, tree
        self.waiting: deque[tuple[int, list[int], dict[str, Any]]] = deque()
        self.current: tuple[int, Iterator[GenerationResponse]] | None = None
        self._ids = itertools.count()
        self._watched: dict[int, threading.Event] = {}

    @property
    def idle(self) -> bool:
        return self.current is None and not self.waiting

    @property
    def running_ids(self) -> list[int]:
        return [] if self.current is None else [self.current[0]]

    @property
    def waiting_ids(self) -> list[int]:
        return [i for i, _, _ in self.waiting]

    def submit(self, prompt: Sequence[int], **sampling: Any) -> int:
        request_id = next(self._ids)
        self.waiting.append((request_id, list(prompt), sampling))
        return request_id

    def prompt_started(self, request_id: int) -> tuple[int, int] | None:
        return None  # known with the first response

    def watch(self, request_id: int, cancelled: threading.Event) -> None:
        # A whole prefill runs within one step: it checks the flag between its chunks.
        self._watched[request_id] = cancelled

    def cancel(self, request_id: int) -> None:
        if self.current is not None and self.current[0] == request_id:
            self._close()
        self.waiting = deque(w for w in self.waiting if w[0] != request_id)
        self._watched.pop(request_id, None)

    def step(self) -> list[tuple[int, GenerationResponse]]:
        if self.current is None:
            if not self.waiting:
                return []
            request_id, prompt, sampling = self.waiting.popleft()
            self.current = (request_id, self._start(prompt, self._watched.get(request_id),
                                                    **sampling))
        request_id, gen = self.current
        try:
            response = next(gen)
        except _Abandoned:  # its client left mid-prefill: nothing more to say
            self.current = None
            self._watched.pop(request_id, None)
            return []
        except BaseException:
            self.current = None  # the worker fails it; its generator is gone
            self._watched.pop(request_id, None)
            raise
        if response.finish_reason is not None:
            self._close()
        return [(request_id, response)]

    def _start(self, prompt: list[int], cancelled: threading.Event | None, *,
               seed: int | None, checkpoints: list[int],
               **kwargs: Any) -> Iterator[GenerationResponse]:
        served = self.served
        if cancelled is not None:
            kwargs["prompt_progress"] = lambda done, total: _check(cancelled)
        kwargs.update(seed=seed, block_size=served.block_size, copy_drafts=self.copy_drafts,
                      tree=self.tree)
        args = (served.model, served.drafter, served.tokenizer, prompt)
        if served.prefix_cache is None:
            return stream_generate(*args, **kwargs)
        return stream_generate_cached(served.prefix_cache, *args, checkpoints=checkpoints,
                                      generate=stream_generate, **kwargs)

    def _close(self) -> None:
        request_id, gen = self.current
        self.current = None
        self._watched.pop(request_id, None)
        try:  # exit the decode loop's MLX stream context on this thread; store caches
            gen.close()
        except Exception:  # noqa: BLE001 (a cache that cannot be stored costs a prefill)
            log.exception("storing the prompt cache failed")


def _check(cancelled: threading.Event) -> None:
    if cancelled.is_set():
        raise _Abandoned


class _RanksParted(Exception):
    """A step failed across machines: the ranks' engines can no longer be trusted to agree."""


@dataclass
class _Active:
    """A job inside an engine."""

    job: Job
    stops: StopMatcher
    started: bool = False
    stats: Any = None  # its GenerationStats, from its first response on
    origins: Origins | None = None


class ModelWorker:
    """Runs the pool's models; ``submit`` queues a job, the thread runs it. ``max_batch``:
    how many jobs of one model decode together (1: one at a time)."""

    def __init__(self, pool: ModelPool, copy_drafts: bool = COPY_DRAFTS, max_batch: int = 8,
                 tree: int | str | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.pool, self.copy_drafts, self.max_batch = pool, copy_drafts, max_batch
        self.tree = tree  # tree drafts (tree.py) for the pairs that take them
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._backlog: deque[Job] = deque()  # taken from the queue, not yet in an engine
        # An engine per model in use: each running one gets a step in turn (fair turns).
        self._engines: dict[str, Engine] = {}
        self._active: dict[tuple[str, int], _Active] = {}  # (model, request id) -> its job
        # Across machines (ranks.py): what the other ranks are told before each engine step.
        self._outbox: list | None = [] if distributed.group() is not None else None
        self.running = self.waiting = 0  # jobs decoding / queued (read by /health)
        self.metrics: Metrics | None = None  # set by the app (metrics.py)
        _live_workers.add(self)

    @property
    def pending(self) -> int:
        return self.running + self.waiting

    @property
    def serving(self) -> set[str]:
        """The models whose engines have requests now."""
        return {name for name, e in list(self._engines.items()) if not e.idle}

    def last_pass(self, name: str) -> tuple[int, int] | None:
        """(rows, tokens a row) of the model's last batched verify pass, while it has one."""
        engine = self._engines.get(name)
        return None if engine is None or engine.idle else engine.last_pass

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mlx-dflash-model",
                                                daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> Job:
        self.start()  # (re)started lazily: an app can outlive one server's lifespan
        self.waiting += 1
        self._jobs.put(job)
        return job

    def call(self, fn: Any) -> concurrent.futures.Future:
        """Run ``fn`` on the worker thread between engine steps; its result as a future."""
        self.start()
        call = _Call(fn)
        self._jobs.put(call)
        return call.future

    def load_model(self, name: str) -> Any:
        """(worker thread) Load a served model now (no model with requests is unloaded for
        it)."""
        return self.pool.acquire(name, protect=self.serving)

    def unload_model(self, name: str) -> bool:
        """(worker thread) Unload a served model; ModelBusy while it has requests."""
        if name in self.busy_models():
            raise ModelBusy(f"'{name}' has requests running or queued: unload it when they end")
        self._engines.pop(name, None)  # its idle engine goes with it
        return self.pool.unload(name)

    def busy_models(self) -> set[str]:
        busy = {self._name(j) for j in self._backlog}
        return busy | {name for name, _ in self._active}

    def _name(self, job: Job) -> str:
        return job.model or self.pool.default

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread; the running and queued jobs are cancelled and told why."""
        # Held throughout, so a concurrent start() cannot add a second thread meanwhile.
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None or not thread.is_alive():
                return
            self._jobs.put(None)  # the thread fails what it still holds, then ends
            thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take(block=self._idle):
                self._expire()
                self._drop_cancelled()
                self._feed_engines()
                for name, engine in list(self._engines.items()):  # a step each, in turn
                    if not engine.idle:
                        self._step(name, engine)
                self._drop_cancelled()  # one left mid-step (a prefill it abandoned)
                self._count()
                if self._idle and self._jobs.empty():
                    mx.clear_cache()  # idle: give the buffer cache back so memory returns to base
                    _trim_heap()
        except _RanksParted as e:
            log.error("the run across machines broke off (%s): the server stops", e)
            os.kill(os.getpid(), signal.SIGTERM)  # the HTTP server shuts down
        finally:
            self._fail_all("the server is shutting down")
            if self._outbox is not None:
                try:
                    send(self._outbox, ["stop"])  # the other ranks stop following
                except RuntimeError:  # they are gone already
                    pass
            # Thread-local MLX streams must be torn down by their own thread; left to process
            # exit they can abort the interpreter ("terminate called without an active exception").
            mx.synchronize()
            if hasattr(mx, "clear_streams"):  # mlx >= 0.32
                mx.clear_streams()

    @property
    def _idle(self) -> bool:
        return not self._backlog and all(e.idle for e in self._engines.values())

    def _take(self, block: bool) -> bool:
        """Move queued jobs to the backlog and run queued calls (waiting for one if there is
        nothing to do, at most until a model's idle time runs out); False once ``stop`` asked
        the thread to end."""
        while True:
            timeout = self.pool.next_expiry(time.monotonic()) if block else None
            try:
                job = self._jobs.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            if job is None:
                return False
            if isinstance(job, _Call):
                job.run()
            else:
                self._backlog.append(job)
            block = False

    def _expire(self) -> None:
        """Unload the models idle for longer than the pool's ttl (not one with requests)."""
        busy = self.busy_models()
        for name in self.pool.expired(time.monotonic()):
            if name not in busy:
                self._engines.pop(name, None)
                self.pool.unload(name, f"idle for {self.pool.ttl:g} s")

    def _ended(self, job: Job, outcome: str, stats: Any = None) -> None:
        job.outcome = outcome
        self.pool.touch(job.model)
        if self.metrics is not None:
            self.metrics.finished(job.model or self.pool.default, job.endpoint, outcome, stats,
                                  job.first_token_s)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._backlog if j.cancelled.is_set()]:
            self._ended(job, "cancelled")
            self._backlog.remove(job)
        for (name, request_id), active in list(self._active.items()):
            if active.job.cancelled.is_set():
                self._ended(active.job, "cancelled")
                if (engine := self._engines.get(name)) is not None:
                    engine.cancel(request_id)
                del self._active[name, request_id]

    def _feed_engines(self) -> None:
        """Hand backlog jobs to their models' engines, making an engine (and loading its model)
        for a model that has none. A model that cannot be loaded while others decode (the
        memory they hold) waits for them to drain; across machines one engine runs at a time
        (the other ranks follow one), so another model's jobs wait for it to drain."""
        for job in list(self._backlog):
            name = self._name(job)
            engine = self._engines.get(name)
            if engine is None:
                busy = self.serving
                if busy and (self._outbox is not None or not self.pool.room_for(name, busy)):
                    continue  # its turn comes when they drain
                if self._outbox is not None:
                    self._engines.clear()  # (all idle) the other ranks drop theirs too
                try:
                    engine = self._engines[name] = self._make_engine(name)
                except Exception as e:  # noqa: BLE001 (a model that cannot load fails its job)
                    log.exception("loading the model failed")
                    self._backlog.remove(job)
                    self._fail(job, e)
                    continue
                for gone in [n for n in self._engines if not self.pool.models[n].loaded]:
                    del self._engines[gone]  # unloaded to make room for this one
            self._backlog.remove(job)
            try:
                request_id = engine.submit(job.prompt, **job.sampling)
            except Exception as e:  # noqa: BLE001 (a malformed job fails alone)
                self._fail(job, e)
                continue
            engine.watch(request_id, job.cancelled)
            self._active[name, request_id] = _Active(job, StopMatcher(job.stop),
                                                     origins=Origins() if job.origins else None)

    def _make_engine(self, model: str | None) -> Engine:
        if self._outbox is None:
            return self.make_engine(model)
        send(self._outbox, ["new", model])  # the other ranks make theirs alongside
        return LeadingEngine(self.make_engine(model), self._outbox)

    def make_engine(self, model: str | None) -> Engine:
        """A fresh engine over ``model`` (loaded if need be)."""
        served = self.pool.acquire(model, protect=self.serving)
        tree = self._tree_for(served)
        if self.max_batch > 1 and served.model is not None:
            try:
                return BatchedEngine(served, self.copy_drafts, self.max_batch, tree)
            except BatchNotSupported as e:
                log.info("serving '%s' one request at a time: %s", served.name, e)
        return SequentialEngine(served, self.copy_drafts, tree)

    def _tree_for(self, served: Any) -> int | str | None:
        """The server's tree setting where this model pair takes trees, else None (chains),
        said once in the log."""
        if self.tree is None or served.model is None:
            return None
        try:
            check_tree(as_target(served.model), served.drafter, self.tree)
        except ValueError as e:
            log.info("serving '%s' without tree drafts: %s", served.name, e)
            return None
        return self.tree

    def _step(self, name: str, engine: Engine) -> None:
        try:
            responses = engine.step()
        except Exception as e:  # noqa: BLE001 (a failed step fails its requests, not the worker)
            log.exception("generation failed")
            waiting = set(engine.waiting_ids)
            for key in [k for k in self._active if k[0] == name and k[1] not in waiting]:
                self._fail(self._active.pop(key).job, e)
            # The engine's state is suspect: its queued jobs start over in a fresh one.
            self._backlog.extendleft(reversed([self._active.pop((name, i)).job
                                               for i in engine.waiting_ids
                                               if (name, i) in self._active]))
            del self._engines[name]
            if self._outbox is not None:  # across machines the ranks may part here: stop
                raise _RanksParted(e) from e
            return
        if self.metrics is not None and engine.last_pass is not None:
            self.metrics.step(name, *engine.last_pass)
        for request_id, response in responses:
            if (active := self._active.get((name, request_id))) is not None:
                self._deliver(name, request_id, active, response)
        if self.metrics is not None:
            self.metrics.sample()
        for (model, request_id), active in self._active.items():
            # Said as soon as the prefill begins: streams open (and ping) while a long one runs.
            if model == name and not active.started and (
                    counts := engine.prompt_started(request_id)):
                active.started = True
                active.job.push(Started(*counts))

    def _deliver(self, name: str, request_id: int, active: _Active,
                 response: GenerationResponse) -> None:
        job = active.job
        if not active.started:
            active.started = True
            job.push(Started(response.stats.prompt_tokens, response.stats.cached_tokens))
        if job.first_token_s is None and response.tokens:
            job.first_token_s = time.monotonic() - job.arrived
        active.stats = response.stats
        if self.metrics is not None:
            self.metrics.progress(len(response.tokens), response.accepted)
        if active.origins is not None:
            active.origins.feed(response.pieces)
        text, hit = active.stops.feed(response.text)
        if text:
            job.push(self._delta(active, text))
        reason = "stop" if hit else response.finish_reason
        if reason is None:
            return
        if not hit and (tail := active.stops.flush()):
            job.push(self._delta(active, tail))
        if hit:
            self._engines[name].cancel(request_id)  # it leaves (and stores its caches) next step
        del self._active[name, request_id]
        self._ended(job, "done", response.stats)
        done = _done(reason, response.stats, len(job.prompt), active.stops.matched)
        log.info("'%s': %d prompt tokens (%d cached), %d generated, %.1f tokens/s, mean "
                 "acceptance %.2f, finish %s", job.model or self.pool.default,
                 done.prompt_tokens, done.cached_tokens, done.completion_tokens,
                 done.dflash.get("tokens_per_second", 0.0),
                 done.dflash.get("mean_acceptance_length", 0.0), reason)
        job.push(done)

    @staticmethod
    def _delta(active: _Active, text: str) -> Delta:
        origins = active.origins
        return Delta(text, None if origins is None else origins.take(text))

    def requests(self) -> list[dict[str, Any]]:
        """The jobs running and waiting, for the dashboard (read from another thread: a
        snapshot of the worker's lists; figures as of each job's last cycle)."""
        now, out = time.monotonic(), []
        for active in list(self._active.values()):
            stats, job = active.stats, active.job
            out.append(_request_view(job, now, "running" if stats else "prefill", stats))
        out += [_request_view(job, now, "waiting") for job in list(self._backlog)]
        return out

    def _count(self) -> None:
        running = sum(len(e.running_ids) for e in self._engines.values())
        self.running = running
        self.waiting = len(self._active) - running + len(self._backlog) + self._jobs.qsize()

    def _fail(self, job: Job, error: BaseException | str) -> None:
        self._ended(job, "failed")
        job.push(Failed(error if isinstance(error, str) else f"{type(error).__name__}: {error}"))

    def _fail_all(self, message: str) -> None:
        running = {(n, i) for n, e in self._engines.items() for i in e.running_ids}
        for key in running & set(self._active):
            self._active[key].job.outcome = "cancelled"
        jobs = [a.job for a in self._active.values()] + list(self._backlog)
        while not self._jobs.empty():
            jobs.append(self._jobs.get_nowait())
        self._active.clear()
        self._backlog.clear()
        for job in jobs:
            if isinstance(job, _Call):
                job.future.set_exception(RuntimeError(message))
            elif job is not None and not job.cancelled.is_set():
                job.cancel()
                job.push(Failed(message))
        self._engines.clear()
        self.running = self.waiting = 0


def _request_view(job: Job, now: float, state: str, stats: Any = None) -> dict[str, Any]:
    view = {"id": job.id, "model": job.model, "endpoint": job.endpoint, "state": state,
            "prompt_tokens": len(job.prompt), "age_s": round(now - job.arrived, 2),
            "max_tokens": job.max_tokens, "structured": job.grammar is not None}
    if stats is not None:
        view.update(cached_tokens=stats.cached_tokens, generated=stats.generation_tokens,
                    tokens_per_second=round(stats.generation_tps, 2),
                    mean_acceptance=round(stats.mean_acceptance_length, 3),
                    cycles=stats.cycles, last_drafts=(stats.draft_lengths or [0])[-1],
                    by_source={k: v[1] for k, v in stats.by_source.items()})
    return view


def _done(reason: str, stats: Any, prompt_tokens: int, stop_sequence: str | None) -> Done:
    if stats is None:
        return Done(reason, prompt_tokens, 0, {}, stop_sequence=stop_sequence)
    return Done(
        finish_reason=reason,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.generation_tokens,
        cached_tokens=getattr(stats, "cached_tokens", 0),
        stop_sequence=stop_sequence,
        dflash={
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "accepted_tokens": stats.accepted_tokens,
            "drafted_tokens": stats.drafted_tokens,
            "cycles": stats.cycles,
            "block_size": stats.block_size,
            "tokens_per_second": round(stats.generation_tps, 2),
        },
    )


def _trim_heap() -> None:
    """Linux: hand the heap's free pages back to the system. MLX's CPU buffers come from
    malloc, and glibc keeps what they freed (per-thread arenas): without this the process's
    RSS stays at its high-water mark after a burst of requests although nothing is held."""
    if _libc is not None:
        _libc.malloc_trim(0)


_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim  # noqa: B018 (glibc has it; musl does not)
    except (OSError, AttributeError):
        _libc = None

_live_workers: weakref.WeakSet[ModelWorker] = weakref.WeakSet()
_job_ids = itertools.count(1)


@atexit.register
def _stop_all() -> None:
    # Join worker threads before the interpreter tears MLX down (see ModelWorker._run).
    for worker in list(_live_workers):
        worker.stop(timeout=5.0)
