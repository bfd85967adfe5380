"""Requests -> prompt token ids, with the checks that need the tokenizer or the context size."""

from __future__ import annotations

from typing import Any

from ..prompts import encode_prompt
from .errors import APIError
from .schemas import ChatMessage


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage] | list[dict], tools: list[dict] | None = None
) -> list[int]:
    """The chat template's token ids (``tools`` rendered by the template as well); without a
    template, the contents joined by newlines."""
    convo = [m if isinstance(m, dict) else m.template_dict() for m in messages]
    if not getattr(tokenizer, "has_chat_template", False):
        return text_prompt_ids(tokenizer, "\n".join(m["content"] for m in convo), "messages")
    return _render(tokenizer, convo, tools, add_generation_prompt=True)


def _render(tokenizer: Any, convo: list[dict], tools: list[dict] | None,
            add_generation_prompt: bool) -> list[int]:
    extra = {"tools": tools} if tools else {}
    try:
        ids = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt,
                                            **extra)
    except Exception as e:  # noqa: BLE001 (jinja raises anything; e.g. "roles must alternate")
        raise APIError(400, f"The chat template rejected the messages: {e}",
                       param="messages", code="invalid_value") from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    if isinstance(ids, str):
        return text_prompt_ids(tokenizer, ids, "messages")
    return [int(t) for t in ids]


def earlier_turns_end(
    tokenizer: Any, messages: list[ChatMessage] | list[dict], tools: list[dict] | None,
    ids: list[int],
) -> list[int]:
    """Where the messages before the last one end in ``ids`` (when the template renders them as
    a prefix): a point later requests of the same conversation, or with the same system
    prompt, continue from. [] when there is no such point."""
    convo = [m if isinstance(m, dict) else m.template_dict() for m in messages]
    if len(convo) < 2 or not getattr(tokenizer, "has_chat_template", False):
        return []
    try:
        head = _render(tokenizer, convo[:-1], tools, add_generation_prompt=False)
    except APIError:
        return []
    return [len(head)] if 0 < len(head) < len(ids) and ids[: len(head)] == head else []


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
