"""`mlx-dflash models`: the published drafters `--drafter auto` picks from, and what is here."""

from __future__ import annotations

import json

import typer

from .app import app


@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The table of published target/drafter pairs (which `--drafter auto` matches by hub id
    or by shape), whether each drafter is on this machine, and the targets converted here."""
    from ..drafters.published import table_rows
    from ..drafters.shipped import shipped_drafters
    from ..paths import cache_root

    rows = table_rows()
    targets_dir = cache_root() / "targets"
    converted = sorted(p.name for p in targets_dir.iterdir() if (p / "config.json").exists()) \
        if targets_dir.exists() else []
    if as_json:
        typer.echo(json.dumps({"published": rows, "shipped_drafters": shipped_drafters(),
                               "converted_targets": converted}, indent=1))
        return
    width = max(len(r["target"]) for r in rows)
    dwidth = max(len(r["drafter"]) for r in rows)
    typer.echo(f"{'target':{width}}  {'drafter':{dwidth}}  {'family':8} {'source':10} here")
    for r in rows:
        here = "yes" if r["cached"] else f"no: {r['fetch']}"
        typer.echo(f"{r['target']:{width}}  {r['drafter']:{dwidth}}  {r['family']:8} "
                   f"{r['source']:10} {here}")
    typer.echo(f"\nShipped drafters: {', '.join(shipped_drafters()) or 'none'}")
    typer.echo(f"Targets converted in {targets_dir}: {', '.join(converted) or 'none'}")
    typer.echo("A target not in the table is matched by its shape (model type, hidden size, "
               "layers, vocabulary); with no match it runs with lookup drafts only.")
