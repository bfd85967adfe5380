"""Tool calls in replies: the text between the tokenizer's tool-call markers, parsed by mlx-lm's
parser for the model's format (``TokenizerWrapper.tool_parser``), comes back in the API's
tool-call shape instead of as text.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

log = logging.getLogger("mlx_dflash.server")


class ToolCallSplitter:
    """Separates streamed text into plain text and raw tool calls (``calls``). Text that could be
    the start of the start marker is held back until the next piece decides it."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.calls: list[str] = []
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        """The plain text that can be emitted now."""
        self._buf += text
        out = ""
        while True:
            if self._in_call:
                j = self._buf.find(self.end)
                if j < 0:
                    return out
                self.calls.append(self._buf[:j])
                self._buf, self._in_call = self._buf[j + len(self.end) :], False
                continue
            i = self._buf.find(self.start)
            if i >= 0:
                out += self._buf[:i]
                self._buf, self._in_call = self._buf[i + len(self.start) :], True
                continue
            keep = _partial_suffix(self._buf, self.start)
            out += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def flush(self) -> str:
        """At the end: an unterminated call still counts (mlx-lm's rule); held text is text."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            if rest.strip():
                self.calls.append(rest)
            return ""
        return rest


def _partial_suffix(buf: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class ToolCalls:
    """One reply's tool calls: split from the text as it streams, parsed at the end."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        self.splitter = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end)
        self.parser, self.tools = tokenizer.tool_parser, tools

    @staticmethod
    def for_request(tokenizer: Any, tools: list[dict[str, Any]] | None) -> ToolCalls | None:
        """None when the request has no tools or mlx-lm knows no tool-call format for the model."""
        if not tools or not getattr(tokenizer, "has_tool_calling", False):
            return None
        return ToolCalls(tokenizer, tools)

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
