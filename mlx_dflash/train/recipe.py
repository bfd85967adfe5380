"""The DFlash training recipe: random anchors, masked blocks, decay-weighted cross-entropy.

Per sequence: sample anchors in the response; block n is ``[x_anchor, MASK x (B-1)]`` at
positions ``anchor..anchor+B-1``; it sees target features strictly before its anchor and its own
block (bidirectionally), never other blocks; position k predicts token ``anchor+k`` with weight
``exp(-(k-1)/gamma)``. The target's embedding and LM head stay frozen.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..drafters import DFlashDraftModel
from ..target import Target
from .softmax import softmax_logsumexp


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spaced tap layers from 1 to L-3 (z-lab's rule); one tap: the middle layer."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


def sample_anchors(
    prompt_len: int, total_len: int, num_anchors: int, rng: np.random.Generator
) -> np.ndarray:
    """Anchor positions among response tokens that have at least one label after them."""
    low, high = prompt_len, total_len - 2  # inclusive range
    if high < low:
        return np.zeros((0,), dtype=np.int32)
    candidates = np.arange(low, high + 1)
    n = min(num_anchors, len(candidates))
    return np.sort(rng.choice(candidates, size=n, replace=False)).astype(np.int32)


def block_inputs(
    tokens: np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block token ids [N, B], labels [N, B-1] and label validity [N, B-1]."""
    T = len(tokens)
    offsets = np.arange(1, block_size)
    label_pos = anchors[:, None] + offsets[None, :]
    valid = label_pos < T
    labels = tokens[np.minimum(label_pos, T - 1)]
    blocks = np.full((len(anchors), block_size), mask_token_id, dtype=np.int32)
    blocks[:, 0] = tokens[anchors]
    return blocks, labels.astype(np.int32), valid


def position_weights(block_size: int, gamma: float) -> mx.array:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    return mx.array([math.exp(-(k - 1) / gamma) for k in range(1, block_size)])


class Batch(NamedTuple):
    """Training blocks of one sequence (or of G, see ``collate``). Slot k of a block is
    labelled with token anchor+k+1
    (DFlash: the slot after it, k+1, is the one that predicts it; see ``train_logits``)."""

    features: mx.array  # [G, T-1, taps*D] standardised target features
    blocks: mx.array  # [N, width] anchor + MASK ids
    anchors: mx.array  # [N]
    labels: mx.array  # [N, n] indices in the drafter's vocabulary (-1: outside it)
    valid: mx.array  # [N, n] label inside the sequence
    topk_ids: mx.array  # [N, n, k] the target's top-k (drafter indices, -1: outside)
    topk_probs: mx.array  # [N, n, k] and their probabilities
    prev: mx.array  # [N, n] target ids of the token before each label (teacher forcing)
    tokens: mx.array | None = None  # [G, T] the sequences' tokens (a chain drafter reads them)


def collate(batches: list[Batch]) -> Batch:
    """Several sequences' blocks as one batch: one forward, larger matmuls, fewer ops.

    Features are zero-padded to the longest sequence (padding sits after every anchor, so no
    block sees it) and each sequence's blocks padded to the same count with label-less copies
    of its last block; ``train_hidden`` gives block n of ``features[g]`` to sequence
    ``n // (blocks per sequence)``.
    """
    if len(batches) == 1:
        return batches[0]
    T = max(b.features.shape[1] for b in batches)
    N = max(b.blocks.shape[0] for b in batches)

    def rows(x: mx.array, fill: mx.array | None = None) -> mx.array:
        extra = N - x.shape[0]
        if extra == 0:
            return x
        pad = mx.broadcast_to(x[-1:] if fill is None else fill, (extra, *x.shape[1:]))
        return mx.concatenate([x, pad.astype(x.dtype)], axis=0)

    fields = {name: [] for name in Batch._fields}
    for b in batches:
        fields["features"].append(mx.pad(b.features, [(0, 0), (0, T - b.features.shape[1]),
                                                      (0, 0)]))
        if b.tokens is not None:
            fields["tokens"].append(mx.pad(b.tokens, [(0, 0), (0, T + 1 - b.tokens.shape[1])]))
        for name in ("blocks", "anchors", "topk_ids", "topk_probs", "prev"):
            fields[name].append(rows(getattr(b, name)))
        fields["labels"].append(rows(b.labels, mx.array(-1)))
        fields["valid"].append(rows(b.valid, mx.array(False)))
    return Batch(*(mx.concatenate(fields[name], axis=0) if fields[name] else None
                   for name in Batch._fields))


# Collating sequences into one batch pays where each brings few block rows (DSpark's 16 anchors
# of 7) and costs where each brings many (DFlash's 32 blocks of 16): docs/training.md.
COLLATE_MAX_ROWS = 256


def step_gradients(loss_and_grad: Any, batches: list[Batch]) -> tuple[tuple, Any]:
    """((loss, accuracy), grads) of one step: one collated forward when the sequences' blocks
    are small, else one forward per sequence with the results weighted by valid positions
    (the accuracy, logged only, by each sequence's share of all positions)."""
    rows = max(int(b.blocks.size) for b in batches)
    if rows <= COLLATE_MAX_ROWS or len(batches) == 1:
        return loss_and_grad(collate(batches))
    counts = [b.valid.sum().astype(mx.float32) for b in batches]
    total = sum(counts)
    shares = [n / total for n in counts]
    results = [loss_and_grad(b) for b in batches]  # ((loss, accuracy), grads) each
    loss = sum(s * r[0][0] for s, r in zip(shares, results))
    acc = sum(s * r[0][1] for s, r in zip(shares, results))
    grads = tree_map(lambda *g: sum(s * x for s, x in zip(shares, g)), *[r[1] for r in results])
    return (loss, acc), grads


def train_logits(drafter: DFlashDraftModel, target: Target, batch: Batch) -> tuple:
    """The drafter's training logits of ``batch`` (a chain drafter also reads the tokens)."""
    extra = {"tokens": batch.tokens} if getattr(drafter, "chained", False) else {}
    return drafter.train_logits(target, batch.features, batch.blocks, batch.anchors,
                                batch.prev, **extra)


def block_loss(
    drafter: DFlashDraftModel,
    target: Target,
    batch: Batch,
    weights: mx.array,
    ce_weight: float = 1.0,
    tv_weight: float = 0.0,
    aux_weight: float = 0.0,
) -> tuple[mx.array, mx.array]:
    """Position-weighted CE on the target's tokens, total variation toward the target's
    distribution and the family's own term (``drafter.aux_loss``: DSpark's confidence BCE,
    DFlash 2's selector CE), over all blocks of the batch. Returns (loss, per-position
    accuracy).

    Labels outside the drafter's vocabulary count as wrong and are left out of the CE. The TV
    term knows the target's top-k only and treats the rest of its mass as unknown:
    ``0.5 * (sum_topk |q - p| + (1 - sum_topk q))``.
    """
    logits, aux = train_logits(drafter, target, batch)
    logits = logits.astype(mx.float32)
    labels, valid = batch.labels, batch.valid
    w = weights[None, :] * valid
    total = w.sum()
    loss = 0.0
    q, lse = softmax_logsumexp(logits)  # one exp pass for both terms (see softmax.py)
    if ce_weight:
        picked = mx.take_along_axis(logits, mx.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        wc = w * (labels >= 0)
        loss = loss + ce_weight * ((lse - picked) * wc).sum() / mx.maximum(wc.sum(), 1e-6)

    @functools.cache
    def tv() -> mx.array:  # built once, only if a term reads it
        known = batch.topk_ids >= 0
        q_k = mx.take_along_axis(q, mx.maximum(batch.topk_ids, 0), axis=-1) * known
        return 0.5 * (mx.abs(q_k - batch.topk_probs * known).sum(-1) + 1.0 - q_k.sum(-1))

    if tv_weight:
        loss = loss + tv_weight * (tv() * w).sum() / mx.maximum(total, 1e-6)
    if aux_weight:
        extra = drafter.aux_loss(aux, labels, w, tv)
        if extra is not None:
            loss = loss + aux_weight * extra
    correct = (mx.argmax(logits, axis=-1) == labels) * valid
    accuracy = correct.sum(axis=0) / mx.maximum(valid.sum(axis=0), 1)
    return loss, accuracy


def choose_draft_vocab(tokens: np.ndarray, vocab_size: int, size: int) -> tuple[np.ndarray, float]:
    """The ``size`` most frequent ids of ``tokens`` (ties by id), and the share they cover."""
    counts = np.bincount(tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    return order.astype(np.int32), float(counts[order].sum() / max(counts.sum(), 1))


def grow_layers(drafter: DFlashDraftModel, num_layers: int) -> int:
    """Append layers to a trained drafter without changing what it computes (returns how many).

    Each new layer copies the last one with its output projections (o_proj, down_proj) zeroed,
    so it starts as the identity on the residual stream and its gradients are not zero.
    """
    have = len(drafter.layers)
    if num_layers < have:
        raise ValueError(f"cannot shrink a {have}-layer drafter to {num_layers} layers")
    args = drafter.args
    args.layer_types = list(args.layer_types) + [args.layer_types[-1]] * (num_layers - have)
    args.num_hidden_layers = num_layers
    last = tree_flatten(drafter.layers[-1].parameters())
    zeroed = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    for i in range(have, num_layers):
        layer = drafter.layer_class(args, i)
        layer.load_weights([(k, mx.zeros_like(v) if k in zeroed else v)
                            for k, v in last])
        drafter.layers.append(layer)
    return num_layers - have


def init_from_target(drafter: DFlashDraftModel, target: Target) -> list[int]:
    """Warm-start the drafter's layers from the target's last layers (same shapes only).

    Returns the target layer indices copied. Norms the target lacks (q_norm/k_norm) stay ones.
    """
    layers = target.inner.layers
    n = len(drafter.layers)
    sources = list(range(len(layers) - n, len(layers)))
    for draft_layer, src in zip(drafter.layers, sources):
        src_params = dict(tree_flatten(layers[src].parameters()))
        own = dict(tree_flatten(draft_layer.parameters()))
        update = [(k, v) for k, v in src_params.items() if k in own and own[k].shape == v.shape]
        draft_layer.load_weights(update, strict=False)
    return sources
