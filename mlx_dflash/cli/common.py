"""Loading shared by the subcommands: the target/drafter pair, default or given."""

from __future__ import annotations

import sys
from typing import Any

from .app import fail

LONG_PROMPT = 512  # tokens; from here on the prefill gets a progress line


class PrefillProgress:
    """A live 'prefill done/total' line on stderr for long prompts; erased when decoding starts."""

    def __init__(self) -> None:
        self.active = None  # decided on the first call, when the prompt length is known
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.active is None:
            self.active = total >= LONG_PROMPT
        if not self.active:
            return
        if self.tty:
            print(f"\r[prefill {done}/{total} tokens]", end="", file=sys.stderr, flush=True)
        elif done == 0:
            print(f"[prefill {total} tokens]", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.active and self.tty:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
        self.active = False


def load_pair(model: str | None, drafter: str | None, block_size: int | None = None,
              split: str = "auto", draft_window: int | None = None,
              kv_bits: int | None = None) -> tuple:
    """(model, drafter, tokenizer). No --model: the package's default pair. Under mlx.launch
    (several ranks, distributed.py) the target is split across them (``split``: how, see
    ``distributed.shard_target``). ``draft_window``: the drafter attends to that many last
    context positions (0: all of them; None: as its config says). ``kv_bits``: the target's
    full-attention KV caches quantized to that many bits (target.quantize_kv)."""
    from ..target import KV_BITS

    if kv_bits is not None and kv_bits not in KV_BITS:  # before minutes of loading
        fail(f"--kv-bits takes {', '.join(map(str, KV_BITS))}, got {kv_bits}")
    pair = _load_pair(model, drafter, split)
    if kv_bits is not None:
        from ..target import quantize_kv

        try:
            quantize_kv(pair[0], kv_bits)
        except ValueError as e:
            fail(f"--kv-bits: {e}")
    if draft_window is not None:
        from ..drafters.dflash import DFlashDraftModel

        if not isinstance(pair[1], DFlashDraftModel):
            fail("--draft-window applies to DFlash, DFlash 2 and DSpark drafters (they attend "
                 "to the context's features)")
        pair[1].args.context_window = draft_window or None
    return pair


KV_BITS_HELP = ("Quantize the target's keys and values to this many bits (4 or 8; group size "
                "64) from the first position on: less memory at long contexts. Speculative "
                "output equals plain decoding with the same quantized caches, not the "
                "full-precision model's.")
DRAFT_WINDOW_HELP = ("The drafter attends to the last N context positions only (0: all): its "
                     "pass then costs the same at any context length. Default: its config's "
                     "context_window, else all.")


def _load_pair(model: str | None, drafter: str | None, split: str) -> tuple:
    from mlx_lm import load

    from .. import distributed
    from ..drafters import DrafterMismatchError, load_drafter

    from ..drafters.base import LookupDrafts
    from ..drafters.published import AUTO, LOOKUP, MTP, NONE

    choice = (drafter or AUTO).lower() if (drafter or AUTO).lower() in (
        AUTO, LOOKUP, MTP, NONE) else None
    try:
        if model is None and choice == AUTO:
            from ..default_pair import load_default

            return _split(*load_default(progress=distributed.is_root()), split)
        if model is None:  # the default target with another drafter
            from ..default_pair import ensure_default_target

            model = str(ensure_default_target())
        if distributed.is_root():
            print(f"Loading target {model} ...", file=sys.stderr)
        # Split across ranks, each loads only its part (lazily, then sharded).
        target, tokenizer = load(model, lazy=distributed.group() is not None)
        draft = None
        if choice == AUTO:  # the target's MTP head, a published drafter, or lookups only
            from mlx_lm.utils import _download

            from ..drafters.published import choose

            draft, chosen = choose(model, _download(model), target)
            if distributed.is_root():
                print(f"Drafter (auto): {chosen.label}: {chosen.reason}", file=sys.stderr)
        elif choice == MTP:  # the target's own MTP head
            from mlx_lm.utils import _download

            from ..drafters.mtp import load_mtp_drafter

            draft = load_mtp_drafter(_download(model), target)
        elif choice == LOOKUP:
            draft = LookupDrafts()
        elif choice is None:
            draft = load_drafter(drafter, model=target)
        return _split(target, draft, tokenizer, split)
    except (FileNotFoundError, NotADirectoryError, DrafterMismatchError, ValueError,
            NotImplementedError) as e:
        fail(str(e))


def _split(target: Any, draft: Any, tokenizer: Any, split: str) -> tuple:
    """The pair with its target split across the run's ranks, when there are several."""
    from .. import distributed

    if distributed.group() is not None:
        how = distributed.shard_target(target, mode=split)
        if distributed.is_root():
            print(f"Target split across {distributed.group().size()} ranks ({how} parallel)",
                  file=sys.stderr)
    return target, draft, tokenizer


SPLIT_HELP = ("Under mlx.launch, how the target is split across the ranks: 'tensor' (every "
              "layer by heads: two messages a layer per pass), 'pipeline' (runs of whole "
              "layers: a few messages per pass, however deep; better over slow links), or "
              "'auto' (tensor where the heads divide).")
SPLITS = ("auto", "tensor", "pipeline")


def parse_split(text: str) -> str:
    """--split: one of SPLITS."""
    if text not in SPLITS:
        fail(f"--split takes {', '.join(SPLITS)}, got {text!r}")
    return text


def chat_prompt(tokenizer: Any, text: str, use_template: bool = True,
                **template_kwargs: Any) -> str | list[int]:
    """Wrap a user message in the chat template when the tokenizer has one (like mlx_lm)."""
    if use_template and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **template_kwargs)
    return text


def read_grammar(json_schema: str | None, json_object: bool) -> Any:
    """The grammar --json-schema FILE or --json asks for (None: free text); a file that is
    missing or a schema that cannot be enforced ends the command with the reason."""
    from pathlib import Path

    from ..grammar import Grammar, GrammarError

    if json_schema is not None and json_object:
        fail("--json-schema and --json are alternatives: give one")
    try:
        if json_schema is not None:
            path = Path(json_schema)
            if not path.is_file():
                fail(f"--json-schema: no such file: {json_schema}")
            return Grammar.json_schema(path.read_text())
        return Grammar.json_object() if json_object else None
    except GrammarError as e:
        fail(f"--json-schema {json_schema}: {e}" if json_schema else str(e))


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GB', '512MiB', '1.5g', '0' -> bytes."""
    import re

    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 2GB, 512MiB, 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


TREE_HELP = ("Verify a tree of this many drafted nodes per cycle instead of a chain, or 'auto': "
             "as many as pay.")


def parse_tree(text: str | None) -> int | str | None:
    """--tree: a number of nodes (>= 1), 'auto', or None (chains)."""
    if text is None or text == "auto":
        return text
    if not (text.isdigit() and int(text) > 0):
        fail(f"--tree takes a number of nodes (>= 1) or 'auto', got {text!r}")
    return int(text)
