"""Serving with the target split across machines (distributed.py): rank 0 serves HTTP and runs
the model worker; every other rank runs the same engine, step for step, and answers nobody.

Before each engine step, and before making an engine, rank 0 sends what changed since its
last message: requests submitted (tokens and sampling settings) and cancelled; a step with
nothing new is one message of size 0. Given the same inputs the engines decide alike (their
pass costs, free memory and random seed are made common across the ranks), so each step's
target pass is the same pass on every rank, and they number the requests alike. A step that
fails on any rank ends the run: rank 0 stops serving, since the ranks' engines may part.
"""

from __future__ import annotations

from typing import Any, Sequence

from .. import distributed
from ..grammar import Grammar


class LeadingEngine:
    """Rank 0's engine: runs as ``engine`` and tells the other ranks what it was asked, through
    ``outbox`` (the worker's: it has told them of the engine already)."""

    def __init__(self, engine: Any, outbox: list):
        self.engine, self.outbox = engine, outbox
        self.cancelled: list[int] = []  # cancelled at the next step, on every rank alike

    @property
    def idle(self) -> bool:
        return self.engine.idle

    @property
    def last_pass(self) -> tuple[int, int] | None:
        return self.engine.last_pass

    @property
    def running_ids(self) -> list[int]:
        return self.engine.running_ids

    @property
    def waiting_ids(self) -> list[int]:
        return self.engine.waiting_ids

    def submit(self, prompt: Sequence[int], **sampling: Any) -> int:
        request_id = self.engine.submit(prompt, **sampling)  # refused here: never sent
        grammar = sampling.get("grammar")
        sent = {**sampling, "grammar": grammar and [grammar.text, grammar.kind]}  # as JSON
        self.outbox.append(["submit", request_id, list(prompt), sent])
        return request_id

    def prompt_started(self, request_id: int) -> tuple[int, int] | None:
        return self.engine.prompt_started(request_id)

    def watch(self, request_id: int, cancelled: Any) -> None:
        pass  # never mid-step: the other ranks run the same step in lockstep

    def cancel(self, request_id: int) -> None:
        # Not now: cancelling may store the request's caches, which sends messages (a
        # pipeline's sizes are rank 0's) while the other ranks wait for the next step.
        self.cancelled.append(request_id)
        self.outbox.append(["cancel", request_id])

    def step(self) -> list:
        send(self.outbox, ["step"])
        for request_id in self.cancelled:
            self.engine.cancel(request_id)
        self.cancelled.clear()
        return self.engine.step()


def send(outbox: list, last: list) -> None:
    """Send the other ranks what ``outbox`` holds and then ``last`` (["new", model]: make an
    engine; ["step"]; ["stop"]: rank 0 stopped serving), and empty it. Every rank must act
    on it before rank 0 runs anything that sends messages (making an engine times passes)."""
    ops = outbox + [last]
    distributed.share(None if ops == [["step"]] else ops)  # most steps: one empty message
    outbox.clear()


def follow(worker: Any) -> None:
    """Run rank 0's engine steps on this rank until rank 0 stops serving. ``worker``: a
    ModelWorker over the same models (its thread is not started: only its engines are used)."""
    engine = None
    while True:
        for op, *args in distributed.share(None) or [["step"]]:
            if op == "new":
                engine = worker.make_engine(args[0])
            elif op == "submit" and engine.submit(args[1], **received(args[2])) != args[0]:
                raise RuntimeError(f"rank {distributed.rank()} numbers requests unlike rank 0")
            elif op == "cancel":
                engine.cancel(args[0])
            elif op == "step":
                engine.step()  # one that fails ends the run (rank 0 stops serving too)
            elif op == "stop":
                return


def received(sampling: dict) -> dict:
    """A job's sampling as rank 0 sent it (its grammar as [text, kind])."""
    grammar = sampling.get("grammar")
    return {**sampling, "grammar": grammar and Grammar(*grammar)}
