"""Copy drafts (prompt lookup): the index, and lossless greedy and sampled output."""

import numpy as np
from test_lossless_greedy import reference
from test_lossless_sampling import N_SAMPLES, V, assert_follows, exact_joint, sample_runs
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.lookup import CopyIndex


def test_index_finds_the_latest_earlier_occurrence():
    index = CopyIndex([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5], ngram=3)
    assert index.lookup(4) == []  # the suffix (7, 8, 5) never occurred before
    index.extend([1, 2, 3])
    assert index.lookup(2) == [7, 8]  # the later of the two earlier "1 2 3"
    assert index.lookup(0) == []
    index.extend([7])
    assert index.lookup(9) == [8, 5, 1, 2, 3, 7]  # runs up to the end of what is known


def test_index_prefers_the_longest_window_that_occurred():
    # "5 2" last occurred before 8, but "4 5 2" (a longer match) before 6.
    index = CopyIndex([4, 5, 2, 6, 1, 5, 2, 8, 3, 4, 5, 2], ngram=2, longest=4)
    assert index.lookup(2) == [6, 1] and index.lookup_window(2) == (3, [6, 1])
    assert CopyIndex([4, 5, 2, 6, 1, 5, 2, 8, 3, 4, 5, 2], ngram=2).lookup(2) == [8, 3]
    index.extend([9])  # "2 9" never occurred; no window of 2-4 tokens did
    assert index.lookup(3) == [] and index.lookup_window(3) == (0, [])


def test_greedy_with_copy_drafts_is_lossless():
    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=8)
    tok = make_tokenizer(128)
    rng = np.random.default_rng(0)
    copies = 0
    for length in (3, 12, 50):
        base = rng.integers(3, 128, size=length).tolist()
        prompt = base + base[: length // 2]  # repeats: the lookup has something to find
        want, want_reason = reference(model, prompt, 40)
        got = []
        for r in stream_generate(model, drafter, tok, prompt, max_tokens=40, block_size=8,
                                 copy_drafts=True, copy_ngram=2):
            got += r.tokens
        assert got == want and r.finish_reason == want_reason
        copies += r.stats.copy_cycles
    assert copies > 0


def test_sampling_with_copy_drafts_follows_the_target():
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(0.8, 1.0, 0))
    counts, counts4, _, copies = sample_runs(model, drafter, 7, temperature=0.8, block_size=4,
                                             copy_drafts=True, copy_ngram=1)
    assert_follows(counts, counts4, joint, marginal4)
    assert copies > N_SAMPLES // 2  # most runs verified at least one copied block


def test_lookup_branches_are_the_latest_different_continuations():
    index = CopyIndex([1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 9, 1, 2], ngram=2)
    # "1 2" was followed by 3 4, 5 6, 3 4: the latest first, the repeat once
    assert index.lookup_branches(2) == [[3, 4], [5, 6]]
    assert index.lookup_branches(2)[0] == index.lookup(2)
    assert index.lookup_branches(3, most=1) == [[3, 4, 9]]
    assert index.lookup_branches(0) == []
    assert CopyIndex([1, 2, 3], ngram=2).lookup_branches(4) == []
