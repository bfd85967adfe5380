"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``): request body,
conversion of its input items to a chat template's messages, and the reply whole or as the
stream of typed events the official SDK parses.

As agents send it (Codex): ``input`` as text or items (``message`` with ``developer``,
``system``, ``user`` and ``assistant`` roles, ``function_call``, ``function_call_output``,
``reasoning``), ``instructions``, ``tools`` of type ``function`` and ``namespace`` (its tools
offered as ``namespace.name``; calls come back with ``namespace``), ``tool_choice``,
``max_output_tokens``, ``reasoning`` (``effort: "none"`` turns a model's thinking off),
``store`` / ``previous_response_id`` (kept in memory, the most recent ``STORED`` responses).
Tools the server cannot run (``web_search``, custom grammars) are left out of the prompt with
a log line; fields that change nothing for a local model (``include``, ``prompt_cache_key``,
``metadata``, ``parallel_tool_calls``, ``truncation``) are accepted.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..grammar import Grammar
from .errors import APIError
from .reply import KEEPALIVE, REASONING, Reply, sse
from .structured import grammar_of
from .schemas import SEED_MAX, SEED_MIN, Int, json_or_text
from .worker import Done

log = logging.getLogger("mlx_dflash.server")

STORED = 256  # responses kept for previous_response_id and GET, most recent first


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    max_output_tokens: Optional[Annotated[Int, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=0)] = 0  # an extension, as the seed
    seed: Optional[Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict] = None
    text: Optional[dict] = None
    top_logprobs: Optional[Int] = None
    metadata: Optional[dict] = None

    def stop_strings(self) -> list[str]:
        return []

    def check_supported(self) -> None:
        """A 400 for what would change the reply in a way this server cannot honour."""
        if self.top_logprobs:
            raise APIError(400, "'top_logprobs' is not supported by this server.",
                           param="top_logprobs")

    def grammar(self) -> Grammar | None:
        """What ``text.format`` holds the reply to (structured.py)."""
        return grammar_of((self.text or {}).get("format"), "text.format")

    def template_kwargs(self) -> dict[str, Any]:
        effort = (self.reasoning or {}).get("effort")
        return {"enable_thinking": False} if effort == "none" else {}

    def choice(self) -> str:
        """tool_choice as prompts.chat_prompt reads it."""
        c = self.tool_choice
        if c is None or c == "auto" or (isinstance(c, dict) and c.get("type") == "allowed_tools"):
            return "auto"
        if c in ("none", "required"):
            return c
        if isinstance(c, dict) and c.get("type") == "function" and isinstance(c.get("name"), str):
            return c["name"]
        raise APIError(400, f"Unsupported 'tool_choice': {json.dumps(c)}; use 'auto', 'none', "
                       "'required' or {\"type\": \"function\", \"name\": ...}.",
                       param="tool_choice")

    def template_tools(self) -> tuple[list[dict] | None, dict[str, tuple[str, str]]]:
        """Tools in the function format chat templates read, and the namespaced ones'
        offered names -> (namespace, name)."""
        out, namespaced = [], {}
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind == "function":
                out.append(_function(tool, f"tools[{i}]"))
            elif kind == "namespace":
                for j, inner in enumerate(tool.get("tools") or []):
                    if inner.get("type") != "function":
                        continue
                    fn = _function(inner, f"tools[{i}].tools[{j}]")
                    offered = f"{tool.get('name')}.{fn['function']['name']}"
                    namespaced[offered] = (tool.get("name"), fn["function"]["name"])
                    fn["function"]["name"] = offered
                    out.append(fn)
            else:
                log.info("tool of type '%s' cannot run here: left out of the prompt", kind)
        return out or None, namespaced


def _function(tool: dict, param: str) -> dict:
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"Missing required parameter: '{param}.name'.", param=f"{param}.name")
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description") or "",
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        **({"strict": True} if tool.get("strict") else {})}}


def conversation(instructions: str | None, items: str | list[dict]) -> list[dict[str, Any]]:
    """Input items as chat templates read them: instructions and developer messages as system
    messages, function calls as an assistant's ``tool_calls``, their outputs as ``tool``
    messages, reasoning as the next assistant message's ``reasoning_content``."""
    convo: list[dict[str, Any]] = []
    if instructions:
        convo.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return convo + [{"role": "user", "content": items}]
    reasoning = ""

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        if not (convo and convo[-1]["role"] == "assistant" and not reasoning):
            convo.append({"role": "assistant", "content": ""})
        if reasoning:
            convo[-1]["reasoning_content"], reasoning = reasoning, ""
        return convo[-1]

    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"Invalid value for 'input[{i}].role': {item.get('role')!r}.",
                               param=f"input[{i}].role")
            text = _parts_text(item.get("content"), f"input[{i}].content")
            if role == "assistant":
                message = assistant()
                message["content"] += text
            else:
                convo.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name", "")
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            args = (json_or_text(item.get("arguments") or "{}") if kind == "function_call"
                    else {"input": item.get("input", "")})
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            convo.append({"role": "tool", "tool_call_id": item.get("call_id"),
                          "content": _parts_text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            log.info("input item of type '%s' left out of the prompt", kind)
    return convo


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            out.append(part.get("text", ""))
        elif kind == "refusal":
            out.append(part.get("refusal", ""))
        else:
            raise APIError(400, f"Content of type '{kind}' is not supported: this model reads "
                           "text only.", param=param)
    return "".join(out)


class ResponseStore:
    """The last ``size`` responses by id: their body, and the conversation they continue
    (input items and output items) for ``previous_response_id``."""

    def __init__(self, size: int = STORED):
        self.size = size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, items: list[dict]) -> None:
        self._items[body["id"]] = (body, items + body["output"])
        self._items.move_to_end(body["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict:
        return self._lookup(response_id)[0]

    def items(self, response_id: str) -> list[dict]:
        return list(self._lookup(response_id)[1])

    def _lookup(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self._items:
            raise APIError(404, f"No response with id '{response_id}' is stored here (this "
                           f"server keeps the last {self.size}, in memory).",
                           param="previous_response_id", code="not_found")
        return self._items[response_id]


def usage(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class ResponseShaper:
    """One response: the whole body, or its stream of events (response.created, output items
    with their content parts and deltas, response.completed), with the same methods as
    chat.Shaper. Thinking is a ``reasoning`` item, the answer a ``message``, each tool call a
    ``function_call``."""

    def __init__(self, model: str, body: ResponsesRequest, reply: Reply,
                 namespaced: dict[str, tuple[str, str]], on_done: Any = None):
        self.model, self.body, self.reply, self.namespaced = model, body, reply, namespaced
        self.on_done = on_done  # called with the finished body (the store)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[dict] = []  # finished items
        self._item: dict | None = None  # the item being streamed
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(payload, kind)

    def _response(self, status: str, done: Done | None = None) -> dict[str, Any]:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.model, "output": list(self.output),
               "error": None, "incomplete_details": None, "instructions": b.instructions,
               "metadata": b.metadata or {}, "parallel_tool_calls": True,
               "temperature": b.temperature, "top_p": b.top_p,
               "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
               "max_output_tokens": b.max_output_tokens,
               "previous_response_id": b.previous_response_id, "store": b.store,
               "text": {"format": {"type": "text"}}, "usage": None}
        if done is not None:
            out["usage"] = usage(done)
            out["dflash"] = done.dflash
            if done.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def open(self) -> list[str]:
        body = self._response("in_progress")
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def started(self, event: Any) -> list[str]:
        return []

    def keepalive(self) -> list[str]:
        return [KEEPALIVE]

    def delta(self, text: str) -> list[str]:
        return self._pieces(self.reply.feed(text))

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[str]:
        out = []
        for kind, piece in pieces:
            want = "reasoning" if kind == REASONING else "message"
            if self._item is None or self._item["type"] != want:
                out += self._finish_item()
                out += self._open_item(want)
            self._item["_text"] += piece
            delta = ("response.reasoning_text.delta" if want == "reasoning"
                     else "response.output_text.delta")
            extra = {} if want == "reasoning" else {"logprobs": []}
            out.append(self._event(delta, item_id=self._item["id"],
                                   output_index=len(self.output), content_index=0,
                                   delta=piece, **extra))
        return out

    def _open_item(self, kind: str) -> list[str]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=len(self.output),
                            item=dict(item))
        self._item = {**item, "_text": ""}
        return [added, self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output), content_index=0, part=part)]

    def _finish_item(self) -> list[str]:
        if self._item is None:
            return []
        item, self._item = self._item, None
        text = item.pop("_text")
        index, ids = len(self.output), dict(item_id=item["id"], output_index=len(self.output))
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = [self._event("response.reasoning_text.done", **ids, content_index=0,
                               text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [self._event("response.output_text.done", **ids, content_index=0, text=text,
                               logprobs=[])]
        item.update(content=[part], status="completed")
        out.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _call_item(self, call: dict[str, Any]) -> dict[str, Any]:
        args = call["arguments"]
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": call["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args,
                                                                            ensure_ascii=False),
                "status": "completed"}
        if call["name"] in self.namespaced:
            item["namespace"], item["name"] = self.namespaced[call["name"]]
        return item

    def close(self, done: Done) -> list[str]:
        out = self._pieces(self.reply.flush())
        out += self._finish_item()
        for call in self.reply.calls():
            item = self._call_item(call)
            index, ids = len(self.output), dict(item_id=item["id"], output_index=len(self.output))
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"}))
            out.append(self._event("response.function_call_arguments.delta", **ids,
                                   delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", **ids,
                                   name=item["name"], arguments=item["arguments"]))
            self.output.append(item)
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        body = self._finished(done)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=body)]

    def _finished(self, done: Done) -> dict[str, Any]:
        body = self._response("completed", done)
        if self.on_done is not None:
            self.on_done(body)
        return body

    def error(self, message: str) -> list[str]:
        body = self._response("failed")
        body["error"] = {"code": "server_error", "message": f"Internal error: {message}"}
        return [self._event("response.failed", response=body)]

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        self._pieces(self.reply.feed(text) + self.reply.flush())
        self._finish_item()
        self.output += [self._call_item(c) for c in self.reply.calls()]
        return self._finished(done)
