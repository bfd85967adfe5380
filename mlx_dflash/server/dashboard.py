"""The dashboard at ``GET /dashboard``: a page the package serves as it is (static files: no
build step, nothing fetched from the internet), fed by ``GET /v1/stats`` and streaming its chat
from ``POST /v1/chat/completions`` with ``token_origins``.

Model text is shown as text (the script sets ``textContent``, never HTML), and the page's
Content-Security-Policy allows only its own script and style, so a reply containing markup
can neither render nor run. The page itself needs no key; with ``--api-key`` it asks for one
and sends it with its requests, as every /v1 route requires it.
"""

from __future__ import annotations

from pathlib import Path
from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_dashboard(app: FastAPI) -> None:
    """Serve the page at /dashboard and its script and style under /dashboard/static."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": CSP,
                                     "X-Content-Type-Options": "nosniff",
                                     "Cache-Control": "no-cache"})

