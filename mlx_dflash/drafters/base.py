"""What the decode loop asks of a drafter, and what a proposal is.

A drafter reads the target's tap-layer features of every committed position (``commit``) and,
from the anchor (the last committed token), proposes up to ``max_drafts`` tokens in one pass
(``propose``). Everything it returns is lazy: the loop syncs once per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx

from .. import attention
from ..accept import CandidateProposal, SamplingParams

if TYPE_CHECKING:
    from ..ngram import NgramTable
    from .layers import DraftArgs


@dataclass
class Proposal:
    """K drafted target ids; when sampling, the distribution they were drawn from ([K, V] or
    a few candidates per position); and, from drafters with a confidence head, the calibrated
    chance that each draft survives given that the ones before it did ([K])."""

    drafts: mx.array
    probs: mx.array | CandidateProposal | None = None
    confidence: mx.array | None = None
    forced: tuple[bool, ...] = ()  # with a grammar: which drafts it admitted alone


@runtime_checkable
class Drafter(Protocol):
    args: DraftArgs
    block_size: int  # the block width it was trained at
    max_drafts: int  # drafts one pass proposes at that width
    fixed_width: bool  # False: a wider block may be asked for (more drafts than max_drafts)
    target_layer_ids: list[int]
    vocab_ids: mx.array | None  # target ids of a reduced draft vocabulary (None: full)
    ngram: NgramTable | None  # lookup drafts from the target's own text, if it ships them
    source_path: Path | None  # the directory it was loaded from

    def make_cache(self) -> list[Any]:
        """An empty context cache (one per layer)."""

    def commit(self, features: mx.array, cache: list[Any], tokens: mx.array) -> None:
        """Append committed positions' tap features [1, n, taps*D] to the context; ``tokens``
        [1, n]: the tokens at those positions (families that read them: EAGLE-3)."""

    def propose(self, target: Any, anchor: mx.array, cache: list[Any], width: int,
                num_drafts: int, params: SamplingParams) -> Proposal:
        """``num_drafts`` drafts after ``anchor`` ([1]) for a cycle verifying up to ``width``
        tokens (a family that can widens its block to it)."""

    def pass_key(self) -> tuple:
        """What decides the cost of one ``propose`` pass (names its cached timing)."""


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that drafts for many requests in one pass (its weights read once for all)."""

    def propose_batch(self, target: Any, anchors: mx.array, caches: list[list[Any]],
                      width: int, counts: list[int], params: list[SamplingParams]
                      ) -> list[Proposal]:
        """Row i: ``counts[i]`` drafts after ``anchors[i]`` over context ``caches[i]``, as
        ``propose`` would give them."""


def propose_all(drafter: Drafter, target: Any, anchors: list[mx.array], caches: list[list[Any]],
                width: int, counts: list[int], params: list[SamplingParams]) -> list[Proposal]:
    """Drafts for several requests: one batched pass where the drafter has one (and there is
    more than one request), else one ``propose`` each. Every drafter pass of the decode loop is
    built here or in :func:`grow_trees`, with the target's CPU attention (attention.py): at 16k
    tokens of context it halves the drafter's attention."""
    with attention.on_cpu():
        if len(anchors) > 1 and isinstance(drafter, BatchDrafter):
            return drafter.propose_batch(target, mx.concatenate(anchors), caches, width, counts,
                                         params)
        return [drafter.propose(target, a, c, width, K, p)
                for a, c, K, p in zip(anchors, caches, counts, params)]


def grow_trees(drafter: Any, target: Any, anchors: list[mx.array], caches: list[list[Any]],
               width: int, beam: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Tree candidates (tree.grow_tree's, lazy) for several requests: one batched pass where
    the drafter has one (and there is more than one request), else one ``grow_tree`` each."""
    with attention.on_cpu():
        if len(anchors) > 1 and hasattr(drafter, "grow_trees"):
            return drafter.grow_trees(target, mx.concatenate(anchors), caches, width, beam)
        return [drafter.grow_tree(target, a, c, width, beam) for a, c in zip(anchors, caches)]


LOOKUP_WIDTH = 8  # most tokens a cycle of lookup drafts only verifies (the anchor and 7)


class LookupDrafts:
    """No drafter: a cycle verifies a block looked up from the context (copies, as prompt
    lookup decoding finds them) where the scheduler expects it to pay, else decodes plainly.
    What ``--drafter lookup`` loads, and ``auto`` for a target no published drafter fits.
    The decode loop sees no drafter (``drafting`` gives None) and a verify width of
    ``width``."""

    source_path = None

    def __init__(self, width: int = LOOKUP_WIDTH):
        self.width = width


def verify_width(drafter: Drafter | LookupDrafts | None, block_size: int | None = None,
                 schedule: bool = True) -> int:
    """Most tokens one cycle verifies (the anchor and its drafts): ``block_size`` if given;
    else the drafter's block for the scheduler to choose within, or its configured
    ``verify_block_size`` without one; 1 without a drafter; for lookups only, their width."""
    if drafter is None:
        return 1
    if isinstance(drafter, LookupDrafts):
        return block_size or drafter.width
    width = block_size or (None if schedule else drafter.args.verify_block_size)
    width = width or drafter.block_size
    if drafter.fixed_width:
        width = min(width, drafter.max_drafts + 1)
    return width


def drafting(drafter: Drafter | LookupDrafts | None, block_size: int | None = None,
             schedule: bool = True) -> Drafter | None:
    """The drafter, or None when nothing is drafted (a cycle verifies one token at most, or
    lookups only)."""
    if isinstance(drafter, LookupDrafts):
        return None
    return drafter if verify_width(drafter, block_size, schedule) > 1 else None
