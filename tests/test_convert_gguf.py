"""GGUF -> mlx-lm conversion: round trip of a tiny random llama written the way llama.cpp does."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from mlx_dflash.convert import gguf as gguf_mod
from mlx_dflash.convert.atomic import atomic_output_dir
from mlx_dflash.convert.gguf import GGUFConversionError, convert_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 12345 apples and 678 oranges cost $9.10 today.",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "the the the hello hello world world fox fox dog",
] * 20

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in HF_TO_GGUF:
        return f"{HF_TO_GGUF[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


def make_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on CORPUS, with a multi-digit token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Add a multi-digit token so that tokenizing "123" shows whether digits are split first
    # (SmolLM2's "smollm" pre-tokenizer does; plain GPT-2 byte-level would give "12", "3").
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab["12"] = len(vocab)
    merges = spec["model"]["merges"]
    merges.append("1 2" if merges and isinstance(merges[0], str) else ["1", "2"])
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer: Tokenizer) -> Model:
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=tiny_tokenizer.get_vocab_size(),
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = Model(args)
    # Norm weights default to ones; randomise them so a wrong name mapping would show.
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("norm.weight"):
            params[k] = 1.0 + 0.1 * mx.random.normal(v.shape)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


def gguf_writer(path: Path, arch: str, a) -> tuple[GGUFWriter, int]:
    """A writer with the hyperparameters every architecture has, and the head size."""
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(a.num_hidden_layers)
    w.add_context_length(256)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_rope_dimension_count(head_dim)
    return w, head_dim


def _write_gguf(
    path: Path,
    model: Model,
    tok: Tokenizer,
    *,
    arch: str = "llama",
    tied: bool = False,
    qtypes: dict[str, GGMLQuantizationType] | None = None,
) -> None:
    """Write ``model`` the way llama.cpp's convert_hf_to_gguf.py would."""
    a = model.args
    w, head_dim = gguf_writer(path, arch, a)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(a.vocab_size)

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    qtypes = qtypes or {}
    for name, value in tree_flatten(model.parameters()):
        if tied and name == "lm_head.weight":
            continue
        arr = np.array(value, dtype=np.float32)
        # llama.cpp permutes Q/K (weights and biases) of llama models only.
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _permute(arr, a.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _permute(arr, a.num_key_value_heads)
        gname = _gguf_name(name)
        qt = qtypes.get(gname)
        if qt is None:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids])))


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    _write_gguf(path, tiny_model, tiny_tokenizer)
    return path


def test_f32_roundtrip_logits_and_tokenizer(tmp_path, f32_gguf, tiny_model, tiny_tokenizer, capsys):
    from mlx_lm import load

    out = convert_gguf(f32_gguf, tmp_path / "out", progress=True)
    assert "Converting tensors" in capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert cfg["num_key_value_heads"] == 2 and cfg["eos_token_id"] == 2

    model, tokenizer = load(str(out))
    ref = dict(tree_flatten(tiny_model.parameters()))
    got = dict(tree_flatten(model.parameters()))
    assert ref.keys() == got.keys()
    for k, v in ref.items():
        np.testing.assert_array_equal(np.array(got[k]), np.array(v), err_msg=k)

    text = "Hello world 12345 fox"
    ids = tokenizer.encode(text)
    assert ids == tiny_tokenizer.encode(text).ids
    assert [tokenizer.decode([i]) for i in tokenizer.encode("123")] == ["1", "2", "3"]
    assert tokenizer.decode(ids) == text
    np.testing.assert_allclose(_logits(model, ids), _logits(tiny_model, ids), atol=1e-5, rtol=0)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt)[0] == 1  # <|im_start|> stays one token
    assert 2 in tokenizer.eos_token_ids


def test_quantized_tensors_within_tolerance(tmp_path, tiny_model, tiny_tokenizer):
    q = {
        "token_embd.weight": GGMLQuantizationType.Q8_0,
        "blk.0.attn_q.weight": GGMLQuantizationType.Q4_1,
        "blk.0.attn_k.weight": GGMLQuantizationType.Q8_0,
        "blk.1.ffn_down.weight": GGMLQuantizationType.Q4_1,
    }
    path = tmp_path / "tiny-q.gguf"
    _write_gguf(path, tiny_model, tiny_tokenizer, tied=True, qtypes=q)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True

    got = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in got
    ref = dict(tree_flatten(tiny_model.parameters()))
    for hf in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        r, g = np.array(ref[hf]), np.array(got[hf])
        assert g.dtype == np.float32 and g.shape == r.shape
        # Q8_0: step amax/127 per 32-block; Q4_1: step (max-min)/15. Error <= step/2 (+ fp16 scale).
        step = (
            np.abs(r).max() / 127
            if hf.endswith(("embed_tokens.weight", "k_proj.weight"))
            else ((r.max() - r.min()) / 15)
        )
        assert np.abs(g - r).max() <= 0.55 * step + 1e-3 * np.abs(r).max(), hf
    # Untouched F32 tensors are bit-exact.
    np.testing.assert_array_equal(
        np.array(got["model.layers.1.self_attn.q_proj.weight"]),
        np.array(ref["model.layers.1.self_attn.q_proj.weight"]),
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_roundtrip_logits(tmp_path, arch, tiny_tokenizer):
    from importlib import import_module

    from mlx_lm import load

    mod = import_module(f"mlx_lm.models.{arch}")
    args = mod.ModelArgs(
        model_type=arch,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=tiny_tokenizer.get_vocab_size(),
        max_position_embeddings=256,
        rope_theta=1e6,
        tie_word_embeddings=True,
        **({"head_dim": 32} if arch == "qwen3" else {}),  # head_dim != hidden/heads
    )
    mx.random.seed(1)
    ref_model = mod.Model(args)
    params = dict(tree_flatten(ref_model.parameters()))
    for k, v in params.items():  # randomise norms and (qwen2) biases so mapping errors show
        if k.endswith(("norm.weight", ".bias")):
            params[k] = (1.0 if k.endswith("weight") else 0.0) + 0.1 * mx.random.normal(v.shape)
    ref_model.load_weights(list(params.items()))
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, ref_model, tiny_tokenizer, arch=arch, tied=True)

    out = convert_gguf(path, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg.get("head_dim") == (32 if arch == "qwen3" else None)
    model, tokenizer = load(str(out))
    ids = tokenizer.encode("Hello world 12345 fox")
    np.testing.assert_allclose(_logits(model, ids), _logits(ref_model, ids), atol=1e-5, rtol=0)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFConversionError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, tiny_model, tiny_tokenizer):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, tiny_model, tiny_tokenizer, arch="falcon")
    with pytest.raises(GGUFConversionError, match="'falcon'"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path, f32_gguf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_gguf(f32_gguf, out, progress=False)
    convert_gguf(f32_gguf, out, overwrite=True, progress=False)
    assert (out / "config.json").exists() and not (out / "old.txt").exists()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_conversion_leaves_nothing(tmp_path, f32_gguf, monkeypatch, exc):
    real = gguf_mod._dequantize
    calls = {"n": 0}

    def flaky(t, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise exc("interrupted")
        return real(t, name)

    monkeypatch.setattr(gguf_mod, "_dequantize", flaky)
    with pytest.raises(exc):
        convert_gguf(f32_gguf, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither out nor a hidden temp dir


def test_atomic_output_dir(tmp_path):
    target = tmp_path / "t"
    with atomic_output_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".")
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with pytest.raises(FileExistsError), atomic_output_dir(target):
        pass
    with pytest.raises(ValueError), atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
        raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert (target / "a").exists()  # the old copy survives a failed overwrite
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in target.iterdir()] == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_default_target_is_converted_once_into_the_cache(tmp_path, f32_gguf, monkeypatch):
    """The offline default: a GGUF (here a tiny one via the env override) converted once, cached."""
    import mlx_dflash.convert.gguf as gguf_module
    from mlx_dflash import default_pair

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLX_DFLASH_SMOLLM2_GGUF", str(f32_gguf))
    path = default_pair.ensure_default_target(progress=False)
    assert path == tmp_path / "home" / "targets" / "smollm2-135m-instruct-f32"
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_module, "convert_gguf", no_second_conversion)
    assert default_pair.ensure_default_target(progress=False) == path
