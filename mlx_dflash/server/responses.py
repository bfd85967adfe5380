"""OpenAI-shaped bodies for chat and text completions, whole or as stream chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .worker import Done


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class Shaper:
    """Builds the bodies of one response; ``chat`` picks chat.completion vs text_completion."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False):
        self.chat, self.model, self.include_usage = chat, model, include_usage
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

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; text completions have no such chunk."""
        if not self.chat:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None})
        return self._chunk({"text": text, "finish_reason": None})

    def final_chunk(self, done: Done) -> dict[str, Any]:
        reason = done.finish_reason
        choice = {"delta": {}} if self.chat else {"text": ""}
        body = self._chunk({**choice, "finish_reason": reason})
        body["dflash"] = done.dflash
        return body

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(done), dflash=done.dflash)
        return body

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        body = self._base("chat.completion" if self.chat else "text_completion")
        if self.chat:
            choice = {"message": {"role": "assistant", "content": text}}
        else:
            choice = {"text": text}
        body["choices"] = [
            {"index": 0, **choice, "finish_reason": done.finish_reason, "logprobs": None}
        ]
        body.update(usage=usage(done), dflash=done.dflash)
        return body
