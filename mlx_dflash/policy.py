"""What the next cycle verifies after the anchor.

In order: a block copied from the context (the last few tokens occurred before: verify what
followed them), else a continuation from the drafter's n-gram table, as much of either as the
scheduler expects to beat the drafter; else as many drafts as the scheduler chooses (all the
width allows without one; 0 is a plain decoding step).

A looked-up block's chance to survive is learned per request: every block found, verified or
not, is checked against the tokens committed after it (a block skipped as too unlikely is
judged all the same, so a text that starts to repeat itself is noticed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cycle import COPY, DRAFTER, NGRAM, PLAIN, TREE, Cycle
from .drafters.base import Drafter
from .lookup import CopyIndex
from .ngram import NgramTable
from .schedule import Scheduler, bytes_per_verified_token, cached_costs
from .target import Target
from .tree import TREE_MAX, Calibration, TreeSizer

# Copy drafts by default, looking up the last 4, 3, then 2 tokens: the rule measured best on
# the eval files (docs/training.md).
COPY_DRAFTS = True
COPY_NGRAM = 2
COPY_LONGEST = 4
# A copied token's chance to survive until this request's copies bear it out (Calibration):
# copies from code and math prompts mostly survive.
COPY_SCORE = 0.9
LOOKUP_DECAY = 0.1  # a lookup's survival follows the last ~10 blocks judged (the text changes)
LOOKUP_PRIOR = 1.0  # ... its prior score weighing as one of them


@dataclass
class Lookup:
    """A block looked up after the anchor: copied from the context or from the n-gram table."""

    tokens: list[int]
    scores: list[float]  # each step's prior chance to survive (the table's; COPY_SCORE)
    source: str  # COPY or NGRAM
    steps: np.ndarray  # P(step survives | the steps before did), as this request bears out

    @property
    def survival(self) -> np.ndarray:
        """a_j: the chance that the first j tokens all survive."""
        return np.cumprod(self.steps)


class Watch:
    """A looked-up block checked against the tokens committed after it, then scored."""

    def __init__(self, lookup: Lookup, calibration: Calibration):
        self.lookup, self.calibration, self.matched = lookup, calibration, 0

    def extend(self, tokens: Sequence[int]) -> bool:
        """Compare the next committed tokens; True once the block is judged (and scored)."""
        block = self.lookup.tokens
        for t in tokens:
            if self.matched == len(block) or t != block[self.matched]:
                break
            self.matched += 1
        else:
            if self.matched < len(block):
                return False
        reached = min(len(block), self.matched + 1)
        self.calibration.observe(np.asarray(self.lookup.scores[:reached]),
                                 np.arange(reached) < self.matched)
        return True


class BlockPolicy:
    def __init__(self, width: int, copy_index: CopyIndex | None = None,
                 ngram_table: NgramTable | None = None, scheduler: Scheduler | None = None,
                 tree_sizer: TreeSizer | None = None, drafts: bool = True):
        self.width, self.copy_index = width, copy_index
        self.drafts = drafts  # False: lookups only (no drafter)
        self.ngram_table, self.scheduler = ngram_table, scheduler
        self.tree_sizer = tree_sizer  # trees sized per cycle (tree="auto")
        self.calibration = {source: Calibration(LOOKUP_DECAY, LOOKUP_PRIOR)
                            for source in (COPY, NGRAM)}
        self.watch: Watch | None = None  # the block being checked against committed tokens
        self.looked: Lookup | None = None  # the last block looked up

    @classmethod
    def for_request(cls, target: Target, drafter: Drafter | None, width: int,
                    tokens: Sequence[int], schedule: bool, copy_drafts: bool = COPY_DRAFTS,
                    copy_ngram: int = COPY_NGRAM, size_trees: bool = False, reach: int = 0
                    ) -> BlockPolicy:
        """The policy for one request; with ``schedule``, the scheduler's pass costs are
        measured on first use (then cached per model pair and machine) as far as the request
        ``reach``-es (its prompt and most tokens); ``size_trees``: a tree sizer too (its pass
        costs measured up to TREE_MAX + 1 tokens)."""
        drafts = drafter is not None  # else the target alone, or lookups only (a wider width)
        if not drafts and (width == 1 or not copy_drafts):
            return cls(width, drafts=False)
        scheduler = sizer = None
        if schedule:
            scheduler = Scheduler(cached_costs(target, drafter, width, reach), width - 1,
                                  bytes_per_verified_token(target), drafts=drafts)
        if size_trees and drafts:
            sizer = TreeSizer(cached_costs(target, drafter, TREE_MAX + 1, reach))
        index = CopyIndex(list(tokens), copy_ngram, COPY_LONGEST) if copy_drafts else None
        ngram = drafter.ngram if copy_drafts and drafts else None
        return cls(width, index, ngram, scheduler, sizer, drafts)

    def choose(self, room: int, context: int, may_look_up: bool = True
               ) -> tuple[int, list[int], str]:
        """(drafts to verify, the looked-up block or [], where they come from) for a cycle
        with ``room`` tokens left to draft before max_tokens and ``context`` tokens held."""
        K = min(self.width - 1, room)
        if may_look_up:
            block, source = self.lookup(K, context)
            if block:
                return len(block), block, source
        if not self.drafts:
            return 0, [], PLAIN
        if self.scheduler is not None:
            K = self.scheduler.choose(K, context)
        return K, [], DRAFTER if K else PLAIN

    def find(self, room: int, watch: bool = False) -> Lookup | None:
        """Up to ``room`` tokens copied from the context, else from the n-gram table (None:
        neither has a continuation, or no copy drafts). ``watch``: the block is also checked
        against what is committed next (its source's survival learns from it)."""
        if self.copy_index is None or room <= 0:
            return None
        room = min(self.width - 1, room)
        found, source = self.copy_index.lookup(room), COPY
        scores = [COPY_SCORE] * len(found)
        if not found and self.ngram_table is not None:
            (found, scores), source = self.ngram_table.draft(self.copy_index.tokens, room), NGRAM
        lookup = (Lookup(found, scores, source, self.calibration[source](np.asarray(scores)))
                  if found else None)
        if watch:
            self.looked = lookup
            if lookup is not None and self.watch is None:
                self.watch = Watch(lookup, self.calibration[source])
        return lookup

    def lookup(self, room: int, context: int, watch: bool = True
               ) -> tuple[list[int], str]:
        """The looked-up block to verify alone, as long as the scheduler expects to pay (without
        a scheduler: whole), or []."""
        found = self.find(room, watch)
        if found is None:
            return [], COPY
        n = (self.scheduler.lookup_length(found.steps, room, context) if self.scheduler
             else len(found.tokens))
        return found.tokens[:n], found.source

    def copy_branches(self, block: list[int]) -> list[list[int]]:
        """Continuations of the context besides a copied ``block`` (the latest occurrence's),
        each as long at most: ``[block]`` alone when the context has no other."""
        found = self.copy_index.lookup_branches(len(block)) if self.copy_index else []
        return found if found and found[0] == block else [block]

    def finds_lookup(self, room: int, context: int) -> bool:
        """Whether a cycle planned now with ``room`` would verify a looked-up block (a
        pipelined plain cycle was planned without looking: the next one should look)."""
        return bool(self.lookup(room, context, watch=False)[0])

    def extend(self, tokens: Sequence[int]) -> None:
        """Committed tokens (the copy index learns them)."""
        if self.copy_index is not None:
            self.copy_index.extend(list(tokens))
        if self.watch is not None and self.watch.extend(tokens):
            self.watch = None

    def observe(self, cycle: Cycle, accepted: int) -> None:
        """What a cycle accepted (the scheduler's survival estimates for drafts, or for
        looked-up blocks, learn it)."""
        if cycle.source == TREE:
            if self.tree_sizer is not None:
                self.tree_sizer.observe(cycle.tree, cycle.kept[1:])
            if self.scheduler is not None:  # it decides whether drafting pays: survival by depth
                self.scheduler.observe(max(cycle.tree.depths()), accepted)
            return
        if self.scheduler is None:
            return
        if not cycle.looked_up:  # lookups learn from the committed tokens (Watch)
            confidence = cycle.confidence
            self.scheduler.observe(cycle.num_drafts, accepted,
                                   None if confidence is None else confidence.tolist())
