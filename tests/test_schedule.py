"""The block scheduler: its choices, and lossless output on every path it takes."""

import mlx.core as mx
import numpy as np
import pytest
from test_lossless_greedy import OracleDrafter, reference
from test_lossless_sampling import N_SAMPLES, PROMPT, V, chi_square, exact_joint
from tiny import make_drafter, make_target, make_tokenizer

import mlx_dflash.policy as policy
from mlx_dflash import stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.schedule import CONTEXTS, PassCosts, Scheduler, measure_costs

# Verify grows mildly with the block; drafting costs a fifth of a decode.
COSTS = PassCosts({c: [0.010 * (1 + 0.05 * n) for n in range(1, 17)] for c in (128, 1024)},
                  draft_s=0.002, sizes=tuple(range(1, 17)))


def test_choices_follow_acceptance_cost_and_memory():
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40, probe_every=3)
    s.accept_rate[:] = 0.9
    assert s.choose(7, 100) == 7  # drafts nearly always survive: verify them all
    s.accept_rate[:] = 0.0
    assert [s.choose(7, 100) for _ in range(3)] == [0, 0, 7]  # plain, plain, then a probe
    s.accept_rate[:] = [0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert s.choose(7, 100) == 2  # only the first two are worth their verify cost
    s.observe(2, 0)
    assert s.accept_rate[0] < 0.9 and s.accept_rate[1] == 0.9  # position 2 never reached
    s.accept_rate[:] = 0.9
    s.headroom = lambda: (256 << 20) + 4 * (1 << 20)  # room for 4 more tokens: 3 drafts
    assert s.choose(7, 100) == 3
    s.headroom = lambda: 100
    assert s.choose(7, 100) == 0  # no room at all: the anchor alone, never an error
    s.confidence = np.array([0.99, 0.99, 0.05, 0.05, 0.05, 0.05, 0.05])
    s.headroom = lambda: 1 << 40
    assert s.choose(7, 100) == 2  # a drafter's calibrated confidence takes precedence


def test_confidence_this_request_does_not_bear_out_is_discounted():
    """A drafter sure of its drafts (0.95 each) whose first draft this request keeps rejecting:
    after a few such cycles the scheduler stops drafting; where they are borne out it keeps
    verifying them all."""
    confident = [0.95] * 7
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40, probe_every=100)
    s.observe(7, 0, confident)
    assert s.choose(7, 100) == 7  # one failure: the drafter's word still counts for more
    for _ in range(20):
        s.observe(7, 0, confident)  # rejected at once, cycle after cycle
    assert s.choose(7, 100) == 0
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40)
    for _ in range(20):
        s.observe(7, 7, confident)  # all survive
    assert s.choose(7, 100) == 7


def test_measured_costs_have_one_entry_per_block():
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    from mlx_dflash.target import Target

    costs = measure_costs(Target(model), drafter, 4, reps=1)
    assert set(costs.verify_s) == set(CONTEXTS) and costs.sizes == (1, 2, 3, 4)
    assert len(costs.verify_s[128]) == 4 and len(costs.draft_by_context) == len(CONTEXTS)
    assert costs.draft_s > 0 and costs.verify(2, 500) > 0 and costs.draft(1, 9000) > 0


def test_long_contexts_are_timed_when_a_request_reaches_them(tmp_path, monkeypatch):
    """Short requests time 128 and 1024 tokens of context only; one that reaches 3000 times
    4096 too (and the file keeps it for all); what is read is what was asked for."""
    from mlx_dflash import schedule
    from mlx_dflash.schedule import contexts_for
    from mlx_dflash.target import Target

    assert contexts_for(0) == (128, 1024) and contexts_for(1024) == (128, 1024)
    assert contexts_for(3000) == (128, 1024, 4096) and contexts_for(10**6) == CONTEXTS
    # a file of its own: the session's cost files may hold this tiny pair's already
    monkeypatch.setattr(schedule, "_cache_file", lambda *a: tmp_path / "costs.json")
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    target = Target(model)
    timed = []
    measure = schedule.measure_costs
    monkeypatch.setattr(schedule, "measure_costs",
                        lambda *a, **k: timed.append(k["contexts"]) or measure(*a, **k))
    assert schedule.cached_costs(target, drafter, 4).contexts == (128, 1024)
    assert schedule.cached_costs(target, drafter, 4, reach=3000).contexts == (128, 1024, 4096)
    assert schedule.cached_costs(target, drafter, 4).contexts == (128, 1024)  # read, cut
    assert schedule.cached_costs(target, drafter, 4, reach=2000).contexts == (128, 1024, 4096)
    assert timed == [(128, 1024), (128, 1024, 4096)]


def test_a_snapshot_times_long_contexts_without_prefilling_them():
    """The snapshot prefills PREFILLED tokens and repeats their K/V: the caches it times hold
    the whole context (so the passes cost what they would there)."""
    from mlx_dflash.schedule import PREFILLED, stretch
    from mlx_dflash.target import Target

    model = make_target("qwen3")
    target = Target(model)
    cache = target.make_cache()
    target.hidden_states(mx.zeros((1, PREFILLED), dtype=mx.uint32), cache, ())
    for c in cache:
        stretch(c, 5000)
    assert {c.offset for c in cache} == {5000} and cache[0].keys.shape[2] == 5000
    out = target.forward(mx.ones((1, 3), dtype=mx.uint32), cache, ())
    assert cache[0].offset == 5003 and mx.all(mx.isfinite(out[0] if isinstance(out, tuple)
                                                           else out)).item()


def test_costs_follow_the_context():
    """Between measured contexts the costs are interpolated, beyond the last they go on along
    its slope (never down); a batch pays what the context adds once per row."""
    from mlx_dflash.schedule import BatchCosts

    costs = PassCosts({128: [1.0, 2.0], 1024: [2.0, 4.0], 4096: [4.0, 10.0]}, 0.5,
                      sizes=(1, 8), draft_by_context=[0.5, 0.6, 1.0])
    assert costs.contexts == (128, 1024, 4096)
    assert costs.verify(1, 10) == 1.0 and costs.verify(8, 1024) == 4.0
    assert costs.verify(8, 2560) == 7.0 and costs.verify(8, 7168) == 16.0  # extended
    assert costs.draft(1, 4096) == 1.0 and costs.draft(1, 0) == 0.5
    falling = PassCosts({128: [1.0], 1024: [3.0], 4096: [2.0]}, 0.5, sizes=(1,))
    assert falling.verify(1, 100_000) == 2.0
    batch = BatchCosts(costs, {r: [r * 0.5, r * 0.5] for r in (1, 2, 4, 8)}, (1, 8),
                       draft_ratio={1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0})
    assert batch.verify(4, 8, 4096) == 2.0 * 2.0 + 4 * 8.0  # rows pay their attention each
    assert batch.draft(4, 4096) == 0.5 * 2.0 + 4 * 0.5


def test_the_best_block_shrinks_as_the_context_grows():
    """Costs where a wide pass's attention grows with the context (as on a CPU): long blocks
    at 1k, shorter ones at 16k, plain decoding at 256k where no block pays."""
    sizes = tuple(range(1, 9))
    verify = {c: [0.05 + 0.003 * n + n * 3e-6 * c for n in sizes] for c in (128, 1024, 16384)}
    costs = PassCosts(verify, 0.01, sizes=sizes)
    s = Scheduler(costs, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40, probe_every=1000)
    s.accept_rate[:] = 0.9
    short, long, longest = s.choose(7, 1024), s.choose(7, 16384), s.choose(7, 262144)
    assert short == 7 and 0 < long < short and longest == 0


def test_a_costs_file_with_a_zero_time_is_measured_anew(tmp_path, monkeypatch):
    """A file whose times include 0 (a broken measurement) would divide by zero: it is timed
    again and rewritten."""
    import json

    from mlx_dflash import schedule
    from mlx_dflash.target import Target

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    target = Target(model)
    path = schedule._cache_file(target, drafter, 4)
    good = schedule.cached_costs(target, drafter, 4)
    data = json.loads(path.read_text())
    data["verify_s"]["128"][0] = 0.0
    path.write_text(json.dumps(data))
    again = schedule.cached_costs(target, drafter, 4)
    assert min(again.verify_s[128]) > 0 and good.sizes == again.sizes
    assert json.loads(path.read_text())["verify_s"]["128"][0] > 0


@pytest.fixture
def forced(monkeypatch):
    """Auto mode with fixed costs and a settable memory headroom."""
    room = {"bytes": 1 << 40}
    monkeypatch.setattr(policy, "cached_costs", lambda *a: COSTS)
    monkeypatch.setattr("mlx_dflash.schedule.memory_headroom", lambda: room["bytes"])
    return room


def run(model, drafter, prompt, n, eos_id=1, **kw):
    tokens, last = [], None
    tok = make_tokenizer(model.args.vocab_size, eos_id=eos_id)
    for last in stream_generate(model, drafter, tok, prompt, max_tokens=n, copy_drafts=False,
                                **kw):
        tokens += last.tokens
    return tokens, last.stats


def test_greedy_auto_is_lossless_when_drafts_pay_and_when_they_do_not(forced):
    model = make_target("qwen3", tied=False)
    drafter = make_drafter(model, block_size=8)
    prompt = [5, 6, 7, 8]
    want, _ = reference(model, prompt, 60)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, 128, 0.05)
    got, stats = run(model, oracle, prompt, 60)
    assert got == want and max(stats.draft_lengths) >= 5  # good drafts: blocks grow
    got, stats = run(model, drafter, prompt, 60)  # a random drafter: falls back, probes
    assert got == want
    assert 0 in stats.draft_lengths and max(stats.draft_lengths) > 0


def test_low_memory_shrinks_the_block_and_the_run_completes(forced):
    model = make_target("qwen3", tied=False)
    drafter = make_drafter(model, block_size=8)
    prompt = [5, 6, 7, 8]
    want, _ = reference(model, prompt, 40)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, 128, 0.0)
    from mlx_dflash.schedule import bytes_per_verified_token
    from mlx_dflash.target import Target

    per_token = bytes_per_verified_token(Target(model))
    forced["bytes"] = (256 << 20) + 3 * per_token  # room for the anchor + 2 drafts
    got, stats = run(model, oracle, prompt, 40)
    assert got == want and max(stats.draft_lengths) == 2


def test_sampled_output_is_exact_whatever_block_the_scheduler_picks(monkeypatch, forced):
    rng = np.random.default_rng(3)
    monkeypatch.setattr(Scheduler, "choose",
                        lambda self, room, context: int(rng.integers(0, room + 1)))
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, _ = exact_joint(model, SamplingParams(1.0))
    mx.random.seed(5)
    counts, lengths = np.zeros((V, V, V)), set()
    for _ in range(N_SAMPLES):
        out, stats = run(model, drafter, PROMPT, 4, eos_id=V, temperature=1.0)
        counts[out[0], out[1], out[2]] += 1
        lengths.update(stats.draft_lengths)
    stat, dof = chi_square(counts.ravel(), joint.ravel())
    assert stat < dof + 5 * np.sqrt(2 * dof), f"joint chi2 {stat:.1f} with {dof} dof"
    assert lengths == {0, 1, 2}  # every block the room allows, plain decoding included


def test_drafter_context_stays_aligned_across_plain_cycles(monkeypatch, forced):
    """Plain cycles are pipelined and feed the drafter lazily; a drafting cycle after them
    must see every committed position (the oracle drafts by its context offset)."""
    pattern = iter([0, 0, 3, 0, 2, 0, 0, 0, 4] * 20)
    monkeypatch.setattr(Scheduler, "choose", lambda self, room, context: min(room, next(pattern)))
    model = make_target("qwen3", tied=False)
    drafter = make_drafter(model, block_size=8)
    prompt = [5, 6, 7, 8]
    want, _ = reference(model, prompt, 50)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, 128, 0.0)
    got, stats = run(model, oracle, prompt, 50)
    assert got == want and 0 in stats.draft_lengths
    drafted = [(k, a) for k, a in zip(stats.draft_lengths, stats.acceptance_lengths) if k]
    assert drafted and all(a == k + 1 for k, a in drafted)  # perfect drafts all accepted


def test_failed_probes_back_off_and_a_paying_one_resets():
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40, probe_every=2)
    s.observe(7, 0), s.observe(7, 0)  # two failures at position 1 stop drafting
    assert s.accept_rate[0] < 0.2
    assert s.choose(7, 100) == 0
    gaps = []
    for _ in range(4):
        k = 0
        while k == 0:
            k = s.choose(7, 100)
            s.observe(0, 0)  # a plain cycle observed after the probe was chosen (pipelining)
        gaps.append(s.probe_gap)
        s.observe(k, 0)  # the probe fails
    assert gaps == [2, 4, 8, 16] and s.probe_gap == 16  # capped at 8x
    k = 0
    while k == 0:
        k = s.choose(7, 100)
    s.observe(k, 3)
    assert s.probe_gap == 2
