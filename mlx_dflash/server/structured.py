"""Structured output as each API asks for it, read into one grammar (grammar.py).

- chat completions: ``response_format`` ``{"type": "json_object"}`` or ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- Responses: ``text.format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "name", "schema", "strict"}``;
- Anthropic messages: ``output_config.format`` ``{"type": "json_schema", "schema"}``;
- function tools with ``strict: true`` (all three APIs): once the reply opens a tool call, the
  call is held to ``{"name": <an offered tool>, "arguments": <its parameters' schema>}``
  (other tools' arguments: any object), for models whose calls are JSON between markers
  (mlx-lm's ``json_tools`` format: Qwen's, among others); free text around the calls as
  usual. Other call formats leave strict tools unconstrained (logged once per request).

The reply is held to the schema whether or not ``strict`` is set (a reply valid under the
schema is what a client asking for one can use). A schema the engine cannot compile is a 400
naming what it could not take; it is never dropped. With a grammar the chat template is asked
not to open a thinking block (``enable_thinking: false``): the reply is the JSON itself.
"""

from __future__ import annotations

import logging
from typing import Any

from ..grammar import Grammar, GrammarError
from .errors import APIError

log = logging.getLogger("mlx_dflash.server")

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


def tool_call_grammar(tokenizer: Any, tools: list[dict] | None, inside: bool) -> Grammar | None:
    """The grammar holding tool calls to strict tools' schemas (None: no strict tool, or a
    call format it cannot hold). ``inside``: the prompt ends with the call's opening marker."""
    functions = [t.get("function") or {} for t in tools or []]
    if not any(f.get("strict") for f in functions):
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    if getattr(parser, "__module__", "") != "mlx_lm.tool_parsers.json_tools":
        log.info("strict tools are not enforced: this model's tool calls are not JSON "
                 "between markers")
        return None
    calls = [{"type": "object", "properties": {
        "name": {"const": f.get("name")},
        "arguments": (f.get("parameters") or {"type": "object"}) if f.get("strict")
        else {"type": "object"}}, "required": ["name", "arguments"],
        "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        return Grammar.tool_calls(schema, tokenizer.tool_call_start, tokenizer.tool_call_end,
                                  inside)
    except GrammarError as e:
        raise APIError(400, f"A strict tool's 'parameters' cannot be enforced: {e}",
                       param="tools", code="unsupported_value") from None
