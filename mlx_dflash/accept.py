"""Acceptance rules: greedy prefix match and lossless rejection sampling.

Everything here stays lazy (no host sync): the decode loop evaluates the packed result once per
cycle. Sampling filters are applied as in ``mlx_lm.sample_utils.make_sampler`` (top-p, then
top-k, on log-probabilities, temperature last), identically to target and drafter: top-p is
mlx-lm's own; top-k is too, except that of the values equal to the k-th largest it keeps the
lowest ids (``kernels.top_k_mask``; mlx-lm leaves that choice unspecified), the rule the
verification kernel follows.

Verification itself runs in ``kernels`` (one Metal kernel per step where there is a Metal GPU,
the same function in MLX ops otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from .kernels import top_k_mask, verify_greedy, verify_sample, verify_sample_candidates


class RandomStream:
    """A request's own random numbers, from its seed: in a batch, a seeded request draws from
    its own key instead of MLX's global one (which every request there shares)."""

    def __init__(self, seed: int):
        self._key = mx.random.key(seed % 2**64)

    def next(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key


_MASK64 = 2**64 - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a key per position, unrelated across seeds."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionNoise:
    """A seeded request's Gumbel noise, keyed by the seed and each token's position in the
    sequence: the target's token at position t is argmax(sampling logits_t + noise_t), an
    exact draw from its distribution (Gumbel-max) that depends on nothing else. So a seeded
    reply is the same whatever blocks, drafts, trees or batch neighbours it was decoded with
    (drafts are accepted where they equal that token)."""

    def __init__(self, seed: int):
        self.seed = seed % 2**64

    def gumbel(self, position: int, rows: int, vocab: int) -> mx.array:
        """Noise [rows, vocab] for positions ``position`` .. ``position + rows - 1``."""
        return mx.stack([mx.random.gumbel((vocab,), key=mx.random.key(_mix(self.seed, p)))
                         for p in range(position, position + rows)])


def seeded(seed: int | None) -> dict:
    """SamplingParams' random fields for ``seed`` (none: MLX's global key, rejection
    sampling): drafting draws from its own stream, the target's choices from PositionNoise."""
    return {} if seed is None else {"random": RandomStream(seed), "noise": PositionNoise(seed)}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    random: RandomStream | None = field(default=None, compare=False)  # None: the global key
    noise: PositionNoise | None = field(default=None, compare=False)  # seeded target choices

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

    def key(self) -> mx.array | None:
        """The key of the next random draw (None: MLX's global one)."""
        return None if self.random is None else self.random.next()


class CandidateProposal(NamedTuple):
    """A proposal supported on a few candidates per position: ids [K, C] (distinct within a
    row, target ids) with probabilities [K, C], zero elsewhere. DFlash 2's walk (C = 16) and a
    copied block (C = 1, probability 1) propose this way; verifying it never builds [K, V]."""

    ids: mx.array
    probs: mx.array


def point_mass(drafts: mx.array) -> CandidateProposal:
    """The proposal of drafts that were not sampled (a copied block): each with probability 1."""
    return CandidateProposal(drafts[:, None], mx.ones((drafts.shape[0], 1)))


def sampling_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Filtered, temperature-scaled logits whose softmax is the distribution to sample from."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = mx.where(top_k_mask(logprobs, params.top_k), logprobs, -mx.inf)
    return logprobs * (1.0 / params.temperature)


def noisy_logits(logits: mx.array, params: SamplingParams, position: int) -> mx.array:
    """A seeded request's sampling logits [R, V] plus its noise for rows at ``position``
    onward: their argmax is the target's choice."""
    return sampling_logits(logits, params) + params.noise.gumbel(position, *logits.shape)


def sample_first(logits: mx.array, params: SamplingParams, position: int = 0) -> mx.array:
    """One token from the target's last-position logits [V] -> [1] (``position``: the
    token's index in the sequence, which a seeded request's noise is keyed by)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1, keepdims=True).astype(mx.uint32)
    if params.noise is not None:
        return mx.argmax(noisy_logits(logits[None], params, position), axis=-1).astype(mx.uint32)
    token = mx.random.categorical(sampling_logits(logits, params), key=params.key())
    return token[None].astype(mx.uint32)


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
        drafts = mx.random.categorical(scaled, key=params.key())
        probs = mx.softmax(scaled, axis=-1)
    if vocab_ids is not None:
        drafts = vocab_ids[drafts]
        if probs is not None:
            K, N = probs.shape
            probs = mx.put_along_axis(mx.zeros((K, vocab_size), dtype=probs.dtype),
                                      mx.broadcast_to(vocab_ids[None], (K, N)), probs, axis=-1)
    return drafts.astype(mx.uint32), probs


def greedy_accept(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [K], target_logits [K+1, V] -> (accepted_len [], next_tokens [K+1]).

    Row i of the logits is the target's after the anchor and drafts[:i]; ``accepted_len`` drafts
    match the argmax of their row, and ``next_tokens[accepted_len]`` is the token to emit: the
    argmax at the first mismatch, or after all K (the bonus). Only that token is computed: every
    entry of ``next_tokens`` holds it.
    """
    accepted, token = verify_greedy(target_logits[None], drafts[None])
    return accepted[0], mx.broadcast_to(token, (drafts.shape[0] + 1,))


def rejection_accept(
    drafts: mx.array, draft_probs: mx.array | CandidateProposal, target_logits: mx.array,
    params: SamplingParams,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al.): output tokens follow the target distribution.

    drafts [K] were sampled from draft_probs [K, V] or a :class:`CandidateProposal`. Accept
    draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from
    normalize(max(p - q, 0)); after K acceptances sample the bonus from p_K
    (``kernels.verify_sample`` or ``verify_sample_candidates``, with uniforms drawn here).
    Returns (accepted_len [], next_tokens [K+1]) where next_tokens[a] is the token to emit
    after accepting ``a`` drafts (every entry holds it: only that one is computed).
    """
    K = drafts.shape[0]
    if 0 < params.top_p < 1.0:
        # top-p stays in MLX ops: verification gets the filtered, scaled logits.
        logits, temperature, top_k = sampling_logits(target_logits, params), 1.0, 0
    else:
        logits, temperature, top_k = target_logits, params.temperature, params.top_k
    uniforms = mx.random.uniform(shape=(1, K + 1), key=params.key())
    if isinstance(draft_probs, CandidateProposal):
        accepted, token = verify_sample_candidates(
            logits[None], drafts[None], draft_probs.ids[None], draft_probs.probs[None], uniforms,
            temperature, top_k)
    else:
        accepted, token = verify_sample(logits[None], drafts[None], draft_probs[None], uniforms,
                                        temperature, top_k)
    return accepted[0], mx.broadcast_to(token, (K + 1,))


def accept_block(
    drafts: mx.array, draft_probs: mx.array | CandidateProposal | None, target_logits: mx.array,
    params: SamplingParams, position: int = 0,
) -> tuple[mx.array, mx.array]:
    """The acceptance rule for one verified block: greedy prefix match, rejection sampling when
    sampling, or (no drafts) a plain sample; a seeded request's prefix match against its
    noisy choices (``position``: the index of the token row 0 predicts). Returns
    (accepted_len [], next_tokens [K+1])."""
    if params.greedy:
        return greedy_accept(drafts, target_logits)
    if params.noise is not None:
        return greedy_accept(drafts, noisy_logits(target_logits, params, position))
    if drafts.shape[0] > 0:
        return rejection_accept(drafts, draft_probs, target_logits, params)
    return mx.array(0), sample_first(target_logits[-1], params)
