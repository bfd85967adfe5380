"""Streamed text split at a pair of markers (tool calls, thinking): pieces ready to send, with
text that could be the start of a marker held back until the next piece decides it."""

from __future__ import annotations


class MarkedSpans:
    """Splits streamed text at a start and an end marker into ``("out" | "in", text)`` pieces,
    with ``("end", "")`` where a span closes. Text that could be the start of a marker is held
    back until the next piece decides it."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end, self.inside = start, end, inside
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            marker = self.end if self.inside else self.start
            kind = "in" if self.inside else "out"
            i = self._buf.find(marker)
            if i < 0:
                keep = _partial_suffix(self._buf, marker)
                out.append((kind, self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
                return [(k, s) for k, s in out if s or k == "end"]
            out.append((kind, self._buf[:i]))
            if self.inside:
                out.append(("end", ""))
            self._buf, self.inside = self._buf[i + len(marker) :], not self.inside

    def flush(self) -> list[tuple[str, str]]:
        """At the end: whatever is held back, on the side it was on."""
        rest, self._buf = self._buf, ""
        return [("in" if self.inside else "out", rest)] if rest else []


def _partial_suffix(buf: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0
