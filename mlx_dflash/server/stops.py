"""Cut streamed text at the first stop string.

Text that could be the start of a stop string is held back until the next piece decides it, so a
stop string split across two decode cycles is still caught and never reaches the client.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit). After a hit, stop feeding."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, when generation ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class Origins:
    """How streamed text came (runs of (origin, text): GenerationResponse.pieces), cut as the
    stop matcher cuts the text: ``take(text)`` gives the runs of the text it let out."""

    def __init__(self) -> None:
        self._runs: deque[tuple[str, str]] = deque()

    def feed(self, pieces: list[tuple[str, str]]) -> None:
        self._runs.extend(pieces)

    def take(self, text: str) -> list[tuple[str, str]]:
        out, need = [], len(text)
        while need and self._runs:
            origin, run = self._runs.popleft()
            if len(run) > need:
                self._runs.appendleft((origin, run[need:]))
                run = run[:need]
            out.append((origin, run))
            need -= len(run)
        return out
