"""The Metal kernels (metal_kernels/), compiled as C++ by tests/kernel_harness.py, against the
MLX path of mlx_dflash.kernels on random inputs and edge cases.

Integer outputs must be bit-equal. The sampled ones (verify_sample_*, path_select at T > 0)
are functions of float32 probabilities that the kernel and MLX compute in different orders
(and with different exp), so a float64 reference of each row decides: where every decision
on the way has a margin, both paths must give exactly the reference's output; a row is a
rounding tie when an acceptance test u * q < p is within a relative ACCEPT_TOL = 2e-5 of
equality, or the inverse-CDF target within CDF_TOL = 3e-6 of a token boundary (over a total
mass of 1; over a residual of mass m, 3e-6 / m, since an error e * p_i in every p_i moves the
residual's CDF by e / m), and then each path's output must be one the reference admits
within those tolerances. The tolerances are ~10x the largest errors measured on the MLX path
over 151,936 tokens (2e-6 relative in p, 2.6e-7 in the normalised CDF; the C++ kernel, with
chunked sums and libm's exp, is closer to float64). Float outputs (path_select's proposals)
agree within 1e-6 absolute. Each kernel runs under several schedules of its threads (see
metal_kernels/harness/metal_shim.h).
"""

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import (
    Arg,
    KernelError,
    launch,
    launch_verify,
    needs_compiler,
    remove_nth,
    settle,
)

from mlx_dflash import kernels
from mlx_dflash.kernels import (
    PATH_SELECT_GREEDY,
    PATH_SELECT_SAMPLE,
    SAMPLE_ROWS,
    VERIFY_GREEDY,
    VERIFY_SAMPLE_CANDIDATES,
    VERIFY_SAMPLE_DENSE,
    KernelSpec,
)

pytestmark = needs_compiler

ACCEPT_TOL = 2e-5  # relative, on u * q against p
CDF_TOL = 3e-6  # absolute, on the inverse-CDF target over a total mass of 1
MAX_TIE_SHARE = 0.5
ORDERS = ("forward", "reverse", "shuffled")


# ---------------------------------------------------------------------------------------------
# Running both paths


def harness_verify_greedy(logits, drafts, threads, order="forward", dtype=None, **kw):
    return launch_verify(VERIFY_GREEDY, [Arg.of(logits, dtype)], drafts, logits.shape[1],
                         threads, order=order, **kw)


def harness_verify_sample(logits, drafts, proposal, u, temperature, top_k, threads,
                          order="forward"):
    """proposal: ("dense", q [B, L, V]) or ("candidates", ids [B, L, K], probs [B, L, K])."""
    B, L = drafts.shape
    kind, *arrays = proposal
    dummy = np.zeros(1, np.uint32)
    inputs = [Arg.of(logits), Arg.of(drafts if L else dummy, "uint32")]
    if kind == "dense":
        spec, template = VERIFY_SAMPLE_DENSE, None
        inputs.append(Arg.of(arrays[0] if L else dummy, "float32"))
    else:
        spec, template = VERIFY_SAMPLE_CANDIDATES, [("K", arrays[0].shape[-1])]
        inputs += [Arg.of(arrays[0] if L else dummy, "uint32"),
                   Arg.of(arrays[1] if L else dummy, "float32")]
    inputs += [Arg.of(u, "float32"), Arg.of(np.float32(1.0 / temperature)),
               Arg.of(np.int32(top_k))]
    return launch_verify(spec, inputs, drafts, L + 1, threads, template=template, order=order)


def mlx_verify_sample(logits, drafts, proposal, u, temperature, top_k):
    kind, *arrays = proposal
    args = [mx.array(a) for a in arrays]
    fn = kernels.verify_sample_mlx if kind == "dense" else kernels.verify_sample_candidates_mlx
    accepted, token = fn(mx.array(logits), mx.array(drafts), *args, mx.array(u),
                         temperature, top_k)
    return [np.array(accepted), np.array(token)]


def harness_path_select(first, rest, u, temperature, order="forward"):
    B, K = first.shape
    n = rest.shape[1] + 1
    rest = rest if n > 1 else np.zeros(1, np.float32)
    common = dict(grid=B * 32, threadgroup=32, template=[("K", K)], order=order)
    if temperature == 0:
        return launch(PATH_SELECT_GREEDY, [Arg.of(first), Arg.of(rest), Arg.of(np.int32(n))],
                      [(B, n)], ["uint32"], **common)
    return launch(PATH_SELECT_SAMPLE,
                  [Arg.of(first), Arg.of(rest), Arg.of(u, "float32"), Arg.of(np.int32(n)),
                   Arg.of(np.float32(1.0 / temperature))],
                  [(B, n), (B, n, K)], ["uint32", "float32"], **common)


# ---------------------------------------------------------------------------------------------
# A float64 reference for the sampled decisions and their margins


def softmax64(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k_keep(x, k):
    """The k largest of a row, ties at the k-th value to the lowest ids (as top_k_mask)."""
    if not 0 < k < x.shape[-1]:
        return np.ones(x.shape, bool)
    order = np.lexsort((np.arange(x.shape[-1]), -x.astype(np.float64)))
    keep = np.zeros(x.shape, bool)
    keep[order[:k]] = True
    return keep


def sample_reference(weights, u):
    """Inverse CDF in float64: (index, the CDF interval of that index), over a total of 1."""
    w = np.asarray(weights, np.float64)
    c = np.cumsum(w) / w.sum()
    hit = np.flatnonzero((c > u) & (w > 0))
    j = hit[0] if hit.size else np.flatnonzero(w > 0)[-1]
    return j, (c[j - 1] if j else 0.0, c[j])


def interval_margin(u, interval):
    return min(u - interval[0], interval[1] - u)


class RowReference:
    """The rejection step of one row in float64, with the margin of every decision."""

    def __init__(self, logits, drafts, q_rows, u, temperature, top_k):
        self.L, self.u, self.q_rows = drafts.shape[0], u.astype(np.float64), q_rows
        x = logits.astype(np.float64)
        keep = np.stack([top_k_keep(row, top_k) for row in logits])
        self.p = np.where(keep, softmax64(np.where(keep, x / temperature, -np.inf)), 0.0)
        a = np.array([self.u[i] * q_rows(i)[d] for i, d in enumerate(drafts)])
        b = np.array([self.p[i, d] for i, d in enumerate(drafts)])
        self.accepts = a < b
        scale = np.maximum(a, b)
        self.accept_tie = (scale > 0) & (np.abs(a - b) <= ACCEPT_TOL * scale)
        stops = np.flatnonzero(~self.accepts)
        self.accepted = int(stops[0]) if stops.size else self.L

    def residual(self, position):
        """Weights of the sample after ``position`` acceptances, and the CDF tolerance."""
        p = self.p[position]
        if position == self.L:
            return p, CDF_TOL
        r = np.maximum(p - self.q_rows(position), 0.0)
        if not r.sum() > 0:
            return p, CDF_TOL
        # An error of e * p_i in each p_i moves the normalised residual CDF by up to e / mass.
        return r, CDF_TOL / r.sum()

    def expected(self):
        """(accepted, token, tie): tie when a decision on the way is within tolerance."""
        weights, tol = self.residual(self.accepted)
        token, interval = sample_reference(weights, self.u[self.L])
        tie = self.accept_tie[: self.accepted + 1].any()
        return self.accepted, token, bool(tie or interval_margin(self.u[self.L], interval) <= tol)

    def admits(self, accepted, token):
        """Whether (accepted, token) is what the step gives up to the tolerances."""
        for i in range(min(accepted + 1, self.L)):
            if (i < accepted) != self.accepts[i] and not self.accept_tie[i]:
                return False
        weights, tol = self.residual(accepted)
        if not 0 <= token < weights.size or weights[token] <= 0:
            return False
        c = np.cumsum(weights) / weights.sum()
        below = c[token - 1] if token else 0.0
        return below - tol <= self.u[self.L] < c[token] + tol


def assert_agree_up_to_ties(outputs, references):
    """outputs: [(accepted [B], token [B])] from each path. Rows without a tie: bit-equal to
    the reference; rows with one: admitted by it. Returns the number of tie rows."""
    ties = 0
    for b, ref in enumerate(references):
        accepted, token, tie = ref.expected()
        ties += tie
        for out_accepted, out_token in outputs:
            got = (int(out_accepted[b]), int(out_token[b]))
            if tie:
                assert ref.admits(*got), f"row {b}: {got} is not admissible"
            else:
                assert got == (accepted, token), f"row {b}: {got} != {(accepted, token)}"
    return ties


# ---------------------------------------------------------------------------------------------
# verify_greedy


def greedy_case(rng, B, L, V, dtype=np.float32):
    """Logits and drafts whose rows stop at different positions (all accepted, none, ...)."""
    logits = rng.standard_normal((B, L + 1, V)).astype(dtype)
    drafts = logits.argmax(-1)[:, :L].astype(np.uint32)
    for b in range(B):
        stop = rng.integers(0, L + 1) if b >= 2 else (L if b == 0 else 0)
        if stop < L:  # row 0 accepts everything, row 1 nothing, others a random prefix
            drafts[b, stop] = (drafts[b, stop] + 1 + rng.integers(V - 1)) % V
    return logits, drafts


@pytest.mark.parametrize("B,L,V,threads", [
    (1, 0, 1000, 32), (4, 16, 151936, 256), (3, 7, 32000, 128), (2, 16, 5003, 64),
    (4, 3, 100, 128), (1, 5, 151936, 1024)])
def test_verify_greedy_matches_mlx(B, L, V, threads):
    rng = np.random.default_rng(B * 1000 + L * 10 + threads)
    logits, drafts = greedy_case(rng, B, L, V)
    expected = kernels.verify_greedy_mlx(mx.array(logits), mx.array(drafts))
    for order in ORDERS:
        accepted, token = harness_verify_greedy(logits, drafts, threads, order)
        assert accepted.tolist() == expected[0].tolist()
        assert token.tolist() == expected[1].tolist()
    if L:
        assert expected[0].tolist()[:2] == [L, 0][:B]  # the edge rows are there


def test_verify_greedy_ties_go_to_the_lowest_id():
    V, threads = 4099, 128
    logits = np.zeros((3, 3, V), np.float32)
    # Row 0: maxima in different threads and simdgroups; row 1: everything equal; row 2: -inf.
    for pos, ids in enumerate([(4000, 77, 2051, 3), (129, 128, 4098), (64, 4096, 65)]):
        logits[0, pos, list(ids)] = 5.0
    logits[2] = -np.inf
    drafts = np.array([[3, 128], [0, 0], [0, 1]], np.uint32)
    expected_mlx = kernels.verify_greedy_mlx(mx.array(logits), mx.array(drafts))
    assert expected_mlx[0].tolist() == [2, 2, 1] and expected_mlx[1].tolist() == [64, 0, 0]
    for order in ORDERS:
        accepted, token = harness_verify_greedy(logits, drafts, threads, order)
        assert accepted.tolist() == [2, 2, 1] and token.tolist() == [64, 0, 0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_verify_greedy_half_precision_logits_with_natural_ties(dtype):
    rng = np.random.default_rng(5)
    B, L, V = 3, 6, 151936
    logits = mx.array(rng.standard_normal((B, L + 1, V)).astype(np.float32)).astype(
        getattr(mx, dtype))
    tokens = np.array(mx.argmax(logits, axis=-1))
    drafts = tokens[:, :L].astype(np.uint32)
    drafts[1, 4] = (drafts[1, 4] + 1) % V
    raw = np.array(logits.view(mx.uint16)) if dtype == "bfloat16" else np.array(logits)
    expected = kernels.verify_greedy_mlx(logits, mx.array(drafts))
    accepted, token = harness_verify_greedy(raw, drafts, 256, "reverse", dtype)
    assert accepted.tolist() == expected[0].tolist() == [L, 4, L]
    assert token.tolist() == expected[1].tolist()


# ---------------------------------------------------------------------------------------------
# verify_sample


def sample_case(rng, B, L, V, temperature, top_k, kind, K=16, spread=2.5):
    """Target logits, and a drafter close to them (closer in some rows than in others) so
    that acceptance lengths vary."""
    logits = (rng.standard_normal((B, L + 1, V)) * spread).astype(np.float32)
    noise = np.array([0.05, 0.3, 1.0, 0.15])[np.arange(B) % 4, None, None]
    draft_logits = logits[:, :L] + (noise * rng.standard_normal((B, L, V))).astype(np.float32)
    if 0 < top_k < V:  # the drafter samples under the same filter, as in decoding
        cut = -np.sort(-draft_logits, axis=-1)[..., top_k - 1 : top_k]
        draft_logits = np.where(draft_logits >= cut, draft_logits, -np.inf)
    drafts = np.zeros((B, L), np.uint32)
    if kind == "dense":
        q = softmax64(draft_logits / temperature)
        for b in range(B):
            for i in range(L):
                drafts[b, i] = rng.choice(V, p=q[b, i])
        proposal = ("dense", q.astype(np.float32))
    else:
        ids = np.argsort(-draft_logits, axis=-1, kind="stable")[..., :K].astype(np.uint32)
        probs = softmax64(np.take_along_axis(draft_logits, ids.astype(np.int64), -1)
                          / temperature)
        for b in range(B):
            for i in range(L):
                drafts[b, i] = ids[b, i, rng.choice(K, p=probs[b, i])]
        proposal = ("candidates", ids, probs.astype(np.float32))
    u = rng.random((B, L + 1)).astype(np.float32)
    return logits, drafts, proposal, u


def q_rows_of(proposal, b, V):
    kind, *arrays = proposal
    if kind == "dense":
        return lambda i: arrays[0][b, i].astype(np.float64)

    def row(i):
        q = np.zeros(V)
        q[arrays[0][b, i]] = arrays[1][b, i]
        return q
    return row


def check_verify_sample(case, temperature, top_k, threads, orders=ORDERS):
    """Both paths against the reference; returns (rows, tie rows, reference accepted)."""
    logits, drafts, proposal, u = case
    B, V = logits.shape[0], logits.shape[-1]
    refs = [RowReference(logits[b], drafts[b], q_rows_of(proposal, b, V), u[b], temperature,
                         top_k) for b in range(B)]
    outputs = [mlx_verify_sample(logits, drafts, proposal, u, temperature, top_k)]
    outputs += [harness_verify_sample(logits, drafts, proposal, u, temperature, top_k,
                                      threads, order) for order in orders]
    ties = assert_agree_up_to_ties(outputs, refs)
    return B, ties, [r.accepted for r in refs]


SAMPLE_SHAPES = [  # B, L, V, threads, temperature, top_k, kind
    (4, 16, 151936, 256, 1.0, 0, "dense"),
    (2, 7, 151936, 512, 0.7, 40, "dense"),
    (3, 4, 32000, 128, 1.3, 1, "dense"),
    (1, 0, 5000, 64, 0.8, 0, "dense"),
    (4, 12, 20000, 128, 0.6, 0, "candidates"),
    (2, 16, 151936, 256, 1.0, 20, "candidates"),
    (3, 5, 3000, 64, 0.9, 0, "candidates"),
]


def test_verify_sample_matches_mlx_on_random_shapes():
    rows = ties = 0
    accepted = []
    for n, (B, L, V, threads, T, top_k, kind) in enumerate(SAMPLE_SHAPES):
        rng = np.random.default_rng(100 + n)
        case = sample_case(rng, B, L, V, T, top_k, kind)
        b, t, reference_accepted = check_verify_sample(case, T, top_k, threads)
        rows, ties = rows + b, ties + t
        accepted += reference_accepted
    assert ties <= MAX_TIE_SHARE * rows, f"{ties} of {rows} rows are rounding ties"
    assert len(set(accepted)) >= 4  # acceptance lengths vary: the comparison has teeth


def test_verify_sample_all_and_none_accepted():
    rng = np.random.default_rng(7)
    B, L, V, T = 2, 5, 4096, 1.0
    logits, drafts, (_, q), u = sample_case(rng, B, L, V, T, 0, "dense")
    # Row 0: u = 0 accepts every draft of positive target probability (then the bonus from
    # p_L). Row 1: q is a point mass on the target's least likely token, u near 1: rejected.
    drafts[0] = logits[0, :L].argmax(-1)
    u[0, :L] = 0.0
    drafts[1] = logits[1, :L].argmin(-1)
    q[1] = 0.0
    q[1, np.arange(L), drafts[1]] = 1.0
    u[1, :L] = 0.999
    _, _, accepted = check_verify_sample((logits, drafts, ("dense", q), u), T, 0, 128)
    assert accepted == [L, 0]


def test_verify_sample_zero_mass_residual_falls_back_to_p():
    # Two tokens of equal logit, the rest -inf: p = (1/2, 1/2) exactly on both paths. q = p,
    # and the draft is a token of probability 0 under both: rejected with an empty residual.
    V, L = 300, 2
    logits = np.full((4, L + 1, V), -np.inf, np.float32)
    logits[:, :, [40, 250]] = 1.5
    q = np.zeros((4, L, V), np.float32)
    q[:, :, [40, 250]] = 0.5
    drafts = np.full((4, L), 7, np.uint32)
    u = np.zeros((4, L + 1), np.float32)
    u[:, L] = [0.0, 0.49, 0.5, 0.99]
    expected = [[0, 0, 0, 0], [40, 40, 250, 250]]
    out = mlx_verify_sample(logits, drafts, ("dense", q), u, 1.0, 0)
    assert [o.tolist() for o in out] == expected
    for order in ORDERS:
        out = harness_verify_sample(logits, drafts, ("dense", q), u, 1.0, 0, 64, order)
        assert [o.tolist() for o in out] == expected
    ids = np.tile(np.array([40, 250], np.uint32), (4, L, 1))
    probs = np.full((4, L, 2), 0.5, np.float32)
    out = harness_verify_sample(logits, drafts, ("candidates", ids, probs), u, 1.0, 0, 64)
    assert [o.tolist() for o in out] == expected


def test_verify_sample_top_k_ties_keep_the_lowest_ids():
    # bfloat16-like logits: many equal values at the k-th place.
    rng = np.random.default_rng(11)
    B, L, V, k = 3, 4, 50000, 50
    logits = np.round(rng.standard_normal((B, L + 1, V)) * 8) / 8
    logits = logits.astype(np.float32)
    kth = -np.sort(-logits, axis=-1)[..., k - 1]
    at_kth = (logits == kth[..., None]).sum(-1)
    above = (logits > kth[..., None]).sum(-1)
    assert ((at_kth > 1) & (above + at_kth > k)).all()  # the ties are cut
    keep = np.array(kernels.top_k_mask(mx.array(logits), k))
    np.testing.assert_array_equal(keep, np.stack([[top_k_keep(r, k) for r in b] for b in logits]))
    drafts = np.zeros((B, L), np.uint32)
    for b in range(B):  # drafts among the kept tokens and the ties that are cut
        for i in range(L):
            tied = np.flatnonzero(logits[b, i] == kth[b, i])
            drafts[b, i] = tied[-1] if (b + i) % 2 else tied[0]
    q = np.zeros((B, L, V), np.float32)
    q[np.arange(B)[:, None], np.arange(L)[None], drafts] = 1.0
    u = rng.random((B, L + 1)).astype(np.float32) * 1e-3
    check_verify_sample((logits, drafts, ("dense", q), u), 1.0, k, 128)


def test_verify_sample_point_mass_candidates():
    # A copied block: K = 1 candidate of probability 1 per position.
    rng = np.random.default_rng(3)
    B, L, V = 3, 9, 8000
    logits, drafts, _, u = sample_case(rng, B, L, V, 1.0, 0, "dense", spread=4.0)
    drafts[:, :5] = logits[:, :5].argmax(-1)
    proposal = ("candidates", drafts[..., None].copy(), np.ones((B, L, 1), np.float32))
    rows, ties, _ = check_verify_sample((logits, drafts, proposal, u), 1.0, 0, 64)
    assert ties < rows


@pytest.mark.parametrize("top_k,kind", [(0, "dense"), (3, "dense"), (0, "candidates")])
def test_verify_sample_kernel_emits_the_target_distribution(top_k, kind):
    """The first emitted token of 4,000 rows (a draft from q, accepted or not) follows p:
    chi-square below dof + 5 sqrt(2 dof), and no token of probability 0."""
    rng = np.random.default_rng(20 + top_k)
    B, L, V, T = 4000, 2, 8, 0.9
    logits = np.broadcast_to((rng.standard_normal((L + 1, V)) * 1.5).astype(np.float32),
                             (B, L + 1, V))
    keep = top_k_keep(logits[0, 0], top_k)
    p0 = np.where(keep, softmax64(np.where(keep, logits[0, 0] / T, -np.inf)), 0.0)
    q = np.abs(rng.standard_normal((L, V))) + 0.05
    if kind == "candidates":  # 3 candidates per position
        ids = np.stack([rng.choice(V, 3, replace=False) for _ in range(L)]).astype(np.uint32)
        probs = np.take_along_axis(q, ids.astype(np.int64), -1)
        probs /= probs.sum(-1, keepdims=True)
        drafts = np.stack([ids[i, rng.choice(3, B, p=probs[i])] for i in range(L)], 1)
        proposal = ("candidates", np.broadcast_to(ids, (B, L, 3)),
                    np.broadcast_to(probs.astype(np.float32), (B, L, 3)))
    else:
        q /= q.sum(-1, keepdims=True)
        drafts = np.stack([rng.choice(V, B, p=q[i]) for i in range(L)], 1)
        proposal = ("dense", np.broadcast_to(q.astype(np.float32), (B, L, V)))
    u = rng.random((B, L + 1)).astype(np.float32)
    accepted, token = harness_verify_sample(logits, drafts.astype(np.uint32), proposal, u, T,
                                            top_k, 32)
    first = np.where(accepted > 0, drafts[:, 0], token)
    counts = np.bincount(first, minlength=V)
    assert counts[p0 == 0].sum() == 0
    expected = p0[p0 > 0] * B
    stat = ((counts[p0 > 0] - expected) ** 2 / expected).sum()
    dof = (p0 > 0).sum() - 1
    assert stat < dof + 5 * np.sqrt(2 * dof), f"chi2 {stat:.1f} with {dof} dof"


# ---------------------------------------------------------------------------------------------
# sample_rows: a tree's target choices


def harness_sample_rows(logits, u, temperature, top_k, threads, order="forward"):
    R = logits.shape[0]
    inputs = [Arg.of(logits), Arg.of(u, "float32"), Arg.of(np.float32(1.0 / temperature)),
              Arg.of(np.int32(top_k))]
    return launch(SAMPLE_ROWS, inputs, [(R,)], ["uint32"], grid=R * threads,
                  threadgroup=threads, order=order)[0]


@pytest.mark.parametrize("V,threads,temperature,top_k", [
    (151936, 256, 1.0, 0), (32000, 128, 0.7, 40), (5003, 64, 1.3, 1), (3000, 64, 0.9, 0)])
def test_sample_rows_matches_the_reference(V, threads, temperature, top_k):
    """Each row's draw equals the float64 inverse CDF's, on both paths, unless the uniform is
    within CDF_TOL of a token boundary (then a token the reference admits there)."""
    rng = np.random.default_rng(V + top_k)
    R = 6
    logits = (rng.standard_normal((R, V)) * 2.5).astype(np.float32)
    u = rng.random(R).astype(np.float32)
    outputs = [np.array(kernels.sample_rows_mlx(mx.array(logits), mx.array(u), temperature,
                                                top_k))]
    outputs += [harness_sample_rows(logits, u, temperature, top_k, threads, order)
                for order in ORDERS]
    ties = 0
    for r in range(R):
        keep = top_k_keep(logits[r], top_k)
        p = np.where(keep, softmax64(np.where(keep, logits[r] / temperature, -np.inf)), 0.0)
        token, interval = sample_reference(p, u[r])
        if interval_margin(u[r], interval) > CDF_TOL:
            assert all(int(out[r]) == token for out in outputs), r
            continue
        ties += 1
        c = np.cumsum(p)
        for out in outputs:
            t = int(out[r])
            assert p[t] > 0 and (c[t - 1] if t else 0.0) - CDF_TOL <= u[r] < c[t] + CDF_TOL
    assert ties < R


def test_sample_rows_nan_rows_give_the_last_token():
    logits = np.random.default_rng(0).standard_normal((3, 500)).astype(np.float32)
    logits[1] = np.nan
    u = np.full(3, 0.5, np.float32)
    want = np.array(kernels.sample_rows_mlx(mx.array(logits), mx.array(u))).tolist()
    assert want[1] == 499
    for order in ORDERS:
        assert harness_sample_rows(logits, u, 1.0, 0, 64, order).tolist() == want


# ---------------------------------------------------------------------------------------------
# path_select


def lattice(rng, B, n, K=16, rank=256, vocab=2000):
    """The selector's scores as CandidateSelector.lattice builds them (rank-256 codebooks)."""
    pred = rng.standard_normal((vocab, rank)).astype(np.float32) * 0.1
    succ = rng.standard_normal((vocab, rank)).astype(np.float32) * 0.1
    proj = rng.standard_normal((B, n, rank)).astype(np.float32)
    cand = np.stack([[rng.choice(vocab, K, replace=False) for _ in range(n)]
                     for _ in range(B)])
    unary = np.sort(rng.standard_normal((B, n, K)).astype(np.float32) * 2, axis=-1)[..., ::-1]
    anchor = rng.integers(vocab, size=B)
    first = unary[:, 0] + np.einsum("bkr,br->bk", succ[cand[:, 0]], pred[anchor] * proj[:, 0])
    prev = pred[cand[:, :-1]] * proj[:, 1:, None, :]  # [B, n-1, K, r]
    rest = unary[:, 1:, None, :] + np.einsum("ztar,ztcr->ztac", prev, succ[cand[:, 1:]])
    return first.astype(np.float32), rest.astype(np.float32)


@pytest.mark.parametrize("B,n", [(1, 1), (1, 16), (4, 7), (3, 15), (2, 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_path_select_matches_mlx(B, n, temperature):
    rng = np.random.default_rng(B * 100 + n)
    first, rest = lattice(rng, B, n)
    u = rng.random((B, n)).astype(np.float32)
    picks, probs = kernels.path_select_mlx(mx.array(first), mx.array(rest), mx.array(u),
                                           temperature)
    for order in ORDERS:
        out = harness_path_select(first, rest, u, temperature, order)
        if temperature == 0:
            assert out[0].tolist() == picks.tolist()
            continue
        np.testing.assert_allclose(out[1], np.array(probs), atol=1e-6, rtol=0)
        ties = walk_ties(first, rest, u, temperature, np.array(picks))
        assert (out[0][~ties] == np.array(picks)[~ties]).all()
        assert ties.mean() <= MAX_TIE_SHARE


def walk_ties(first, rest, u, temperature, picks):
    """Rows whose sampled walk passes within CDF_TOL of a boundary (float64, along picks)."""
    ties = np.zeros(first.shape[0], bool)
    for b in range(first.shape[0]):
        rows = first[b]
        for t in range(picks.shape[1]):
            if t:
                rows = rest[b, t - 1, picks[b, t - 1]]
            _, interval = sample_reference(softmax64(rows.astype(np.float64) / temperature),
                                           float(u[b, t]))
            ties[b] |= interval_margin(float(u[b, t]), interval) <= CDF_TOL
    return ties


def test_path_select_greedy_ties_take_the_lowest_candidate():
    first = np.zeros((2, 16), np.float32)
    first[0, [5, 9]] = 1.0
    rest = np.zeros((2, 2, 16, 16), np.float32)
    rest[0, 0, 5, [3, 12]] = 2.0
    rest[0, 1, 3, :] = -1.0  # all equal: candidate 0
    rest[1, 0, 0, [15, 14]] = 1.0
    expected = [[5, 3, 0], [0, 14, 0]]
    picks, _ = kernels.path_select_mlx(mx.array(first), mx.array(rest))
    assert picks.tolist() == expected
    for order in ORDERS:
        assert harness_path_select(first, rest, None, 0.0, order)[0].tolist() == expected


# ---------------------------------------------------------------------------------------------
# NaN logits and scores: a token id always, the one the MLX path gives


def test_nan_logits_give_the_mlx_paths_tokens():
    """All-NaN rows and NaN among numbers: mx.argmax counts NaN above everything (the first
    NaN wins); the kernel used to return 0xFFFFFFFF for an all-NaN row."""
    rng = np.random.default_rng(5)
    V = 300
    logits = rng.standard_normal((3, 4, V)).astype(np.float32)
    logits[0] = np.nan
    logits[1, :, [7, 100]] = np.nan
    drafts = np.array([[0, 0, 0], [7, 7, 9], [1, 2, 3]], np.uint32)
    want = [np.array(a) for a in kernels.verify_greedy_mlx(mx.array(logits), mx.array(drafts))]
    assert want[0].tolist() == [3, 2, 0] and want[1].tolist()[:2] == [0, 7]
    for order in ORDERS:
        got = harness_verify_greedy(logits, drafts, 64, order)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
    q = np.full((3, 3, V), 1.0 / V, np.float32)
    u = np.full((3, 4), 0.5, np.float32)
    want = mlx_verify_sample(logits, drafts, ("dense", q), u, 1.0, 0)
    got = harness_verify_sample(logits, drafts, ("dense", q), u, 1.0, 0, 64)
    assert got[1][0] == V - 1 and got[1][1] == V - 1  # no positive weight: the last token
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_scores_keep_the_walk_in_bounds(temperature):
    rng = np.random.default_rng(6)
    K, n = 16, 4
    first = rng.standard_normal((2, K)).astype(np.float32)
    rest = rng.standard_normal((2, n - 1, K, K)).astype(np.float32)
    first[0] = np.nan
    rest[1, 0] = np.nan
    u = np.full((2, n), 0.5, np.float32)
    picks, probs = kernels.path_select_mlx(mx.array(first), mx.array(rest),
                                           mx.array(u) if temperature else None, temperature)
    got = harness_path_select(first, rest, u, temperature)
    assert got[0].tolist() == np.array(picks).tolist()
    assert (got[0] < K).all()


# ---------------------------------------------------------------------------------------------
# Threads agree on every branch even when simdgroups round sums differently


def test_every_thread_takes_the_acceptance_branch_thread_0_takes():
    """With the harness's simd_sum skewed per simdgroup (DFLASH_HARNESS_SIMD_SKEW: simdgroup g
    sums to (1 + g e) times the sum), uniforms swept across the acceptance threshold of one
    draft. Each simdgroup used to decide from its own simd_sum of the partials: where they
    disagreed, some threads went on to the next position while others sampled, and the
    barriers no longer matched (a GPU hangs). Thread 0 now decides for all."""
    rng = np.random.default_rng(8)
    V, rows, threads = 4096, 41, 128
    logits = np.repeat(rng.standard_normal((1, 2, V)).astype(np.float32), rows, axis=0)
    d = 11
    q = np.full((rows, 1, V), 1.0 / V, np.float32)
    q[:, 0, d] = 0.5
    p_d = softmax64(logits[0, 0])[d]
    u = np.zeros((rows, 2), np.float32)
    u[:, 0] = p_d / 0.5 * (1 + np.linspace(-4e-3, 4e-3, rows))
    u[:, 1] = 0.5
    drafts = np.full((rows, 1), d, np.uint32)
    inputs = [Arg.of(logits), Arg.of(drafts), Arg.of(q), Arg.of(u), Arg.of(np.float32(1.0)),
              Arg.of(np.int32(0))]
    for order in ORDERS:
        accepted, token = launch_verify(VERIFY_SAMPLE_DENSE, inputs, drafts, 2, threads,
                                        order=order,
                                        defines={"DFLASH_HARNESS_SIMD_SKEW": "1e-3"})
        assert set(accepted.tolist()) == {0, 1}  # the sweep crosses the threshold
        assert (token < V).all()


# ---------------------------------------------------------------------------------------------
# The harness itself catches races


BARRIER = r"metal::threadgroup_barrier\(metal::mem_flags::mem_threadgroup\);"


# verify_greedy's body with a threadgroup per row walking its positions: threadgroup_argmax
# called again and again, as a reduction in a loop is (its second barrier guards that).
ARGMAX_PER_POSITION = """
DFLASH_THREADGROUP(uint, key_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, id_partials, kMaxSimdgroups);
const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint positions = uint(logits_shape[1]);
const uint vocab = uint(logits_shape[2]);
for (uint pos = 0; pos < positions; pos++) {
  const uint group = threadgroup_position_in_grid.x * positions + pos;
  uint best = 0;
  uint best_id = kNoIndex;
  for (uint i = tg.tid; i < vocab; i += tg.n_threads) {
    uint key = order_key(float(logits[size_t(group) * vocab + i]));
    if (key > best || best_id == kNoIndex) {
      best = key;
      best_id = i;
    }
  }
  const uint token = threadgroup_argmax(best, best_id, tg, key_partials, id_partials);
  if (tg.tid == 0) {
    tokens[group] = token;
  }
}
"""


def test_harness_catches_each_missing_barrier_of_the_argmax():
    """threadgroup_argmax (common.h), called once per position by a threadgroup per row,
    with either of its barriers deleted from a copy of its source: the writes of one
    simdgroup race with the reads of another, and some schedule of the harness gives a wrong
    answer or a stall."""
    rng = np.random.default_rng(1)
    logits, drafts = greedy_case(rng, 4, 8, 3000)
    expected = [a.tolist() for a in kernels.verify_greedy_mlx(mx.array(logits),
                                                               mx.array(drafts))]

    def per_row(order, header=None):
        raw = launch(VERIFY_GREEDY, [Arg.of(logits)], [(4, 9)], ["uint32"], grid=4 * 128,
                     threadgroup=128, order=order, source=ARGMAX_PER_POSITION, header=header)
        return settle(VERIFY_GREEDY, raw, drafts)

    header = VERIFY_GREEDY.header()
    start = header.index("inline uint threadgroup_argmax")
    end = header.index("inline bool threadgroup_decide")
    n_barriers = header[start:end].count("threadgroup_barrier(")
    assert n_barriers == 2
    first = header[:start].count("threadgroup_barrier(")
    for n in range(first, first + n_barriers):
        broken = remove_nth(header, BARRIER, n)
        caught = []
        for order in ORDERS:
            try:
                caught.append([a.tolist() for a in per_row(order, broken)] != expected)
            except KernelError:
                caught.append(True)
        assert any(caught), f"removing barrier {n} went unnoticed"
    # and the intact sources pass under the same schedules
    for order in ORDERS:
        assert [a.tolist() for a in per_row(order)] == expected
        out = harness_verify_greedy(logits, drafts, 128, order)
        assert [a.tolist() for a in out] == expected


def test_harness_catches_a_missing_barrier_in_the_sampler():
    """verify_sample_dense with the barrier after the radix-select histogram is read deleted
    (the next pass clears it while other simdgroups still read it)."""
    rng = np.random.default_rng(2)
    case = sample_case(rng, 2, 3, 3000, 1.0, 30, "dense")
    header = VERIFY_SAMPLE_DENSE.header()
    target = header.index("prefix |= digit << shift;")
    n = header[:target].count("threadgroup_barrier(")
    broken = remove_nth(header, BARRIER, n)
    logits, drafts, (_, q), u = case
    inputs = [Arg.of(logits), Arg.of(drafts), Arg.of(q), Arg.of(u), Arg.of(np.float32(1.0)),
              Arg.of(np.int32(30))]
    good = harness_verify_sample(logits, drafts, ("dense", q), u, 1.0, 30, 128)
    caught = []
    for order in ORDERS:
        try:
            out = launch_verify(VERIFY_SAMPLE_DENSE, inputs, drafts, 4, 128, order=order,
                                header=broken)
            caught.append([a.tolist() for a in out] != [a.tolist() for a in good])
        except KernelError:
            caught.append(True)
    assert any(caught)


DIVERGENT = KernelSpec("divergent_barrier", "divergent.metal", (), ("x",), ("y",))


def test_harness_reports_a_barrier_not_every_thread_reaches():
    source = """
    if (thread_index_in_threadgroup < 32) {
      metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    }
    y[thread_index_in_threadgroup] = x[0];
    """
    with pytest.raises(KernelError, match="barrier"):
        launch(DIVERGENT, [Arg.of(np.ones(8, np.float32))], [(64,)], ["float32"], grid=64,
               threadgroup=64, source=source, header="")
