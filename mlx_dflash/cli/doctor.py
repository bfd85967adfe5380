"""`mlx-dflash doctor`: what this machine gives the package, and what is wrong with it."""

from __future__ import annotations

from typing import Optional

import typer

from .app import app


@app.command()
def doctor(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Also load this target (dir or hub id) with its drafter and "
        "say what the block scheduler would choose for the pair."),
    drafter: Optional[str] = typer.Option(
        None, "--drafter", "-d", help="The pair's drafter (default: auto, as everywhere)."),
    pair: bool = typer.Option(
        False, "--pair", help="Check the default pair (without --model)."),
) -> None:
    """Check the platform, MLX and Metal, each kernel variant, the BLAS, memory headroom, the
    cache and the pass costs measured so far; exits 1 when something is wrong, saying what
    to do."""
    from ..doctor import check_pair, diagnose, report

    extra = []
    if model is not None or drafter is not None or pair:
        from .common import load_pair

        target, draft, _ = load_pair(model, drafter)
        extra = check_pair(target, draft, model or "the default pair")
    raise typer.Exit(report(diagnose(extra), typer.echo))
