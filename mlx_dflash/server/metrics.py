"""What the server has done, for ``GET /metrics`` (Prometheus' text format, through the
prometheus-client library) and ``GET /v1/stats`` (the same as JSON).

Counters move where the worker already holds the figures: when a request ends (its
statistics, gathered at each cycle's one sync) and after each engine step (the batch's rows and
pass width), so the decode path does no extra work. Nothing secret is exported: no prompt, no
reply, no key. Gauges (running and waiting requests, memory, prefix caches) are read when
scraped.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..cycle import COPY, DRAFTER, NGRAM, TREE

SOURCES = (DRAFTER, COPY, NGRAM, TREE)
RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 150, 250)
SECOND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CYCLE_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
HISTORY_S = 600  # the dashboard's charts: the last ten minutes, a sample a second at most


class Metrics:
    """One server's metrics (a registry of its own: several apps may share a process)."""

    def __init__(self, read_state: Callable[[], dict[str, Any]]):
        self.read_state = read_state  # running/waiting, models, caches: read when scraped
        self.started = time.time()
        # Tokens committed and target passes (one a request a cycle) and accepted drafts so
        # far, as they happen (the counters below move when a request ends): the live charts.
        self.tokens = self.passes = self.drafts_accepted = 0
        self.history: deque[tuple[float, int, int, int]] = deque(maxlen=HISTORY_S)
        r = self.registry = CollectorRegistry()
        model = ["model"]
        self.requests = Counter("mlx_dflash_requests", "Requests ended, by endpoint and outcome "
                                "(done, cancelled, failed).", model + ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("mlx_dflash_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", model, registry=r)
        self.cached_tokens = Counter("mlx_dflash_cached_tokens", "Prompt tokens continued from "
                                     "the prefix cache (not prefilled).", model, registry=r)
        self.generated_tokens = Counter("mlx_dflash_generated_tokens", "Tokens generated.",
                                        model, registry=r)
        self.prefix_hits = Counter("mlx_dflash_prefix_cache_hits", "Requests that continued "
                                   "from the prefix cache.", model, registry=r)
        self.drafted = Counter("mlx_dflash_drafted_tokens", "Tokens verified after the anchor, "
                               "by where they came from.", model + ["source"], registry=r)
        self.accepted = Counter("mlx_dflash_accepted_tokens", "Verified tokens accepted, by "
                                "where they came from (forced: admitted alone by a grammar).",
                                model + ["source"], registry=r)
        self.ttft = Histogram("mlx_dflash_time_to_first_token_seconds", "From the request's "
                              "arrival to its first token.", model, buckets=SECOND_BUCKETS,
                              registry=r)
        self.decode_rate = Histogram("mlx_dflash_decode_tokens_per_second", "Each request's "
                                     "generated tokens per second after its first.", model,
                                     buckets=RATE_BUCKETS, registry=r)
        self.per_cycle = Histogram("mlx_dflash_tokens_per_cycle", "Each request's mean tokens "
                                   "committed per target pass.", model, buckets=CYCLE_BUCKETS,
                                   registry=r)
        self.rows = Histogram("mlx_dflash_batch_rows", "Requests in each batched verify pass.",
                              model, buckets=ROW_BUCKETS, registry=r)
        self.width = Histogram("mlx_dflash_verify_width", "Tokens per row of each batched verify "
                               "pass.", model, buckets=ROW_BUCKETS, registry=r)
        self.running = Gauge("mlx_dflash_running_requests", "Requests decoding.", registry=r)
        self.waiting = Gauge("mlx_dflash_waiting_requests", "Requests queued.", registry=r)
        self.memory = Gauge("mlx_dflash_memory_bytes", "MLX memory: active, peak, cache, limit.",
                            ["kind"], registry=r)
        self.cache_bytes = Gauge("mlx_dflash_prefix_cache_bytes", "Prefix-cache bytes, in "
                                 "memory and on disk.", model + ["tier"], registry=r)
        self.loaded = Gauge("mlx_dflash_model_loaded", "1 for each served model in memory.",
                            model, registry=r)
        self.kernels = Gauge("mlx_dflash_kernels", "1 for the verification kernels in use "
                             "(metal or mlx).", ["backend"], registry=r)

    def finished(self, model: str, endpoint: str, outcome: str, stats: Any = None,
                 first_token_s: float | None = None) -> None:
        """A request ended: its outcome, and when it ran, what its statistics say."""
        self.requests.labels(model, endpoint, outcome).inc()
        if stats is None:
            return
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.cached_tokens.labels(model).inc(stats.cached_tokens)
        self.generated_tokens.labels(model).inc(stats.generation_tokens)
        if stats.cached_tokens:
            self.prefix_hits.labels(model).inc()
        for source, (drafted, accepted) in stats.by_source.items():
            self.drafted.labels(model, source).inc(drafted)
            self.accepted.labels(model, source).inc(accepted)
        if stats.forced_tokens:
            self.accepted.labels(model, "forced").inc(stats.forced_tokens)
        if first_token_s is not None:
            self.ttft.labels(model).observe(first_token_s)
        if stats.generation_tokens > 1:
            self.decode_rate.labels(model).observe(stats.generation_tps)
        if stats.cycles:
            self.per_cycle.labels(model).observe(stats.mean_acceptance_length)

    def progress(self, tokens: int, accepted: int) -> None:
        """One request's cycle committed ``tokens`` (``accepted`` of them drafts)."""
        self.tokens += tokens
        self.passes += 1
        self.drafts_accepted += accepted

    def sample(self, min_gap_s: float = 1.0) -> None:
        """Note the live totals for the charts, at most one sample per ``min_gap_s``."""
        now = time.time()
        if not self.history or now - self.history[-1][0] >= min_gap_s:
            self.history.append((round(now, 3), self.tokens, self.passes, self.drafts_accepted))

    def step(self, model: str, rows: int, width: int) -> None:
        """One batched verify pass of ``rows`` requests, ``width`` tokens a row."""
        self.rows.labels(model).observe(rows)
        self.width.labels(model).observe(width)

    def refresh(self) -> dict[str, Any]:
        """Read the gauges' current values; returns the state they came from."""
        from ..kernels import backend as kernel_backend

        state = self.read_state()
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        memory = {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(),
                  "cache": mx.get_cache_memory()}
        limit = mx.device_info().get("max_recommended_working_set_size")
        if limit:
            memory["limit"] = limit
        for kind, value in memory.items():
            self.memory.labels(kind).set(value)
        for name, m in state["models"].items():
            self.loaded.labels(name).set(1 if m["loaded"] else 0)
            for tier, value in (m.get("prefix_cache") or {}).items():
                self.cache_bytes.labels(name, tier).set(value)
        backend = kernel_backend()
        self.kernels.labels(backend).set(1)
        self.kernels.labels("mlx" if backend == "metal" else "metal").set(0)
        state["memory"] = memory
        state["kernels"] = backend
        return state

    def text(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def totals(self) -> dict[str, Any]:
        """The counters' values as JSON (for /v1/stats)."""
        out: dict[str, Any] = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.name.removeprefix("mlx_dflash_").removesuffix("_total")
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    out.setdefault(key, {})[labels] = sample.value
        return out
