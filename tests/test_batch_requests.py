"""What a batched request keeps of a single one: continuing from the prefix cache and leaving
its caches there, and a seed of its own."""

import mlx.core as mx
from test_batch import PROMPTS
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import generate
from mlx_dflash.batch import BatchEngine, batch_generate
from mlx_dflash.prefix_cache import PrefixCache


def test_batched_requests_continue_from_the_prefix_cache_and_leave_theirs_there():
    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(128)
    store = PrefixCache(1 << 30)
    prompts = PROMPTS[2:5]
    first = batch_generate(model, drafter, tok, prompts, max_tokens=12, block_size=4,
                           prefix_cache=store)
    assert len(store) == len(prompts) and all(r.stats.cached_tokens == 0 for r in first)
    # The next turns: each prompt extended by its answer and more; they continue from it.
    turns = [p + r.tokens + [7, 8, 9] for p, r in zip(prompts, first)]
    second = batch_generate(model, drafter, tok, turns, max_tokens=12, block_size=4,
                            prefix_cache=store)
    for prompt, turn, r in zip(prompts, turns, second):
        assert r.stats.cached_tokens >= len(prompt)
        assert r.text == generate(model, drafter, tok, turn, max_tokens=12, block_size=4)


def test_a_cancelled_request_leaves_what_it_committed():
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    store = PrefixCache(1 << 30)
    engine = BatchEngine(model, None, tok, prefix_cache=store)
    rid = engine.submit(PROMPTS[2], max_tokens=50)
    got = []
    for _ in range(4):
        got += [t for i, r in engine.step() if i == rid for t in r.tokens]
    engine.cancel(rid)
    engine.step()
    assert engine.idle and len(store) == 1
    pair, cached = store.fetch(PROMPTS[2] + got + [5])
    assert cached == len(PROMPTS[2]) + len(got) - 1  # the last token is the next anchor


def test_a_seeded_request_draws_from_its_own_stream():
    """The same seed gives the same sample whatever else runs beside it."""
    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(128)

    def sample(beside: int) -> list[int]:
        engine = BatchEngine(model, drafter, tok, block_size=4)
        rid = engine.submit(PROMPTS[0], max_tokens=10, temperature=1.0, seed=1234)
        for p in PROMPTS[1 : 1 + beside]:
            engine.submit(p, max_tokens=10, temperature=1.0)
        out = []
        while not engine.idle:
            out += [t for i, r in engine.step() if i == rid for t in r.tokens]
        return out

    mx.random.seed(0)
    alone = sample(0)
    mx.random.seed(1)
    assert sample(0) == alone
    mx.random.seed(2)
    assert sample(3) == alone


def test_a_seeded_reply_depends_on_its_seed_alone():
    """A seeded request's tokens are a function of the seed and their positions (Gumbel-max
    with position-keyed noise): the same reply from plain decoding, any block size, lookups
    on or off, and the batch engine alone or beside other requests."""
    model = make_target("qwen3", vocab_size=64)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(64)
    prompt = "w5 w6 w7 w5 w6"  # repeats: copy drafts come and go
    kw = dict(max_tokens=24, temperature=1.0)
    for seed in range(4):
        plain = generate(model, None, tok, prompt, seed=seed, **kw)
        assert generate(model, drafter, tok, prompt, seed=seed, **kw) == plain
        assert generate(model, drafter, tok, prompt, seed=seed, block_size=2,
                        copy_drafts=False, **kw) == plain
        engine = BatchEngine(model, drafter, tok)
        others = [engine.submit(p, max_tokens=16, temperature=0.8) for p in ("w9 w8", "w7")]
        rid = engine.submit(prompt, seed=seed, **kw)
        texts = {i: "" for i in (*others, rid)}
        while not engine.idle:
            for i, r in engine.step():
                texts[i] += r.text
        assert texts[rid] == plain
    # Another seed, another reply.
    assert generate(model, None, tok, prompt, seed=9, **kw) != plain


def test_a_long_prompt_joins_over_several_steps_while_the_others_decode():
    from test_batch import check_against_solo

    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=4)
    engine = BatchEngine(model, drafter, make_tokenizer(128), block_size=4, prefill_chunk=16)
    short = [PROMPTS[1], PROMPTS[3]]
    long_prompt = (PROMPTS[5] * 3)[:150]
    ids = [engine.submit(p, max_tokens=40) for p in short]
    out = {i: [] for i in ids}
    reasons = {}

    def step():
        produced = set()
        for rid, r in engine.step():
            out.setdefault(rid, []).extend(r.tokens)
            produced.add(rid)
            if r.finish_reason:
                reasons[rid] = r.finish_reason
        return produced

    step()
    late = engine.submit(long_prompt, max_tokens=10)
    waits = 0
    while not (produced := step()) >= {late}:
        assert produced >= set(ids)  # the running ones keep decoding meanwhile
        waits += 1
    assert waits >= 150 // 16 - 1
    while not engine.idle:
        step()
    prompts = short + [long_prompt]
    check_against_solo(model, prompts, [out[i] for i in (*ids, late)],
                       [reasons.get(i) for i in (*ids, late)], [40, 40, 10])
