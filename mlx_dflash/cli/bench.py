"""`mlx-dflash bench`: speculative vs plain mlx-lm decoding on prompt files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from .app import app, fail
from .common import load_pair, parse_tree


@app.command()
def bench(
    prompts: List[Path] = typer.Option(..., "--prompts", help="JSON Lines file(s) with a "
                                       "'prompt', 'question' or 'turns' field; repeatable."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d",
                                          help="Shipped drafter name or dir/hub id."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target (default pair)."),
    block_size: List[int] = typer.Option([4, 8, 16], "--block-size", "-b", min=2,
                                         help="Block sizes to compare; repeatable."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Prompts per file."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures here."),
    copy: bool = typer.Option(False, "--copy", help="Also run each block size with copy "
                              "drafts (variant 'B+copy')."),
    auto: bool = typer.Option(True, "--auto/--no-auto", help="Also run the default settings "
                              "(variant 'auto': scheduler + copy drafts)."),
    tree: List[str] = typer.Option([], "--tree", help="Also run tree drafts of this many "
                                   "nodes (variant 'treeN', no copy drafts), or 'auto' (variant "
                                   "'tree-auto': sized per cycle, copy drafts on); repeatable. "
                                   "With --concurrency: the batch engine with trees."),
    concurrency: List[int] = typer.Option([], "--concurrency", "-c", min=1,
                                          help="Requests at once; repeatable. Instead of the "
                                          "single-request bench: groups of this many prompts "
                                          "arriving together, our batch engine against "
                                          "mlx-lm's batched plain decoding (the first "
                                          "--block-size is the fixed-block variant)."),
    stagger: float = typer.Option(0.0, "--stagger", min=0.0,
                                  help="With --concurrency: a group's requests arrive this "
                                  "many seconds apart instead of together."),
) -> None:
    """Compare plain greedy decoding with DFlash at several block sizes (runs interleaved)."""
    from ..bench import (
        format_batch_table,
        format_table,
        load_prompt_sets,
        run_batch_bench,
        run_bench,
    )
    from ..drafters.shipped import DEFAULT_DRAFTER, resolve_drafter

    for f in prompts:
        if not f.exists():
            fail(f"prompt file not found: {f}")
    try:
        sets = load_prompt_sets([str(f) for f in prompts], limit)
    except ValueError as e:
        fail(str(e))
    trees = [parse_tree(t) for t in tree]
    target, draft, tokenizer = load_pair(model, resolve_drafter(drafter) if drafter else None)
    if draft is None:
        fail("bench needs a drafter (--drafter)")
    if concurrency:
        results = run_batch_bench(target, draft, tokenizer, sets, list(concurrency), max_tokens,
                                  block_size[0], stagger=stagger, trees=trees)
    else:
        results = run_bench(target, draft, tokenizer, sets, list(block_size), max_tokens,
                            copy_drafts=copy, auto=auto, trees=trees)
    # Named as given (a shipped drafter by its name): no paths of this machine in the results.
    results["settings"]["drafter"] = drafter or DEFAULT_DRAFTER
    results["settings"]["model"] = model or "default (SmolLM2-135M-Instruct, float32)"
    typer.echo(format_batch_table(results) if concurrency else format_table(results))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")
