"""The Metal kernels' first-use check (kernels.check): with Metal reported available
here, where no kernel can compile, generation falls back to the MLX path with one warning and
the same output; a kernel that runs but disagrees falls back too; each kernel keeps one
signature whatever the block length (no recompiles while decoding)."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import generate, kernels
from mlx_dflash.kernels import Variant


@pytest.fixture
def metal_reported(monkeypatch):
    """kernels sees a Metal GPU as MLX's default device; the choice is made anew."""
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    monkeypatch.setattr(kernels, "_metal_gpu", lambda: True)
    kernels.reset_backend()
    yield
    kernels.reset_backend()


def test_generation_falls_back_to_the_mlx_path_with_one_warning(metal_reported):
    model = make_target("qwen3", seed=2)
    drafter = make_drafter(model, block_size=4)
    tok = make_tokenizer(128)
    prompt = [5, 9, 14, 3, 9, 14, 22]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.backend() == "metal"
        greedy = generate(model, drafter, tok, prompt, max_tokens=16)
        mx.random.seed(3)
        sampled = generate(model, drafter, tok, prompt, max_tokens=16, temperature=0.8)
    fallbacks = [w for w in caught if "first-use check" in str(w.message)]
    assert len(fallbacks) == 1 and issubclass(fallbacks[0].category, RuntimeWarning)
    assert "MLX path" in str(fallbacks[0].message)
    assert kernels.backend() == "mlx"

    kernels.reset_backend()
    kernels._backend = "mlx"
    assert greedy == generate(model, None, tok, prompt, max_tokens=16)  # plain decoding's
    mx.random.seed(3)
    assert sampled == generate(model, drafter, tok, prompt, max_tokens=16, temperature=0.8)


def test_a_kernel_that_disagrees_with_its_twin_is_not_used(metal_reported, monkeypatch):
    def wrong(logits, drafts):
        accepted, token = kernels.verify_greedy_mlx(logits, drafts)
        return accepted, token + 1

    monkeypatch.setattr(kernels, "verify_greedy_metal", wrong)
    logits = mx.random.normal((1, 4, 50))
    drafts = mx.argmax(logits[:, :3], axis=-1).astype(mx.uint32)
    with pytest.warns(RuntimeWarning, match="tokens"):
        got = kernels.verify_greedy(logits, drafts)
    want = kernels.verify_greedy_mlx(logits, drafts)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_forced_metal_fails_loudly(metal_reported, monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "metal")
    kernels.reset_backend()
    with pytest.raises(RuntimeError, match="first-use check.*MLX_DFLASH_KERNELS=metal"):
        kernels.verify_greedy(mx.zeros((1, 2, 16)), mx.zeros((1, 1), dtype=mx.uint32))


def test_a_checked_variant_is_checked_once(metal_reported, monkeypatch):
    """Kernels that pass (stood in for by their twins) are checked at first use only."""
    checks = []
    for step in kernels.STEPS:
        monkeypatch.setattr(kernels, f"{step}_metal", getattr(kernels, f"{step}_mlx"))
    real = kernels.check
    monkeypatch.setattr(kernels, "check", lambda v: checks.append(v) or real(v))
    for L in (0, 1, 3, 0, 7):
        kernels.verify_greedy(mx.random.normal((2, L + 1, 64)),
                              mx.zeros((2, L), dtype=mx.uint32))
    assert checks == [Variant("verify_greedy", "float32", False),
                      Variant("verify_greedy", "float32", True)]
    assert kernels.backend() == "metal"


@pytest.mark.parametrize("variant", kernels.decode_variants(), ids=str)
def test_the_check_inputs_have_clear_margins(variant):
    """The MLX twin gives the designed answer on each check input, and still does with the
    uniforms moved by 0.2: no rounding can decide the check."""
    args = kernels.example(variant, vocab=256)
    want = kernels.run(variant, args, metal=False)
    if variant.step == "path_select":
        n = 1 + args["rest"].shape[1]
        expected = [3 % variant.candidates]
        for _ in range(n - 1):
            expected.append((expected[-1] * 5 + 1) % variant.candidates)
        assert want[0].tolist() == [expected]
    elif variant.step == "sample_rows":  # each row's draw is its peak
        rows = args["logits"].shape[0]
        assert want[0].tolist() == ((np.arange(rows) * 17 + 5) % 256).tolist()
    else:
        L = args["drafts"].shape[-1]
        peaks = (np.arange(L + 1) * 17 + 5) % 256
        assert want[0].tolist() == [max(L - 1, 0)]
        assert want[1].tolist() == [int(peaks[max(L - 1, 0)])]
    if "uniforms" in args:
        for shift in (-0.2, 0.2):
            moved = dict(args, uniforms=args["uniforms"] + shift)
            out = kernels.run(variant, moved, metal=False)
            assert [o.tolist() for o in out[:2] if o.dtype == mx.uint32] == \
                [w.tolist() for w in want[:2] if w.dtype == mx.uint32]


def test_each_kernel_keeps_one_signature_whatever_the_block(monkeypatch):
    """What MLX compiles a kernel for (its inputs' dtypes, and constant or device memory:
    under 8 elements MLX passes constant) is the same with no drafts, one, or fifteen, and
    for one row or several: the dummies match their inputs' dtypes and small inputs are
    padded. So decoding never recompiles a kernel mid-flight."""
    seen = {}

    class Recorder:
        def __init__(self, spec):
            self.spec = spec

        def __call__(self, inputs, output_shapes, output_dtypes, **kw):
            sig = [(str(a.dtype), "constant" if a.ndim == 0 else
                    "constant" if a.size < kernels.MIN_DEVICE_ELEMENTS else "device")
                   for a in inputs]
            seen.setdefault((self.spec.name, kw.get("template") and tuple(kw["template"])),
                            set()).add(tuple(sig))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(kernels, "_kernel", Recorder)
    V = 40
    for B in (1, 3):
        for L in (0, 1, 3, 15):
            logits = mx.random.normal((B, L + 1, V))
            drafts = mx.zeros((B, L), dtype=mx.uint32)
            u = mx.random.uniform(shape=(B, L + 1))
            kernels.verify_greedy_metal(logits, drafts)
            kernels.verify_sample_metal(logits, drafts, mx.ones((B, L, V)) / V, u)
            for K in (1, 16):
                kernels.verify_sample_candidates_metal(
                    logits, drafts, mx.zeros((B, L, K), dtype=mx.uint32), mx.ones((B, L, K)), u)
            for T in (0.0, 0.7):
                kernels.path_select_metal(mx.random.normal((B, 16)),
                                          mx.random.normal((B, L, 16, 16)),
                                          mx.random.uniform(shape=(B, L + 1)), T)
    assert len(seen) == 6
    for key, signatures in seen.items():
        assert len(signatures) == 1, (key, signatures)
