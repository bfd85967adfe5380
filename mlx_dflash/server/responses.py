"""OpenAI-shaped bodies for chat and text completions, whole or as stream chunks.

A shaper turns one job's events into the bytes of one response: ``open()``, ``delta(text)``,
``close(done)`` and ``error(message)`` return the server-sent events to write (a list, maybe
empty); ``whole(text, done)`` is the body of a non-streamed reply. The Anthropic shaper
(anthropic.py) has the same methods.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .errors import error_body
from .tools import ToolCalls, openai_tool_calls
from .worker import Done


def sse(payload: dict[str, Any] | str, event: str | None = None) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class Shaper:
    """Builds the bodies of one response; ``chat`` picks chat.completion vs text_completion.
    With ``tools`` (chat only), tool calls in the reply come back as ``tool_calls``."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False,
                 tools: ToolCalls | None = None):
        self.chat, self.model, self.include_usage, self.tools = chat, model, include_usage, tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [{"index": 0, **choice, "logprobs": None}]
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def _text_chunk(self, text: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None})
        return self._chunk({"text": text, "finish_reason": None})

    def _reason(self, done: Done, calls: list[Any]) -> str:
        return "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason

    def open(self) -> list[str]:
        """Chat streams open with the assistant role; text completions have no such chunk."""
        if not self.chat:
            return []
        return [sse(self._chunk({"delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}))]

    def started(self, event: Any) -> list[str]:
        return []

    def delta(self, text: str) -> list[str]:
        if self.tools is not None:
            text = self.tools.feed(text)
        return [sse(self._text_chunk(text))] if text else []

    def close(self, done: Done) -> list[str]:
        out, calls = [], []
        if self.tools is not None:
            if tail := self.tools.flush():
                out.append(sse(self._text_chunk(tail)))
            if calls := self.tools.parsed():
                out.append(sse(self._chunk({"delta": {"tool_calls": openai_tool_calls(calls, True)},
                                            "finish_reason": None})))
        choice = {"delta": {}} if self.chat else {"text": ""}
        final = self._chunk({**choice, "finish_reason": self._reason(done, calls)})
        final["dflash"] = done.dflash
        out.append(sse(final))
        if self.include_usage:
            body = self._base("chat.completion.chunk" if self.chat else "text_completion")
            body.update(choices=[], usage=usage(done), dflash=done.dflash)
            out.append(sse(body))
        return out + [sse("[DONE]")]

    def error(self, message: str) -> list[str]:
        # The status line is gone: the error goes in-stream.
        return [sse(error_body(f"Internal error: {message}", "server_error")), sse("[DONE]")]

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        body = self._base("chat.completion" if self.chat else "text_completion")
        calls = []
        if self.tools is not None:
            text = self.tools.feed(text) + self.tools.flush()
            calls = self.tools.parsed()
        if self.chat:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = openai_tool_calls(calls)
            choice = {"message": message}
        else:
            choice = {"text": text}
        body["choices"] = [
            {"index": 0, **choice, "finish_reason": self._reason(done, calls), "logprobs": None}
        ]
        body.update(usage=usage(done), dflash=done.dflash)
        return body
