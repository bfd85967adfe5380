"""API-key check for /v1/*, as plain ASGI middleware: ``Authorization: Bearer KEY`` (OpenAI
clients) or ``x-api-key: KEY`` (Anthropic clients).

It runs before the body is read or validated, so a request without the key learns nothing
about its payload (it always gets the 401).
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1"):
        self.app, self.api_key, self.prefix = app, api_key, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            given = _bearer(scope)
            if given is None or not secrets.compare_digest(given.encode(), self.api_key.encode()):
                message = ("Missing API key: send 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'." if given is None
                           else "Incorrect API key provided.")
                err = APIError(401, message, code="invalid_api_key")
                response = error_response(err, headers={"WWW-Authenticate": "Bearer"},
                                          path=scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    """The key the request sends (a bearer token, else x-api-key); None if it sends none."""
    headers = dict(scope.get("headers", []))
    if b"authorization" in headers:
        scheme, _, token = headers[b"authorization"].decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" or b"x-api-key" not in headers:
            return token.strip() if scheme.lower() == "bearer" else ""
    if b"x-api-key" in headers:
        return headers[b"x-api-key"].decode("latin-1").strip()
    return None
