"""Every kernel variant the decode loop can launch (kernels.decode_variants()), through the
real Metal wrappers of mlx_dflash.kernels: MLX generates each launch's Metal source (printed by
mx.export_function with kernels.PRINT_SOURCE on), the harness compiles that text as C++ and
runs it with the wrapper's own inputs (padded, dummies), grid and threadgroup, and the outputs
must equal the MLX twin's (kernels.run(..., metal=False)). What this adds to
test_kernel_harness.py: MLX's real signature (parameter names, dtypes, address spaces, template
instantiation) and the wrappers' launch arithmetic, for block lengths 0 to 15."""

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import (
    Mode,
    STRICT,
    capture,
    clang,
    launch_generated,
    needs_compiler,
    settle,
)

from mlx_dflash import kernels

pytestmark = needs_compiler

LENGTHS = (1, 3, 7, 15)  # drafts (path_select: steps - 1); variants without drafts: 0
VOCAB = 4096  # threads follow V (kernels.row_threads): 512 here, as at V >= 4096
VARIANTS = kernels.decode_variants()


def lengths(variant):
    return LENGTHS if variant.drafted else (0,)


def top_ks(variant):
    return (0, 5) if variant.step.startswith(("verify_sample", "sample_rows")) else (None,)


def outputs_of(gen, args, **kw):
    """The captured launch run by the harness, its outputs as the wrapper returns them."""
    drafts = np.array(args["drafts"]) if "drafts" in args else None
    return settle(gen.spec, launch_generated(gen, **kw), drafts)


def run_variant(variant, L, top_k, order="forward"):
    """(the captured launch, the harness's outputs, the MLX twin's outputs)."""
    args = kernels.example(variant, drafts=L, vocab=VOCAB, seed=L)
    if top_k is not None:
        args["top_k"] = top_k
    (gen,) = capture(lambda: kernels.run(variant, args, metal=True))
    got = outputs_of(gen, args, order=order)
    want = [np.array(a) for a in kernels.run(variant, args, metal=False)]
    return gen, got, want


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.shape == w.shape, what
        if np.issubdtype(w.dtype, np.floating):
            np.testing.assert_allclose(g, w, atol=1e-5, err_msg=what)
        else:
            assert g.tolist() == w.tolist(), what


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_generated_kernel_matches_its_mlx_twin(variant):
    """Each block length (and top-k 0 and 5 for the sampling steps): the generated kernel's
    outputs equal the twin's, and the kernel's signature is the same for every length."""
    signatures = set()
    for L in lengths(variant):
        for top_k in top_ks(variant):
            gen, got, want = run_variant(variant, L, top_k)
            assert_same(got, want, f"{variant} L={L} top_k={top_k}")
            signatures.add(gen.signature)
            # every array input reaches the kernel in device memory (padded, dummies)
            for p in gen.params:
                if p.name in gen.inputs and gen.inputs[p.name].ndim:
                    assert " device " in f" {p.type} ", p
    assert len(signatures) == 1, signatures


def signature_key(variant):
    return (variant.step, variant.dtype, variant.candidates, variant.sampled)


def test_one_signature_with_and_without_drafts():
    """A variant without drafts (dummies of the inputs' dtypes) compiles to the same kernel as
    the one with drafts: MLX compiles no second pipeline when a block comes up empty."""
    by_key = {}
    for variant in VARIANTS:
        args = kernels.example(variant, drafts=3 if variant.drafted else 0, vocab=VOCAB)
        (gen,) = capture(lambda: kernels.run(variant, args, metal=True))  # noqa: B023
        by_key.setdefault(signature_key(variant), set()).add(gen.signature)
    assert all(len(s) == 1 for s in by_key.values()), by_key


def test_generated_kernels_under_the_strict_schedule():
    """A few variants under the shuffled schedule with switch points at every threadgroup-
    memory access (kernel_harness.STRICT), two seeds each."""
    picks = [v for v in VARIANTS if v.drafted and v.dtype == "bfloat16" and v.candidates != 1
             and v.step != "path_select"] + [v for v in VARIANTS if v.step == "path_select"
                                               and v.sampled and v.drafted]
    for variant in picks:
        args = kernels.example(variant, drafts=7, vocab=VOCAB)
        (gen,) = capture(lambda: kernels.run(variant, args, metal=True))  # noqa: B023
        want = [np.array(a) for a in kernels.run(variant, args, metal=False)]
        for seed in range(2):
            assert_same(outputs_of(gen, args, order="shuffled", seed=seed, mode=STRICT), want,
                        str(variant))


@pytest.mark.skipif(clang() is None, reason="no clang++ (.ci/run installs it)")
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.dtype == "float32"], ids=str)
def test_generated_kernels_with_address_spaces(variant):
    """MLX's generated source compiles with Metal's address spaces as distinct types and
    agrees (float32 logits: clang calls no member of a half-precision struct in device
    memory, so the 16-bit variants, which share the text but for the type, are left out)."""
    for L in (0, 3) if variant.drafted else (0,):
        if variant.drafted and not L:
            continue
        args = kernels.example(variant, drafts=L, vocab=VOCAB)
        (gen,) = capture(lambda: kernels.run(variant, args, metal=True))  # noqa: B023
        want = [np.array(a) for a in kernels.run(variant, args, metal=False)]
        assert_same(outputs_of(gen, args, mode=Mode(address_spaces=True)), want,
                    str(variant))


def test_generated_kernels_on_os_threads():
    """One variant of each kernel on real threads (Mode(os_threads=True))."""
    seen = set()
    for variant in VARIANTS:
        key = (variant.step, variant.sampled)
        if not variant.drafted or variant.dtype != "bfloat16" and variant.step != "path_select" \
                or key in seen:
            continue
        seen.add(key)
        args = kernels.example(variant, drafts=3, vocab=2048)
        (gen,) = capture(lambda: kernels.run(variant, args, metal=True))  # noqa: B023
        want = [np.array(a) for a in kernels.run(variant, args, metal=False)]
        assert_same(outputs_of(gen, args, mode=Mode(os_threads=True)), want, str(variant))
    assert len(seen) == 6


def test_captured_launch_is_the_wrappers():
    """The capture reads what the wrapper passed: padded inputs, 0-d scalars, the grid."""
    variant = next(v for v in VARIANTS if v.step == "verify_sample_candidates" and v.drafted
                   and v.candidates == 1 and v.dtype == "float32")
    args = kernels.example(variant, drafts=1, vocab=VOCAB)
    (gen,) = capture(lambda: kernels.run(variant, args, metal=True))
    assert gen.grid == (2 * 512, 1, 1) and gen.threadgroup == (512, 1, 1)  # 2 positions
    assert gen.inputs["drafts"].size == 8 and gen.inputs["cand_ids"].size == 8  # padded
    assert gen.inputs["top_k"].ndim == 0 and int(gen.inputs["top_k"]) == 5
    assert gen.template_args == "<1>"
    assert mx.array(gen.inputs["logits"]).shape == (1, 2, VOCAB)
