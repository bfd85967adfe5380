"""N-gram drafts from the target's own text: the table, the scheduler's choice, lossless output."""

import numpy as np
import pytest
from test_lossless_greedy import reference
from test_lossless_sampling import N_SAMPLES, V, assert_follows, exact_joint, sample_runs
from test_schedule import COSTS
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import load_drafter, save_drafter, stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.ngram import NgramTable
from mlx_dflash.schedule import Scheduler


def test_table_counts_continuations_and_backs_off():
    seqs = [([9, 1, 2, 3, 4], 1), ([9, 1, 2, 3, 5], 1), ([8, 1, 2, 3, 4], 1)]
    table = NgramTable.build(seqs, max_n=3, min_count=2, min_prob=0.5)
    assert table.entries[(1, 2, 3)] == (4, pytest.approx(2 / 3))
    assert table.entries[(9,)] == (1, 1.0)  # contexts may reach into the prompt ...
    assert (8,) not in table.entries and (8, 1) not in table.entries  # ... once: too rare
    assert (4,) not in NgramTable.build([([1, 4, 1, 4, 1], 5)] * 3).entries  # prompt only
    tokens, probs = table.draft([7, 7, 1], 5)  # (7, 1) unknown: backs off to (1,)
    assert tokens == [2, 3, 4] and probs == [1.0, 1.0, pytest.approx(2 / 3)]
    assert table.draft([7, 7, 7], 5) == ([], [])
    assert table.draft([1], 2) == ([2, 3], [1.0, 1.0])


def test_table_round_trips_and_refuses_bad_files(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 20, size=60).tolist() for _ in range(30)]
    table = NgramTable.build(seqs, max_n=4, min_count=2, min_prob=0.2)
    assert len(table) > 20
    table.save(tmp_path / "t.npz")
    again = NgramTable.load(tmp_path / "t.npz")
    assert again.max_n == 4 and again.entries.keys() == table.entries.keys()
    for ctx, (nxt, p) in table.entries.items():
        assert again.entries[ctx][0] == nxt and abs(again.entries[ctx][1] - p) < 1e-3
    with pytest.raises(ValueError, match="the target.s vocabulary has 10"):
        again.check_vocab(10, "here")
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    with pytest.raises(ValueError, match="cannot be read"):
        NgramTable.load(tmp_path / "bad.npz")


def test_scheduler_verifies_a_lookup_only_when_it_pays():
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40)
    s.accept_rate[:] = 0.2  # the drafter is poor here
    assert s.lookup_length([0.95] * 5, 7, 100) == 5
    assert s.lookup_length([0.95, 0.95, 0.01, 0.9], 7, 100) == 2  # later steps unlikely
    assert s.lookup_length([0.95] * 5, 3, 100) == 3  # never past the room left
    s.accept_rate[:] = 0.95  # a drafter this good beats an uncertain lookup
    assert s.lookup_length([0.3, 0.3], 7, 100) == 0
    s.accept_rate[:] = 0.8  # a short sure lookup loses to the drafter's full-length cycle
    assert s.lookup_length([0.99], 7, 100) == 0
    s.headroom = lambda: 100  # no memory: nothing
    assert s.lookup_length([0.99] * 5, 7, 100) == 0


def with_table(drafter, sequences, **kw):
    drafter.ngram = NgramTable.build(sequences, **kw)
    return drafter


@pytest.mark.parametrize("block_size", [None, 4])  # the scheduler's choice, a fixed block
def test_greedy_with_ngram_drafts_is_lossless(block_size):
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    rng = np.random.default_rng(1)
    ngram_cycles = 0
    for length in (3, 20):
        prompt = rng.integers(3, 128, size=length).tolist()
        want, reason = reference(model, prompt, 40)
        # A table that knows this very text (drafts that hit), mixed with noise (that miss).
        noise = [rng.integers(3, 128, size=40).tolist() for _ in range(3)]
        drafter = with_table(make_drafter(model, block_size=8), [(prompt + want, length)] * 2
                             + [(n, 0) for n in noise] * 2, max_n=3, min_count=2, min_prob=0.2)
        got = []
        for r in stream_generate(model, drafter, tok, prompt, max_tokens=40,
                                 block_size=block_size, copy_ngram=8):
            got += r.tokens
        assert got == want and r.finish_reason == reason
        ngram_cycles += r.stats.ngram_cycles
        assert r.stats.ngram_cycles <= r.stats.copy_cycles
    assert ngram_cycles > 0


def test_sampling_with_ngram_drafts_follows_the_target():
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    rng = np.random.default_rng(3)
    with_table(drafter, [rng.integers(0, V, size=50).tolist() for _ in range(20)], max_n=2,
               min_count=2, min_prob=0.1)
    joint, marginal4 = exact_joint(model, SamplingParams(0.8, 1.0, 0))
    counts, counts4, _, lookups = sample_runs(model, drafter, 11, temperature=0.8,
                                              block_size=4, copy_ngram=8)
    assert_follows(counts, counts4, joint, marginal4)
    assert lookups > N_SAMPLES // 2  # most runs verified at least one n-gram block


def test_drafters_carry_their_table(tmp_path):
    model = make_target("qwen3")
    drafter = with_table(make_drafter(model), [list(range(5, 40))] * 2, max_n=2, min_count=2)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", model=model)
    assert loaded.ngram.entries.keys() == drafter.ngram.entries.keys()
    assert load_drafter(save_drafter(make_drafter(model), tmp_path / "e")).ngram is None
    NgramTable.build([[1, 500, 1, 500]], max_n=1, min_count=1).save(tmp_path / "d" / "ngram.npz")
    with pytest.raises(ValueError, match="token id 500"):
        load_drafter(tmp_path / "d")
