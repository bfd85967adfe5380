"""One drafter pass for many requests: each row's drafts are what that request's own pass
gives, for every family, with contexts of different lengths, sliding-window and causal drafter
layers, a reduced draft vocabulary, and sampling."""

import mlx.core as mx
import numpy as np
import pytest
from test_dflash2 import make_dflash2
from test_dspark import make_dspark
from tiny import make_drafter, make_target

from mlx_dflash.accept import CandidateProposal, RandomStream, SamplingParams
from mlx_dflash.drafters.base import BatchDrafter, propose_all
from mlx_dflash.target import as_target

VOCAB = list(range(3, 120, 2))
DRAFTERS = {
    "dflash": lambda m: make_drafter(m, block_size=6, num_layers=2),
    "dflash-window-causal": lambda m: make_drafter(
        m, block_size=6, num_layers=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8),
    "dspark": lambda m: make_dspark(m),
    "dspark-vocab": lambda m: make_dspark(m, vocab=VOCAB),
    "dflash2": lambda m: make_dflash2(m, block_size=6),
}


def contexts(model, drafter, lengths):
    """Each request's drafter context, as prefill leaves it, and its anchor."""
    target = as_target(model)
    rng = np.random.default_rng(0)
    caches, anchors = [], []
    for n in lengths:
        tokens = mx.array(rng.integers(3, 120, size=n).tolist())[None]
        _, features = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)
        cache = drafter.make_cache()
        drafter.commit(features, cache)
        caches.append(cache)
        anchors.append(mx.array([int(rng.integers(3, 120))], dtype=mx.uint32))
    return target, caches, anchors


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_one_pass_for_many_requests_drafts_what_each_would_alone(name):
    model = make_target("qwen3", seed=2)
    drafter = DRAFTERS[name](model)
    target, caches, anchors = contexts(model, drafter, [5, 17, 1, 30])
    counts = [drafter.max_drafts, 2, 1, drafter.max_drafts - 1]
    width = drafter.block_size
    greedy = [SamplingParams()] * 4
    assert isinstance(drafter, BatchDrafter)
    alone = [drafter.propose(target, a, c, width, K, p)
             for a, c, K, p in zip(anchors, caches, counts, greedy)]
    together = propose_all(drafter, target, anchors, caches, width, counts, greedy)
    for one, batched, K in zip(alone, together, counts):
        assert batched.drafts.shape == (K,)
        assert batched.drafts.tolist() == one.drafts.tolist()
        if one.confidence is not None:
            assert np.allclose(batched.confidence, one.confidence, atol=1e-4)


@pytest.mark.parametrize("name", ["dflash", "dspark-vocab", "dflash2"])
def test_sampled_rows_draw_from_the_same_distributions(name):
    """Seeded rows draw the same drafts from the same proposal alone and together."""
    model = make_target("qwen3", seed=2)
    drafter = DRAFTERS[name](model)
    target, caches, anchors = contexts(model, drafter, [9, 3, 21])
    counts = [3, drafter.max_drafts, 2]

    def params():
        return [SamplingParams(1.0, 0.9, 0, RandomStream(s)) for s in (1, 2, 3)]

    alone = [drafter.propose(target, a, c, drafter.block_size, K, p)
             for a, c, K, p in zip(anchors, caches, counts, params())]
    together = propose_all(drafter, target, anchors, caches, drafter.block_size, counts,
                           params())
    for one, batched in zip(alone, together):
        assert batched.drafts.tolist() == one.drafts.tolist()
        if isinstance(one.probs, CandidateProposal):
            assert batched.probs.ids.tolist() == one.probs.ids.tolist()
            assert np.allclose(batched.probs.probs, one.probs.probs, atol=1e-5)
        else:
            assert np.allclose(batched.probs, one.probs, atol=1e-5)
