"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): request body,
conversion to a chat template's messages, and the reply whole or as Anthropic's stream of named
events.

As agents send it (Claude Code): ``system`` as text or blocks, ``system``-role messages inside
``messages`` (kept in place where the template allows, else folded into the next user turn),
text, ``tool_use``, ``tool_result`` and ``thinking`` blocks, ``tools`` (those without an
``input_schema``, server tools, are left out of the prompt), ``tool_choice``, ``thinking``
(a model that reasons answers with thinking blocks; ``disabled`` turns its thinking off),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, streaming. Fields that change nothing
for a local model (``metadata``, ``cache_control``, ``context_management``, ``output_config``'s
effort, beta headers) are accepted. Usage counts the prompt tokens continued from the prefix
cache as ``cache_read_input_tokens`` (``input_tokens``: those prefilled).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..grammar import Grammar
from .errors import APIError
from .reply import KEEPALIVE, REASONING, Reply, sse
from .structured import grammar_of
from .schemas import SEED_MIN, SEED_MAX, Int
from .worker import Done, Started

log = logging.getLogger("mlx_dflash.server")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # cache_control, citations: ignored


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Any = None

    def arguments(self) -> dict:
        if isinstance(self.input, str):  # some clients send the JSON text
            try:
                return json.loads(self.input)
            except ValueError:
                return {"input": self.input}
        return self.input if isinstance(self.input, dict) else {}


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[dict], None] = None  # text blocks (an image becomes a note)
    is_error: Optional[bool] = None


ContentBlock = Annotated[
    Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock],
    Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]


class Tool(_Strict):
    name: str
    type: Optional[str] = None  # "custom" or absent; server tools ("web_search_...") too
    description: Optional[str] = None
    input_schema: Optional[dict] = None
    strict: Optional[bool] = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None


class Thinking(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Optional[Int] = None


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Optional[str] = None


class CountTokensRequest(_Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools in the function format chat templates read; tools the server cannot run
        (no ``input_schema``: Anthropic's server tools) are left out."""
        out = []
        for t in self.tools or []:
            if t.input_schema is None:
                log.info("tool '%s' (%s) has no input_schema: left out of the prompt", t.name,
                         t.type or "no type")
                continue
            out.append({"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema, **({"strict": True} if t.strict else {})}})
        return out or None

    def choice(self) -> str:
        """tool_choice as chat.prompts.chat_prompt reads it."""
        c = self.tool_choice
        if c is None or c.type == "auto":
            return "auto"
        if c.type == "tool":
            if not c.name:
                raise APIError(400, "tool_choice of type 'tool' needs a 'name'.",
                               param="tool_choice.name")
            return c.name
        return {"any": "required", "none": "none"}[c.type]

    def template_kwargs(self) -> dict[str, Any]:
        """``thinking`` as the chat template's switch; absent: the template's default."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: the system prompt first, system messages
        in place, tool uses as an assistant's ``tool_calls``, tool results as ``tool`` messages,
        thinking as the assistant's ``reasoning_content``."""
        convo = []
        if self.system:
            convo.append({"role": "system", "content": _text(self.system)})
        for m in self.messages:
            if isinstance(m.content, str):
                convo.append({"role": m.role, "content": m.content})
                continue
            texts = [b.text for b in m.content if isinstance(b, TextBlock)]
            thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    convo.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                  "content": _text(b.content)})
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": b.arguments()}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            if texts or calls or thinking or not m.content:
                convo.append({"role": m.role, "content": "".join(texts)}
                             | ({"tool_calls": calls} if calls else {})
                             | ({"reasoning_content": thinking} if thinking else {}))
        return convo


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[Int, Field(ge=1)]
    stop_sequences: Optional[Annotated[list[str], Field(max_length=16)]] = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=0)] = 0
    seed: Optional[Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]] = None  # an extension
    output_config: Optional[OutputConfig] = None

    def stop_strings(self) -> list[str]:
        return [s for s in self.stop_sequences or [] if s]

    def check_supported(self) -> None:
        """Nothing it may ask for changes the reply in a way this server cannot honour."""

    def grammar(self) -> Grammar | None:
        """What ``output_config.format`` holds the reply to (structured.py)."""
        extra = self.output_config.model_extra if self.output_config is not None else {}
        return grammar_of((extra or {}).get("format"), "output_config.format")


def _text(content: Union[str, list, None]) -> str:
    if isinstance(content, list):
        parts = []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else getattr(b, "type", None)
            if kind == "text":
                parts.append(b["text"] if isinstance(b, dict) else b.text)
            else:  # an image or document in a tool result: this model reads text only
                parts.append(f"[{kind or 'content'} omitted]")
        return "".join(parts)
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
    blocks, message_delta, message_stop) with the same methods as chat.Shaper. Thinking comes
    as ``thinking`` blocks, the answer as ``text`` blocks, tool calls as ``tool_use`` blocks."""

    def __init__(self, model: str, reply: Reply):
        self.model, self.reply = model, reply
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._index = 0  # the content block being written
        self._open: str | None = None  # the kind of the open block ("thinking", "text")
        self._started = False

    def _message(self, content: list[dict], reason: str | None, stop: str | None,
                 use: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": use}

    def open(self) -> list[str]:
        return []  # message_start waits for the prompt's cached-token count (``started``)

    def started(self, event: Started) -> list[str]:
        self._started = True
        start = {"type": "message_start", "message": self._message([], None, None, usage(event))}
        return [sse(start, "message_start"), sse({"type": "ping"}, "ping")]

    def keepalive(self) -> list[str]:
        return [sse({"type": "ping"}, "ping")] if self._started else [KEEPALIVE]

    def delta(self, text: str) -> list[str]:
        return self._pieces(self.reply.feed(text))

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[str]:
        out = []
        for kind, piece in pieces:
            block = "thinking" if kind == REASONING else "text"
            if self._open != block:
                out += self._stop_block()
                out += self._start_block({"type": "thinking", "thinking": "", "signature": ""}
                                         if block == "thinking" else {"type": "text", "text": ""})
                self._open = block
            delta = ({"type": "thinking_delta", "thinking": piece} if block == "thinking"
                     else {"type": "text_delta", "text": piece})
            out.append(sse({"type": "content_block_delta", "index": self._index, "delta": delta},
                           "content_block_delta"))
        return out

    def _start_block(self, block: dict[str, Any]) -> list[str]:
        event = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [sse(event, "content_block_start")]

    def _stop_block(self) -> list[str]:
        """Close the open block, if any (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # clients send it back; this server never checks it
            out.append(sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "signature_delta", "signature": ""}},
                           "content_block_delta"))
        out.append(sse({"type": "content_block_stop", "index": self._index},
                       "content_block_stop"))
        self._index += 1
        self._open = None
        return out

    def close(self, done: Done) -> list[str]:
        out = self._pieces(self.reply.flush())
        calls = self.reply.calls()
        if self._index == 0 and self._open is None and not calls:
            out += self._start_block({"type": "text", "text": ""})  # a reply has a block, always
            self._open = "text"
        out += self._stop_block()
        for call in calls:
            block = {"type": "tool_use", "id": _tool_id(), "name": call["name"], "input": {}}
            out += self._start_block(block)
            out.append(sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": json.dumps(_object(call["arguments"]),
                                                                 ensure_ascii=False)}},
                           "content_block_delta"))
            out.append(sse({"type": "content_block_stop", "index": self._index},
                           "content_block_stop"))
            self._index += 1
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
        reasoning, text, calls = self.reply.whole(text)
        content = ([{"type": "thinking", "thinking": reasoning, "signature": ""}]
                   if reasoning else [])
        content += [{"type": "text", "text": text}] if text or not (calls or reasoning) else []
        content += [{"type": "tool_use", "id": _tool_id(), "name": c["name"],
                     "input": _object(c["arguments"])} for c in calls]
        body = self._message(content, stop_reason(done, calls), done.stop_sequence, usage(done))
        body["dflash"] = done.dflash
        return body


def _object(arguments: Any) -> dict:
    """``tool_use.input`` is always an object (a parser may hand back text or a list)."""
    return arguments if isinstance(arguments, dict) else {"input": arguments}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
