"""Structured output as each API asks for it, read into one grammar (grammar.py).

- chat completions: ``response_format`` ``{"type": "json_object"}`` or ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- Responses: ``text.format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "name", "schema", "strict"}``;
- Anthropic messages: ``output_config.format`` ``{"type": "json_schema", "schema"}``.

The reply is held to the schema whether or not ``strict`` is set (a reply valid under the
schema is what a client asking for one can use). A schema the engine cannot compile is a 400
naming what it could not take; it is never dropped. With a grammar the chat template is asked
not to open a thinking block (``enable_thinking: false``): the reply is the JSON itself.
"""

from __future__ import annotations

from typing import Any

from ..grammar import Grammar, GrammarError
from .errors import APIError

NO_THINKING = {"enable_thinking": False}


def grammar_of(fmt: Any, param: str, nested: bool = False) -> Grammar | None:
    """The grammar ``fmt`` asks for (None: plain text). ``nested``: the schema sits in a
    ``json_schema`` object (chat completions) rather than beside ``type``."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"'{param}' must be an object.", param=param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise APIError(400, f"'{param}' of type '{kind}' is not supported; use 'text', "
                       "'json_object' or 'json_schema'.", param=f"{param}.type",
                       code="unsupported_value")
    holder, where = (fmt.get("json_schema"), f"{param}.json_schema") if nested else (fmt, param)
    if not isinstance(holder, dict) or not isinstance(holder.get("schema"), dict):
        raise APIError(400, f"'{where}.schema' must be a JSON schema object.",
                       param=f"{where}.schema")
    try:
        return Grammar.json_schema(holder["schema"])
    except GrammarError as e:
        raise APIError(400, f"'{where}.schema' cannot be enforced: {e}",
                       param=f"{where}.schema", code="unsupported_value") from None
