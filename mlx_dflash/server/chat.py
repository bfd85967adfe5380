"""OpenAI-shaped bodies for chat and text completions, whole or as stream chunks.

A shaper turns one job's events into the bytes of one response: ``open()``, ``started(event)``,
``delta(text)``, ``close(done)``, ``error(message)`` and ``keepalive()`` return the server-sent
events to write (a list, maybe empty); ``whole(text, done)`` is the body of a non-streamed
reply. The Responses and Anthropic shapers (responses.py, anthropic.py) have the same methods.
A model's thinking comes back as ``reasoning_content``, beside ``content``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .errors import error_body
from .reply import KEEPALIVE, REASONING, Reply, sse
from .tools import openai_tool_calls
from .worker import Done


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class Shaper:
    """Builds the bodies of one response; ``chat`` picks chat.completion vs text_completion.
    ``reply`` (chat only) splits thinking and tool calls off the text."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False,
                 reply: Reply | None = None):
        self.chat, self.model, self.include_usage, self.reply = chat, model, include_usage, reply
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

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[str]:
        if not self.chat:
            return [sse(self._chunk({"text": text, "finish_reason": None}))
                    for _, text in pieces if text]
        return [sse(self._chunk({"delta": {"reasoning_content" if kind == REASONING
                                           else "content": text}, "finish_reason": None}))
                for kind, text in pieces if text]

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

    def keepalive(self) -> list[str]:
        return [KEEPALIVE]

    def delta(self, text: str) -> list[str]:
        pieces = self.reply.feed(text) if self.reply is not None else [("text", text)]
        return self._pieces(pieces)

    def origins(self, pieces: list[tuple[str, str]]) -> list[str]:
        """An mlx-dflash chunk (asked for with ``token_origins``): the raw text just generated,
        in runs of how it came: a draft source ("drafter", "copy", "ngram", "tree"),
        "forced" (a grammar's only choice) or "target" (the target's own)."""
        body = self._base("chat.completion.chunk")
        body.update(choices=[], origins=[list(p) for p in pieces])
        return [sse(body)]

    def close(self, done: Done) -> list[str]:
        out, calls = [], []
        if self.reply is not None:
            out += self._pieces(self.reply.flush())
            if calls := self.reply.calls():
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
        reasoning, calls = "", []
        if self.reply is not None:
            reasoning, text, calls = self.reply.whole(text)
        if self.chat:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if reasoning:
                message["reasoning_content"] = reasoning
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
