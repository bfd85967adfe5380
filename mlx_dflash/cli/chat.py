"""`mlx-dflash chat`: multi-turn chat with the model's chat template, streamed, with statistics."""

from __future__ import annotations

import time
from typing import Any, Optional

import typer

from ..policy import COPY_DRAFTS
from .app import app, fail
from .common import (
    DRAFT_WINDOW_HELP,
    KV_BITS_HELP,
    SPLIT_HELP,
    TREE_HELP,
    PrefillProgress,
    load_pair,
    parse_split,
    parse_tree,
)

COMMANDS = "/reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"
CONVERSATION_ENTRIES = 3  # cache entries a chat keeps: its last reply, and checkpoints


def estimate_speedup(stats: Any, costs: Any, context: int) -> float:
    """Plain decoding's modelled time for the committed tokens over that of the cycles run
    (each: a drafter pass unless plain or copied, plus a verify of its 1+K tokens)."""
    if costs is None or not stats.cycles:
        return 1.0
    spent = sum(costs.verify(k + 1, context) for k in stats.draft_lengths)
    drafting = [k for k in stats.draft_lengths if k]  # copied cycles among them: no drafter
    drafted = max(len(drafting) - stats.copy_cycles, 0)
    if drafting:
        spent += sum(costs.draft(k, context) for k in drafting) * drafted / len(drafting)
    return sum(stats.acceptance_lengths) * costs.verify(1, context) / spent


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The whole conversation through the chat template, ready for the assistant's turn."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding from some versions
        out = out["input_ids"]
    return [int(t) for t in out]


def fit_context(tokenizer: Any, messages: list[dict], max_kv: int | None,
                max_tokens: int) -> tuple[list[int], int]:
    """The prompt, after dropping the oldest exchanges (never the system prompt or the new
    message) until prompt + reply fit in ``max_kv`` tokens; and how many messages went."""
    prompt = render_prompt(tokenizer, messages)
    dropped = 0
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while max_kv is not None and len(prompt) + max_tokens > max_kv and len(messages) - first > 1:
        del messages[first : first + 2]  # a user message and the reply to it
        dropped += 2
        prompt = render_prompt(tokenizer, messages)
    return prompt, dropped


@app.command(
    epilog="Speedup estimate: at start-up the target's cost for one 1-token pass (plain "
    "decoding: one token per pass) and for one B-token verify pass, plus one drafter pass, are "
    "timed once (the block scheduler's cost model, cached per model pair and machine). est. "
    "speedup = committed tokens x t(1-token pass) / sum over cycles of (t(drafter pass) + "
    "t((1+K)-token pass)), K the drafts verified that cycle (no drafter pass for plain or copied "
    "cycles). It leaves out per-token overheads (sampling, host sync) and is labelled 'est.'; "
    "measure the real speedup with --drafter none for comparison."
)
def chat(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="mlx-lm target (dir or hub id). Default: the built-in pair."),
    drafter: Optional[str] = typer.Option(
        None, "--drafter", "-d", help="Drafter dir or hub id ('none': target alone; 'mtp': "
        "the target's own MTP head)."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", min=1,
                                   help="Most tokens per reply."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", min=1,
                                             help="Block size (default: the drafter's)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", "--system", "-s",
                                                help="A system message opening the chat."),
    max_kv_size: Optional[int] = typer.Option(
        None, "--max-kv-size", "--max-kv", min=2,
        help="Most tokens of conversation kept (prompt + reply): the oldest exchanges are "
        "dropped (the system prompt stays). Default: no limit."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    copy: bool = typer.Option(COPY_DRAFTS, "--copy/--no-copy",
                              help="Copy drafts: verify what followed an earlier occurrence of "
                              "the last tokens when there is one."),
    tree: Optional[str] = typer.Option(None, "--tree", help=TREE_HELP),
    split: str = typer.Option("auto", "--split", help=SPLIT_HELP),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", min=0,
                                               help=DRAFT_WINDOW_HELP),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
) -> None:
    """Chat with the model (multi-turn, its chat template), one statistics line per reply.

    /reset clears the conversation; /exit, Ctrl-D or Ctrl-C at the prompt quit; Ctrl-C during a
    reply stops it. The whole conversation is rendered through the template every turn, and the
    caches of the turns before are kept, so only the new turn is prefilled.
    """
    if top_p == 0:
        fail("--top-p must be in (0, 1]")
    tree_size, split = parse_tree(tree), parse_split(split)
    import mlx.core as mx

    from .. import distributed
    from ..decode import stream_generate_cached
    from ..drafters.base import drafting, verify_width
    from ..prefix_cache import PrefixCache

    distributed.init()
    speak = distributed.is_root()  # under mlx.launch rank 0 reads and prints; the rest follow
    tic = time.perf_counter()
    target, draft, tokenizer = load_pair(model, drafter, split=split,
                                         draft_window=draft_window, kv_bits=kv_bits)
    if not getattr(tokenizer, "has_chat_template", False):
        fail(f"the tokenizer of {model or 'the default model'} has no chat template; "
             "use `mlx-dflash generate --no-chat-template` for plain text completion")
    B = verify_width(draft, block_size)
    costs = None
    if draft is not None and B > 1:
        from ..schedule import cached_costs
        from ..target import as_target
        from ..tree import TREE_MAX

        # trees verify up to TREE_MAX + 1 tokens: their passes are timed that far
        costs = cached_costs(as_target(target), drafting(draft, block_size),
                             max(B, TREE_MAX + 1) if tree else B)
        if speak:
            typer.echo(f"  target 1-token pass {costs.verify(1, 128) * 1e3:.1f} ms, {B}-token "
                       f"pass {costs.verify(B, 128) * 1e3:.1f} ms; drafter pass "
                       f"{costs.draft_s * 1e3:.1f} ms", err=True)
    if speak:
        typer.echo(f"Ready in {time.perf_counter() - tic:.1f} s. {COMMANDS}.", err=True)
    seed = distributed.common_seed(seed)
    if seed is not None:
        mx.random.seed(seed)

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    start = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(start)
    conversation = PrefixCache(1 << 62, max_entries=CONVERSATION_ENTRIES)  # its caches
    while True:
        text = _read_line(speak)
        if text is None:
            return
        stripped = text.strip()
        if not stripped:
            continue
        if stripped in ("/exit", "/quit"):
            return
        if stripped == "/reset":
            messages = list(start)
            conversation.clear()
            if speak:
                typer.echo("[conversation cleared]", err=True)
            continue
        if stripped == "/help":
            if speak:
                typer.echo(COMMANDS, err=True)
            continue

        messages.append({"role": "user", "content": text})
        prompt, dropped = fit_context(tokenizer, messages, max_kv_size, max_tokens)
        if dropped and speak:
            typer.echo(f"[dropped the {dropped} oldest messages to stay within --max-kv-size]",
                       err=True)
        progress = PrefillProgress() if speak else None
        reply, last = [], None
        gen = stream_generate_cached(
            conversation, target, draft, tokenizer, prompt, take=True, max_tokens=max_tokens,
            temperature=temp, top_p=top_p, top_k=top_k, seed=seed, block_size=block_size,
            prompt_progress=progress, copy_drafts=copy, tree=tree_size,
        )
        try:
            for last in gen:
                reply.append(last.text)
                if speak:
                    progress.clear()
                    print(last.text, end="", flush=True)
        except ValueError as e:  # a request the pair cannot serve (trees on a hybrid target)
            fail(str(e))
        except RuntimeError as e:  # across machines: another rank failed or was stopped
            if distributed.group() is None:
                raise
            fail(f"rank {distributed.rank()}: the run across machines broke off: {e}")
        except KeyboardInterrupt:
            if distributed.group() is not None:  # the other ranks cannot stop mid-reply
                fail("stopped")
            gen.close()  # keeps what can be kept of the caches
            progress.clear()
            messages.pop()  # the turn never completed: forget it
            print()
            typer.echo("[reply stopped; the turn was dropped]", err=True)
            continue
        messages.append({"role": "assistant", "content": "".join(reply)})
        if not speak:
            continue
        print(flush=True)
        if last is not None:
            s = last.stats
            speedup = estimate_speedup(s, costs, len(prompt) + s.generation_tokens)
            typer.secho(
                f"[{s.generation_tps:.1f} tok/s | mean acceptance length "
                f"{s.mean_acceptance_length:.2f} (block {s.block_size}) | "
                f"est. speedup {speedup:.2f}x | prefilled {s.prefilled_tokens} of "
                f"{s.prompt_tokens} prompt tokens]",
                fg=typer.colors.CYAN, err=True,
            )


def _read_line(speak: bool) -> str | None:
    """The next message typed (None: quit). Under mlx.launch rank 0 reads it and sends it on
    (mlx.launch passes the terminal's lines on, but not its end)."""
    from .. import distributed

    text = None
    if speak:
        try:
            text = input(">> ")
        except (EOFError, KeyboardInterrupt):
            print()
    return distributed.share(text)
