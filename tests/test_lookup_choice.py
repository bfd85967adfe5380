"""Scheduler.lookup_length: a looked-up block (a copy, an n-gram continuation) against the
drafter's block, each at its own best length, by expected committed tokens per second."""

import numpy as np
from test_schedule import COSTS

from mlx_dflash.schedule import Scheduler


def rate(survival, seconds):
    return (1.0 + float(np.sum(survival))) / seconds


def expected_choice(s, probs, room, context):
    """What the comparison should choose, written out: the drafter's best block over every
    length it may verify (plain decoding included) against the lookup's best prefix."""
    limit = min(s.max_drafts, room, s.memory_cap())
    a = s.survival()
    drafter = max([1.0 / COSTS.verify(1, context)]
                  + [rate(a[:k], COSTS.draft_s + COSTS.verify(k + 1, context))
                     for k in range(1, limit + 1)])
    b = np.cumprod(probs)
    lookup = {n: rate(b[:n], COSTS.verify(n + 1, context))
              for n in range(1, min(len(probs), limit) + 1)}
    best = max(lookup, key=lookup.get, default=0)
    return best if best and lookup[best] > drafter else 0


def scheduler(confidence=None, accept=None, headroom=1 << 40):
    s = Scheduler(COSTS, 7, token_bytes=1 << 20, headroom=lambda: headroom)
    if confidence is not None:
        s.observe(0, 0, list(confidence))
    if accept is not None:
        s.accept_rate[:] = accept
    return s


def test_a_short_sure_lookup_loses_to_a_good_drafters_longer_block():
    """The drafter's best block is 7 drafts; a 2-token lookup that is nearly sure to survive
    beats the drafter's 2-draft block but not its 7-draft one."""
    s = scheduler(confidence=[0.9] * 7)
    assert s.lookup_length([0.99, 0.99], 7, 100) == 0
    # With the drafter held to the lookup's length the lookup would have won:
    two_drafts = rate(s.survival()[:2], COSTS.draft_s + COSTS.verify(3, 100))
    assert rate(np.cumprod([0.99, 0.99]), COSTS.verify(3, 100)) > two_drafts
    # A lookup reaching as far as the drafter wins (it pays no drafter pass).
    assert s.lookup_length([0.99] * 7, 7, 100) == 7


def test_the_drafter_is_weighed_only_as_far_as_room_and_memory_allow():
    s = scheduler(confidence=[0.9] * 7)
    assert s.lookup_length([0.99, 0.99], 2, 100) == 2  # room for 2: the sure lookup wins
    s.headroom = lambda: (2 + 1) * (1 << 20) + s.reserve_bytes  # memory for 2 drafts
    assert s.memory_cap() == 2
    assert s.lookup_length([0.99, 0.99], 7, 100) == 2


def test_the_lookup_is_weighed_at_its_own_best_length():
    s = scheduler(accept=0.2)  # a poor drafter
    assert s.lookup_length([0.95, 0.95, 0.05, 0.9], 7, 100) == 2  # its likely prefix
    assert s.lookup_length([0.95] * 6, 4, 100) == 4  # never past the room


def test_random_cases_choose_the_better_block_by_expected_tokens_per_second():
    rng = np.random.default_rng(0)
    for case in range(500):
        confidence = rng.uniform(0, 1, size=7) ** rng.uniform(0.1, 3)
        # Every fifth case has memory for a few drafts only (256 MiB stay in reserve).
        headroom = (int(rng.integers(0, 9)) + 1 + 256) << 20 if case % 5 == 0 else 1 << 40
        s = (scheduler(confidence=confidence, headroom=headroom) if case % 2
             else scheduler(accept=confidence, headroom=headroom))
        probs = rng.uniform(0, 1, size=int(rng.integers(1, 8))) ** rng.uniform(0.05, 2)
        room, context = int(rng.integers(0, 9)), int(rng.integers(10, 2000))
        assert s.lookup_length(probs.tolist(), room, context) == expected_choice(
            s, probs, room, context), case


def test_the_batch_budget_weighs_drafting_requests_at_their_own_length_beside_lookups():
    """In one batched pass a short looked-up block does not hold the drafting requests' blocks
    to its length: the pass widens to what the drafters' blocks are worth."""
    from mlx_dflash.schedule import BATCH_ROWS, BatchCosts, plan_batch

    free = BatchCosts(COSTS, {r: [1.0] * len(COSTS.sizes) for r in BATCH_ROWS}, COSTS.sizes)
    drafting = scheduler(confidence=[0.9] * 7)
    alone = scheduler(confidence=[0.9] * 7).choose(7, 100)
    looking = [scheduler(confidence=[0.9] * 7) for _ in range(3)]
    blocks = [np.cumprod([0.99] * n) for n in (1, 1, 2)]
    plan = plan_batch(looking + [drafting], [7] * 4, blocks + [None], 100, free)
    assert alone == 7 and plan == [1, 1, 2, 7]


def test_copies_that_fail_are_cut_back_and_come_back_when_the_text_repeats():
    """A request alone: copied blocks are trusted at first; when the text stops following them they
    are cut to nothing (a wide verify costs 1.5x a decode per token here, as at long contexts
    on a CPU); a block skipped is still judged against the tokens committed after it, so
    copies come back when the text repeats again."""
    from mlx_dflash.cycle import COPY
    from mlx_dflash.lookup import CopyIndex
    from mlx_dflash.policy import BlockPolicy
    from mlx_dflash.schedule import PassCosts

    costs = PassCosts({c: [0.010 * (1 + 0.5 * (n - 1)) for n in range(1, 9)]
                       for c in (128, 1024)}, draft_s=0.002, sizes=tuple(range(1, 9)))
    s = Scheduler(costs, 7, token_bytes=1 << 20, headroom=lambda: 1 << 40)
    s.accept_rate[:] = 0.0  # a drafter that never helps: plain decoding is its best cycle
    A, B = 5, 6
    p = BlockPolicy(8, CopyIndex([A, B, 100, 7, 8, 9, 10, 11, 12], 2, 4), None, s)
    p.extend([A, B])
    block, source = p.lookup(7, 100)
    assert source == COPY and block == [100, 7, 8]  # as long as pays at 0.9 a step
    lengths = []
    for new in range(200, 208):  # the text goes elsewhere: each copy fails at once
        p.extend([new, A, B])
        lengths.append(len(p.lookup(7, 100)[0]))
    assert lengths[-1] == 0 and lengths == sorted(lengths, reverse=True), lengths
    low = p.calibration[COPY]([0.9])[0]
    for _ in range(3):  # the text repeats what followed A B last time: skipped, still judged
        p.extend(p.looked.tokens + [A, B])
        p.lookup(7, 100)
    assert p.calibration[COPY]([0.9])[0] > low + 0.2
    assert p.lookup(7, 100)[0]
