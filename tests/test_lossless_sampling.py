"""Sampled speculative output follows the target's own distribution (rejection sampling).

On a vocabulary of 8 tokens we enumerate the target's exact joint distribution of the first
three generated tokens (and the marginal of the fourth) under the same temperature / top-p /
top-k filters, draw 2,000 speculative samples with a fixed seed and run a chi-square test.
Tolerance: the statistic must stay below dof + 5*sqrt(2*dof) (p < ~1e-5 under the null), and
the drafter's own proposal distribution must be far from the target's so the test has power.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import stream_generate
from mlx_dflash.accept import SamplingParams, sampling_logits

V = 8
N_SAMPLES = 2000
PROMPT = [3, 4, 5]


def exact_probs(model, prefixes, params):
    logits = model(mx.array(prefixes))[:, -1]
    return np.array(mx.softmax(sampling_logits(logits, params), axis=-1))


def exact_joint(model, params):
    """P(t1, t2, t3) as an array [V, V, V] and P(t4) as [V]."""
    p1 = exact_probs(model, [PROMPT], params)[0]
    pairs = list(itertools.product(range(V), repeat=1))
    p2 = exact_probs(model, [PROMPT + list(a) for a in pairs], params)  # [V, V]
    triples = list(itertools.product(range(V), repeat=2))
    p3 = exact_probs(model, [PROMPT + list(a) for a in triples], params).reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    quads = list(itertools.product(range(V), repeat=3))
    p4 = exact_probs(model, [PROMPT + list(a) for a in quads], params).reshape(V, V, V, V)
    marginal4 = (joint[..., None] * p4).sum(axis=(0, 1, 2))
    return joint, marginal4


def chi_square(counts, probs):
    expected = probs * counts.sum()
    order = np.argsort(expected)
    # Merge the smallest cells until each merged cell expects >= 5.
    cells, acc_o, acc_e = [], 0.0, 0.0
    for i in order:
        acc_o += counts[i]
        acc_e += expected[i]
        if acc_e >= 5:
            cells.append((acc_o, acc_e))
            acc_o = acc_e = 0.0
    if acc_e > 0 and cells:
        o, e = cells.pop()
        cells.append((o + acc_o, e + acc_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1


def sample_runs(model, drafter, seed, **kw):
    """N_SAMPLES speculative runs of 4 tokens after PROMPT: counts of the first three tokens
    [V, V, V], counts of the fourth [V], drafts accepted and copy cycles in all."""
    tok = make_tokenizer(V, eos_id=V)  # the stop token is outside the model's vocabulary
    mx.random.seed(seed)
    counts, counts4, accepted, copies = np.zeros((V, V, V)), np.zeros(V), 0, 0
    for _ in range(N_SAMPLES):
        out = []
        for r in stream_generate(model, drafter, tok, PROMPT, max_tokens=4, **kw):
            out += r.tokens
            accepted += r.accepted
        copies += r.stats.copy_cycles
        counts[out[0], out[1], out[2]] += 1
        counts4[out[3]] += 1
    return counts, counts4, accepted, copies


def assert_follows(counts, counts4, joint, marginal4):
    """Chi-square of the sampled joint (first three tokens) and fourth-token marginal."""
    stat, dof = chi_square(counts.ravel(), joint.ravel())
    assert stat < dof + 5 * np.sqrt(2 * dof), f"joint chi2 {stat:.1f} with {dof} dof"
    stat4, dof4 = chi_square(counts4, marginal4)
    assert stat4 < dof4 + 5 * np.sqrt(2 * dof4), f"4th-token chi2 {stat4:.1f} with {dof4} dof"


def assert_drafter_samples_the_target(model, drafter, seed, temperature, top_p=1.0, top_k=0,
                                      **kw):
    """Speculative samples with ``drafter`` (no copy drafts: its own proposals) follow the
    target's exact joint, and some of its drafts were accepted."""
    joint, marginal4 = exact_joint(model, SamplingParams(temperature, top_p, top_k))
    counts, counts4, accepted, _ = sample_runs(model, drafter, seed, temperature=temperature,
                                               top_p=top_p, top_k=top_k, copy_drafts=False,
                                               **kw)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3)]
)
def test_sampled_distribution_matches_target(temperature, top_p, top_k):
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    params = SamplingParams(temperature, top_p, top_k)
    joint, marginal4 = exact_joint(model, params)
    counts, counts4, accepted, _ = sample_runs(
        model, drafter, 1234, block_size=4, temperature=temperature, top_p=top_p, top_k=top_k)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0  # the rejection path and the acceptance path both ran

    # Power: the drafter's own first-draft distribution is far from the target's.
    from mlx_dflash.target import Target

    target = Target(model)
    from mlx_dflash.cycle import prefill

    cache, dcache = target.make_cache(), drafter.make_cache()
    prefill(target, PROMPT, cache, drafter, dcache)
    t1 = int(np.argmax(joint.sum(axis=(1, 2))))
    q = mx.softmax(sampling_logits(
        drafter.draft_logits(target, mx.array([t1], dtype=mx.uint32), dcache, 4)[0], params))
    p2 = joint[t1].sum(axis=1) / joint[t1].sum()
    assert 0.5 * np.abs(np.array(q) - p2).sum() > 0.1


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 3)])
def test_seeded_samples_follow_the_target(temperature, top_p, top_k):
    """Seeded requests (Gumbel-max with noise keyed by seed and position) sample the target's
    exact joint too: one run per seed, with the drafter's blocks and trees."""
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(temperature, top_p, top_k))
    tok = make_tokenizer(V, eos_id=V)
    counts, counts4, accepted = np.zeros((V, V, V)), np.zeros(V), 0
    for seed in range(N_SAMPLES):
        out = []
        for r in stream_generate(model, drafter, tok, PROMPT, max_tokens=4, seed=seed,
                                 temperature=temperature, top_p=top_p, top_k=top_k,
                                 block_size=4, copy_drafts=False, tree=3 if seed % 2 else None):
            out += r.tokens
            accepted += r.accepted
        counts[out[0], out[1], out[2]] += 1
        counts4[out[3]] += 1
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0
