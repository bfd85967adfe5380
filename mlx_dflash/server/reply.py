"""What every API surface does with a reply's text: split the model's thinking from its answer,
pull tool calls out of the answer, and frame server-sent events.

A ``Reply`` is fed the decoded text as it streams and hands back ``("reasoning" | "text",
piece)`` pairs ready to send; its tool calls are parsed at the end (``calls``). The shapers of
the three APIs (chat.py, responses.py, anthropic.py) only say how those pieces look on the wire.
"""

from __future__ import annotations

import json
from typing import Any

from .spans import MarkedSpans
from .tools import ToolCalls

REASONING, TEXT = "reasoning", "text"


def sse(payload: dict[str, Any] | str, event: str | None = None) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


KEEPALIVE = ": keepalive\n\n"  # an SSE comment: every client's parser skips it


def starts_thinking(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the reply begins inside the model's thinking: the prompt opened a think span
    that it did not close (templates that put ``<think>`` in the generation prompt)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    start = tokenizer.rfind_think_start(prompt, start=max(0, len(prompt) - 16))
    return start >= 0 and tokenizer.rfind_think_end(prompt, start=start) < 0


class Reply:
    """One reply's text: thinking split off (for models whose tokenizer has think markers),
    tool calls split off the answer (``tools``: None when the request has none)."""

    def __init__(self, tokenizer: Any, prompt: list[int], tools: ToolCalls | None = None):
        self.tools = tools
        self.thinking = (MarkedSpans(tokenizer.think_start, tokenizer.think_end,
                                     starts_thinking(tokenizer, prompt))
                         if getattr(tokenizer, "has_thinking", False) else None)
        self.reasoning = ""  # all of it, for the whole body

    def feed(self, text: str) -> list[tuple[str, str]]:
        pieces = self.thinking.feed(text) if self.thinking is not None else [("out", text)]
        return self._sort(pieces)

    def flush(self) -> list[tuple[str, str]]:
        out = self._sort(self.thinking.flush()) if self.thinking is not None else []
        if self.tools is not None and (tail := self.tools.flush()):
            out.append((TEXT, tail))
        return out

    def calls(self) -> list[dict[str, Any]]:
        return self.tools.parsed() if self.tools is not None else []

    def whole(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, answer, tool calls) of a whole reply."""
        pieces = self.feed(text) + self.flush()
        return (self.reasoning, "".join(s for k, s in pieces if k == TEXT), self.calls())

    def _sort(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = []
        for kind, piece in pieces:
            if kind == "in":
                self.reasoning += piece
                out.append((REASONING, piece))
            elif kind == "out":
                piece = self.tools.feed(piece) if self.tools is not None else piece
                if piece:
                    out.append((TEXT, piece))
        return out
