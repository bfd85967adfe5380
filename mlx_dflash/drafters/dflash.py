"""DFlash: a block-parallel drafter conditioned on target hidden states (z-lab layout).

The drafter owns no embedding and no LM head: it embeds ``[anchor, MASK x (B-1)]`` with the
target's embedding and reads its B-1 draft logits through the target's head. A drafter may carry
a reduced draft vocabulary (``draft_vocab``: the target ids of the head rows it uses, most
frequent first); then its head is those rows only and its drafts map back to target ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..accept import SamplingParams, proposal_from_logits
from ..ngram import NgramTable
from ..tree import TREE_CANDIDATES, independent
from .base import Proposal
from .layers import DraftArgs, DraftLayer, block_mask, make_context_cache


def _padded(a: mx.array, start: int, end: int, T: int) -> mx.array:
    """A cache's positions ``start..end-1`` [1, heads, n, d], zero-padded to ``T``."""
    return mx.pad(a[..., start:end, :], [(0, 0), (0, 0), (0, T - end + start), (0, 0)])


class _Memo:
    """Arrays derived from the weights and kept between calls (a plain object, so that
    nn.Module never counts them as parameters)."""

    def __init__(self):
        self.head_rows: tuple[Any, mx.array] | None = None  # (target model, its head rows)
        self.prev_table: tuple[mx.array, mx.array] | None = None  # (vocab, id -> row)


class DFlashDraftModel(nn.Module):
    family = "dflash"  # its name in drafters.registry (and train's --family)
    args_class: ClassVar[type[DraftArgs]] = DraftArgs  # reads and writes its config.json
    layer_class = DraftLayer
    fixed_vocab = False  # families with per-token tables (DSpark, DFlash 2) fix it when built
    fixed_width = False  # a wider block than trained may be drafted (more drafts per pass)
    walk_candidates: int | None = None  # families with a sequential walk say how wide it is
    # Training defaults: the loss weighs block position k by exp(-(k-1)/gamma), and the
    # family's own term (aux_loss) by this weight; DFlash has no such term.
    train_gamma: ClassVar[float] = 7.0
    train_aux_weight: ClassVar[float] = 0.0

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        n_taps = len(args.target_layer_ids)
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.draft_vocab_size:
            self.draft_vocab = mx.arange(args.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"])
        self.ngram: NgramTable | None = None  # lookup drafts shipped with the checkpoint
        self.source_path: Path | None = None  # the directory it was loaded from
        self._memo = _Memo()

    @property
    def vocab_ids(self) -> mx.array | None:
        """Target ids of the draft vocabulary, or None when the drafter uses the full head."""
        return self.draft_vocab if "draft_vocab" in self else None

    def set_draft_vocab(self, ids: mx.array) -> None:
        if self.fixed_vocab and ids.shape[0] != self.args.draft_vocab_size:
            raise ValueError(f"a {self.family} drafter's vocabulary size is fixed when it is "
                             f"built ({self.args.draft_vocab_size}), got {ids.shape[0]} ids")
        self.args.draft_vocab_size = int(ids.shape[0])
        self.draft_vocab = ids.astype(mx.int32)
        self.freeze(keys=["draft_vocab"])
        self._memo.head_rows = None

    def prev_rows(self, tokens: mx.array) -> mx.array:
        """Target ids -> rows of a per-previous-token table: the draft vocabulary's index, or
        its size (one extra row) for a token outside it; the ids themselves without one."""
        vocab = self.vocab_ids
        if vocab is None:
            return tokens.astype(mx.int32)
        table = self._memo.prev_table
        if table is None or table[0] is not vocab:
            t = mx.full((self.args.vocab_size,), vocab.shape[0], dtype=mx.int32)
            t[vocab] = mx.arange(vocab.shape[0], dtype=mx.int32)
            table = self._memo.prev_table = (vocab, t)
        return table[1][tokens.astype(mx.int32)]

    def head(self, target: Any, hidden: mx.array) -> mx.array:
        """Draft logits over the drafter's vocabulary (the target's head, or its subset rows)."""
        if self.vocab_ids is None:
            return self.compute_logits(target.lm_head(hidden))
        cached = self._memo.head_rows
        if cached is None or cached[0] is not target.model:
            # Gathered once per target: the head rows of the draft vocabulary.
            cached = self._memo.head_rows = (target.model, target.head_rows(self.vocab_ids))
        return self.compute_logits(hidden @ cached[1].T)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def max_drafts(self) -> int:
        """Drafts one pass proposes at the trained width: the slots after the anchor."""
        return self.block_size - 1

    def pass_key(self) -> tuple:
        a = self.args
        return (a.hidden_size, a.num_hidden_layers, a.draft_vocab_size, self.block_size,
                type(self).__name__, self.walk_candidates, a.context_window)

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    def make_cache(self) -> list[Any]:
        return make_context_cache(len(self.layers))

    def embed_block(self, target: Any, tokens: mx.array) -> mx.array:
        """Block token ids -> inputs, through the target's embedding."""
        embeds = target.embed(tokens)
        if self.args.input_embedding_scale != 1.0:
            embeds = embeds * self.args.input_embedding_scale
        return embeds

    def fuse(self, features: mx.array) -> mx.array:
        """Concatenated tap-layer features [.., T, taps*D] -> context hidden [.., T, D]."""
        return self.hidden_norm(self.fc(features))

    def compute_logits(self, logits: mx.array) -> mx.array:
        a = self.args
        if a.output_multiplier != 1.0:
            logits = logits * a.output_multiplier
        if a.final_logit_softcapping:
            logits = mx.tanh(logits / a.final_logit_softcapping) * a.final_logit_softcapping
        return logits

    def commit(self, features: mx.array, cache: list[Any], tokens: mx.array | None = None
               ) -> None:
        """Append newly committed positions' target features [1, n, taps*D] to the context
        (a block drafter reads no tokens)."""
        ctx = self.fuse(features)
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.context_kv(ctx, c.offset))

    def context_start(self, held: int) -> int:
        """The first context position a block after ``held`` positions attends to."""
        window = self.args.context_window
        return max(0, held - window) if window else 0

    def __call__(self, block_embeds: mx.array, cache: list[Any]) -> mx.array:
        """Inference pass of one block [1, B, D] over the cached context (its last
        ``context_window`` positions where set); final-norm hidden."""
        h = block_embeds
        B = h.shape[1]
        for layer, c in zip(self.layers, cache):
            start = self.context_start(c.offset)
            keys, values = c.keys[..., start : c.offset, :], c.values[..., start : c.offset, :]
            mask = block_mask(c.offset - start, B, c.offset, layer.sliding_window,
                              layer.is_causal, start)
            h = layer(h, keys, values, c.offset, mask)
        return self.norm(h)

    def draft_logits(
        self,
        target: Any,
        anchor: mx.array,
        cache: list[Any],
        block_size: int,
        num_drafts: int | None = None,
    ) -> mx.array:
        """Draft logits [K, V] for the K positions after ``anchor`` (a [1] int array).

        The block always has ``block_size`` inputs; only the first K = num_drafts rows go
        through the (large) LM head.
        """
        K = block_size - 1 if num_drafts is None else num_drafts
        return self.head(target, self.block_hidden(target, anchor, cache, block_size)[1 : 1 + K])

    def block_hidden(
        self, target: Any, anchor: mx.array, cache: list[Any], block_size: int
    ) -> mx.array:
        """Final hidden states [block_size, D] of the block ``[anchor, MASK x (block_size-1)]``
        over the cached context."""
        mask_ids = mx.full((block_size - 1,), self.args.mask_token_id, dtype=anchor.dtype)
        embeds = self.embed_block(target, mx.concatenate([anchor, mask_ids])[None])
        return self(embeds, cache)[0]

    first_draft_slot: ClassVar[int] = 1  # the block slot whose hidden state gives draft 1

    def block_width(self, width: int) -> int:
        """The block a pass runs: the trained width, or ``width`` inputs if that is more (its
        attention over the MASK slots is bidirectional: the width is part of what it was
        trained on)."""
        return max(width, self.block_size)

    def propose(
        self,
        target: Any,
        anchor: mx.array,
        cache: list[Any],
        width: int,
        num_drafts: int,
        params: SamplingParams,
    ) -> Proposal:
        """K draft target ids, and their proposal distribution [K, V] when sampling."""
        s = self.first_draft_slot
        hidden = self.block_hidden(target, anchor, cache, self.block_width(width))
        hidden = hidden[s : s + num_drafts]
        return self.propose_from(target, anchor, hidden, self.head(target, hidden), params)

    def grow_tree(self, target: Any, anchor: mx.array, cache: list[Any], width: int,
                  beam: int) -> tuple[mx.array, mx.array, mx.array]:
        """A tree's candidate nodes below ``anchor`` (tree.grow_tree, lazy), from one block
        pass."""
        s = self.first_draft_slot
        hidden = self.block_hidden(target, anchor, cache, self.block_width(width))
        hidden = hidden[s : s + self.max_drafts]
        return self.tree_from(target, anchor, hidden, self.head(target, hidden), beam)

    def grow_trees(self, target: Any, anchors: mx.array, caches: list[list[Any]], width: int,
                   beam: int) -> list[tuple[mx.array, mx.array, mx.array]]:
        """``grow_tree`` for many requests: one block pass and one head product for all."""
        s, K = self.first_draft_slot, self.max_drafts
        hidden = self.block_hidden_batch(target, anchors, caches, self.block_width(width))
        hidden = hidden[:, s : s + K]
        logits = self.head(target, hidden.reshape(-1, hidden.shape[-1]))
        return [self.tree_from(target, anchors[i : i + 1], hidden[i],
                               logits[i * K : (i + 1) * K], beam)
                for i in range(anchors.shape[0])]

    def tree_from(self, target: Any, anchor: mx.array, hidden: mx.array, logits: mx.array,
                  beam: int) -> tuple[mx.array, mx.array, mx.array]:
        """The tree from the drafts' hidden states [K, D] and logits [K, V']: the block pass
        scores every position on its own, so each position's best candidates may follow any
        node of the depth before."""
        return independent(logits, TREE_CANDIDATES, self.vocab_ids, beam)

    def propose_batch(
        self,
        target: Any,
        anchors: mx.array,
        caches: list[list[Any]],
        width: int,
        counts: list[int],
        params: list[SamplingParams],
    ) -> list[Proposal]:
        """Drafts for many requests in one pass: one block per request over its own context
        (padded to the longest, masked), one head product for all their drafts."""
        s = self.first_draft_slot
        hidden = self.block_hidden_batch(target, anchors, caches, self.block_width(width))
        rows = [hidden[i, s : s + K] for i, K in enumerate(counts)]
        logits = self.head(target, mx.concatenate(rows))
        ends = np.cumsum(counts).tolist()  # host-side counts: no sync
        return [self.propose_from(target, anchors[i : i + 1], h, logits[end - K : end], p)
                for i, (h, K, end, p) in enumerate(zip(rows, counts, ends, params))]

    def propose_from(self, target: Any, anchor: mx.array, hidden: mx.array, logits: mx.array,
                     params: SamplingParams) -> Proposal:
        """The proposal from the drafts' hidden states [K, D] and draft logits [K, V']."""
        return Proposal(*proposal_from_logits(logits, params, self.vocab_ids, target.vocab_size))

    def block_hidden_batch(
        self, target: Any, anchors: mx.array, caches: list[list[Any]], block_size: int
    ) -> mx.array:
        """``block_hidden`` of many requests at once: [R, block_size, D]. Each request's context
        is padded to the longest and masked; its block sits at its own positions."""
        R = anchors.shape[0]
        mask_ids = mx.full((R, block_size - 1), self.args.mask_token_id, dtype=anchors.dtype)
        h = self.embed_block(target, mx.concatenate([anchors[:, None], mask_ids], axis=1))
        lengths = [c[0].offset for c in caches]
        starts = [self.context_start(n) for n in lengths]
        T = max(n - s for n, s in zip(lengths, starts))
        offsets = mx.array(lengths)
        q_pos = offsets[:, None] + mx.arange(block_size)[None]  # [R, B]
        ctx_pos = mx.array(starts)[:, None, None] + mx.arange(T)  # [R, 1, T]
        held = ctx_pos < offsets[:, None, None]
        for i, layer in enumerate(self.layers):
            keys = mx.concatenate([_padded(c[i].keys, s, c[i].offset, T)
                                   for c, s in zip(caches, starts)])
            values = mx.concatenate([_padded(c[i].values, s, c[i].offset, T)
                                     for c, s in zip(caches, starts)])
            ctx_ok = mx.broadcast_to(held, (R, block_size, T))
            if layer.sliding_window is not None:
                ctx_ok = ctx_ok & ((q_pos[:, :, None] - ctx_pos) < layer.sliding_window)
            blk_ok = mx.ones((block_size, block_size), dtype=mx.bool_)
            if layer.is_causal:
                blk_ok = mx.tril(blk_ok)
            blk_ok = mx.broadcast_to(blk_ok, (R, block_size, block_size))
            mask = mx.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]
            h = layer(h, keys, values, offsets, mask)
        return self.norm(h)

    def train_logits(
        self, target: Any, features: mx.array, blocks: mx.array, anchors: mx.array,
        prev: mx.array,
    ) -> tuple[mx.array, None]:
        """Draft logits [N, B-1, V'] of training blocks (slot k+1 predicts token anchor+k+1)."""
        embeds = self.embed_block(target, blocks)
        return self.head(target, self.train_hidden(embeds, features, anchors)[:, 1:]), None

    def train_hidden(
        self, block_embeds: mx.array, features: mx.array, anchors: mx.array
    ) -> mx.array:
        """Training pass over many blocks of G sequences.

        block_embeds [G*N, B, D] (block n starts at position anchors[n] of sequence n // N),
        features [G, T, taps*D]. Block n sees context positions < anchors[n] and its own block
        bidirectionally.
        """
        ctx = self.fuse(features)
        N, B, _ = block_embeds.shape
        T = features.shape[1]
        ctx_pos = mx.arange(T)[None, None, :]
        q_pos = anchors[:, None, None] + mx.arange(B)[None, :, None]
        visible = mx.broadcast_to(ctx_pos < anchors[:, None, None], (N, B, T))
        h = block_embeds
        for layer in self.layers:
            keys, values = layer.self_attn.context_kv(ctx, 0)
            ctx_ok = visible
            if layer.sliding_window is not None:
                ctx_ok = ctx_ok & ((q_pos - ctx_pos) < layer.sliding_window)
            blk_ok = mx.ones((N, B, B), dtype=mx.bool_)
            if layer.is_causal:
                blk_ok = mx.broadcast_to(mx.tril(blk_ok[0]), (N, B, B))
            mask = mx.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]
            h = layer(h, keys, values, anchors, mask)
        return self.norm(h)

    @classmethod
    def train_fields(cls, options: Any) -> dict:
        """The family's own args of a new drafter, from the training options (a
        ``train.loop.TrainConfig``); raises ValueError on an option the family cannot take."""
        return {}

    def aux_loss(self, aux: Any, labels: mx.array, weights: mx.array,
                 tv: Callable[[], mx.array]) -> mx.array | None:
        """The family's own training term on the second output of ``train_logits``: weighted
        by ``weights`` [N, n] (position decay times label validity), with ``tv()`` each
        position's total variation from the target's distribution (computed once, on demand).
        None: the family has none."""
        return None

    def val_metrics(self, logits: mx.array, aux: Any, labels: np.ndarray, valid: np.ndarray
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Teacher-forced validation of ``train_logits``' outputs: the token the drafter would
        pick at each position [N, n], and the family's own per-position counts (summed over
        blocks, reported as shares of the valid positions)."""
        return np.array(mx.argmax(logits, axis=-1)), {}

    @property
    def has_confidence(self) -> bool:
        """Whether proposals carry a confidence (a head that training calibrates)."""
        return False

    def raw_weights(self) -> list[tuple[nn.Module, str]]:
        """Weights held as plain arrays rather than in a Linear or Embedding layer that
        quantizing the drafter packs too, as (owning module, name)."""
        return []
