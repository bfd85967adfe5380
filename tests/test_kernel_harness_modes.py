"""The harness's strict modes (kernel_harness.Mode, metal_kernels/harness/metal_shim.h): each
catches the fault it targets on a deliberately broken copy of a kernel, which the plain fiber
harness lets pass, while the real kernels pass under it.

  garbage           threadgroup memory starts as NaN floats / 0xA5 bytes (a read before any
                    write gives a wrong answer; zeros used to hide it)
  switch_on_shared  with the shuffled order, a fiber may switch at every threadgroup-memory
                    access (races between barriers with no collective in between)
  check_sites       lanes of a simdgroup in one collective from different source lines (a
                    divergent call on a GPU, over part of the lanes) is an error
  os_threads        one std::thread per GPU thread, real barriers and atomics
  address_spaces    clang, device/constant/threadgroup as distinct address spaces: a pointer
                    of one passed where another is declared fails to compile, as in Metal
"""

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import (
    Arg,
    KernelError,
    Mode,
    STRICT,
    clang,
    launch,
    launch_verify,
    needs_compiler,
)

from mlx_dflash import kernels
from mlx_dflash.kernels import (
    PATH_SELECT_SAMPLE,
    VERIFY_GREEDY,
    VERIFY_SAMPLE_CANDIDATES,
    VERIFY_SAMPLE_DENSE,
    KernelSpec,
)

pytestmark = needs_compiler

PLAIN = Mode(garbage=False, check_sites=False)  # the harness before these modes
THREADS = 128


def replaced(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


def sample_inputs(seed=0, B=4, L=3, V=2048, top_k=40):
    """Flat logits (top-k and every probability matter), drafts the target mostly rejects."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((B, L + 1, V)).astype(np.float32)
    drafts = rng.integers(0, V, (B, L)).astype(np.uint32)
    q = rng.dirichlet(np.ones(V), (B, L)).astype(np.float32)
    u = rng.uniform(0.05, 0.95, (B, L + 1)).astype(np.float32)
    inputs = [Arg.of(logits), Arg.of(drafts), Arg.of(q), Arg.of(u), Arg.of(np.float32(1.0)),
              Arg.of(np.int32(top_k))]
    want = kernels.verify_sample_mlx(mx.array(logits), mx.array(drafts), mx.array(q),
                                     mx.array(u), 1.0, top_k)
    return inputs, [np.array(a).tolist() for a in want], B


def run_dense(inputs, B, mode, order="forward", seed=0, header=None, source=None):
    try:
        drafts = inputs[1].array
        out = launch_verify(VERIFY_SAMPLE_DENSE, inputs, drafts, drafts.shape[1] + 1, THREADS,
                            order=order, seed=seed, header=header, source=source, mode=mode)
    except KernelError as e:
        return str(e)
    return [a.tolist() for a in out]


# ---------------------------------------------------------------------------------------------
# garbage: reads of threadgroup memory nobody wrote


def test_garbage_catches_a_read_of_unwritten_threadgroup_memory():
    """threadgroup_sum adding up all 32 partials instead of the n_groups written: zeros in the
    unwritten ones (what the harness had) hide it; on a GPU they hold anything."""
    inputs, want, B = sample_inputs()
    header = VERIFY_SAMPLE_DENSE.header()
    start = header.index("inline float threadgroup_sum")
    end = header.index("inline uint threadgroup_min")
    broken = header[:start] + replaced(header[start:end], "g < tg.n_groups", "g < kMaxSimdgroups"
                                       ) + header[end:]
    assert run_dense(inputs, B, PLAIN, header=broken) == want  # unnoticed before
    assert run_dense(inputs, B, Mode(), header=broken) != want
    assert run_dense(inputs, B, Mode()) == want


# ---------------------------------------------------------------------------------------------
# switch_on_shared: races between barriers without a collective in between


def non_atomic_histogram():
    """The radix select's histogram as plain uints: `histogram[d] += counts[d]` from every
    thread at once loses counts on a GPU."""
    header = VERIFY_SAMPLE_DENSE.header()
    header = replaced(header, "tg_ptr<metal::atomic_uint>", "tg_ptr<uint>", 2)
    header = replaced(header, "metal::atomic_store_explicit(&histogram[tg.tid], 0u, "
                      "metal::memory_order_relaxed);", "histogram[tg.tid] = 0u;")
    header = replaced(header, "metal::atomic_fetch_add_explicit(&histogram[d], counts[d], "
                      "metal::memory_order_relaxed);", "histogram[d] += counts[d];")
    header = replaced(header, "metal::atomic_load_explicit(&histogram[digit], "
                      "metal::memory_order_relaxed)", "histogram[digit]", 2)
    source = replaced(VERIFY_SAMPLE_DENSE.source(), "DFLASH_THREADGROUP(metal::atomic_uint,",
                      "DFLASH_THREADGROUP(uint,")
    return header, source


def test_switch_points_at_threadgroup_memory_catch_a_lost_update():
    header, source = non_atomic_histogram()
    inputs, want, B = sample_inputs(seed=1)
    for order in ("forward", "reverse", "shuffled"):  # fibers switch only at barriers
        assert run_dense(inputs, B, Mode(), order, header=header, source=source) == want
    caught = [run_dense(inputs, B, STRICT, "shuffled", seed, header=header, source=source)
              != want for seed in range(2)]
    assert all(caught)
    for seed in range(2):
        assert run_dense(inputs, B, STRICT, "shuffled", seed) == want


# ---------------------------------------------------------------------------------------------
# check_sites: one collective reached from two lines


def divergent_walk():
    return replaced(PATH_SELECT_SAMPLE.source(), "float p = e / metal::simd_sum(e);",
                    "float p = lane < 16 ? e / metal::simd_sum(e)\n"
                    "                    : e / metal::simd_sum(e);")


def walk_inputs(seed=0, B=2, n=4, K=16):
    rng = np.random.default_rng(seed)
    first = rng.standard_normal((B, K)).astype(np.float32)
    rest = rng.standard_normal((B, n - 1, K, K)).astype(np.float32)
    u = rng.uniform(0, 1, (B, n)).astype(np.float32)
    picks, probs = kernels.path_select_mlx(mx.array(first), mx.array(rest), mx.array(u), 0.8)
    inputs = [Arg.of(first), Arg.of(rest), Arg.of(u), Arg.of(np.int32(n)),
              Arg.of(np.float32(1 / 0.8))]
    return inputs, (np.array(picks), np.array(probs)), B, n, K


def run_walk(mode, source=None, order="forward"):
    inputs, want, B, n, K = walk_inputs()
    got = launch(PATH_SELECT_SAMPLE, inputs, [(B, n), (B, n, K)], ["uint32", "float32"],
                 grid=B * 32, threadgroup=32, template=[("K", K)], order=order, source=source,
                 mode=mode)
    return got, want


def test_call_sites_catch_lanes_meeting_from_different_lines():
    source = divergent_walk()
    got, want = run_walk(PLAIN, source)  # the same values meet: unnoticed before
    assert got[0].tolist() == want[0].tolist()
    with pytest.raises(KernelError, match="different call sites"):
        run_walk(Mode(), source)
    got, want = run_walk(Mode())
    assert got[0].tolist() == want[0].tolist()
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# os_threads: real threads, barriers and atomics

OS = Mode(os_threads=True)


def test_os_threads_run_the_real_kernels():
    inputs, want, B = sample_inputs(seed=2)
    assert run_dense(inputs, B, OS) == want  # atomics of the radix select from 128 threads
    got, want = run_walk(OS)
    assert got[0].tolist() == want[0].tolist()
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 5, 3000)).astype(np.float32)
    drafts = np.argmax(logits[:, :4], axis=-1).astype(np.uint32)
    drafts[1, 2] += 1
    out = launch_verify(VERIFY_GREEDY, [Arg.of(logits)], drafts, 5, THREADS, mode=OS)
    want = kernels.verify_greedy_mlx(mx.array(logits), mx.array(drafts))
    assert [a.tolist() for a in out] == [np.array(a).tolist() for a in want]
    K = 16
    ids = np.stack([rng.permutation(3000)[:K] for _ in range(8)]).reshape(2, 4, K)
    probs = rng.dirichlet(np.ones(K), (2, 4)).astype(np.float32)
    u = rng.uniform(0.05, 0.95, (2, 5)).astype(np.float32)
    out = launch_verify(VERIFY_SAMPLE_CANDIDATES,
                        [Arg.of(logits), Arg.of(drafts), Arg.of(ids, "uint32"), Arg.of(probs),
                         Arg.of(u), Arg.of(np.float32(1.0)), Arg.of(np.int32(0))],
                        drafts, 5, THREADS, template=[("K", K)], mode=OS)
    want = kernels.verify_sample_candidates_mlx(mx.array(logits), mx.array(drafts),
                                                mx.array(ids), mx.array(probs), mx.array(u))
    assert [a.tolist() for a in out] == [np.array(a).tolist() for a in want]


DIVERGENT = KernelSpec("divergent", "divergent.metal", (), ("x",), ("y",))


@pytest.mark.parametrize("body, match", [
    ("if (thread_index_in_threadgroup < 32) {\n"
     "  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);\n}", "barrier"),
    ("float s = thread_index_in_simdgroup < 8 ? metal::simd_sum(x[0]) : metal::simd_max(x[0]);",
     "different collectives"),
    ("if (thread_index_in_simdgroup < 8) { metal::simd_sum(x[0]); }", "collective"),
])
@pytest.mark.parametrize("mode", [Mode(), OS], ids=["fibers", "os_threads"])
def test_divergent_barriers_and_collectives_are_errors(body, match, mode):
    source = body + "\ny[thread_index_in_threadgroup] = x[0];\n"
    with pytest.raises(KernelError, match=match):
        launch(DIVERGENT, [Arg.of(np.ones(8, np.float32))], [(64,)], ["float32"], grid=64,
               threadgroup=64, source=source, header="", mode=mode)


# ---------------------------------------------------------------------------------------------
# address_spaces: Metal's address spaces as types (clang)


@pytest.mark.skipif(clang() is None, reason="no clang++ (.ci/run installs it)")
def test_address_spaces_catch_a_constant_pointer_given_device_memory():
    """step_score declared to take `const constant float*` while the kernel passes its
    `first` input, a `const device float*`: C++ with the address spaces erased compiles and
    runs it, Metal does not compile it, nor does the harness under clang's address spaces."""
    header = replaced(PATH_SELECT_SAMPLE.header(),
                      "template <int K, typename FirstPtr, typename RestPtr>\n"
                      "inline float step_score(FirstPtr first,",
                      "template <int K, typename RestPtr>\n"
                      "inline float step_score(const constant float* first,")
    inputs, want, B, n, K = walk_inputs()

    def run(mode):
        return launch(PATH_SELECT_SAMPLE, inputs, [(B, n), (B, n, K)], ["uint32", "float32"],
                      grid=B * 32, threadgroup=32, template=[("K", K)], header=header,
                      mode=mode)

    assert run(Mode())[0].tolist() == want[0].tolist()
    with pytest.raises(RuntimeError, match="compiling .* failed(.|\n)*step_score"):
        run(Mode(address_spaces=True))
    got, _ = run_walk(Mode(address_spaces=True))  # the real kernel compiles and agrees
    assert got[0].tolist() == want[0].tolist()


@pytest.mark.skipif(clang() is None, reason="no clang++ (.ci/run installs it)")
def test_address_spaces_catch_device_memory_given_as_threadgroup_memory():
    """threadgroup_max handed the kernel's output (device memory) as its partials."""
    source = replaced(VERIFY_SAMPLE_DENSE.source(),
                      "Softmax sm = softmax_stats(x, vocab, inv_temperature, f, tg, f_partials);",
                      "Softmax sm = softmax_stats(x, vocab, inv_temperature, f, tg,\n"
                      "                           (device float*)tokens);")
    inputs, _, B = sample_inputs(seed=4, B=1, L=1, V=256)
    assert isinstance(run_dense(inputs, B, Mode(), source=source), (list, str))
    with pytest.raises(RuntimeError, match="compiling .* failed"):
        run_dense(inputs, B, Mode(address_spaces=True), source=source)
