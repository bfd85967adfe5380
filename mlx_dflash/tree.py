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

**Building the tree** (:func:`build_tree`): the drafter scores ``M`` candidates at each of its
``K`` block positions (independently per position: the block pass proposes all positions at
once). A node at depth ``d`` can be followed by any candidate of position ``d + 1``; its score is
the product of its path's candidate probabilities. The tree is the ``N`` highest-scoring nodes,
grown best first from the anchor (a dynamic tree, as EAGLE-2's); every prefix of that order is a
tree, since a child never scores above its parent.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .accept import SamplingParams, sampling_logits


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

    def walk(self, choices: list[int]) -> tuple[list[int], int]:
        """(rows of the accepted nodes along the path, the token committed after them), given
        the target's choice at every row (``choices[r]``: its token after row r)."""
        children, row, path = self.children(), 0, []
        while choices[row] in children[row]:
            row = children[row][choices[row]]
            path.append(row)
        return path, choices[row]


def build_tree(ids: np.ndarray, probs: np.ndarray, size: int) -> DraftTree:
    """The ``size`` highest-scoring nodes, grown best first: ``ids`` [K, M] candidate target
    ids per block position, ``probs`` [K, M] their probabilities; a node at depth d is followed
    by position d's candidates (0-based: the anchor's children are position 0's)."""
    K = ids.shape[0]
    tree = DraftTree([], [], [])
    # (-score, tie-break, depth of the node's position, candidate index, parent node)
    frontier = [(-float(probs[0, m]), 0, m, -1) for m in range(ids.shape[1])]
    heapq.heapify(frontier)
    while frontier and len(tree) < size:
        neg, d, m, parent = heapq.heappop(frontier)
        node = len(tree)
        tree.tokens.append(int(ids[d, m]))
        tree.parents.append(parent)
        tree.scores.append(-neg)
        if d + 1 < K:
            for m2 in range(ids.shape[1]):
                heapq.heappush(frontier, (neg * float(probs[d + 1, m2]), d + 1, m2, node))
    return tree


def candidates(logits: mx.array, width: int, vocab_ids: mx.array | None
               ) -> tuple[mx.array, mx.array]:
    """The ``width`` likeliest candidates of each draft position: logits [K, V'] over the draft
    vocabulary -> (target ids [K, width], probabilities [K, width]), lazy."""
    width = min(width, logits.shape[-1])
    top = mx.argpartition(-logits, width - 1, axis=-1)[:, :width]
    probs = mx.take_along_axis(mx.softmax(logits.astype(mx.float32), axis=-1), top, axis=-1)
    ids = vocab_ids[top] if vocab_ids is not None else top
    return ids.astype(mx.uint32), probs


def target_choices(logits: mx.array, params: SamplingParams) -> mx.array:
    """The target's token after each row of a tree pass ([N+1, V] -> [N+1]): its argmax, or
    one independent draw per row from what plain decoding samples from."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return mx.random.categorical(sampling_logits(logits, params),
                                 key=params.key()).astype(mx.uint32)
