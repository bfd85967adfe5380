"""The batch engine with sliding-window and Gated DeltaNet layers: every request's greedy output
equals its own run, with requests joining mid-flight, ragged blocks, every acceptance length
(an oracle drafter, a random one, copy drafts), windows that wrap, and rows that leave as caches
mlx-lm continues from."""

import mlx.core as mx
import numpy as np
import pytest
from test_batch import BatchOracle, check_against_solo, run_engine
from test_lossless_greedy import reference
from tiny import WINDOW, make_drafter, make_family_target, make_tokenizer

from mlx_dflash.batch import BatchEngine, BatchNotSupported
from mlx_dflash.batch_cache import BatchRecurrentCache, RaggedKVCache
from mlx_dflash.target import PER_POSITION, SLIDING, Target

SLIDING_FAMILY, HYBRID_FAMILY = "gemma3_text", "qwen3_next"
FAMILIES = [SLIDING_FAMILY, HYBRID_FAMILY]

RNG = np.random.default_rng(11)
BASES = [RNG.integers(3, 128, size=n).tolist() for n in (1, 9, 20, 5, 14)]
# Repeats in some prompts: copy drafts have something to find.
PROMPTS = [b + b[: len(b) // 2] for b in BASES]
MAX_TOKENS = [20, 6, 24, 1, 16]
_models = {}


def family_model(family):
    if family not in _models:
        _models[family] = make_family_target(family, seed=1)
    return _models[family]


def solo_sequences(model, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    return [p + reference(model, p, n)[0] for p, n in zip(prompts, max_tokens)]


def test_the_windows_wrap():
    assert any(len(p) + n > WINDOW for p, n in zip(PROMPTS, MAX_TOKENS))
    assert SLIDING in Target(family_model(SLIDING_FAMILY)).layer_kinds


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafting", ["plain", "oracle", "exact", "random"])
def test_batch_greedy_equals_each_solo_run(family, drafting):
    """Three at a time, so requests join as others finish; copy drafts are on throughout. The
    oracle accepts every length, the exact one whole blocks, the random drafter next to none."""
    model = family_model(family)
    drafter = {"plain": lambda: None,
               "oracle": lambda: BatchOracle(make_drafter(model, block_size=6),
                                             solo_sequences(model)),
               "exact": lambda: BatchOracle(make_drafter(model, block_size=6),
                                            solo_sequences(model), error_rate=0.0),
               "random": lambda: make_drafter(model, block_size=6)}[drafting]()
    outputs, reasons, accepted = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=3,
                                            block_size=6)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)
    if drafting in ("oracle", "exact"):
        assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_drafts(family):
    """Copied blocks verified beside a random drafter's blocks (copy drafts need a drafter).
    A prompt ending in ``last`` that holds ``last, t`` for every token t: whatever comes
    first, the context's last two tokens occurred before, so a block is copied."""
    model = family_model(family)
    prompts = [[x for t in range(128) for x in (last, t)] + [last] for last in (17, 90)]
    prompts.append(PROMPTS[2])
    max_tokens = [14, 18, 10]
    engine = BatchEngine(model, make_drafter(model, block_size=5), make_tokenizer(128),
                         block_size=5)
    ids = [engine.submit(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    out, reasons, copies = {i: [] for i in ids}, {}, 0
    while not engine.idle:
        for rid, r in engine.step():
            out[rid] += r.tokens
            reasons[rid] = r.finish_reason
            copies = max(copies, r.stats.copy_cycles)
    assert copies > 0
    check_against_solo(model, prompts, [out[i] for i in ids], [reasons[i] for i in ids],
                       max_tokens)


def test_squeezing_every_step_drops_what_left_the_window(monkeypatch):
    squeeze = RaggedKVCache.compact
    monkeypatch.setattr(RaggedKVCache, "compact", lambda self, force=False: squeeze(self, True))
    model = family_model(SLIDING_FAMILY)
    engine = BatchEngine(model, BatchOracle(make_drafter(model, block_size=6),
                                            solo_sequences(model)),
                         make_tokenizer(128), max_batch=3, block_size=6)
    ids = [engine.submit(p, max_tokens=n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    out, reasons = {i: [] for i in ids}, {}
    while not engine.idle:
        for rid, r in engine.step():
            out[rid] += r.tokens
            reasons[rid] = r.finish_reason
        for layer in engine.cache:
            if isinstance(layer, RaggedKVCache) and layer.window is not None:
                assert all(n < WINDOW for n in layer.lengths)  # only what the next pass reads
    check_against_solo(model, PROMPTS, [out[i] for i in ids], [reasons[i] for i in ids],
                       MAX_TOKENS)


def test_per_position_recurrent_rollback():
    """The other rollback of Gated DeltaNet layers: the pass's states after every position."""
    model = family_model(HYBRID_FAMILY)
    target = Target(model, recurrent_rollback=PER_POSITION)
    drafter = BatchOracle(make_drafter(model, block_size=6), solo_sequences(model))
    outputs, reasons, accepted = run_engine(target, drafter, PROMPTS, MAX_TOKENS, max_batch=3,
                                            block_size=6)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)
    assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_leaves_as_a_cache_mlx_lm_continues_from(family):
    """Mid-flight, each row of the batch cache as a single request's caches: mlx-lm's model
    continues from it (a multi-token pass, then one token at a time) as the solo run does."""
    model = family_model(family)
    prompts, max_tokens = PROMPTS[1:3] + PROMPTS[4:], [40, 40, 40]
    sequences = solo_sequences(model, prompts, max_tokens)
    engine = BatchEngine(model, BatchOracle(make_drafter(model, block_size=6), sequences),
                         make_tokenizer(128), block_size=6)
    ids = [engine.submit(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    out = {i: [] for i in ids}
    for _ in range(4):
        for rid, r in engine.step():
            out[rid] += r.tokens
    if isinstance(engine.cache[0], BatchRecurrentCache):
        assert engine.cache[0].rows == len(engine.running)
    checked = 0
    for row, r in enumerate(engine.running):
        want = sequences[ids.index(r.id)][len(r.tokens):]
        got = out[r.id]
        assert got == want[: len(got)]
        if len(want) < len(got) + 6:
            continue  # the solo run stopped early
        cache = engine.cache.row_cache(row)  # holds all but the last token (the anchor)
        logits = model(mx.array([got[-1:] + want[len(got) : len(got) + 2]]), cache=cache)
        assert mx.argmax(logits[0], axis=-1).tolist() == want[len(got) : len(got) + 3]
        for k in range(len(got) + 2, len(got) + 5):
            logits = model(mx.array([[want[k]]]), cache=cache)
            assert mx.argmax(logits[0, -1]).item() == want[k + 1]
        checked += 1
    assert checked


def test_a_layer_kind_it_cannot_hold_is_refused():
    target = Target(family_model(SLIDING_FAMILY))
    target.layer_kinds = ["mamba"] + target.layer_kinds[1:]
    with pytest.raises(BatchNotSupported, match="mamba"):
        BatchEngine(target, None, make_tokenizer(128))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shared_budget_measures_and_plans_these_targets(family):
    """The scheduler's batched pass costs are measured on a batch cache of the target's own
    kinds; requests planned from one budget still equal their solo runs."""
    model = family_model(family)
    outputs, reasons, _ = run_engine(model, make_drafter(model, block_size=6), PROMPTS,
                                     MAX_TOKENS, max_batch=4)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_finished_rows_leave_their_caches_in_the_prefix_store(family):
    """A finished request's row goes to the prefix store holding what it committed (a Gated
    DeltaNet row too: its state is exact between passes); the next turn continues from it and
    equals a fresh run."""
    from mlx_dflash import generate
    from mlx_dflash.batch import batch_generate
    from mlx_dflash.prefix_cache import PrefixCache

    model = family_model(family)
    drafter, tok = make_drafter(model, block_size=6), make_tokenizer(128)
    store = PrefixCache(1 << 30)
    prompts = PROMPTS[1:3]
    first = batch_generate(model, drafter, tok, prompts, max_tokens=10, block_size=6,
                           prefix_cache=store)
    turns = [p + r.tokens + [7, 8, 9] for p, r in zip(prompts, first)]
    for p, r, turn in zip(prompts, first, turns):
        # All but the last token (the anchor); before, only the prompt's checkpoint was there.
        assert store.fetch(turn, take=False)[1] == len(p) + len(r.tokens) - 1
    second = batch_generate(model, drafter, tok, turns, max_tokens=10, block_size=6,
                            prefix_cache=store)
    for turn, r in zip(turns, second):
        assert r.text == generate(model, drafter, tok, turn, max_tokens=10, block_size=6)
