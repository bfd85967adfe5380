"""Structured output: replies kept to a grammar (a JSON schema, any JSON object, a regular
expression or a Lark grammar), compiled and matched by llguidance.

llguidance was chosen by measurement (docs/structured_output.md): on this project's CPU it
computes a token mask in tens of microseconds, compiles a schema in about a millisecond, rolls
back any number of tokens, and ships abi3 wheels for macOS arm64 and Linux x86-64 with no
dependencies (xgrammar needs torch; outlines-core's masks cost ~10x more per token).

The law under speculation: at every position the target's distribution is masked by the
grammar (disallowed tokens at -inf, the rest renormalised), exactly as plain constrained
decoding has it. A cycle's block is checked on the host before the target pass
(:meth:`Matcher.constrain`): where the grammar admits one token alone, that token is the
block's there (forced: the masked target can choose nothing else, so it is certain), a
looked-up or greedy draft the grammar forbids ends the block, a sampled draft it forbids is
drawn again from the drafter's distribution restricted to what the grammar allows (so the
drafts follow the masked proposal that rejection sampling is then given), and the masks of
every position go to the target pass.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

# JSON as json.dumps writes it by default: ", " and ": " between items, no other whitespace.
# One spelling per value leaves more tokens forced, and replies read as people expect.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A block's tokens at most where the grammar forces some: drafts stay within the drafter's
# block, and forced tokens may follow them up to this many (the pass is wider, nothing is
# chosen there: they are accepted whenever the drafts before them are).
FORCED_REACH = 16


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile; the message names what it cannot take."""


@dataclass(frozen=True)
class Grammar:
    """A compiled-on-use grammar: llguidance's grammar text and what it was made from."""

    text: str  # llguidance's serialized grammar
    kind: str  # "json_schema", "json_object", "regex" or "lark"

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Replies that are JSON documents valid against ``schema``."""
        import llguidance

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return cls._checked(text, "json_schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        import llguidance

        return cls._checked(llguidance.LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        import llguidance

        return cls._checked(llguidance.LLMatcher.grammar_from_lark(grammar), "lark")

    @classmethod
    def tool_calls(cls, call_schema: dict, start: str, end: str, inside: bool = False
                   ) -> Grammar:
        """Free text with tool calls in it, each ``start`` + newline + a JSON call valid
        against ``call_schema`` + newline + ``end`` (the format of mlx-lm's ``json_tools``
        parser: Qwen's, among others). ``inside``: the reply opens inside a call (the prompt
        ended with ``start``)."""
        import llguidance

        # (JSON as elsewhere: "x-guidance" carries the compile options into %json)
        call_schema = {**call_schema, "x-guidance": JSON_OPTIONS}
        call = (f'call: "\\n" %json {json.dumps(call_schema)} '
                f'{json.dumps(chr(10) + end)}')
        free = re.escape(start).replace("/", "\\/")
        lark = "\n".join([
            f"start: {'call ' if inside else ''}chunk* LAST",
            "chunk: before_call call",
            f"before_call[suffix={json.dumps(start)}]: /(?s:.*)/",
            call,
            f"LAST: /(?s:.*)/ & ~/(?s:.*{free}.*)/",
        ])
        return cls._checked(llguidance.LLMatcher.grammar_from_lark(lark), "tool_calls")

    @classmethod
    def _checked(cls, text: str, kind: str) -> Grammar:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise GrammarError(f"cannot compile the {kind.replace('_', ' ')}: {error}")
        return cls(text, kind)


_llg_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def llg_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of an mlx-lm tokenizer (built once per tokenizer: about 0.5 s for a
    50k vocabulary), over ``vocab_size`` ids (the target's logits; ids past the tokenizer's
    are never allowed)."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    cached = _llg_tokenizers.get(hf)
    if cached is None or cached[0] != vocab_size:
        eos = list(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        try:
            llt = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:
            raise GrammarError(f"structured output needs a fast Hugging Face tokenizer: {e}"
                               ) from None
        cached = _llg_tokenizers[hf] = (vocab_size, llt)
    return cached[1]


class Matcher:
    """One request's grammar state over its committed tokens."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int):
        import llguidance

        self.vocab_size = vocab_size
        llt = llg_tokenizer(tokenizer, vocab_size)
        self.stop_ids = set(llt.eos_tokens)
        self.matcher = llguidance.LLMatcher(llt, grammar.text, log_level=0)
        self._raise_if_error()
        if not self.allowed().any():
            raise GrammarError("no token of this model's vocabulary can begin a reply the "
                               "grammar allows")

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next: a bool mask [vocab_size]."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(np.bool_)

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens committed to the reply (each chosen under this grammar's mask); those after
        the grammar has stopped (past the end of the reply) are not its concern."""
        for t in tokens:
            if int(t) in self.stop_ids:  # the end of the reply: nothing follows
                return
            if not self.matcher.consume_token(int(t)):
                self._raise_if_error()

    def constrain(self, block: Sequence[int], room: int, redraw: Any = None
                  ) -> tuple[list[int], np.ndarray, list[bool]]:
        """The tokens to verify after the committed ones, and the masks of the pass's rows.

        At each position in turn: the token the grammar admits alone (forced: the masked
        target can choose nothing else), else ``block``'s token there if the grammar allows
        it, else ``redraw(position, allowed)``'s (a sampled draft drawn again from what is
        allowed; None: none), else the block ends. At most ``room`` tokens; none after the
        end of the reply. Returns (tokens, masks [len + 1, V]: row i for the position after
        i tokens, forced: per token). The matcher is left where it was."""
        tokens: list[int] = []
        masks: list[np.ndarray] = []
        forced: list[bool] = []
        consumed = 0
        while len(tokens) < room:
            allowed = self.allowed()
            masks.append(allowed)
            i = len(tokens)
            if np.count_nonzero(allowed) == 1:
                token, alone = int(np.flatnonzero(allowed)[0]), True
            elif i < len(block) and allowed[block[i]]:
                token, alone = int(block[i]), False
            elif i < len(block) and redraw is not None:
                token, alone = redraw(i, allowed), False
            else:
                token = None
            if token is None:
                break
            tokens.append(token)
            forced.append(alone)
            if token in self.stop_ids:  # the reply ends: its row after is never sampled from
                masks.append(np.ones(self.vocab_size, dtype=bool))
                break
            if not self.matcher.consume_token(token):
                raise GrammarError(self.matcher.get_error())  # an allowed token: a bug
            consumed += 1
        else:
            masks.append(self.allowed())
        self.matcher.rollback(consumed)
        return tokens, np.stack(masks), forced

def apply_masks(logits: mx.array, masks: mx.array | None) -> mx.array:
    """Logits [R, V] with the tokens each row's mask [R, V] forbids at -inf (none: as is)."""
    if masks is None:
        return logits
    return mx.where(masks, logits, mx.array(-mx.inf, dtype=logits.dtype))


def constrain_proposal(matcher: Matcher, proposal: Any, room: int, params: Any,
                       looked_up: bool) -> tuple[Any, mx.array]:
    """A cycle's proposal kept to the grammar (:meth:`Matcher.constrain`) and the masks of
    the target pass's rows [K' + 1, V]. Drafts drawn from ``proposal.probs`` (the drafter's,
    verified by rejection sampling): a forbidden one is drawn again from that distribution
    restricted to what the grammar allows, and the proposal handed on is that restricted
    distribution (forced positions: a point mass). Looked-up blocks and greedy or seeded
    drafts are cut at the first forbidden token instead."""
    from .accept import point_mass
    from .drafters.base import Proposal

    block = proposal.drafts.tolist()  # the drafter's pass runs here: the host reads its block
    dense = None
    redraw = None
    sampled = not looked_up and not params.greedy and params.noise is None
    if sampled and proposal.probs is not None:
        dense = as_dense(proposal.probs, matcher.vocab_size)

        def redraw(i: int, allowed: np.ndarray) -> int | None:
            row = dense[i] * mx.array(allowed)
            token = mx.random.categorical(mx.log(row), key=params.key())
            total, token = mx.sum(row).item(), token.item()
            return int(token) if total > 0 else None

    tokens, masks, forced = matcher.constrain(block, room, redraw)
    drafts = mx.array(tokens, dtype=mx.uint32)
    masks = mx.array(masks)
    if params.greedy or params.noise is not None:
        probs = None
    elif dense is None:
        probs = point_mass(drafts)
    else:
        n = len(tokens)
        rows = dense[:n]
        if rows.shape[0] < n:  # forced tokens past the drafter's block
            rows = mx.concatenate([rows, mx.zeros((n - rows.shape[0], rows.shape[1]))])
        rows = rows * masks[:n]
        rows = rows / mx.maximum(mx.sum(rows, axis=-1, keepdims=True), 1e-30)
        one_hot = mx.arange(rows.shape[1])[None] == drafts[:, None]
        probs = mx.where(mx.array(forced)[:, None], one_hot.astype(rows.dtype), rows)
    return Proposal(drafts, probs, forced=tuple(forced)), masks


def as_dense(probs: Any, vocab_size: int) -> mx.array:
    """A proposal distribution as [K, V] (a few candidates per position spread out)."""
    from .accept import CandidateProposal

    if isinstance(probs, CandidateProposal):
        K = probs.ids.shape[0]
        return mx.put_along_axis(mx.zeros((K, vocab_size), dtype=probs.probs.dtype),
                                 probs.ids.astype(mx.int32), probs.probs, axis=-1)
    return probs


def constrain_tree(matcher: Matcher, tree: Any) -> tuple[Any, mx.array]:
    """A tree of drafts (tree.DraftTree) kept to the grammar: each node the grammar allows
    after its path, a forbidden node dropped with its subtree, nothing below the end of the
    reply; and the masks of the pass's rows [N' + 1, V] (the anchor's, then each node's).
    The matcher is left where it was."""
    from .tree import DraftTree

    kept = DraftTree([], [], [])
    row_of = {-1: 0}  # node -> its row in the kept tree (the anchor: 0)
    paths: list[list[int]] = [[]]  # row -> the tokens from the anchor down to it
    masks = [matcher.allowed()]
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        row = row_of.get(parent)
        if row is None or not masks[row][token]:
            continue
        if row and paths[row][-1] in matcher.stop_ids:
            continue  # below the end of the reply
        path = paths[row] + [token]
        if token in matcher.stop_ids:
            mask = np.ones(matcher.vocab_size, dtype=bool)  # never sampled from
        else:
            if not matcher.matcher.consume_tokens(path):
                raise GrammarError(matcher.matcher.get_error())  # allowed tokens: a bug
            mask = matcher.allowed()
            matcher.matcher.rollback(len(path))
        row_of[i] = len(paths)
        paths.append(path)
        masks.append(mask)
        kept.tokens.append(token)
        kept.parents.append(row - 1)
        if tree.scores:
            kept.scores.append(tree.scores[i])
    return kept, mx.array(np.stack(masks))
