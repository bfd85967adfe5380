"""The model worker: one thread owns the models and runs jobs one at a time, in arrival order.

MLX and the decode loop are not meant to run on two threads at once, and a single queue keeps
requests first come, first served. The thread also loads and unloads models (``ModelPool``) and
keeps each model's prefix cache. Results go back to the event loop through
``loop.call_soon_threadsafe`` so streaming never blocks it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..decode import stream_generate, stream_generate_cached
from ..policy import COPY_DRAFTS
from .models import ModelPool
from .stops import StopMatcher

log = logging.getLogger("mlx_dflash.server")


@dataclass
class Started:
    """The prompt is in: how many of its tokens came from the prefix cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Delta:
    """A new piece of text."""

    text: str


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
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # None: the client left
    cancelled: threading.Event = field(default_factory=threading.Event)
    outcome: str | None = None  # set by the worker: "done", "cancelled" or "failed"

    def cancel(self) -> None:
        self.cancelled.set()

    def push(self, event: Event) -> None:
        """Hand an event to the request's event loop (called from the worker thread)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class ModelWorker:
    """Runs the pool's models; ``submit`` queues a job, the thread runs it."""

    def __init__(self, pool: ModelPool, copy_drafts: bool = COPY_DRAFTS):
        self.pool, self.copy_drafts = pool, copy_drafts
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._current: Job | None = None
        self.busy = False
        _live_workers.add(self)

    @property
    def pending(self) -> int:
        return self._jobs.qsize() + int(self.busy)

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mlx-dflash-model",
                                                daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> Job:
        self.start()  # (re)started lazily: an app can outlive one server's lifespan
        self._jobs.put(job)
        return job

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread; the running and queued jobs are cancelled and told why."""
        # Held throughout, so a concurrent start() cannot add a second thread meanwhile.
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None or not thread.is_alive():
                return
            pending = [self._current]
            while not self._jobs.empty():
                pending.append(self._jobs.get_nowait())
            for job in pending:
                if job is not None and not job.cancelled.is_set():
                    job.cancel()
                    job.push(Failed("the server is shutting down"))
            self._jobs.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                if job.cancelled.is_set():
                    job.outcome = "cancelled"
                    continue
                self.busy, self._current = True, job
                try:
                    self._generate(job)
                finally:
                    self.busy, self._current = False, None
                if self._jobs.empty():
                    mx.clear_cache()  # idle: give the buffer cache back so memory returns to base
        finally:
            # Thread-local MLX streams must be torn down by their own thread; left to process
            # exit they can abort the interpreter ("terminate called without an active exception").
            mx.synchronize()
            if hasattr(mx, "clear_streams"):  # mlx >= 0.32
                mx.clear_streams()

    def _start(self, job: Job) -> Any:
        """The job's generator, through its model's prefix cache when there is one."""
        served = self.pool.acquire(job.model)
        kwargs = dict(max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                      top_k=job.top_k, block_size=served.block_size, copy_drafts=self.copy_drafts)
        args = (served.model, served.drafter, served.tokenizer, job.prompt)
        if served.prefix_cache is None:
            return stream_generate(*args, **kwargs)
        return stream_generate_cached(served.prefix_cache, *args, checkpoints=job.checkpoints,
                                      generate=stream_generate, **kwargs)

    def _generate(self, job: Job) -> None:
        if job.seed is not None:
            mx.random.seed(job.seed % 2**64)
        stops = StopMatcher(job.stop)
        stats, reason, gen = None, "length", None
        try:
            gen = self._start(job)
            for response in gen:
                if job.cancelled.is_set():
                    job.outcome = "cancelled"
                    return
                if stats is None:
                    job.push(Started(response.stats.prompt_tokens,
                                     getattr(response.stats, "cached_tokens", 0)))
                stats = response.stats
                text, hit = stops.feed(response.text)
                if text:
                    job.push(Delta(text))
                if hit:
                    reason = "stop"
                    break
                if response.finish_reason is not None:
                    reason = response.finish_reason
                    if tail := stops.flush():
                        job.push(Delta(tail))
                    break
            # The client has its answer before the caches are stored (gen.close() below).
            job.outcome = "done"
            job.push(_done(reason, stats, len(job.prompt), stops.matched))
        except Exception as e:  # noqa: BLE001 (one bad job must not take the worker down)
            log.exception("generation failed")
            job.outcome = "failed"
            job.push(Failed(f"{type(e).__name__}: {e}"))
        finally:
            if gen is not None:
                try:  # exit the decode loop's MLX stream context on this thread; store caches
                    gen.close()
                except Exception:  # noqa: BLE001 (a cache that cannot be stored costs a prefill)
                    log.exception("storing the prompt cache failed")


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


_live_workers: weakref.WeakSet[ModelWorker] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Join worker threads before the interpreter tears MLX down (see ModelWorker._run).
    for worker in list(_live_workers):
        worker.stop(timeout=5.0)
