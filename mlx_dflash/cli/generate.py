"""`mlx-dflash generate`: stream one reply, then one line of statistics."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..policy import COPY_DRAFTS
from .app import app, fail
from .common import (
    DRAFT_WINDOW_HELP,
    KV_BITS_HELP,
    SPLIT_HELP,
    TREE_HELP,
    PrefillProgress,
    chat_prompt,
    load_pair,
    parse_split,
    parse_tree,
    read_grammar,
)


@app.command()
def generate(
    prompt_arg: Optional[str] = typer.Argument(None, metavar="[PROMPT]", help="The prompt."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt ('-': stdin)."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="mlx-lm target (dir or hub id). Default: the built-in pair."),
    drafter: Optional[str] = typer.Option(
        None, "--drafter", "-d", help="Drafter dir or hub id ('none': target alone; 'mtp': "
        "the target's own MTP head)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=0),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", min=1,
                                             help="Block size (default: the drafter's)."),
    tree: Optional[str] = typer.Option(None, "--tree", help=TREE_HELP),
    split: str = typer.Option("auto", "--split", help=SPLIT_HELP),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", min=0,
                                               help=DRAFT_WINDOW_HELP),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
    seed: Optional[int] = typer.Option(None, "--seed"),
    no_chat_template: bool = typer.Option(False, "--no-chat-template",
                                          help="Send the prompt as raw text."),
    copy: bool = typer.Option(COPY_DRAFTS, "--copy/--no-copy",
                              help="Copy drafts: verify what followed an earlier occurrence of "
                              "the last tokens when there is one."),
    json_schema: Optional[str] = typer.Option(
        None, "--json-schema", metavar="FILE", help="Reply with JSON valid against the JSON "
        "schema in FILE (structured output, as lossless as free text)."),
    json_object: bool = typer.Option(False, "--json", help="Reply with a JSON object."),
) -> None:
    """Generate text for PROMPT with speculative decoding. Under ``mlx.launch`` the target is
    split across the ranks; rank 0 reads the prompt and prints."""
    from .. import distributed

    distributed.init()
    text = prompt if prompt is not None else prompt_arg
    if text == "-":
        if distributed.group() is not None:  # mlx.launch passes lines on, never the end
            fail("under mlx.launch, pass the prompt as an argument (mlx.launch never passes "
                 "the end of stdin on: reading it would not end)")
        text = sys.stdin.read()
    if not text:
        fail("no prompt given (pass it as an argument or with --prompt)")
    if top_p == 0:
        fail("--top-p must be in (0, 1]")
    tree_size = parse_tree(tree)
    grammar = read_grammar(json_schema, json_object)
    import mlx.core as mx

    from ..decode import stream_generate

    target, draft, tokenizer = load_pair(model, drafter, split=parse_split(split),
                                         draft_window=draft_window, kv_bits=kv_bits)
    seed = distributed.common_seed(seed)
    if seed is not None:
        mx.random.seed(seed)
    speak = distributed.is_root()
    last, progress = None, PrefillProgress() if speak else None
    # A structured reply is the JSON itself: no thinking block first.
    template_kwargs = {"enable_thinking": False} if grammar is not None else {}
    responses = stream_generate(
        target, draft, tokenizer,
        chat_prompt(tokenizer, text, not no_chat_template, **template_kwargs),
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, seed=seed,
        block_size=block_size, prompt_progress=progress, copy_drafts=copy,
        tree=tree_size, grammar=grammar,
    )
    try:
        for last in responses:
            if speak:
                progress.clear()
                print(last.text, end="", flush=True)
    except ValueError as e:  # a request the pair cannot serve (e.g. trees on a hybrid target)
        fail(str(e))
    except RuntimeError as e:  # across machines: another rank failed or was stopped
        if distributed.group() is None:
            raise
        fail(f"rank {distributed.rank()}: the run across machines broke off: {e}")
    if speak:
        print()
        if last is not None:
            typer.secho(last.stats.summary(), fg=typer.colors.CYAN, err=True)
