"""Anthropic's Messages API (``POST /v1/messages``): request body, conversion to a chat template's
messages, and the reply whole or as Anthropic's stream of named events.

Supported: ``system`` (text or text blocks), content blocks of type text (plus ``tool_use`` /
``tool_result`` and ``tools`` for tool calls), ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, streaming; usage counts the prompt tokens continued from the prefix cache as
``cache_read_input_tokens`` (``input_tokens``: those prefilled).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .responses import sse
from .schemas import SEED_MIN, SEED_MAX, Int
from .tools import ToolCalls
from .worker import Done, Started


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # cache_control, citations: ignored


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock],
                         Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(_Strict):
    name: str
    description: Optional[str] = None
    input_schema: dict


class MessagesRequest(_Strict):
    model: str
    max_tokens: Annotated[Int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[Annotated[list[str], Field(max_length=16)]] = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=0)] = 0
    tools: Optional[list[Tool]] = None
    seed: Optional[Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]] = None  # an extension

    def stop_strings(self) -> list[str]:
        return [s for s in self.stop_sequences or [] if s]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools in the function format chat templates read."""
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in self.tools or []] or None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: a system message first, tool uses as an
        assistant's ``tool_calls``, tool results as ``tool`` messages."""
        convo = []
        if self.system:
            convo.append({"role": "system", "content": _text(self.system)})
        for m in self.messages:
            if isinstance(m.content, str):
                convo.append({"role": m.role, "content": m.content})
                continue
            texts = [b.text for b in m.content if isinstance(b, TextBlock)]
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    convo.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                  "content": _text(b.content)})
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": b.input}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            if texts or calls or not m.content:
                convo.append({"role": m.role, "content": "".join(texts)}
                             | ({"tool_calls": calls} if calls else {}))
        return convo


def _text(content: Union[str, list[TextBlock], None]) -> str:
    if isinstance(content, list):
        return "".join(b.text for b in content)
    return content or ""


def usage(done: Done | Started) -> dict[str, int]:
    return {"input_tokens": done.prompt_tokens - done.cached_tokens,
            "output_tokens": getattr(done, "completion_tokens", 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": done.cached_tokens}


def stop_reason(done: Done, calls: list[Any]) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    if done.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if calls else "end_turn"


class MessageShaper:
    """One Messages reply: the whole body, or the stream of events (message_start, content
    blocks, message_delta, message_stop) with the same methods as responses.Shaper."""

    def __init__(self, model: str, tools: ToolCalls | None = None):
        self.model, self.tools = model, tools
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._index = 0  # the content block being written
        self._text_open = False

    def _message(self, content: list[dict], reason: str | None, stop: str | None,
                 use: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": use}

    def open(self) -> list[str]:
        return []  # message_start waits for the prompt's cached-token count (``started``)

    def started(self, event: Started) -> list[str]:
        start = {"type": "message_start", "message": self._message([], None, None, usage(event))}
        return [sse(start, "message_start"), sse({"type": "ping"}, "ping")]

    def delta(self, text: str) -> list[str]:
        return self._text_delta(self.tools.feed(text) if self.tools is not None else text)

    def _text_delta(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self._text_open else self._start_block({"type": "text", "text": ""})
        self._text_open = True
        delta = {"type": "content_block_delta", "index": self._index,
                 "delta": {"type": "text_delta", "text": text}}
        return out + [sse(delta, "content_block_delta")]

    def _start_block(self, block: dict[str, Any]) -> list[str]:
        event = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [sse(event, "content_block_start")]

    def _stop_block(self) -> list[str]:
        event = {"type": "content_block_stop", "index": self._index}
        self._index += 1
        return [sse(event, "content_block_stop")]

    def close(self, done: Done) -> list[str]:
        out, calls = [], []
        if self.tools is not None:
            out += self._text_delta(self.tools.flush())
            calls = self.tools.parsed()
        if self._text_open or not calls:  # a reply always has a block, if only an empty text
            if not self._text_open:
                out += self._start_block({"type": "text", "text": ""})
            out += self._stop_block()
        for call in calls:
            block = {"type": "tool_use", "id": _tool_id(), "name": call["name"], "input": {}}
            out += self._start_block(block)
            out.append(sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": json.dumps(call["arguments"],
                                                                 ensure_ascii=False)}},
                           "content_block_delta"))
            out += self._stop_block()
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": stop_reason(done, calls),
                           "stop_sequence": done.stop_sequence},
                 "usage": usage(done), "dflash": done.dflash}
        return out + [sse(delta, "message_delta"),
                      sse({"type": "message_stop"}, "message_stop")]

    def error(self, message: str) -> list[str]:
        body = {"type": "error", "error": {"type": "api_error",
                                           "message": f"Internal error: {message}"}}
        return [sse(body, "error")]

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        calls = []
        if self.tools is not None:
            text = self.tools.feed(text) + self.tools.flush()
            calls = self.tools.parsed()
        content = [{"type": "text", "text": text}] if text or not calls else []
        content += [{"type": "tool_use", "id": _tool_id(), "name": c["name"],
                     "input": c["arguments"]} for c in calls]
        body = self._message(content, stop_reason(done, calls), done.stop_sequence, usage(done))
        body["dflash"] = done.dflash
        return body


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
