"""Reduced draft vocabulary: the head is a subset of the target's rows; output stays lossless."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_lossless_greedy import reference, speculative
from test_lossless_sampling import V, assert_follows, exact_joint, sample_runs
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import load_drafter, save_drafter
from mlx_dflash.accept import SamplingParams
from mlx_dflash.drafters import DrafterMismatchError, check_fits
from mlx_dflash.target import Target


def subset_drafter(model, ids, **kw):
    drafter = make_drafter(model, **kw)
    drafter.set_draft_vocab(mx.array(ids))
    return drafter


@pytest.mark.parametrize("quantized", [False, True])
def test_greedy_with_reduced_vocab_is_lossless(quantized):
    model = make_target("qwen3", tied=not quantized)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    ids = np.random.default_rng(0).permutation(128)[:40].tolist()
    drafter = subset_drafter(model, ids, block_size=8, layer_ids=(0, 2))
    target = Target(model)
    # The head is the target's rows for those ids; drafts come out as target ids.
    h = mx.random.normal((3, 64))
    assert mx.allclose(drafter.head(target, h), target.lm_head(h)[:, mx.array(ids)], atol=1e-4)
    cache = drafter.make_cache()
    _, feats = target.hidden_states(mx.array([[5, 6, 7]]), None, drafter.target_layer_ids)
    drafter.commit(feats, cache)
    proposal = drafter.propose(target, mx.array([7], dtype=mx.uint32), cache, 8, 7,
                               SamplingParams())
    drafts = proposal.drafts
    assert proposal.probs is None and set(drafts.tolist()) <= set(ids)
    tok = make_tokenizer(128)
    for prompt in ([4], [9, 10, 11, 12, 13], list(range(3, 60))):
        want, _ = reference(model, prompt, 24)
        got, _, _ = speculative(model, drafter, tok, prompt, 24, 8)
        assert got == want


def test_sampling_with_a_subset_that_lacks_the_favourite_token():
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    params = SamplingParams(1.0, 1.0, 0)
    joint, marginal4 = exact_joint(model, params)
    favourite = int(np.argmax(joint.sum(axis=(1, 2))))
    ids = [i for i in range(V) if i != favourite]
    drafter = subset_drafter(model, ids, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    counts, counts4, accepted, _ = sample_runs(model, drafter, 99, temperature=1.0,
                                               block_size=4)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0 and counts[favourite].sum() > 0  # reached only through the residual


def test_draft_vocab_round_trips_and_is_checked(tmp_path):
    model = make_target("qwen3")
    drafter = subset_drafter(model, [5, 9, 3, 100], block_size=4)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", model=model)
    assert loaded.vocab_ids.tolist() == [5, 9, 3, 100] and loaded.args.draft_vocab_size == 4
    assert "draft_vocab" not in dict(_flat(loaded.trainable_parameters()))
    bad = subset_drafter(model, [5, 9, 300], block_size=4)
    with pytest.raises(DrafterMismatchError, match="draft_vocab holds ids up to 300"):
        check_fits(bad, model)


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
