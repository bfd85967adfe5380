"""Tool calls in replies: the text between the tokenizer's tool-call markers, parsed by mlx-lm's
parser for the model's format (``TokenizerWrapper.tool_parser``), comes back in the API's
tool-call shape instead of as text.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from .spans import MarkedSpans

log = logging.getLogger("mlx_dflash.server")


class ToolCallSplitter:
    """Separates streamed text into plain text and raw tool calls (``calls``)."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.spans = MarkedSpans(start, end, inside)
        self.calls: list[str] = []
        self._call = ""

    def feed(self, text: str) -> str:
        """The plain text that can be emitted now."""
        return self._sort(self.spans.feed(text))

    def flush(self) -> str:
        """At the end: an unterminated call still counts (mlx-lm's rule); held text is text."""
        inside = self.spans.inside
        text = self._sort(self.spans.flush())
        if inside and self._call.strip():
            self.calls.append(self._call)
        self._call = ""
        return text

    def _sort(self, pieces: list[tuple[str, str]]) -> str:
        out = ""
        for kind, piece in pieces:
            if kind == "out":
                out += piece
            elif kind == "in":
                self._call += piece
            else:
                self.calls.append(self._call)
                self._call = ""
        return out


class ToolCalls:
    """One reply's tool calls: split from the text as it streams, parsed at the end."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], inside: bool = False):
        self.splitter = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end,
                                         inside)
        self.parser, self.tools = tokenizer.tool_parser, tools

    @staticmethod
    def for_request(tokenizer: Any, tools: list[dict[str, Any]] | None,
                    inside: bool = False) -> ToolCalls | None:
        """None when the request has no tools or mlx-lm knows no tool-call format for the model.
        ``inside``: the prompt already opened a call (a forced tool choice)."""
        if not tools or not getattr(tokenizer, "has_tool_calling", False):
            return None
        return ToolCalls(tokenizer, tools, inside)

    def feed(self, text: str) -> str:
        return self.splitter.feed(text)

    def flush(self) -> str:
        return self.splitter.flush()

    def parsed(self) -> list[dict[str, Any]]:
        """[{"name", "arguments" (a dict)}] for every call that parses; others are dropped with
        a warning (usually a call cut off by max_tokens)."""
        calls = []
        for text in self.splitter.calls:
            try:
                parsed = self.parser(text, self.tools)
            except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                log.warning("could not parse a tool call (%s: %s): %r", type(e).__name__, e, text)
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                if isinstance(call, dict) and isinstance(call.get("name"), str):
                    args = call.get("arguments", {})
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except ValueError:
                            pass
                    calls.append({"name": call["name"], "arguments": args})
        return calls


def openai_tool_calls(calls: list[dict[str, Any]], streaming: bool = False) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        item = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call["name"],
                             "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
        out.append({"index": i, **item} if streaming else item)
    return out


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates expect them (OpenAI's function format)."""
    return [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools or []] \
        or None
