"""Drafters that draft one token a step over their own KV cache: EAGLE-3 and the target's MTP
heads. Position t of such a drafter pairs the target's features of position t with the token
at t + 1, and predicts the token at t + 2; a chain feeds each step's output back with the
token it drafted.

The features of the last committed position wait for their next token (the anchor, known only
when the next cycle drafts), so committed features are kept in the cache unread with the next
tokens known so far, and run through the drafter at the next ``propose``, before the chain
(vLLM's "first pass" over the new context). The chain's keys leave the cache after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from ..accept import SamplingParams, proposal_from_logits
from .base import Proposal

PENDING_CHUNK = 512  # committed positions run through the drafter per pass (bounds attention)


class ChainDrafter(nn.Module):
    """The decode loop's side of a chain drafter. A family defines ``fuse`` (tap features ->
    its hidden input), ``step`` (pairs -> outputs fed back, keys into the cache) and
    ``logits`` (output -> draft logits over ``vocab_ids``), and has ``args`` with
    ``block_size`` (drafts + 1) and ``target_layer_ids``."""

    fixed_width = False  # a chain drafts as many as asked
    chained = True  # its cost grows with the drafts asked (schedule.PassCosts.draft_step_s)
    walk_candidates = None
    ngram = None  # lookup drafts shipped with a checkpoint: none
    source_path = None
    vocab_ids: mx.array | None = None  # the full vocabulary unless a family reduces it

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    @property
    def mask_token_id(self) -> int:  # no mask slots; the trainer's batches read it
        return self.args.mask_token_id

    @property
    def has_confidence(self) -> bool:
        return False

    def raw_weights(self) -> list[tuple[nn.Module, str]]:
        return []

    def make_cache(self) -> list[Any]:
        """The drafter's KV cache, and the committed positions it has not read yet: their
        hidden inputs [1, m, H] and the m - 1 next tokens known so far."""
        return [KVCache(), ArraysCache(2)]

    def commit(self, features: mx.array, cache: list[Any], tokens: mx.array | None = None
               ) -> None:
        """Keep committed positions' features and tokens until the next ``propose`` reads them
        (each position's pair needs the token after it)."""
        if tokens is None:
            raise ValueError(f"a {self.family} drafter reads the committed tokens with their "
                             "features")
        pending = cache[1]
        hidden = self.fuse(features)
        tokens = tokens.astype(mx.uint32)
        if pending[0] is None:  # the very first position has no token before it to pair with
            pending[0], pending[1] = hidden, tokens[:, 1:]
        else:
            pending[0] = mx.concatenate([pending[0], hidden], axis=1)
            pending[1] = mx.concatenate([pending[1], tokens], axis=1)

    def first_pass(self, target: Any, anchor: mx.array, cache: list[Any]
                   ) -> tuple[mx.array, int]:
        """The pending pairs through the drafter (the anchor is the last one's next token):
        the anchor pair's output [1, 1, H], and how many positions the cache held before it
        (the pair is read again with the next commit: trim back to that after drafting)."""
        kv, pending = cache
        if pending[0] is None:
            raise ValueError(f"a {self.family} drafter drafts after at least one committed "
                             "position")
        hidden = pending[0]
        tokens = mx.concatenate([pending[1], anchor.astype(mx.uint32)[None]], axis=1)
        m = hidden.shape[1]
        for start in range(0, m - 1, PENDING_CHUNK):  # all but the last pair: context for good
            end = min(start + PENDING_CHUNK, m - 1)
            self.step(target, tokens[:, start:end], hidden[:, start:end], kv)
        held = kv.offset
        pending[0], pending[1] = hidden[:, -1:], tokens[:, :0]
        return self.step(target, tokens[:, -1:], hidden[:, -1:], kv), held

    def propose(self, target: Any, anchor: mx.array, cache: list[Any], width: int,
                num_drafts: int, params: SamplingParams) -> Proposal:
        """The pending pairs (the anchor is the last one's next token) through the drafter,
        then a chain of ``num_drafts`` drafts; the chain's keys leave the cache again."""
        kv = cache[0]
        out, held = self.first_pass(target, anchor, cache)
        drafts, probs = [], []
        for k in range(num_drafts):
            x, q = proposal_from_logits(self.logits(target, out[:, -1]), params, self.vocab_ids,
                                        target.vocab_size)
            drafts.append(x)
            probs.append(q)
            if k + 1 < num_drafts:
                out = self.step(target, x[None], out, kv)
        kv.trim(kv.offset - held)  # the anchor's pair is read again with the next commit
        return Proposal(mx.concatenate(drafts),
                        None if params.greedy else mx.concatenate(probs))
