"""Structured output under speculation: the reply equals plain decoding under the grammar's
mask (greedy: token for token; sampled: the masked target's distribution), whatever drafted
it, and keeps to the grammar."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from test_lossless_greedy import OracleDrafter
from test_lossless_sampling import chi_square
from tiny import make_drafter, make_target, make_text_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.accept import SamplingParams, sampling_logits
from mlx_dflash.grammar import FORCED_REACH, Grammar, GrammarError, Matcher

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "age", "tags", "ok"],
    "additionalProperties": False,
}
WORDS = ('{"', '": ', '", "', 'name', 'kind', 'age', 'tags', 'true', 'false', 'cat', 'dog',
         'bird', '"]', '"}')


@pytest.fixture(scope="module")
def json_pair():
    tok = make_text_tokenizer(WORDS)
    model = make_target("qwen3", vocab_size=len(tok.vocab), seed=5)
    return model, tok


def constrained_reference(model, tok, prompt, grammar, max_tokens):
    """Plain greedy decoding with the grammar's mask as an mlx-lm logits processor."""
    matcher = Matcher(grammar, tok, model.args.vocab_size)
    seen = [len(prompt)]

    def mask(tokens, logits):
        matcher.commit(tokens[seen[0]:].tolist())
        seen[0] = tokens.shape[0]
        return mx.where(mx.array(matcher.allowed()), logits, -mx.inf)

    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                              logits_processors=[mask]):
        if t in tok.eos_token_ids:
            break
        out.append(t)
    return out


def run(model, drafter, tok, prompt, max_tokens, **kw):
    tokens, last = [], None
    for last in stream_generate(model, drafter, tok, prompt, max_tokens=max_tokens, **kw):
        tokens += last.tokens
    return tokens, last


def drafters(model):
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    return {"dflash": make_drafter(model, block_size=8, layer_ids=(0, 2)),
            "dspark": make_dspark(model, block_size=8),
            "dflash2": make_dflash2(model, block_size=8)}


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_greedy_equals_plain_constrained_decoding(json_pair, family):
    model, tok = json_pair
    drafter = drafters(model)[family]
    grammar = Grammar.json_schema(SCHEMA)
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44, 45]):
        want = constrained_reference(model, tok, prompt, grammar, 80)
        got, last = run(model, drafter, tok, prompt, 80, grammar=grammar)
        assert got == want
        SCHEMA_CHECK(tok.decode(got))
        got, _ = run(model, drafter, tok, prompt, 80, grammar=grammar, block_size=4,
                     copy_drafts=False)
        assert got == want


def SCHEMA_CHECK(text):
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 0.7])
def test_partial_accepts_roll_the_grammar_back(json_pair, error_rate):
    """An oracle drafter (the constrained reply, corrupted at random) accepts blocks of every
    length: the grammar state follows the accepted prefix each time."""
    model, tok = json_pair
    grammar = Grammar.json_schema(SCHEMA)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    prompt = [9, 8, 7]
    want = constrained_reference(model, tok, prompt, grammar, 80)
    oracle = OracleDrafter(drafter, prompt + want + [0] * 16, model.args.vocab_size,
                           error_rate, seed=3)
    got, last = run(model, oracle, tok, prompt, 80, grammar=grammar, block_size=8)
    assert got == want
    if error_rate == 0.0:
        assert last.stats.cycles < len(want) / 3


def test_forced_tokens_ride_along_for_free(json_pair):
    """Keys, quotes and separators the schema dictates are appended to the block as certain
    drafts: with a drafter that never helps, the reply still takes far fewer target passes
    than tokens."""
    model, tok = json_pair
    grammar = Grammar.json_schema(SCHEMA)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2), seed=9)
    prompt = [5, 6, 7]
    want = constrained_reference(model, tok, prompt, grammar, 80)
    got, last = run(model, drafter, tok, prompt, 80, grammar=grammar, copy_drafts=False)
    assert got == want
    assert last.stats.forced_tokens > len(want) / 4
    assert last.stats.cycles < len(want) - last.stats.forced_tokens / 2
    # forced tokens may follow the drafts past the drafter's block (grammar.FORCED_REACH)
    assert drafter.max_drafts < max(last.stats.draft_lengths) <= FORCED_REACH


def test_verified_drafts_keep_to_the_grammar(json_pair, monkeypatch):
    """No block the target verifies holds a token the grammar forbids after the tokens
    before it (drafts are masked, lookups cut)."""
    from mlx_dflash.cycle import Speculator

    model, tok = json_pair
    grammar = Grammar.json_schema(SCHEMA)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    checked = []
    verify = Speculator.verify

    def checking_verify(self, anchor, proposal, *args, **kw):
        if self.matcher is not None:
            block = proposal.drafts.tolist()
            # the committed tokens so far are in the matcher: the block must be admitted
            assert self.matcher.matcher.validate_tokens(block) == len(block), block
            checked.append(len(block))
        return verify(self, anchor, proposal, *args, **kw)

    monkeypatch.setattr(Speculator, "verify", checking_verify)
    for prompt in ([5, 6, 7], [11, 12]):
        run(model, drafter, tok, prompt, 60, grammar=grammar)
    assert sum(checked) > 0


# -- sampling: the masked target's distribution ------------------------------------------------
CHARS = "abcxyz"
V = len(CHARS) + 1  # <eos> and one token per character
REGEX = "(a|b|c)(a|x|yy)(z|b|c)[a-c]*"  # several branches; later steps depend on earlier
PROMPT = [1, 2, 3]
N_SAMPLES = 1500


def masked_joint(model, tok, grammar, params):
    """P(t1, t2, t3) [V, V, V] under the grammar's masks, enumerated exactly."""
    def probs(prefix):
        m = Matcher(grammar, tok, V)
        m.commit(prefix)
        logits = model(mx.array(PROMPT + prefix)[None])[0, -1]
        masked = mx.where(mx.array(m.allowed()), logits, -mx.inf)
        return np.array(mx.softmax(sampling_logits(masked[None], params), axis=-1))[0]

    joint = np.zeros((V, V, V))
    p1 = probs([])
    for a in np.flatnonzero(p1 > 0):
        p2 = probs([int(a)])
        for b in np.flatnonzero(p2 > 0):
            joint[a, b] = p1[a] * p2[b] * probs([int(a), int(b)])
    return joint


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampled_replies_follow_the_masked_target(temperature, top_k):
    tok = make_text_tokenizer(chars=CHARS)
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=0.3)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    grammar = Grammar.regex(REGEX)
    joint = masked_joint(model, tok, grammar, SamplingParams(temperature, 1.0, top_k))
    mx.random.seed(11)
    counts = np.zeros((V, V, V))
    accepted = 0
    for _ in range(N_SAMPLES):
        out = []
        for r in stream_generate(model, drafter, tok, PROMPT, max_tokens=3, block_size=4,
                                 temperature=temperature, top_k=top_k, grammar=grammar,
                                 copy_drafts=False):
            out += r.tokens
            accepted += r.accepted
        assert len(out) == 3
        counts[tuple(out)] += 1
    stat, dof = chi_square(counts.ravel(), joint.ravel())
    assert stat < dof + 5 * np.sqrt(2 * dof), f"chi2 {stat:.1f} with {dof} dof"
    assert accepted > 0


def test_sampled_drafts_are_drawn_from_the_masked_drafter():
    """A forbidden sampled draft is drawn again from the drafter's distribution restricted to
    what the grammar allows; rejection sampling is given that restricted distribution."""
    from mlx_dflash.accept import CandidateProposal
    from mlx_dflash.drafters.base import Proposal
    from mlx_dflash.grammar import constrain_proposal

    tok = make_text_tokenizer(chars=CHARS)
    grammar = Grammar.regex("(a|b)x(y|z)")
    m = Matcher(grammar, tok, V)
    a, b, x, y, z, c = (CHARS.index(ch) + 1 for ch in "abxyzc")
    probs = mx.zeros((3, V))
    probs[0, a], probs[0, c] = 0.25, 0.75  # c is forbidden: a redraw can only give a
    probs[1, c] = 1.0  # position 2 is forced to x: a point mass whatever was drafted
    probs[2, y], probs[2, z] = 0.5, 0.5
    params = SamplingParams(1.0)
    for proposal in (Proposal(mx.array([c, c, y], dtype=mx.uint32), probs),
                     Proposal(mx.array([c, c, y], dtype=mx.uint32), CandidateProposal(
                         mx.array([[a, c], [c, x], [y, z]]), mx.array([[0.25, 0.75],
                                                                       [1.0, 0.0],
                                                                       [0.5, 0.5]])))):
        kept, masks = constrain_proposal(m, proposal, 3, params, looked_up=False)
        assert kept.drafts.tolist() == [a, x, y]
        q = np.array(kept.probs)
        assert q[0, a] == pytest.approx(1.0) and q[1, x] == 1.0
        assert q[2, y] == pytest.approx(0.5) and q[2, z] == pytest.approx(0.5)
        assert masks.shape == (4, V)


def test_a_schema_it_cannot_compile_is_named():
    with pytest.raises(GrammarError, match="strng"):
        Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strng"}}})
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(GrammarError, match="regex"):
        Grammar.regex("(a|")


@pytest.mark.parametrize("tree", [4, "auto"])
def test_tree_drafts_under_a_grammar(json_pair, tree):
    """Tree drafts (the drafter's, and copied branches) under a grammar: each node is kept to
    the grammar along its path, the pass's rows are masked; alone and batched, greedy equals
    plain constrained decoding, and sampled trees stay in the grammar."""
    from mlx_dflash import BatchEngine
    from mlx_dflash.cycle import Speculator

    model, tok = json_pair
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    grammar = Grammar.json_schema(SCHEMA)
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    wants = [constrained_reference(model, tok, p, grammar, 80) for p in prompts]
    trees = []
    verify_tree = Speculator.verify_tree

    def counting(self, anchor, t, *args, **kw):
        trees.append(len(t))
        return verify_tree(self, anchor, t, *args, **kw)

    Speculator.verify_tree = counting
    try:
        for p, want in zip(prompts, wants):
            got, _ = run(model, drafter, tok, p, 80, grammar=grammar, tree=tree)
            assert got == want
    finally:
        Speculator.verify_tree = verify_tree
    assert trees and max(trees) > 1
    engine = BatchEngine(model, drafter, tok, max_batch=4, tree=tree)
    ids = [engine.submit(p, max_tokens=80, grammar=grammar) for p in prompts]
    ids.append(engine.submit([8, 9], max_tokens=30))  # a row without one beside them
    got = {i: [] for i in ids}
    while not engine.idle:
        for i, response in engine.step():
            got[i] += response.tokens
    assert [got[i] for i in ids[:2]] == wants
    for seed in range(3):
        text, _ = run(model, drafter, tok, [5, 6, 7], 200, grammar=grammar, tree=tree,
                      temperature=1.0, seed=seed)
        SCHEMA_CHECK(tok.decode(text))


def test_the_reply_ends_when_the_grammar_does(json_pair):
    model, tok = json_pair
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    got, last = run(model, drafter, tok, [5, 6, 7], 200, grammar=Grammar.json_schema(SCHEMA))
    assert last.finish_reason == "stop"
    SCHEMA_CHECK(tok.decode(got))


def test_json_object_mode(json_pair):
    model, tok = json_pair
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    grammar = Grammar.json_object()
    want = constrained_reference(model, tok, [3, 4], grammar, 40)
    got, _ = run(model, drafter, tok, [3, 4], 40, grammar=grammar)
    assert got == want and tok.decode(got).startswith("{")



def test_the_batch_engine_keeps_each_row_to_its_own_grammar(json_pair):
    """Rows with different grammars (and one without) in one batch: each equals plain
    decoding under its own mask (a matcher per row)."""
    from mlx_dflash import BatchEngine

    model, tok = json_pair
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    grammars = [Grammar.json_schema(SCHEMA), None, Grammar.json_object(),
                Grammar.json_schema(SCHEMA)]
    prompts = [[5, 6, 7], [8, 9], [3, 4], [40, 41, 42]]
    engine = BatchEngine(model, drafter, tok, max_batch=4)
    ids = [engine.submit(p, max_tokens=60, grammar=g) for p, g in zip(prompts, grammars)]
    got = {i: [] for i in ids}
    while not engine.idle:
        for i, response in engine.step():
            got[i] += response.tokens
    for i, p, g in zip(ids, prompts, grammars):
        if g is None:
            want = [t for t, _ in generate_step(mx.array(p), model, max_tokens=60)]
            want = want[: want.index(0)] if 0 in want else want
        else:
            want = constrained_reference(model, tok, p, g, 60)
        assert got[i] == want, i


def test_every_shipped_schema_is_kept(json_pair):
    """The 24 extraction schemas that ship (nested objects, enums, arrays of objects, optional
    fields, bounded numbers, patterns): a random model's replies under each parse and validate
    when they end; a random model may write digits without end, so a few run to the limit
    (still a prefix the grammar allows)."""
    import jsonschema

    from mlx_dflash.bench_structured import read_tasks

    model, tok = json_pair
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    ended = 0
    for task in read_tasks():
        grammar = Grammar.json_schema(task["schema"])
        got, last = run(model, drafter, tok, [5, 6, 7], 800, grammar=grammar)
        if last.finish_reason == "stop":
            jsonschema.validate(json.loads(tok.decode(got)), task["schema"])
            ended += 1
        else:
            assert Matcher(grammar, tok, model.args.vocab_size).matcher.validate_tokens(
                got) == len(got)
    assert ended >= 18
