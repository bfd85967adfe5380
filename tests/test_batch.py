"""Continuous batching: every request's output equals its own run, with requests joining and
leaving mid-flight, ragged blocks (K = 0 included), each drafter family and copy drafts."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from test_dflash2 import make_dflash2
from test_dspark import make_dspark
from test_lossless_greedy import assert_same_or_near_tie, reference
from test_lossless_sampling import PROMPT, V, assert_follows, exact_joint
from test_schedule import COSTS
from tiny import make_drafter, make_target, make_tokenizer

import mlx_dflash.policy as policy
from mlx_dflash import generate
from mlx_dflash.accept import SamplingParams, proposal_from_logits
from mlx_dflash.batch import BatchEngine, batch_generate
from mlx_dflash.drafters.base import Proposal

RNG = np.random.default_rng(3)
BASES = [RNG.integers(3, 128, size=n).tolist() for n in (1, 6, 40, 13, 3, 70, 9)]
# Repeats in some prompts: copy drafts have something to find.
PROMPTS = [b + b[: len(b) // 2] for b in BASES]
MAX_TOKENS = [24, 7, 30, 1, 18, 26, 12]


class BatchOracle:
    """Drafts each request's true continuation, corrupted at random: every acceptance length
    occurs. It tells requests apart by their context caches (made in admission order)."""

    fixed_width = False
    vocab_ids = None
    ngram = None
    source_path = None

    def __init__(self, drafter, sequences, error_rate=0.3, seed=0):
        self.inner, self.args = drafter, drafter.args
        self.block_size, self.max_drafts = drafter.block_size, drafter.max_drafts
        self.target_layer_ids = drafter.target_layer_ids
        self.sequences, self.by_cache = list(sequences), {}
        self.error_rate, self.rng = error_rate, np.random.default_rng(seed)

    def make_cache(self):
        cache = self.inner.make_cache()
        self.by_cache[id(cache[0])] = self.sequences.pop(0)
        return cache

    def commit(self, features, cache, tokens=None):
        self.inner.commit(features, cache, tokens)

    def pass_key(self):
        return ("oracle",)

    def propose(self, target, anchor, cache, width, num_drafts, params):
        full = self.by_cache[id(cache[0])]
        pos = cache[0].offset
        want = list(full[pos + 1 : pos + 1 + num_drafts]) + [0] * num_drafts
        want = [(t + 1 + int(self.rng.integers(127))) % 128
                if self.rng.random() < self.error_rate else t for t in want[:num_drafts]]
        logits = mx.zeros((num_drafts, 128))
        logits[mx.arange(num_drafts), mx.array(want)] = 100.0
        return Proposal(*proposal_from_logits(logits, params, None, target.vocab_size))


def batch_costs(growth: float):
    """COSTS for one row; ``growth``: each more row costs that much more of a row's pass."""
    from mlx_dflash.schedule import BATCH_ROWS, BatchCosts

    ratio = {r: [1.0 + growth * (r - 1)] * len(COSTS.sizes) for r in BATCH_ROWS}
    return BatchCosts(COSTS, ratio, COSTS.sizes)


def run_engine(model, drafter, prompts, max_tokens, cancel_after=None, **options):
    engine = BatchEngine(model, drafter, make_tokenizer(128), **options)
    ids = [engine.submit(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    out = {i: [] for i in ids}
    reasons, steps, accepted = {}, 0, 0
    while not engine.idle:
        for rid, r in engine.step():
            out[rid] += r.tokens
            accepted += r.accepted
            if r.finish_reason:
                reasons[rid] = r.finish_reason
        steps += 1
        if cancel_after is not None and steps == cancel_after[1]:
            engine.cancel(ids[cancel_after[0]])
    return [out[i] for i in ids], [reasons.get(i) for i in ids], accepted


def check_against_solo(model, prompts, outputs, reasons, max_tokens, skip=()):
    for i, (prompt, got, reason, n) in enumerate(zip(prompts, outputs, reasons, max_tokens)):
        if i in skip:
            continue
        want, want_reason = reference(model, prompt, n)
        assert_same_or_near_tie(model, prompt, got, want)
        assert reason == want_reason


@pytest.mark.parametrize("family", ["plain", "dflash", "dspark", "dflash2", "oracle"])
def test_batch_greedy_equals_each_solo_run(family):
    model = make_target("qwen3", seed=2)
    drafter = {"plain": lambda: None,
               "dflash": lambda: make_drafter(model, block_size=6),
               "dspark": lambda: make_dspark(model),
               "dflash2": lambda: make_dflash2(model, block_size=6),
               "oracle": lambda: BatchOracle(make_drafter(model, block_size=6), [
                   p + reference(model, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]),
               }[family]()
    # Three at a time: requests join as others finish, mid-flight.
    outputs, reasons, accepted = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=3,
                                            block_size=6)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)
    if family in ("oracle", "dflash"):
        assert accepted > 0


def test_batch_with_the_scheduler_and_a_cancelled_request(monkeypatch):
    import mlx_dflash.batch as batch

    monkeypatch.setattr(policy, "cached_costs", lambda *a: COSTS)
    monkeypatch.setattr(batch, "cached_batch_costs", lambda *a: batch_costs(1.0))
    monkeypatch.setattr("mlx_dflash.schedule.memory_headroom", lambda: 1 << 40)
    model = make_target("qwen3", seed=2)
    sequences = [p + reference(model, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
    drafter = BatchOracle(make_drafter(model, block_size=8), sequences, error_rate=0.4)
    outputs, reasons, _ = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=4,
                                     cancel_after=(2, 3))
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS, skip=(2,))
    want, _ = reference(model, PROMPTS[2], MAX_TOKENS[2])
    assert reasons[2] is None and outputs[2] == want[: len(outputs[2])] and outputs[2] != want


def test_batch_text_matches_generate():
    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(128)
    results = batch_generate(model, drafter, tok, PROMPTS[:4], max_tokens=16, block_size=4)
    for prompt, result in zip(PROMPTS[:4], results):
        assert result.text == generate(model, drafter, tok, prompt, max_tokens=16, block_size=4)
        assert result.stats.generation_tokens == len(result.tokens) + (
            result.finish_reason == "stop")


def test_sampled_rows_follow_the_target_inside_a_batch():
    """Sampled requests beside greedy ones: each row's first four tokens follow the target's
    exact joint distribution (chi-square, as in test_lossless_sampling)."""
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    params = SamplingParams(1.0, 0.9, 0)
    joint, marginal4 = exact_joint(model, params)
    counts, counts4, accepted = batch_samples(model, drafter, 11, block_size=4)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def batch_samples(model, drafter, seed, **engine_options):
    """2000 sampled requests (temperature 1, top-p 0.9) of 4 tokens after PROMPT, 7 at a time
    beside a greedy one in the same passes: counts of the first three tokens, of the fourth,
    and drafts accepted."""
    tok = make_tokenizer(V, eos_id=V)
    mx.random.seed(seed)
    counts, counts4 = np.zeros((V, V, V)), np.zeros(V)
    engine = BatchEngine(model, drafter, tok, max_batch=8, **engine_options)
    samples, accepted = 0, 0
    while samples < 2000:
        ids = [engine.submit(PROMPT, max_tokens=4, temperature=1.0, top_p=0.9)
               for _ in range(7)]
        engine.submit([5, 6], max_tokens=6)  # a greedy row in the same passes
        out = {i: [] for i in ids}
        while not engine.idle:
            for rid, r in engine.step():
                if rid in out:
                    out[rid] += r.tokens
                    accepted += r.accepted
        for tokens in out.values():
            counts[tokens[0], tokens[1], tokens[2]] += 1
            counts4[tokens[3]] += 1
        samples += len(ids)
    return counts, counts4, accepted


def test_bad_requests_are_refused():
    model = make_target("qwen3")
    engine = BatchEngine(model, None, make_tokenizer(128))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit([5], max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], max_tokens=4)
    with pytest.raises(ValueError, match="max_batch"):
        BatchEngine(model, None, make_tokenizer(128), max_batch=0)


def test_squeezing_out_the_holes_every_step_stays_exact(monkeypatch):
    from mlx_dflash.batch_cache import RaggedKVCache

    squeeze = RaggedKVCache.compact
    monkeypatch.setattr(RaggedKVCache, "compact", lambda self, force=False: squeeze(self, True))
    model = make_target("qwen3", seed=2)
    sequences = [p + reference(model, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
    drafter = BatchOracle(make_drafter(model, block_size=6), sequences)
    outputs, reasons, _ = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=3,
                                     block_size=6)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)


def test_requests_queue_for_memory_instead_of_failing(monkeypatch):
    """Long requests under a small memory budget: they wait their turn, all complete, and no
    more run at once than the budget holds."""
    import mlx_dflash.batch as batch

    model = make_target("qwen3", seed=2)
    prompts = [RNG.integers(3, 128, size=40).tolist() for _ in range(6)]  # all one length
    max_tokens = [30] * 6
    engine = BatchEngine(model, make_drafter(model, block_size=6), make_tokenizer(128),
                         max_batch=8, block_size=6, reserve_bytes=0)
    longest = max(len(p) for p in prompts) + 30 + 6
    budget = int(2.5 * 2 * engine.position_bytes * longest)  # two rows at most
    monkeypatch.setattr(batch, "memory_headroom",
                        lambda: budget - sum(layer.nbytes for layer in engine.cache))
    ids = [engine.submit(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    out, reasons, most = {i: [] for i in ids}, {}, 0
    while not engine.idle:
        for rid, r in engine.step():
            out[rid] += r.tokens
            reasons[rid] = r.finish_reason
        most = max(most, len(engine.running))
    assert most == 2
    check_against_solo(model, prompts, [out[i] for i in ids], [reasons[i] for i in ids],
                       max_tokens)


def test_one_budget_with_one_request_chooses_what_the_scheduler_chooses():
    from mlx_dflash.schedule import Scheduler, plan_batch

    rng = np.random.default_rng(0)
    for _ in range(200):
        one, alone = (Scheduler(COSTS, 7, 1 << 20, headroom=lambda: 1 << 40) for _ in range(2))
        confidence = rng.uniform(0, 1, size=7) ** rng.uniform(0.2, 3)
        for s in (one, alone):
            s.observe(0, 0, confidence.tolist())
        room, context = int(rng.integers(0, 9)), int(rng.integers(10, 2000))
        assert plan_batch([one], [room], [None], context, batch_costs(1.0)) == [
            alone.choose(room, context)]


def test_a_busy_batch_cuts_the_unlikely_tails():
    """Passes whose cost grows with every token of every row: the budget verifies fewer drafts
    per request than when a pass costs what one row's does (then at least as many as alone)."""
    from mlx_dflash.schedule import Scheduler, plan_batch

    def schedulers(n):
        out = []
        for _ in range(n):
            s = Scheduler(COSTS, 7, 1 << 20, headroom=lambda: 1 << 40)
            s.observe(0, 0, [0.9, 0.7, 0.5, 0.35, 0.25, 0.2, 0.15])
            out.append(s)
        return out

    from mlx_dflash.schedule import BATCH_ROWS, BatchCosts

    def tokens_cost(r, w):  # a fixed part (the weights, read once) and a part per token
        return 0.010 + 0.0005 * r * w

    cheap_drafter = replace(COSTS, draft_s=0.0002)  # a batched drafter pass, nearly free
    busy_costs = BatchCosts(cheap_drafter, {r: [tokens_cost(r, w) / tokens_cost(1, w)
                                                for w in COSTS.sizes] for r in BATCH_ROWS},
                            COSTS.sizes)
    alone = plan_batch(schedulers(1), [7], [None], 300, busy_costs)[0]
    free = plan_batch(schedulers(8), [7] * 8, [None] * 8, 300,
                      BatchCosts(cheap_drafter, batch_costs(0.0).ratio, COSTS.sizes))
    busy = plan_batch(schedulers(8), [7] * 8, [None] * 8, 300, busy_costs)
    assert 0 < alone <= min(free)
    assert 0 < max(busy) < min(free)


def test_batched_pass_costs_are_measured_and_cached():
    from mlx_dflash.schedule import BATCH_ROWS, cached_batch_costs
    from mlx_dflash.target import Target

    model = make_target("qwen3")
    target, drafter = Target(model), make_drafter(model, block_size=4)
    costs = cached_batch_costs(target, drafter, 4)
    assert set(costs.ratio) == set(BATCH_ROWS) and costs.ratio[1] == [1.0] * len(costs.sizes)
    assert all(v > 0 for r in BATCH_ROWS for v in costs.ratio[r])
    assert costs.verify(1, 3, 200) == costs.single.verify(3, 200)
    assert costs.verify(16, 3, 200) > costs.verify(8, 3, 200) > 0
    assert costs.draft_ratio[1] == 1.0 and costs.draft(1) == costs.single.draft_s
    assert costs.draft(8) > 0 and costs.draft(0) == 0
    again = cached_batch_costs(target, drafter, 4)  # from the cache
    assert again.ratio == costs.ratio and again.draft_ratio == costs.draft_ratio


def test_the_budget_weighs_looked_up_blocks_by_how_often_they_survive():
    """A busy batch: a copy block that usually survives is verified whole, one that rarely does
    is cut back; nothing is drafted for the lookups (they cost no drafter pass)."""
    from mlx_dflash.schedule import BATCH_ROWS, BatchCosts, Scheduler, plan_batch

    def tokens_cost(r, w):
        return 0.010 + 0.0005 * r * w

    costs = BatchCosts(COSTS, {r: [tokens_cost(r, w) / tokens_cost(1, w) for w in COSTS.sizes]
                               for r in BATCH_ROWS}, COSTS.sizes)

    def scheduler():
        s = Scheduler(COSTS, 7, 1 << 20, headroom=lambda: 1 << 40)
        s.observe(0, 0, [0.3] * 7)  # the drafter: rarely right
        return s

    def blocks(step):  # 8 looked-up blocks of 6 tokens, each step surviving with ``step``
        return [np.cumprod([step] * 6)] * 8

    sure = plan_batch([scheduler() for _ in range(8)], [7] * 8, blocks(0.95), 300, costs)
    unsure = plan_batch([scheduler() for _ in range(8)], [7] * 8, blocks(0.2), 300, costs)
    assert sure == [6] * 8 and max(unsure) < 6


def test_the_budget_plans_tree_drafts_as_well_as_any_subtree():
    """plan_nodes takes each request's candidate nodes by the chance that each survives (its
    path accepted), parents first, in falling order: random trees, as tree drafts will bring
    them, are planned as well as the best choice over every subtree of every request and every
    set of drafting requests (brute force)."""
    from itertools import combinations, product

    from mlx_dflash.schedule import BATCH_ROWS, BatchCosts, plan_nodes

    def tokens_cost(r, w):
        return 0.010 + 0.0005 * r * w

    costs = BatchCosts(COSTS, {r: [tokens_cost(r, w) / tokens_cost(1, w) for w in COSTS.sizes]
                               for r in BATCH_ROWS}, COSTS.sizes)
    rng = np.random.default_rng(4)

    def random_tree():
        """Parents and path survival; siblings are exclusive (their shares sum below 1)."""
        n = int(rng.integers(1, 6))
        parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        share = np.zeros(n)
        for p in set(parent):
            kids = [i for i in range(n) if parent[i] == p]
            share[kids] = rng.dirichlet(np.ones(len(kids) + 1))[:-1] * rng.uniform(0.3, 1)
        path = np.array([share[i] for i in range(n)])
        for i in range(n):
            if parent[i] >= 0:
                path[i] *= path[parent[i]]
        return parent, path

    def subtrees(parent):
        n = len(parent)
        for k in range(n + 1):
            for chosen in combinations(range(n), k):
                if all(parent[i] < 0 or parent[i] in chosen for i in chosen):
                    yield chosen

    def rate(rows, widths, gain, drafting):
        return (rows + gain) / (costs.verify(rows, 1 + max(widths), 300) + costs.draft(drafting))

    for _ in range(25):
        trees = [random_tree() for _ in range(2)]
        ordered = [np.sort(path)[::-1] for _, path in trees]  # parents first: P(child) <= P(parent)
        counts = plan_nodes(ordered, [False, False], 300, costs)
        planned = rate(2, counts, sum(o[:k].sum() for o, k in zip(ordered, counts)),
                       sum(k > 0 for k in counts))
        best = max(rate(2, [len(s) for s in choice],
                        sum(path[list(s)].sum() for (_, path), s in zip(trees, choice)),
                        sum(len(s) > 0 for s in choice))
                   for choice in product(*(list(subtrees(p)) for p, _ in trees)))
        assert planned >= best - 1e-12
