"""`mlx-dflash serve`: an OpenAI-compatible HTTP server (chat and text completions, streaming)."""

from __future__ import annotations

from typing import Optional

import typer

from ..decode import COPY_DRAFTS
from .app import app, fail
from .common import load_pair


@app.command()
def serve(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="mlx-lm target (dir or hub id). Default: the built-in pair."),
    drafter: Optional[str] = typer.Option(
        None, "--drafter", "-d", help="Drafter dir or hub id ('none': target alone)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", "-p", min=0, max=65535),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="MLX_DFLASH_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (env MLX_DFLASH_API_KEY)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", min=1,
                                             help="Block size (default: the drafter's)."),
    model_name: Optional[str] = typer.Option(
        None, "--model-name", help="Name clients must send as 'model' (default: --model)."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", min=2, help="Context size (default: the target's config)."),
    log_level: str = typer.Option("info", "--log-level"),
    copy: bool = typer.Option(COPY_DRAFTS, "--copy/--no-copy",
                              help="Copy drafts: verify what followed an earlier occurrence of "
                              "the last tokens when there is one."),
) -> None:
    """Serve the model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions)."""
    try:
        import uvicorn

        from ..server import create_app
    except ModuleNotFoundError as e:
        fail(f"{e.name} is needed for serving: pip install fastapi uvicorn")
    target, draft, tokenizer = load_pair(model, drafter)
    if model_name is None:
        from ..default_target import DEFAULT_TARGET_NAME

        model_name = model if model is not None else DEFAULT_TARGET_NAME
    server_app = create_app(target, draft, tokenizer, model_name=model_name, api_key=api_key,
                            max_context=max_context, block_size=block_size,
                            copy_drafts=copy)
    typer.secho(f"Serving '{model_name}' at http://{host}:{port}/v1"
                + (" (API key required)" if api_key else ""), fg=typer.colors.CYAN, err=True)
    # A bounded graceful shutdown: on Ctrl-C, open streams get 5 s, then they are cancelled.
    uvicorn.run(server_app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
