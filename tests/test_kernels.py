"""mlx_dflash.kernels: the choice between the Metal kernels and the MLX path, the decode
loop's use of it, and the MLX path's own rules (the kernels are checked against it in
test_kernel_harness.py)."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash import accept, kernels
from mlx_dflash.accept import SamplingParams
from mlx_dflash.drafters.dflash2 import walk_path


def backend_in_subprocess(value):
    env = dict(os.environ)
    env.pop(kernels.ENV_SWITCH, None)
    if value is not None:
        env[kernels.ENV_SWITCH] = value
    code = "from mlx_dflash import kernels; print(kernels.backend())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True)


def test_backend_follows_metal_and_the_environment_switch():
    metal = mx.metal.is_available()
    assert backend_in_subprocess(None).stdout.strip() == ("metal" if metal else "mlx")
    assert backend_in_subprocess("mlx").stdout.strip() == "mlx"
    forced = backend_in_subprocess("metal")
    if metal:
        assert forced.stdout.strip() == "metal"
    else:
        assert forced.returncode != 0 and "no Metal GPU" in forced.stderr
    bad = backend_in_subprocess("cuda")
    assert bad.returncode != 0 and "must be metal, mlx or auto" in bad.stderr


def test_backend_is_decided_once_per_process(monkeypatch):
    first = kernels.backend()
    monkeypatch.setenv(kernels.ENV_SWITCH, "metal" if first == "mlx" else "mlx")
    assert kernels.backend() == first


def test_decode_steps_use_the_kernels_where_metal_is(monkeypatch):
    """With the kernels on (each variant checked), accept.py and walk_path go through the Metal
    wrappers (stood in for here by the MLX path, since this machine may have no Metal)."""
    calls = []

    def stand_in(name, mlx_fn):
        def fn(*args, **kwargs):
            calls.append(name)
            return mlx_fn(*args, **kwargs)
        return fn

    monkeypatch.setattr(kernels, "_use_metal", lambda variant: True)
    for name in ("verify_greedy", "verify_sample", "verify_sample_candidates", "path_select"):
        monkeypatch.setattr(kernels, f"{name}_metal",
                            stand_in(name, getattr(kernels, f"{name}_mlx")))
    logits = mx.random.normal((4, 50))
    drafts = mx.array([3, 4, 5], dtype=mx.uint32)
    accept.greedy_accept(drafts, logits)
    q = mx.softmax(mx.random.normal((3, 50)), axis=-1)
    accept.rejection_accept(drafts, q, logits, SamplingParams(0.8))
    accept.rejection_accept(drafts, accept.point_mass(drafts), logits, SamplingParams(0.8))
    walk_path(mx.random.normal((16,)), mx.random.normal((2, 16, 16)))
    walk_path(mx.random.normal((16,)), mx.random.normal((2, 16, 16)), temperature=0.7)
    assert calls == ["verify_greedy", "verify_sample", "verify_sample_candidates", "path_select",
                     "path_select"]


def test_greedy_accept_gives_the_token_at_the_accepted_length():
    logits = mx.zeros((4, 10))
    logits = logits.at[0, 2].add(1.0).at[1, 7].add(1.0).at[2, 1].add(1.0).at[3, 9].add(1.0)
    accepted, next_tokens = accept.greedy_accept(mx.array([2, 7, 3], dtype=mx.uint32), logits)
    assert accepted.item() == 2 and next_tokens.tolist()[2] == 1 and next_tokens.shape == (4,)
    accepted, next_tokens = accept.greedy_accept(mx.array([2, 7, 1], dtype=mx.uint32), logits)
    assert accepted.item() == 3 and next_tokens.tolist()[3] == 9


def test_top_k_mask_keeps_the_lowest_ids_among_ties():
    x = mx.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    assert np.flatnonzero(np.array(kernels.top_k_mask(x, 3))[0]).tolist() == [1, 2, 3]
    assert np.flatnonzero(np.array(kernels.top_k_mask(x, 5))[0]).tolist() == [1, 2, 3, 4, 5]
    assert np.flatnonzero(np.array(kernels.top_k_mask(x, 1))[0]).tolist() == [1]


def test_sample_index_is_the_inverse_cdf():
    w = mx.array([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 5)
    u = mx.array([0.0, 0.2499, 0.25, 0.9999, 0.75])
    assert kernels.sample_index(w, u).tolist() == [1, 1, 3, 4, 4]


def test_sample_index_never_picks_a_zero_weight_after_rounding():
    # u just below 1 with a cumulative sum that rounds: the last positive index, not the end.
    w = mx.array([[0.1] * 10 + [0.0] * 3])
    assert kernels.sample_index(w, mx.array([1.0 - 2 ** -24])).item() == 9


def test_blocked_sums_are_accurate_over_a_large_vocabulary():
    rng = np.random.default_rng(0)
    x = np.exp(rng.standard_normal((2, 151936)) * 2.5).astype(np.float32)
    exact = x.astype(np.float64).sum(-1)
    got = np.array(kernels.blocked_sum(mx.array(x)))[:, 0]
    assert np.abs(got / exact - 1).max() < 1e-5
    cum = np.array(kernels.blocked_cumsum(mx.array(x)))
    assert np.abs(cum / exact[:, None] - np.cumsum(x.astype(np.float64), -1)
                  / exact[:, None]).max() < 1e-5


def first_tokens(accepted, token, drafts):
    """The first emitted token of each row: the draft if it was accepted, else the sample."""
    return np.where(np.array(accepted) > 0, drafts[:, 0], np.array(token))


def chi_square_ok(counts, probs):
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = keep.sum() - 1
    return stat < dof + 5 * np.sqrt(2 * dof)


@pytest.mark.parametrize("top_k,kind", [(0, "dense"), (3, "dense"), (0, "candidates")])
def test_verify_sample_mlx_emits_the_target_distribution(top_k, kind):
    """The first emitted token of 20,000 rows (a draft from q, accepted or not) follows p."""
    rng = np.random.default_rng(top_k)
    B, L, V, T = 20000, 2, 8, 0.9
    row_logits = (rng.standard_normal((L + 1, V)) * 1.5).astype(np.float32)
    logits = mx.broadcast_to(mx.array(row_logits), (B, L + 1, V))
    p0 = np.array(kernels.target_probs(mx.array(row_logits[0]), T, top_k), np.float64)
    q = np.abs(rng.standard_normal((L, V))) + 0.05
    if kind == "candidates":  # 3 candidates per position
        ids = np.stack([rng.choice(V, 3, replace=False) for _ in range(L)]).astype(np.uint32)
        probs = np.take_along_axis(q, ids.astype(np.int64), -1)
        probs /= probs.sum(-1, keepdims=True)
        drafts = np.stack([ids[i, rng.choice(3, B, p=probs[i])] for i in range(L)], 1)
        out = kernels.verify_sample_candidates_mlx(
            logits, mx.array(drafts), mx.broadcast_to(mx.array(ids), (B, L, 3)),
            mx.broadcast_to(mx.array(probs.astype(np.float32)), (B, L, 3)),
            mx.array(rng.random((B, L + 1)).astype(np.float32)), T, top_k)
    else:
        q /= q.sum(-1, keepdims=True)
        drafts = np.stack([rng.choice(V, B, p=q[i]) for i in range(L)], 1).astype(np.uint32)
        out = kernels.verify_sample_mlx(
            logits, mx.array(drafts), mx.broadcast_to(mx.array(q.astype(np.float32)), (B, L, V)),
            mx.array(rng.random((B, L + 1)).astype(np.float32)), T, top_k)
    counts = np.bincount(first_tokens(*out, drafts), minlength=V)
    assert chi_square_ok(counts, p0)
