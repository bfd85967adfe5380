"""Request bodies of the OpenAI-compatible endpoints (pydantic validates them before any work).

Strict types (no "5" for 5, no 1 for true) like the OpenAI API; unknown fields are ignored so
clients that send extras (``user``, ``metadata``, ...) still work, while a field that would
change the output in a way the server cannot honour (``logprobs``, penalties, ``n`` > 1,
``response_format``) gets a 400 that names it (``check_supported``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..grammar import Grammar
from .errors import APIError
from .structured import grammar_of

# Seeds are reduced mod 2**64 for mx.random.seed; allow the usual signed and unsigned 64-bit range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _integral_float(value: object) -> object:
    # JSON Schema counts 1.0 as an integer; strict pydantic would not. Strings stay rejected.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float)]

StopField = Optional[
    Union[str, Annotated[list[str], Field(max_length=16)]]
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: Optional[Annotated[Int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[Int, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Int, Field(ge=0)] = 0
    n: Annotated[Int, Field(ge=1, le=1, description="Only 1 is supported.")] = 1
    stop: StopField = None
    seed: Optional[Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, Int]] = None
    top_logprobs: Optional[Int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None

    def check_supported(self) -> None:
        """A 400 naming the first field this server cannot honour (never a silent 200)."""
        unsupported = [
            ("logprobs", bool(self.logprobs)), ("top_logprobs", bool(self.top_logprobs)),
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("presence_penalty", bool(self.presence_penalty)),
            ("logit_bias", bool(self.logit_bias)),
        ]
        for name, used in unsupported:
            if used:
                raise APIError(400, f"'{name}' is not supported by this server; leave it out.",
                               param=name, code="unsupported_parameter")

    def grammar(self) -> Grammar | None:
        """What ``response_format`` holds the reply to (structured.py)."""
        return grammar_of(self.response_format, "response_format", nested=True)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(value, parameter name): ``max_completion_tokens`` wins, as in OpenAI's API."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]  # an empty stop string would end every reply at once

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool's result answers this call
    reasoning_content: Optional[str] = None  # an assistant turn's thinking, as agents send it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates read it (Hugging Face's conventions)."""
        # Templates rarely know the newer "developer" role; it means what "system" meant.
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json_or_text(
                     c.function.arguments)}}
                for c in self.tool_calls
            ]
        return out


def json_or_text(text: str) -> object:
    # Templates index into the arguments (arguments.items()), so they get the parsed object.
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None  # its calls held to ``parameters`` (structured.py)


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[list[ToolSpec]] = None  # into the chat template; calls come back parsed
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    chat_template_kwargs: Optional[dict] = None  # e.g. {"enable_thinking": false}
    # mlx-dflash: streamed chunks also say how each piece of text came (Shaper.origins)
    token_origins: bool = False

    def choice(self) -> str:
        """tool_choice as prompts.chat_prompt reads it."""
        c = self.tool_choice
        return c.function.name if isinstance(c, NamedToolChoice) else (c or "auto")


class CompletionRequest(SamplingRequest):
    # A string, a list of token ids, or a list of either (a batch: only one item is served).
    prompt: Union[
        str,
        Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)],
        Annotated[list[str], Field(min_length=1)],
        Annotated[list[Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]],
                  Field(min_length=1)],
    ]

    def single_prompt(self) -> str | list[int] | None:
        """The one prompt; None for a batch of several (answered with a 400 by the caller)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0] if len(p) == 1 else None
        return p
