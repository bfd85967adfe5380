"""Bearer API-key check for /v1/*, as plain ASGI middleware.

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
                message = ("Missing API key: send 'Authorization: Bearer <key>'." if given is None
                           else "Incorrect API key provided.")
                err = APIError(401, message, code="invalid_api_key")
                response = error_response(err, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None
