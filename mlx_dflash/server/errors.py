"""OpenAI-style error bodies (Anthropic-style under /v1/messages), and handlers that turn every
failure into one."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("mlx_dflash.server")


class APIError(Exception):
    """An error the client should see as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(
    err: APIError, headers: dict[str, str] | None = None, path: str = ""
) -> JSONResponse:
    """The error in the shape of the API ``path`` belongs to."""
    if path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(err.status, err.message)
    else:
        body = err.body()
    return JSONResponse(body, status_code=err.status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _is_union_tag(part: str) -> bool:
    """Pydantic puts the union member's type ("str", "list[int]", "TextPart") in the location."""
    return part in _TYPE_TAGS or not part.isidentifier() or part[:1].isupper()


def _param(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role" (OpenAI's spelling)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "json_invalid":
        return "invalid_json"
    if kind.endswith(("_type", "_parsing")) or kind in ("union_tag_invalid", "is_instance_of"):
        return "invalid_type"
    return "invalid_value"


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, phrased for a client (400, as OpenAI does, not FastAPI's 422)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request body.")
    # The deepest location is the most specific (in a union it names the branch that got closest).
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return APIError(400, "The request body is not valid JSON.", code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    if param is None:
        message = "The request body must be a JSON object (Content-Type: application/json)."
        if kind == "missing":
            message = "The request body is missing; send a JSON object."
        return APIError(400, message, code=_code(kind))
    message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}."
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: '{param}'."
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error(s) in the request.)"
    return APIError(400, message, param=param, code=_code(kind))


def install_handlers(app: FastAPI) -> None:
    """Route every error (bad input, unknown path, a crash) through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return error_response(err, headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this (uvicorn logs it); the server itself keeps running.
        log.exception("internal error")
        err = APIError(500, f"Internal server error: {type(exc).__name__}.", type="server_error")
        return error_response(err, path=request.url.path)
