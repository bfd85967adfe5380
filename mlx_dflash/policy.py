"""What the next cycle verifies after the anchor.

In order: a block copied from the context (the last few tokens occurred before: verify what
followed them), else a continuation from the drafter's n-gram table when the scheduler expects
it to beat the drafter, else as many drafts as the scheduler chooses (all the width allows
without one; 0 is a plain decoding step).
"""

from __future__ import annotations

from typing import Sequence

from .cycle import COPY, DRAFTER, NGRAM, PLAIN, TREE, Cycle, TreeCycle
from .drafters.base import Drafter
from .lookup import CopyIndex
from .ngram import NgramTable
from .schedule import Scheduler, bytes_per_verified_token, cached_costs
from .target import Target
from .tree import TREE_MAX, TreeSizer

# Copy drafts by default, looking up the last 4, 3, then 2 tokens: the rule measured best on
# the eval files (docs/training.md).
COPY_DRAFTS = True
COPY_NGRAM = 2
COPY_LONGEST = 4


class BlockPolicy:
    def __init__(self, width: int, copy_index: CopyIndex | None = None,
                 ngram_table: NgramTable | None = None, scheduler: Scheduler | None = None,
                 tree_sizer: TreeSizer | None = None):
        self.width, self.copy_index = width, copy_index
        self.ngram_table, self.scheduler = ngram_table, scheduler
        self.tree_sizer = tree_sizer  # trees sized per cycle (tree="auto")

    @classmethod
    def for_request(cls, target: Target, drafter: Drafter | None, width: int,
                    tokens: Sequence[int], schedule: bool, copy_drafts: bool = COPY_DRAFTS,
                    copy_ngram: int = COPY_NGRAM, size_trees: bool = False, reach: int = 0
                    ) -> BlockPolicy:
        """The policy for one request; with ``schedule``, the scheduler's pass costs are
        measured on first use (then cached per model pair and machine) as far as the request
        ``reach``-es (its prompt and most tokens); ``size_trees``: a tree sizer too (its pass
        costs measured up to TREE_MAX + 1 tokens)."""
        if drafter is None:
            return cls(width)
        scheduler = sizer = None
        if schedule:
            scheduler = Scheduler(cached_costs(target, drafter, width, reach), width - 1,
                                  bytes_per_verified_token(target))
        if size_trees:
            sizer = TreeSizer(cached_costs(target, drafter, TREE_MAX + 1, reach))
        index = CopyIndex(list(tokens), copy_ngram, COPY_LONGEST) if copy_drafts else None
        return cls(width, index, drafter.ngram if copy_drafts else None, scheduler, sizer)

    def choose(self, room: int, context: int, may_look_up: bool = True
               ) -> tuple[int, list[int], str]:
        """(drafts to verify, the looked-up block or [], where they come from) for a cycle
        with ``room`` tokens left to draft before max_tokens and ``context`` tokens held."""
        K = min(self.width - 1, room)
        if may_look_up:
            block, source = self.lookup(K, context)
            if block:
                return len(block), block, source
        if self.scheduler is not None:
            K = self.scheduler.choose(K, context)
        return K, [], DRAFTER if K else PLAIN

    def lookup(self, room: int, context: int) -> tuple[list[int], str]:
        """A block copied from the context, else one from the n-gram table when the scheduler
        expects it to beat the drafter (without a scheduler: whenever there is one); none
        without copy drafts."""
        if self.copy_index is None:
            return [], COPY
        room = min(self.width - 1, room)
        copied = self.copy_index.lookup(room)
        if copied or self.ngram_table is None:
            return copied, COPY
        found, probs = self.ngram_table.draft(self.copy_index.tokens, room)
        n = self.scheduler.lookup_length(probs, room, context) if self.scheduler else len(found)
        return found[:n], NGRAM

    def copy_branches(self, block: list[int]) -> list[list[int]]:
        """Continuations of the context besides a copied ``block`` (the latest occurrence's),
        each as long at most: ``[block]`` alone when the context has no other."""
        found = self.copy_index.lookup_branches(len(block)) if self.copy_index else []
        return found if found and found[0] == block else [block]

    def finds_lookup(self, context: int) -> bool:
        """Whether a lookup would find a block now."""
        return self.copy_index is not None and bool(self.lookup(1, context)[0])

    def extend(self, tokens: Sequence[int]) -> None:
        """Committed tokens (the copy index learns them)."""
        if self.copy_index is not None:
            self.copy_index.extend(list(tokens))

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
        if cycle.looked_up:  # branches: as a chain as long as the longest
            n = max(cycle.tree.depths()) if isinstance(cycle, TreeCycle) else cycle.num_drafts
            self.scheduler.observe_lookup(n, accepted)
        else:
            confidence = cycle.confidence
            self.scheduler.observe(cycle.num_drafts, accepted,
                                   None if confidence is None else confidence.tolist())
