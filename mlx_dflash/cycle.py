"""One speculative cycle, built lazily and synced once: draft -> verify -> accept -> rollback.

A :class:`Speculator` holds one request's decoding state: the target's and the drafter's caches,
the committed features the drafter has not read yet, the sampling parameters. ``cycle`` builds
a cycle's graph (K drafts after the anchor, the drafter's or a looked-up block; one target pass
over ``[anchor] + drafts``; the acceptance rule); :meth:`Cycle.resolve` is its one host sync;
``settle`` rolls the target cache back past what was accepted and queues the accepted
positions' features for the drafter, read when it next drafts (plain cycles cost it nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx

import numpy as np

from .accept import SamplingParams, accept_block, point_mass
from .drafters.base import Drafter, Proposal, grow_trees, propose_all
from .grammar import Matcher, apply_masks, constrain_proposal, constrain_tree
from .pair_cache import PairCache
from .target import Target
from .tree import DraftTree, LazyTree, select_tree, target_choices, tree_beam

DEFAULT_PREFILL_STEP = 2048

# Where a cycle's drafts came from.
DRAFTER, COPY, NGRAM, PLAIN, TREE = "drafter", "copy", "ngram", "plain", "tree"
TARGET, FORCED = "target", "forced"  # how a committed token came, besides a draft's source



@dataclass
class Cycle:
    anchor: mx.array  # [1] the last committed token, not yet in the target cache
    num_drafts: int  # K: tokens verified after the anchor (0: a plain decoding step)
    source: str  # DRAFTER, COPY (from the context), NGRAM (the drafter's table) or PLAIN
    packed: mx.array  # [accepted_len, drafts (K), next tokens (K+1)]: what the sync reads
    next_tokens: mx.array  # [K+1] the token committed after each accepted prefix
    features: mx.array | None  # [1, K+1, taps*D] the target's tap features of the pass
    confidence: mx.array | None = None  # [K] calibrated survival of each draft (DSpark)
    forced: tuple[bool, ...] = ()  # with a grammar: which drafts it admitted alone

    @property
    def looked_up(self) -> bool:
        return self.source in (COPY, NGRAM)

    def start(self) -> None:
        """Start evaluating the cycle (no wait)."""
        mx.async_eval(self.packed, *([self.confidence] if self.confidence is not None else []))

    def resolve(self) -> tuple[int, list[int]]:
        """(accepted_len, the tokens to commit: the accepted drafts and the target's next)."""
        values = self.packed.tolist()  # the one host sync of the cycle
        a, K = values[0], self.num_drafts
        return a, values[1 : 1 + a] + [values[1 + K + a]]

    def origins(self, accepted: int) -> list[str]:
        """How each committed token came: the accepted drafts' source (FORCED where a grammar
        admitted it alone), then the target's own choice."""
        forced = self.forced + (False,) * (accepted - len(self.forced))
        return [FORCED if f else self.source for f in forced[:accepted]] + [TARGET]


@dataclass
class TreeCycle(Cycle):
    """A cycle verifying a tree of drafts (tree.py): ``packed`` holds the target's token after
    each row of the pass (and, for a tree chosen on the device, its nodes' tokens and
    parents + 1); the walk down the tree happens at the sync."""

    tree: DraftTree | None = None  # None: read from ``packed`` at the sync
    scores: list[float] | None = None  # its nodes' path probabilities, where read (tree="auto")
    kept: list[int] | None = None  # after resolve: the pass's rows that stay (anchor, path)

    def resolve(self) -> tuple[int, list[int]]:
        values = self.packed.tolist()  # the cycle's one host sync
        n = self.num_drafts
        if self.tree is None:
            self.tree = DraftTree(values[n + 1 : 2 * n + 1],
                                  [p - 1 for p in values[2 * n + 1 : 3 * n + 1]],
                                  self.scores or [])
        path, token = self.tree.walk(values[: n + 1])
        tokens = [self.tree.tokens[row - 1] for row in path] + [token]
        self.kept = [0] + path
        self.next_tokens = mx.array(tokens, dtype=mx.uint32)
        return len(path), tokens


def prefill(
    target: Target,
    tokens: Sequence[int],
    cache: list[Any],
    drafter: Drafter | None,
    draft_cache: list[Any] | None,
    step: int = DEFAULT_PREFILL_STEP,
    progress: Callable[[int, int], Any] | None = None,
) -> mx.array:
    """Run the prompt through the target in chunks; feed its tap features to the drafter.

    Returns the target's logits [V] at the last prompt position.
    """
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    prompt = mx.array(tokens, dtype=mx.uint32)[None]
    n = len(tokens)
    if progress is not None:
        progress(0, n)
    for start in range(0, n, step):
        chunk = prompt[:, start : start + step]
        hidden, features = target.hidden_states(chunk, cache, layer_ids)
        if drafter is not None:
            drafter.commit(features, draft_cache, chunk)
        last = hidden[:, -1]
        mx.eval([c.state for c in cache] + ([c.state for c in draft_cache] if drafter else []))
        if progress is not None:
            progress(min(start + step, n), n)
    return target.lm_head(last)[0]


def accepted_cycle(anchor: mx.array, proposal: Proposal, logits: mx.array,
                   features: mx.array | None, params: SamplingParams, source: str,
                   position: int = 0) -> Cycle:
    """The cycle of a verified block: the target's ``logits`` [K+1, V] over ``[anchor] +
    drafts`` (one row of a batched pass, or a request's own) through the acceptance rule
    (``position``: the index in the sequence of the token after the anchor)."""
    accepted_len, next_tokens = accept_block(proposal.drafts, proposal.probs, logits, params,
                                             position)
    packed = mx.concatenate([accepted_len.astype(mx.uint32)[None], proposal.drafts, next_tokens])
    return Cycle(anchor, proposal.drafts.shape[0], source, packed, next_tokens, features,
                 proposal.confidence, proposal.forced)


class Speculator:
    """One request's decoding state; builds its cycles and settles them.

    ``pair`` (a :class:`PairCache` holding a proper prefix of ``tokens``, or empty) is
    continued from; ``cached`` says how many prompt tokens it already held. ``held`` tracks
    what the pair's caches hold, so that they can be named when generation ends.
    """

    def __init__(self, target: Target, drafter: Drafter | None, params: SamplingParams,
                 width: int, tokens: Sequence[int], pair: PairCache | None = None,
                 matcher: Matcher | None = None):
        self.target, self.drafter, self.params, self.width = target, drafter, params, width
        self.matcher = matcher  # the reply's grammar (grammar.py), if it has one
        self.layer_ids = drafter.target_layer_ids if drafter is not None else ()
        # committed positions the drafter has not read: (their tap features, their tokens)
        self.backlog: list[tuple[mx.array, mx.array]] = []
        self.pair, self.cached, self.held = pair, 0, None
        if pair is None:
            self.cache = target.make_cache()
            self.draft_cache = drafter.make_cache() if drafter is not None else None
        else:
            self.cached = pair.begin(tokens, target, drafter)
            self.cache, self.draft_cache = pair.target, pair.drafter
            self.held = list(tokens)  # + every committed token (the anchor included)

    def prefill(self, tokens: Sequence[int], step: int, progress: Any = None) -> mx.array:
        """Prefill the prompt tokens the caches do not hold; the last position's logits (kept
        to the grammar, if there is one)."""
        logits = prefill(self.target, tokens[self.cached :], self.cache, self.drafter,
                         self.draft_cache, step, progress)
        if self.matcher is None:
            return logits
        return apply_masks(logits[None], mx.array(self.matcher.allowed())[None])[0]

    def cycle(self, anchor: mx.array, num_drafts: int, looked_up: Sequence[int] = (),
              source: str = DRAFTER, position: int = 0, room: int = 0) -> Cycle:
        """Build (lazily) one cycle: ``num_drafts`` drafts after ``anchor`` (the looked-up
        block when one is given), one target pass over them, the acceptance rule.
        ``position``: the index in the sequence of the token after the anchor (what a seeded
        request's choices are keyed by). With a grammar the block is read and kept to it on
        the host first (forced tokens lead, up to ``room`` tokens in all; one more sync)."""
        proposal = self.draft(anchor, num_drafts, looked_up)
        if self.matcher is None:
            return self.verify(anchor, proposal, source, position)
        proposal, masks = constrain_proposal(self.matcher, proposal, room, self.params,
                                             bool(looked_up))
        return self.verify(anchor, proposal, source, position, masks)

    def draft(self, anchor: mx.array, num_drafts: int, looked_up: Sequence[int] = ()
              ) -> Proposal:
        """The block to verify after ``anchor``: a looked-up one (a point-mass proposal, exact
        under rejection sampling too), the drafter's, or none."""
        if looked_up:
            drafts = mx.array(list(looked_up), dtype=mx.uint32)
            return Proposal(drafts, None if self.params.greedy else point_mass(drafts))
        if num_drafts == 0:
            return Proposal(mx.zeros((0,), dtype=mx.uint32))
        self.catch_up()
        return propose_all(self.drafter, self.target, [anchor], [self.draft_cache], self.width,
                           [num_drafts], [self.params])[0]

    def verify(self, anchor: mx.array, proposal: Proposal, source: str = DRAFTER,
               position: int = 0, masks: mx.array | None = None) -> Cycle:
        """One target pass over ``[anchor] + drafts`` on this request's cache, accepted
        (``masks``: what a grammar allows at each row)."""
        logits, features = self.target.forward(
            mx.concatenate([anchor, proposal.drafts])[None], self.cache, self.layer_ids)
        return accepted_cycle(anchor, proposal, apply_masks(logits[0], masks), features,
                              self.params, source, position)

    def tree_cycle(self, anchor: mx.array, size: int,
                   sizer: Callable[[np.ndarray], int] | None = None,
                   position: int = 0) -> TreeCycle:
        """A cycle verifying a tree of ``size`` drafted nodes below ``anchor`` (or the first
        ``sizer(scores)`` of them), grown by the drafter (its ``grow_tree``) and chosen on the
        device: with a fixed size the cycle syncs once, as a chain cycle does; a ``sizer``
        reads the nodes' scores on the host first (one more sync)."""
        tree, scores = self.grow_tree(anchor, size), []
        if sizer is not None:  # its size sets the pass's shape: the scores are read first
            scores = tree.scores.tolist()
            tree = tree.first(sizer(np.array(scores)))
        if self.matcher is not None:  # the tree is read and kept to the grammar on the host
            host = DraftTree(tree.tokens.tolist(), tree.parents.tolist(),
                             tree.scores.tolist())
            return self.verify_tree(anchor, host, TREE, position)
        choices, features = self.tree_pass(anchor, tree.tokens, tree.depths, tree.visible,
                                           min(len(tree), self.drafter.max_drafts), position)
        packed = mx.concatenate([choices, tree.tokens.astype(mx.uint32),
                                 (tree.parents + 1).astype(mx.uint32)])
        return TreeCycle(anchor, len(tree), TREE, packed, choices, features,
                         scores=scores[: len(tree)])

    def grow_tree(self, anchor: mx.array, size: int) -> LazyTree:
        """The drafter's ``size`` likeliest nodes below ``anchor``, chosen on the device."""
        self.catch_up()
        grown = grow_trees(self.drafter, self.target, [anchor], [self.draft_cache], self.width,
                           tree_beam(size, self.drafter.max_drafts))
        return select_tree(*grown[0], size)

    def verify_tree(self, anchor: mx.array, tree: DraftTree, source: str = TREE,
                    position: int = 0) -> TreeCycle:
        """A cycle verifying a tree known on the host; ``source``: TREE (the drafter's) or
        COPY (looked-up branches). With a grammar, its nodes are kept to it first."""
        masks = None
        if self.matcher is not None:
            tree, masks = constrain_tree(self.matcher, tree)
        choices, features = self.tree_pass(anchor, mx.array(tree.tokens, dtype=mx.uint32),
                                           tree.depths(), tree.visible(), position=position,
                                           masks=masks)
        return TreeCycle(anchor, len(tree), source, choices, choices, features, tree=tree,
                         scores=tree.scores or None)

    def tree_pass(self, anchor: mx.array, nodes: mx.array, depths: Any, visible: Any,
                  max_depth: int | None = None, position: int = 0,
                  masks: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
        """One target pass over the anchor and a tree's nodes (a tree mask): the target's
        choice after each row (``masks``: what a grammar allows there), and the pass's tap
        features."""
        logits, features = self.target.forward_tree(
            mx.concatenate([anchor, nodes.astype(mx.uint32)])[None], depths, visible,
            self.cache, self.layer_ids, max_depth)
        return (target_choices(apply_masks(logits[0], masks), self.params, position, depths),
                features)

    def feed(self, cycle: Cycle) -> None:
        """Queue all of a cycle's features for the drafter before it is synced (a plain
        cycle's one position, when the next cycle is built from its token ahead)."""
        if self.drafter is not None:
            self.backlog.append((cycle.features, cycle.anchor))

    def settle(self, cycle: Cycle, accepted: int, fed: bool = False) -> None:
        """After the sync: drop the rejected drafts from the target cache and queue the
        accepted positions' features for the drafter (unless ``feed`` did). A tree keeps the
        anchor's and the accepted path's rows."""
        if isinstance(cycle, TreeCycle):
            self.target.keep_rows(self.cache, cycle.kept)
        else:
            self.target.rollback(self.cache, cycle.num_drafts - accepted)
        if not fed:
            self.queue_features(cycle, accepted)

    def queue_features(self, cycle: Cycle, accepted: int) -> None:
        """The accepted positions' features (the anchor's and the accepted drafts', or a
        tree's accepted path's), read by the drafter when it next drafts."""
        if self.drafter is None:
            return
        if isinstance(cycle, TreeCycle):
            path = [cycle.tree.tokens[row - 1] for row in cycle.kept[1:]]
            tokens = mx.concatenate([cycle.anchor, mx.array(path, dtype=mx.uint32)])
            self.backlog.append((cycle.features[:, mx.array(cycle.kept)], tokens))
        else:
            tokens = mx.concatenate([cycle.anchor, cycle.packed[1 : 1 + accepted]])
            self.backlog.append((cycle.features[:, : accepted + 1], tokens))

    def hold(self, tokens: Sequence[int]) -> None:
        """Committed tokens the caches now hold (or will, as the next anchor)."""
        if self.held is not None:
            self.held += tokens
        if self.matcher is not None:
            self.matcher.commit(tokens)

    def close(self, pending: Cycle | None) -> None:
        """At the end of generation, leave the pair's caches holding exactly ``held``: run the
        last token through the target (a cycle started ahead already did: keep only that of
        its pass) and give the drafter what it has not read. Lazy: evaluated while the caller
        reads on."""
        if self.pair is None:
            return
        if pending is not None:
            self.target.rollback(self.cache, pending.num_drafts)  # its first position stays
            features = pending.features
        else:
            last = mx.array([self.held[-1:]], dtype=mx.uint32)
            _, features = self.target.hidden_states(last, self.cache, self.layer_ids)
        if self.drafter is not None:
            self.backlog.append((features[:, :1], mx.array(self.held[-1:], dtype=mx.uint32)))
            self.catch_up()
        self.pair.hold(self.held)

    def abandon(self) -> None:
        """The generation was closed mid-stream, with one or two cycles started past what was
        committed. Caches that can be cut anywhere are cut back to it; others stay unnamed."""
        if self.pair is None:
            return
        held = self.held[:-1]  # the last committed token is the anchor: not in the caches
        self.catch_up()
        if self.pair.trim_to(len(held)):
            self.pair.hold(held)

    def release(self) -> None:
        """Between cycles (none started ahead, every rejected draft rolled back) the caches
        hold exactly the committed tokens less the anchor, whatever their kinds: name them."""
        if self.pair is not None:
            self.catch_up()
            self.pair.hold(self.held[:-1])

    def catch_up(self) -> None:
        """Give the drafter the committed features it has not read yet."""
        if self.backlog:
            features, tokens = zip(*self.backlog)
            self.drafter.commit(mx.concatenate(features, axis=1), self.draft_cache,
                                mx.concatenate(tokens)[None])
            self.backlog.clear()
