"""`mlx-dflash bench`: speculative vs plain mlx-lm decoding on prompt files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from .app import app, fail
from .common import load_pair, parse_tree


def parse_length(text: str) -> int:
    """'4k', '16K', '1024' -> tokens (k = 1024)."""
    t = text.strip().lower()
    scale = 1024 if t.endswith("k") else 1
    digits = t.removesuffix("k")
    if not digits.isdigit() or int(digits) == 0:
        fail(f"--context takes a number of tokens such as 4k or 16384, got {text!r}")
    return int(digits) * scale


@app.command()
def bench(
    prompts: List[Path] = typer.Option([], "--prompts", help="JSON Lines file(s) with a "
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
    context: List[str] = typer.Option([], "--context", help="Instead: the long-context bench "
                                      "at this many prompt tokens (e.g. 4k, 16384); "
                                      "repeatable. Code prompts (standard-library sources "
                                      "and a question) and chat prompts (earlier turns from "
                                      "the --prompts rows with a question and an answer, a "
                                      "new question from the others); each prefilled once."),
    draft_window: List[int] = typer.Option([], "--draft-window", min=0, help="With "
                                           "--context: also run the drafter attending to this "
                                           "many last context positions; repeatable."),
    kind: List[str] = typer.Option([], "--kind", help="With --context: only prompts of this "
                                   "kind (code or chat; repeatable). Default: both."),
    shared_context: bool = typer.Option(False, "--shared-context", help="With --context: a "
                                        "kind's prompts share their long part (one source "
                                        "text or chat history, prefilled once) and differ in "
                                        "the last question, as an agent's requests do."),
    prefill_compare: bool = typer.Option(True, "--prefill-compare/--no-prefill-compare",
                                         help="With --context: also time mlx-lm's prefill of "
                                         "the first prompt of each kind (one more prefill)."),
    structured: bool = typer.Option(False, "--structured", help="Instead: the structured-"
                                    "output bench (JSON extraction tasks, with and without "
                                    "their schemas, plain and speculative)."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", help="With --structured: a JSON "
                                         "Lines file of tasks (name, text, schema, question); "
                                         "default: the 24 that ship with the package."),
) -> None:
    """Compare plain greedy decoding with DFlash at several block sizes (runs interleaved)."""
    from ..bench import (
        format_batch_table,
        format_table,
        load_prompt_sets,
        run_batch_bench,
        run_bench,
    )
    from ..drafters.shipped import resolve_drafter

    if structured:
        return _structured(model, drafter, tasks, max_tokens, limit, json_out)
    if not prompts:
        fail("--prompts is required (a JSON Lines file of prompts; repeatable)")
    for f in prompts:
        if not f.exists():
            fail(f"prompt file not found: {f}")
    try:
        sets = load_prompt_sets([str(f) for f in prompts], limit)
    except ValueError as e:
        fail(str(e))
    trees = [parse_tree(t) for t in tree]
    lengths = [parse_length(c) for c in context]
    if draft_window and not lengths:
        fail("--draft-window variants are part of the long-context bench (--context)")
    if shared_context and not lengths:
        fail("--shared-context shapes the long-context bench's prompts (--context)")
    if kind and not lengths:
        fail("--kind chooses the long-context bench's prompts (--context)")
    unknown = sorted(set(kind) - {"code", "chat"})
    if unknown:
        fail(f"--kind takes code or chat, got {', '.join(unknown)}")
    target, draft, tokenizer = load_pair(model, resolve_drafter(drafter) if drafter else None)
    if draft is None:
        fail("bench needs a drafter (--drafter)")
    if lengths:
        from ..bench_context import format_context_table, read_turns, run_context_bench
        from ..drafters.dflash import DFlashDraftModel

        if not isinstance(draft, DFlashDraftModel):
            fail("the long-context bench times DFlash, DFlash 2 and DSpark drafters")
        turns, questions = [], []
        for f in prompts:
            try:
                turns += read_turns(f)
            except ValueError:
                questions += [q for texts in load_prompt_sets([str(f)], None).values()
                              for q in texts]
        if not turns or not questions:
            fail("--context needs --prompts files of both kinds: rows with a question and an "
                 "answer (the chats' earlier turns) and rows with a prompt (their last turn)")
        results = run_context_bench(target, draft, tokenizer, lengths, turns=turns,
                                    questions=questions, prompts=limit or 2,
                                    max_tokens=max_tokens, concurrency=concurrency,
                                    windows=draft_window, compare_prefill=prefill_compare,
                                    shared_context=shared_context,
                                    kinds=tuple(kind) or ("code", "chat"))
        table = format_context_table
    elif concurrency:
        results = run_batch_bench(target, draft, tokenizer, sets, list(concurrency), max_tokens,
                                  block_size[0], stagger=stagger, trees=trees)
        table = format_batch_table
    else:
        results = run_bench(target, draft, tokenizer, sets, list(block_size), max_tokens,
                            copy_drafts=copy, auto=auto, trees=trees)
        table = format_table
    _report(results, table, model, drafter, json_out)


def _report(results: dict, table, model: Optional[str], drafter: Optional[str],
            json_out: Optional[Path]) -> None:
    from ..drafters.shipped import DEFAULT_DRAFTER

    # Named as given (a shipped drafter by its name): no paths of this machine in the results.
    results["settings"]["drafter"] = drafter or DEFAULT_DRAFTER
    results["settings"]["model"] = model or "default (SmolLM2-135M-Instruct, float32)"
    typer.echo(table(results))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


def _structured(model: Optional[str], drafter: Optional[str], tasks_file: Optional[Path],
                max_tokens: int, limit: Optional[int], json_out: Optional[Path]) -> None:
    from ..bench_structured import format_structured_table, read_tasks, run_structured_bench
    from ..drafters.shipped import resolve_drafter

    if tasks_file is not None and not tasks_file.is_file():
        fail(f"task file not found: {tasks_file}")
    try:
        tasks = read_tasks(tasks_file)[:limit]
    except (ValueError, KeyError) as e:
        fail(str(e))
    target, draft, tokenizer = load_pair(model, resolve_drafter(drafter) if drafter else None)
    if draft is None:
        fail("bench needs a drafter (--drafter)")
    results = run_structured_bench(target, draft, tokenizer, tasks, max_tokens)
    _report(results, format_structured_table, model, drafter, json_out)
