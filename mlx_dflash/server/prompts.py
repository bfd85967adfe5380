"""Requests -> prompt token ids, with the checks that need the tokenizer or the context size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..grammar import Grammar
from ..prompts import encode_prompt
from .errors import APIError
from .structured import tool_call_grammar
from .schemas import ChatMessage
from .tools import ToolCalls


@dataclass
class ChatPrompt:
    """A conversation rendered for the model: its token ids, how to read the reply's tool calls
    (None: not at all), and where later requests may continue from (see earlier_turns_end)."""

    ids: list[int]
    tools: ToolCalls | None = None
    checkpoints: list[int] = field(default_factory=list)
    grammar: Grammar | None = None  # strict tools' calls held to their schemas


def chat_prompt(
    tokenizer: Any, messages: list[ChatMessage] | list[dict], tools: list[dict] | None = None,
    *, tool_choice: Any = "auto", template_kwargs: dict[str, Any] | None = None,
    checkpoints: bool = False, param: str = "tool_choice",
) -> ChatPrompt:
    """The chat template's rendering of ``messages`` with ``tools`` under ``tool_choice``
    ("auto", "none": no tools offered, "required": the reply opens with a call, or a tool's
    name: that tool alone, called). ``checkpoints``: also find where earlier turns end."""
    convo = [m if isinstance(m, dict) else m.template_dict() for m in messages]
    kwargs = dict(template_kwargs or {})
    forced = tool_choice not in ("auto", "none", None) and bool(tools)
    if tool_choice == "none":
        tools = None
    elif forced and tool_choice != "required":
        tools = [t for t in tools if _tool_name(t) == tool_choice]
        if not tools:
            raise APIError(400, f"'{param}' names the function '{tool_choice}', which is not "
                           "among the request's tools.", param=param, code="invalid_value")
    if forced:
        if not getattr(tokenizer, "has_tool_calling", False):
            raise APIError(400, f"'{param}' asks for a tool call, but this model's tool-call "
                           "format is not known, so a call cannot be forced; use 'auto'.",
                           param=param, code="unsupported_value")
        kwargs.setdefault("enable_thinking", False)  # the reply opens with the call itself
    ids = chat_prompt_ids(tokenizer, convo, tools, kwargs)
    ends = earlier_turns_end(tokenizer, convo, tools, ids, kwargs) if checkpoints else []
    if forced:
        ids = ids + list(tokenizer.tool_call_start_tokens)
    return ChatPrompt(ids, ToolCalls.for_request(tokenizer, tools, inside=forced), ends,
                      tool_call_grammar(tokenizer, tools, inside=forced))


def _tool_name(tool: dict) -> str | None:
    return (tool.get("function") or {}).get("name")


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage] | list[dict], tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The chat template's token ids (``tools`` rendered by the template as well); without a
    template, the contents joined by newlines."""
    convo = [m if isinstance(m, dict) else m.template_dict() for m in messages]
    if not getattr(tokenizer, "has_chat_template", False):
        return text_prompt_ids(tokenizer, "\n".join(m["content"] for m in convo), "messages")
    return _render(tokenizer, convo, tools, True, template_kwargs)


def _render(tokenizer: Any, convo: list[dict], tools: list[dict] | None,
            add_generation_prompt: bool,
            template_kwargs: dict[str, Any] | None = None) -> list[int]:
    extra = {"tools": tools} if tools else {}
    extra.update(template_kwargs or {})
    try:
        ids = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt,
                                            **extra)
    except Exception as e:  # noqa: BLE001 (jinja raises anything; e.g. "roles must alternate")
        folded = fold_system_messages(convo)
        if folded == convo:
            raise APIError(400, f"The chat template rejected the messages: {e}",
                           param="messages", code="invalid_value") from e
        return _render(tokenizer, folded, tools, add_generation_prompt, template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    if isinstance(ids, str):
        return text_prompt_ids(tokenizer, ids, "messages")
    return [int(t) for t in ids]


def fold_system_messages(convo: list[dict]) -> list[dict]:
    """For templates that take a system message only first: the leading system messages as
    one, each later one folded into the next user message (the one before, if it is last)."""
    lead = 0
    while lead < len(convo) and convo[lead]["role"] == "system":
        lead += 1
    if lead <= 1 and all(m["role"] != "system" for m in convo[lead:]):
        return convo
    out = ([{"role": "system", "content": "\n\n".join(m["content"] for m in convo[:lead])}]
           if lead else [])
    pending: list[str] = []
    for m in convo[lead:]:
        if m["role"] == "system":
            pending.append(m["content"])
        elif m["role"] == "user" and pending:
            out.append({**m, "content": "\n\n".join([*pending, m["content"]])})
            pending = []
        else:
            out.append(m)
    if pending:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if users:
            i = users[-1]
            out[i] = {**out[i], "content": "\n\n".join([out[i]["content"], *pending])}
        else:
            out.insert(0, {"role": "system", "content": "\n\n".join(pending)})
    return out


def earlier_turns_end(
    tokenizer: Any, messages: list[ChatMessage] | list[dict], tools: list[dict] | None,
    ids: list[int], template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Where the system prompt and the messages before the last one end in ``ids`` (when the
    template renders them as a prefix): points later requests of the same conversation, or
    with the same system prompt, continue from. [] when there is no such point."""
    convo = [m if isinstance(m, dict) else m.template_dict() for m in messages]
    if len(convo) < 2 or not getattr(tokenizer, "has_chat_template", False):
        return []
    ends = []
    heads = [convo[:-1]] + ([convo[:1]] if convo[0]["role"] == "system" and len(convo) > 2
                            else [])
    for head_convo in heads:
        try:
            head = _render(tokenizer, head_convo, tools, False, template_kwargs)
        except APIError:
            continue
        if 0 < len(head) < len(ids) and ids[: len(head)] == head:
            ends.append(len(head))
    return sorted(set(ends))


def text_prompt_ids(tokenizer: Any, prompt: str | list[int], param: str = "prompt") -> list[int]:
    try:
        return encode_prompt(tokenizer, prompt)
    except ValueError as e:  # nothing to condition on: the text encodes to no tokens
        verb = "encode" if param == "messages" else "encodes"
        raise APIError(400, f"The {param} {verb} to no tokens: there is nothing to continue.",
                       param=param, code="invalid_value") from e


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is not None and (bad := [t for t in ids if not 0 <= t < vocab_size]):
        raise APIError(400, f"Token id {bad[0]} is outside the vocabulary (size {vocab_size}).",
                       param="prompt", code="invalid_value")


def check_context(n_prompt: int, max_context: int, param: str) -> None:
    """A prompt that fills the context leaves no room for even one new token."""
    if n_prompt >= max_context:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens, but the prompt has "
            f"{n_prompt} tokens; shorten it to at most {max_context - 1} tokens so there is room "
            "to generate.",
            param=param,
            code="context_length_exceeded",
        )
