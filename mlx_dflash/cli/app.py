"""The typer application that every `mlx-dflash` subcommand registers on."""

import typer

app = typer.Typer(
    name="mlx-dflash",
    help="Lossless block-parallel speculative decoding (DFlash) for MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> None:
    """Print a clear error and exit (no traceback for user mistakes)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"mlx-dflash {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Lossless block-parallel speculative decoding (DFlash) for MLX."""
