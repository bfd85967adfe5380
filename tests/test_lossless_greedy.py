"""Greedy speculative output equals the target's own greedy output, token for token."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tiny import EOS_ID, make_drafter, make_target, make_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.accept import proposal_from_logits
from mlx_dflash.drafters.base import Proposal


def reference(model, prompt, max_tokens, stop_ids=(EOS_ID,)):
    """mlx-lm's greedy decode, cut like mlx_lm.stream_generate (stop token not emitted). A
    reply that stops at once is refused: a test comparing it would compare nothing."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if tok in stop_ids:
            assert out, f"the target stops at once after {prompt}: choose another prompt"
            return out, "stop"
        out.append(tok)
    return out, "length"


def speculative(model, drafter, tokenizer, prompt, max_tokens, block_size, copy_drafts=True):
    tokens, reason, accepted = [], None, 0
    for r in stream_generate(
        model, drafter, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size,
        copy_drafts=copy_drafts,
    ):
        tokens += r.tokens
        accepted += r.accepted
        reason = r.finish_reason
    return tokens, reason, accepted


def assert_same_or_near_tie(model, prompt, got, want):
    """A mismatch is a bug unless the target's top-2 logits nearly tie at that position."""
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got + [-1], want + [-2])) if a != b)
    logits = model(mx.array(prompt + want[:i])[None])[0, -1]
    top2 = mx.sort(logits)[-2:].tolist()
    gap = top2[1] - top2[0]
    assert gap < 1e-4, f"mismatch at generated token {i} with top-2 logit gap {gap:.3g}"
    pytest.skip(f"float near-tie at token {i}: top-2 logit gap {gap:.2e}")


class OracleDrafter:
    """Wraps a real DFlash drafter (so its cache/commit path runs) but proposes the target's
    true continuation, corrupted at random positions, to exercise every acceptance length."""

    fixed_width = False
    vocab_ids = None
    ngram = None
    source_path = None

    def __init__(self, drafter, full_sequence, vocab_size, error_rate, seed=0):
        self.inner = drafter
        self.args = drafter.args
        self.block_size = drafter.block_size
        self.max_drafts = drafter.max_drafts
        self.target_layer_ids = drafter.target_layer_ids
        self.full = full_sequence
        self.vocab = vocab_size
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)

    def make_cache(self):
        return self.inner.make_cache()

    def commit(self, features, cache, tokens=None):
        self.inner.commit(features, cache, tokens)

    def draft_logits(self, target, anchor, cache, block_size, num_drafts=None):
        K = block_size - 1 if num_drafts is None else num_drafts
        real = self.inner.draft_logits(target, anchor, cache, block_size, K)
        pos = cache[0].offset  # position of the anchor
        want = list(self.full[pos + 1 : pos + block_size])
        want += [0] * (block_size - 1 - len(want))
        for k in range(len(want)):
            if self.rng.random() < self.error_rate:
                want[k] = (want[k] + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
        onehot = mx.zeros((block_size - 1, self.vocab))
        onehot[mx.arange(block_size - 1), mx.array(want)] = 100.0
        return onehot[:K] + 0 * real

    def pass_key(self):
        return ("oracle",)

    def propose(self, target, anchor, cache, width, num_drafts, params):
        logits = self.draft_logits(target, anchor, cache, max(width, self.block_size), num_drafts)
        return Proposal(*proposal_from_logits(logits, params, None, target.vocab_size))


CONFIGS = [
    ("llama", True, 4, 4),
    ("llama", False, 4, 2),
    ("qwen2", True, 4, 2),
    ("qwen2", False, 4, 1),
    ("qwen3", True, 4, 2),
    ("qwen3", False, 4, 4),
]


@pytest.mark.parametrize("model_type,tied,heads,kv_heads", CONFIGS)
def test_random_drafter_matches_target(model_type, tied, heads, kv_heads):
    model = make_target(model_type, tied=tied, heads=heads, kv_heads=kv_heads)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 1, 3))
    tok = make_tokenizer(128)
    rng = np.random.default_rng(0)
    for length, block in [(1, 1), (2, 2), (7, 4), (33, 8), (260, 16)]:
        prompt = rng.integers(3, 128, size=length).tolist()
        want, want_reason = reference(model, prompt, 24)
        got, reason, _ = speculative(model, drafter, tok, prompt, 24, block)
        assert_same_or_near_tie(model, prompt, got, want)
        assert reason == want_reason


@pytest.mark.parametrize("block_size", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("error_rate", [0.0, 0.15, 0.5])
def test_oracle_drafter_all_acceptance_lengths(block_size, error_rate):
    model = make_target("qwen3", tied=False)
    tok = make_tokenizer(128)
    drafter = make_drafter(model, block_size=block_size)
    rng = np.random.default_rng(block_size)
    for length in (1, 5, 40):
        prompt = rng.integers(3, 128, size=length).tolist()
        want, _ = reference(model, prompt, 40)
        oracle = OracleDrafter(drafter, prompt + want, 128, error_rate, seed=length)
        got, _, accepted = speculative(model, oracle, tok, prompt, 40, block_size,
                                       copy_drafts=error_rate > 0)  # the oracle's own blocks
        assert_same_or_near_tie(model, prompt, got, want)
        if error_rate == 0.0:
            assert accepted >= len(want) * (block_size - 1) / block_size - block_size


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11, 17])
def test_max_tokens_cuts_a_block(max_tokens):
    model = make_target("llama")
    tok = make_tokenizer(128)
    drafter = make_drafter(model, block_size=8)
    prompt = [5, 6, 7]
    want, _ = reference(model, prompt, max_tokens)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, 128, 0.0)
    got, reason, _ = speculative(model, oracle, tok, prompt, max_tokens, 8)
    assert got == want and len(got) == max_tokens and reason == "length"


def test_eos_inside_a_block_and_mask_equal_to_stop_id():
    model = make_target("qwen3", seed=3)
    prompt = [9, 10, 11, 12]
    free, _ = reference(model, prompt, 30, stop_ids=())
    stop = free[6]  # a token the target emits mid-way: make it the stop token
    first = free.index(stop)
    tok = make_tokenizer(128, eos_id=stop)
    # The mask token id equals the stop id: drafts must not be confused with real stops.
    drafter = make_drafter(model, block_size=8, mask_token_id=stop)
    oracle = OracleDrafter(drafter, prompt + free, 128, 0.0)
    got, reason, _ = speculative(model, oracle, tok, prompt, 30, 8)
    assert got == free[:first] and reason == "stop"
    got, reason, _ = speculative(model, drafter, tok, prompt, 30, 8)
    assert got == free[:first] and reason == "stop"


def test_text_matches_mlx_lm_generate():
    from mlx_lm import generate as mlx_generate

    from mlx_dflash import generate

    model = make_target("qwen3", vocab_size=96)
    tok = make_tokenizer(96)
    drafter = make_drafter(model, block_size=4)
    prompt = "w5 w6 w7 w8"
    assert generate(model, drafter, tok, prompt, max_tokens=20) == mlx_generate(
        model, tok, prompt, max_tokens=20
    )


def test_quantized_target_is_lossless():
    import mlx.nn as nn

    model = make_target("qwen3", hidden_size=64)
    nn.quantize(model, group_size=32, bits=4)
    tok = make_tokenizer(128)
    drafter = make_drafter(model, block_size=4)
    prompt = [3, 4, 5, 6, 7]
    want, _ = reference(model, prompt, 20)
    oracle = OracleDrafter(drafter, prompt + want, 128, 0.2)
    got, _, _ = speculative(model, oracle, tok, prompt, 20, 4)
    assert_same_or_near_tie(model, prompt, got, want)
