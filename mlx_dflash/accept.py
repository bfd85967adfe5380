"""Acceptance rules: greedy prefix match and lossless rejection sampling.

Everything here stays lazy (no host sync): the decode loop evaluates the packed result once per
cycle. Sampling filters are mlx-lm's own (top-p, then top-k, on log-probabilities, temperature
last, as in ``mlx_lm.sample_utils.make_sampler``), applied identically to target and drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Filtered, temperature-scaled logits whose softmax is the distribution to sample from."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def sample_first(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token from the target's last-position logits [V] -> [1]."""
    if params.greedy:
        return mx.argmax(logits, axis=-1, keepdims=True).astype(mx.uint32)
    return mx.random.categorical(sampling_logits(logits, params))[None].astype(mx.uint32)


def proposal_from_logits(
    logits: mx.array, params: SamplingParams, vocab_ids: mx.array | None, vocab_size: int
) -> tuple[mx.array, mx.array | None]:
    """Drafts [K] (target ids) from draft logits [K, N] over the draft vocabulary, and when
    sampling the proposal distribution [K, vocab_size] (zero outside the draft vocabulary,
    which rejection sampling handles exactly)."""
    if params.greedy:
        drafts = mx.argmax(logits, axis=-1)
        probs = None
    else:
        scaled = sampling_logits(logits, params)
        drafts = mx.random.categorical(scaled)
        probs = mx.softmax(scaled, axis=-1)
    if vocab_ids is not None:
        drafts = vocab_ids[drafts]
        if probs is not None:
            K, N = probs.shape
            probs = mx.put_along_axis(mx.zeros((K, vocab_size), dtype=probs.dtype),
                                      mx.broadcast_to(vocab_ids[None], (K, N)), probs, axis=-1)
    return drafts.astype(mx.uint32), probs


def greedy_accept(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [K], target_logits [K+1, V] -> (accepted_len [], target tokens [K+1]).

    Token i of the target's choice is what it would emit after the anchor and drafts[:i]; the
    next token after accepting ``a`` drafts is ``target_tokens[a]``.
    """
    target_tokens = mx.argmax(target_logits, axis=-1).astype(mx.uint32)
    matches = (drafts == target_tokens[:-1]).astype(mx.int32)
    accepted_len = mx.cumprod(matches).sum()
    return accepted_len, target_tokens


def rejection_accept(
    drafts: mx.array, draft_probs: mx.array, target_logits: mx.array, params: SamplingParams
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al.): output tokens follow the target distribution.

    drafts [K] were sampled from draft_probs [K, V]. Accept draft i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from normalize(max(p - q, 0));
    after K acceptances sample the bonus from p_K. Returns (accepted_len [], next tokens [K+1])
    where next_tokens[a] is the token to emit after accepting ``a`` drafts.
    """
    K = drafts.shape[0]
    p = mx.softmax(sampling_logits(target_logits, params), axis=-1)  # [K+1, V]
    idx = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:K], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(draft_probs, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(K,))
    accepted_len = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    residual = mx.maximum(p[:K] - draft_probs, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # Zero residual mass only happens when p == q; then p itself is the right distribution.
    residual = mx.where(mass > 0, residual, p[:K])
    corrections = mx.random.categorical(mx.log(residual))
    bonus = mx.random.categorical(mx.log(p[K:]))
    return accepted_len, mx.concatenate([corrections, bonus]).astype(mx.uint32)
