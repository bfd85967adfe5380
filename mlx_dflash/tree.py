"""Tree drafts: verify several continuations of the anchor in one target pass.

A chain verifies one guess per position, so a wrong first guess wastes the whole block. A tree
holds the drafter's likeliest continuations: N nodes below the anchor, each a token whose parent
is the anchor or another node. The target reads the anchor and all N nodes in one pass, each node
at the position of its depth and seeing only the context, the anchor and its own ancestors (a
tree attention mask), so each node's logits are exactly the target's after the path to it.

**The rule, lossless at every temperature.** The walk starts at the anchor. At each node it
visits, the next token is the target's own choice from that node's logits: the argmax (greedy)
or one draw from the sampling distribution (temperature, top-k, top-p: what plain decoding draws
from). If a child of the node carries that token the walk moves to it (its logits are in the
pass already) and goes on; otherwise the token is committed as the cycle's last. Every committed
token is therefore drawn from the target's distribution given all tokens before it, as plain
decoding draws it, each visited node's draw independent of the others: the tree only decides how
many of those draws one pass covers. With the children taken as point-mass proposals this is
recursive (multi-draft) rejection sampling: child ``c_i`` is accepted with probability
``p(c_i) / (1 - p(c_1) - ... - p(c_{i-1}))`` after the ones before it were rejected, ``p(c_i)``
in all, and the residual is ``p`` outside the children: the same distribution.

**Growing the tree** (:func:`grow_tree`, lazily, one level per draft position): the drafter
scores ``M`` candidates at each of its ``K`` block positions; the anchor's children are position
0's, and a node at depth ``d`` is followed by position ``d``'s candidates, scored given the
node's token where the drafter conditions on it (DSpark's Markov head, DFlash 2's pair scores)
and alike under every parent where it does not (DFlash's block pass proposes all positions at
once). Each level keeps the ``beam`` best paths by path probability. :func:`select_tree` then
takes the ``N`` best nodes of all levels (a dynamic tree, as EAGLE-2's): since a child never
scores above its parent, the best ``N`` are a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .accept import SamplingParams, sampling_logits
from .kernels import argmax_rows, sample_rows


# Candidates per position a tree may branch into, from drafters that score positions on their
# own, and the paths each level keeps.
TREE_CANDIDATES = 8
TREE_BEAM = 4
# tree="auto": each cycle grows TREE_MAX nodes and verifies as many as pay (TreeSizer).
AUTO = "auto"
TREE_MAX = 15


@dataclass
class DraftTree:
    """N drafted nodes below the anchor, in the order they were chosen (parents first)."""

    tokens: list[int]  # node -> its token (a target id)
    parents: list[int]  # node -> its parent node; -1: the anchor
    scores: list[float] = field(default_factory=list)  # node -> the drafter's path probability

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each row of the pass (the anchor, then the nodes) -> its depth (the anchor: 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p + 1] + 1)
        return depth

    def visible(self) -> np.ndarray:
        """[N+1, N+1] bool: row i sees row j when j is i or one of its ancestors (the anchor is
        everyone's)."""
        n = len(self) + 1
        seen = np.eye(n, dtype=bool)
        seen[:, 0] = True
        for i, p in enumerate(self.parents, start=1):
            seen[i] |= seen[p + 1]
        return seen

    def children(self) -> list[dict[int, int]]:
        """Row -> {token: child row}, for the anchor's row (0) and each node's."""
        out: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents), start=1):
            out[p + 1].setdefault(tok, i)
        return out

    @classmethod
    def of_branches(cls, branches: list[list[int]], size: int) -> DraftTree:
        """The trie of looked-up continuations of the anchor (lookup.CopyIndex.lookup_branches,
        the likeliest first): common prefixes share nodes; at most ``size`` nodes, the first
        branch whole (it is what a chain would verify), the others as far as room is left."""
        tree, node_of = cls([], []), {}  # (parent node, token) -> node
        size = max(size, len(branches[0]) if branches else 0)
        for branch in branches:
            parent = -1
            for token in branch:
                node = node_of.get((parent, token))
                if node is None:
                    if len(tree) == size:
                        break
                    node = node_of[parent, token] = len(tree)
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                parent = node
        return tree

    def walk(self, choices: list[int]) -> tuple[list[int], int]:
        """(rows of the accepted nodes along the path, the token committed after them), given
        the target's choice at every row (``choices[r]``: its token after row r)."""
        children, row, path = self.children(), 0, []
        while choices[row] in children[row]:
            row = children[row][choices[row]]
            path.append(row)
        return path, choices[row]


def tree_beam(size: int, depth: int) -> int:
    """Paths a tree of ``size`` nodes keeps per level, ``depth`` levels deep: TREE_BEAM, or as
    many as it takes for the levels to hold ``size`` nodes (a wider beam, not a cap on the
    size asked for)."""
    return max(TREE_BEAM, -(-size // max(depth, 1)))


def grow_tree(first: mx.array, transition: Callable[[int, mx.array, mx.array], mx.array],
              cand_ids: mx.array, beam: int) -> tuple[mx.array, mx.array, mx.array]:
    """A tree's candidate nodes, level by level (lazy). ``first`` [M]: logits of position 0's
    candidates (the anchor's children); ``transition(d, parents, rows)``: logits [B, M] of
    position d's candidates under each of B parent nodes of depth d (``parents``: their
    candidate indices at position d - 1; ``rows``: the row of each one's own parent in the
    level before, 0 for the anchor's children); ``cand_ids`` [K, M]: the candidates' target
    ids. Returns per node (``beam`` per level, by level): target id, parent node (-1: the
    anchor), log path probability."""
    K, M = cand_ids.shape
    beam = min(beam, M)
    logp = first.astype(mx.float32) - mx.logsumexp(first.astype(mx.float32))
    pick = mx.argpartition(-logp, beam - 1)[:beam]
    scores = logp[pick]
    tokens, parents, all_scores = [cand_ids[0][pick]], [mx.full((beam,), -1, mx.int32)], [scores]
    rows = mx.zeros((beam,), dtype=mx.int32)
    for d in range(1, K):
        logits = transition(d, pick, rows).astype(mx.float32)  # [beam, M]
        paths = logits - mx.logsumexp(logits, axis=-1, keepdims=True) + scores[:, None]
        flat = paths.reshape(-1)
        best = mx.argpartition(-flat, beam - 1)[:beam]
        scores, pick, rows = flat[best], best % M, (best // M).astype(mx.int32)
        parents.append(rows + (d - 1) * beam)
        tokens.append(cand_ids[d][pick])
        all_scores.append(scores)
    return (mx.concatenate(tokens).astype(mx.uint32), mx.concatenate(parents),
            mx.concatenate(all_scores))


@dataclass
class LazyTree:
    """:func:`select_tree`'s tree as device arrays, chosen without a host sync: node tokens
    [N], parents [N] (-1: the anchor), path probabilities [N], and the pass's rows' depths
    [N+1] and visibility [N+1, N+1] (as ``DraftTree.depths`` / ``visible``)."""

    tokens: mx.array
    parents: mx.array
    scores: mx.array
    depths: mx.array
    visible: mx.array

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def first(self, n: int) -> LazyTree:
        """The first ``n`` nodes (a tree: parents come first)."""
        return LazyTree(self.tokens[:n], self.parents[:n], self.scores[:n],
                        self.depths[: n + 1], self.visible[: n + 1, : n + 1])


def select_tree(tokens: mx.array, parents: mx.array, scores: mx.array, size: int) -> LazyTree:
    """The ``size`` best nodes of :func:`grow_tree`'s (log path probabilities ``scores``),
    parents first, in MLX ops. A node's ancestors come from the closure of the parent
    relation (repeated squaring of a [M, M] matrix), the order from pairwise comparisons: by
    score, then depth (a child's score never exceeds its parent's, so parents come first and
    the best ``size`` nodes are a tree)."""
    M = tokens.shape[0]
    size = min(size, M)
    idx = mx.arange(M)
    reach = (idx[:, None] == idx[None, :]) | (parents[:, None] == idx[None, :])
    for _ in range(max(M - 1, 1).bit_length()):  # ancestors-or-self of each node
        r = reach.astype(mx.float32)
        reach = (r @ r) > 0
    depth = reach.sum(axis=-1)  # rows: the anchor 0, its children 1, ...
    # Each node's rank by score, then depth, then index, counted pairwise: exact (a child may
    # tie its parent's score), and distinct, so any sort of the ranks gives the order.
    s = scores.astype(mx.float32)
    before = (s[None, :] > s[:, None]) | (s[None, :] == s[:, None]) & (
        (depth[None, :] < depth[:, None])
        | (depth[None, :] == depth[:, None]) & (idx[None, :] < idx[:, None]))
    order = mx.argsort(before.sum(axis=-1))[:size]
    new_index = mx.zeros((M,), dtype=mx.int32).at[order].add(mx.arange(size, dtype=mx.int32))
    picked_parents = parents[order]
    new_parents = mx.where(picked_parents < 0, -1, new_index[mx.maximum(picked_parents, 0)])
    seen = reach[order][:, order]
    visible = mx.concatenate([
        mx.concatenate([mx.ones((1, 1), dtype=mx.bool_), mx.zeros((1, size), dtype=mx.bool_)],
                       axis=1),
        mx.concatenate([mx.ones((size, 1), dtype=mx.bool_), seen], axis=1)])
    depths = mx.concatenate([mx.zeros((1,), dtype=depth.dtype), depth[order]])
    return LazyTree(tokens[order], new_parents.astype(mx.int32), mx.exp(s[order]), depths,
                    visible)


def independent(logits: mx.array, width: int, vocab_ids: mx.array | None, beam: int
                ) -> tuple[mx.array, mx.array, mx.array]:
    """:func:`grow_tree` for a drafter that scores each position on its own: logits [K, V']
    over the draft vocabulary, its ``width`` best candidates per position under any parent."""
    width = min(width, logits.shape[-1])
    top = mx.argpartition(-logits, width - 1, axis=-1)[:, :width]
    cand_logits = mx.take_along_axis(logits, top, axis=-1)
    ids = vocab_ids[top] if vocab_ids is not None else top
    return grow_tree(cand_logits[0],
                     lambda d, parents, _: mx.broadcast_to(cand_logits[d],
                                                           (parents.shape[0], width)),
                     ids, beam)


def target_choices(logits: mx.array, params: SamplingParams, position: int = 0,
                   depths: Any = None) -> mx.array:
    """The target's token after each row of a tree pass ([N+1, V] -> [N+1]): its argmax, or
    one independent draw per row from what plain decoding samples from (a Metal kernel each
    where there is one: kernels.argmax_rows, kernels.sample_rows). A seeded request's row at
    depth d takes the noise of position ``position + d`` (accept.PositionNoise)."""
    if params.greedy:
        return argmax_rows(logits)
    if params.noise is not None:
        table = params.noise.gumbel(position, *logits.shape)  # one row per depth
        noise = table[mx.array(depths) if depths is not None else mx.arange(logits.shape[0])]
        return argmax_rows(sampling_logits(logits, params) + noise)
    uniforms = mx.random.uniform(shape=(logits.shape[0],), key=params.key())
    if 0 < params.top_p < 1.0:  # top-p stays in MLX ops, as in rejection_accept
        return sample_rows(sampling_logits(logits, params), uniforms)
    return sample_rows(logits, uniforms, params.temperature, params.top_k)


class Calibration:
    """A drafter's survival scores (in [0, 1]) corrected by what this request's verify passes
    showed: the share of scores in the same bucket that survived, the score itself weighing as
    ``prior`` observations (so a score is taken as it is until the request says otherwise: a
    drafter calibrated on its training text can be far off on other text). ``decay``: each
    observation first discounts the earlier ones by that share (recent text weighs most)."""

    EDGES = np.array([1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9])
    PRIOR = 4.0

    def __init__(self, decay: float = 0.0, prior: float = PRIOR) -> None:
        self.hits = np.zeros(len(self.EDGES) + 1)
        self.tries = np.zeros(len(self.EDGES) + 1)
        self.keep, self.prior = 1.0 - decay, prior

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        scores = np.asarray(scores, dtype=np.float64)
        b = np.searchsorted(self.EDGES, scores)
        return (self.hits[b] + self.prior * scores) / (self.tries[b] + self.prior)

    def observe(self, scores: np.ndarray, survived: np.ndarray) -> None:
        b = np.searchsorted(self.EDGES, np.asarray(scores, dtype=np.float64))
        self.hits *= self.keep
        self.tries *= self.keep
        np.add.at(self.tries, b, 1)
        np.add.at(self.hits, b, np.asarray(survived, dtype=np.float64))


class TreeSizer:
    """How many of a grown tree's nodes a cycle verifies (``tree="auto"``): the ``n`` best with
    the most expected committed tokens per second, ``(1 + sum of their survival) / (t_draft +
    t_verify(1 + n))``, the pass times measured (``schedule.PassCosts``). A node's survival is
    its drafter score calibrated by this request's verified trees (:class:`Calibration`: the
    share of nodes in its score bucket that ended on the accepted path)."""

    def __init__(self, costs: Any):
        self.costs = costs
        self.survival = Calibration()

    def choose(self, scores: np.ndarray, context: int) -> int:
        gain = np.cumsum(self.survival(scores))
        draft = self.costs.draft(1, context)
        rates = [(1 + gain[n - 1]) / (draft + self.costs.verify(n + 1, context))
                 for n in range(1, len(gain) + 1)]
        return 1 + int(np.argmax(rates)) if rates else 0

    def observe(self, tree: DraftTree, accepted_rows: list[int]) -> None:
        """A verified tree and the rows of its accepted path."""
        on_path = np.zeros(len(tree), dtype=bool)
        on_path[[r - 1 for r in accepted_rows]] = True
        self.survival.observe(tree.scores, on_path)
