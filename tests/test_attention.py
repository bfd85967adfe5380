"""The CPU attention the target's passes use: the same function as MLX's, to rounding."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny import make_target

from mlx_dflash import attention
from mlx_dflash.target import Target

MLX = attention._MLX_ATTENTION


def test_fast_exp_within_one_ulp_of_mlx():
    x = mx.concatenate([mx.linspace(-100, 100, 200001),
                        mx.array([-mx.inf, mx.inf, 0.0, -88.8, 88.8, -1e-30])])
    got, want = np.array(attention.fast_exp(x)), np.array(mx.exp(x))
    normal = (want > np.finfo(np.float32).tiny) & np.isfinite(want)
    ulps = np.abs(got.view(np.int32)[normal].astype(np.int64) - want.view(np.int32)[normal])
    assert ulps.max() <= 1
    outside = np.abs(np.array(x)) > 88.75  # 0 and inf where MLX's are
    assert np.array_equal(got[outside], want[outside])


def _masks(heads, length, keys):
    keep = mx.random.uniform(shape=(2, heads, length, keys)) > 0.3
    keep[..., 0] = True  # every query sees a key
    return [None, "causal", keep[0, 0], keep, mx.random.normal((1, 1, length, keys)),
            mx.where(keep, 0.0, -mx.inf)]


@pytest.mark.parametrize("heads,kv_heads,length,keys",
                         [(9, 3, 1, 50), (9, 3, 7, 50), (8, 8, 5, 33), (4, 1, 3, 20),
                          (6, 2, 16, 16)])
def test_attention_equals_mlx(heads, kv_heads, length, keys):
    mx.random.seed(heads + length)
    q = mx.random.normal((2, heads, length, 64))
    k, v = mx.random.normal((2, kv_heads, keys, 64)), mx.random.normal((2, kv_heads, keys, 64))
    for mask in _masks(heads, length, keys):
        got = attention.attention(q, k, v, scale=0.125, mask=mask)
        want = MLX(q, k, v, scale=0.125, mask=mask)
        assert got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6), mask


def test_other_dtypes_and_sinks_are_mlx_own():
    q = mx.random.normal((1, 4, 3, 16))
    k, v = mx.random.normal((1, 2, 8, 16)), mx.random.normal((1, 2, 8, 16))
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert mx.array_equal(attention.attention(*half, scale=0.25, mask="causal"),
                          MLX(*half, scale=0.25, mask="causal"))
    sinks = mx.zeros((4,))
    assert mx.array_equal(attention.attention(q, k, v, scale=0.25, sinks=sinks),
                          MLX(q, k, v, scale=0.25, sinks=sinks))


def test_many_queries_are_mlx_own(monkeypatch):
    """A prefill chunk's scores (past MOST_SCORES) go to MLX's one softmax op."""
    q = mx.random.normal((1, 4, 8, 16))
    k, v = mx.random.normal((1, 2, 8, 16)), mx.random.normal((1, 2, 8, 16))
    monkeypatch.setattr(attention, "MOST_SCORES", 4 * 8 * 8 - 1)
    assert mx.array_equal(attention.attention(q, k, v, scale=0.25, mask="causal"),
                          MLX(q, k, v, scale=0.25, mask="causal"))


def test_on_cpu_swaps_and_restores(monkeypatch):
    with attention.on_cpu():
        with attention.on_cpu():
            assert mx.fast.scaled_dot_product_attention is attention.attention
        assert mx.fast.scaled_dot_product_attention is attention.attention
    assert mx.fast.scaled_dot_product_attention is MLX
    monkeypatch.setenv(attention.ENV_SWITCH, "0")
    with attention.on_cpu():
        assert mx.fast.scaled_dot_product_attention is MLX


def test_target_passes_use_it_and_stay_close_to_mlx(monkeypatch):
    """The target's passes build their attention here (their logits equal the model's own
    call under on_cpu, tests/test_targets.py); against MLX's attention they differ by
    rounding only, and with the switch off they are MLX's exactly."""
    model = make_target("qwen3")
    target = Target(model)
    tokens = mx.array([[5, 9, 2, 7, 3, 11, 4]])
    ours, _ = target.forward(tokens, target.make_cache())
    mlx_own = model(tokens, cache=make_prompt_cache(model))
    assert mx.allclose(ours, mlx_own, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(attention.ENV_SWITCH, "0")
    off, _ = target.forward(tokens, target.make_cache())
    assert mx.array_equal(off, mlx_own)


def test_drafter_passes_use_it(monkeypatch):
    """The decode loop's drafter passes (propose_all, grow_trees) are built with this attention
    too; their drafts equal those with MLX's attention."""
    from tiny import make_drafter

    from mlx_dflash.accept import SamplingParams
    from mlx_dflash.cycle import prefill
    from mlx_dflash.drafters.base import propose_all

    model = make_target("qwen3")
    target = Target(model)
    drafter = make_drafter(model)
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    prefill(target, [5, 9, 2, 7, 3, 11, 4, 8], cache, drafter, draft_cache)
    calls = []
    real = attention.few_queries
    monkeypatch.setattr(attention, "few_queries", lambda *a: calls.append(1) or real(*a))

    def drafts() -> list[int]:
        anchor = mx.array([6], dtype=mx.uint32)
        proposal = propose_all(drafter, target, [anchor], [draft_cache], 4, [3],
                               [SamplingParams()])[0]
        return proposal.drafts.tolist()

    ours = drafts()
    assert calls
    monkeypatch.setenv(attention.ENV_SWITCH, "0")
    assert drafts() == ours
