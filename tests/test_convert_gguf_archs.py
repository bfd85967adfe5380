"""GGUF -> mlx-lm for each architecture ``convert gguf`` reads beyond llama and Qwen: a tiny
random mlx-lm model is written the way llama.cpp's converter writes that architecture (its
tensor names, fused or stacked tensors, Gemma's norms stored as 1 + w), converted back, and
must give the same logits; SentencePiece vocabularies (Gemma, Mistral) must tokenize as the
tokenizer they came from."""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter
from mlx.utils import tree_flatten
from test_convert_gguf import (
    CHAT_TEMPLATE,
    CORPUS,
    SPECIALS,
    _logits,
    _permute,
    gguf_writer,
    make_tiny_tokenizer,
)

from mlx_dflash.convert.gguf import GGUFConversionError, convert_gguf

LAYER = {  # mlx-lm's layer parameter -> llama.cpp's, per architecture (see convert/gguf.py)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
ARCH_LAYER = {
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "qwen3moe": {"mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                 "mlp.switch_mlp.up_proj": "ffn_up_exps",
                 "mlp.switch_mlp.down_proj": "ffn_down_exps"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def gguf_name(hf: str, arch: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{ {**LAYER, **ARCH_LAYER.get(arch, {})}[rest]}.{suffix}"


def sentencepiece_tokenizer(space_prefix: bool):
    """A SentencePiece-style BPE (as Gemma's and Mistral's tokenizer.json are): "▁" for
    spaces, bytes by fallback; ids in merge order, so -id serves as llama.cpp's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=GEMMA_SPECIALS + bytes_,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def random_model(arch: str, vocab: int):
    """A tiny mlx-lm model of ``arch`` with random weights (norms and router too)."""
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-6,
                  vocab_size=vocab)
    if arch == "gemma3":
        mod = import_module("mlx_lm.models.gemma3_text")
        common["num_hidden_layers"] = 6  # every sixth layer attends globally
        args = mod.ModelArgs(model_type="gemma3_text", intermediate_size=128, head_dim=32,
                             num_key_value_heads=1, query_pre_attn_scalar=32, sliding_window=512,
                             max_position_embeddings=256, **common)
    elif arch == "qwen3moe":
        mod = import_module("mlx_lm.models.qwen3_moe")
        args = mod.ModelArgs(model_type="qwen3_moe", intermediate_size=128, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                             moe_intermediate_size=32, num_key_value_heads=2, head_dim=32,
                             rope_theta=1e6, tie_word_embeddings=False,
                             max_position_embeddings=256, norm_topk_prob=True, **common)
    elif arch == "phi3":
        mod = import_module("mlx_lm.models.phi3")
        args = mod.ModelArgs(model_type="phi3", intermediate_size=128, num_key_value_heads=4,
                             max_position_embeddings=256, original_max_position_embeddings=256,
                             **common)
    else:  # llama (Mistral's files say llama)
        mod = import_module("mlx_lm.models.llama")
        args = mod.ModelArgs(model_type="llama", intermediate_size=128, num_key_value_heads=2,
                             rope_theta=1e6, tie_word_embeddings=False, **common)
    mx.random.seed(3)
    model = mod.Model(args)
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("norm.weight"):
            params[k] = (0.0 if arch == "gemma3" else 1.0) + 0.1 * mx.random.normal(v.shape)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


def write_gguf(path: Path, arch: str, model, tok, spm: bool, space_prefix: bool = False) -> None:
    """``model`` and ``tok`` as llama.cpp's convert_hf_to_gguf.py writes them for ``arch``."""
    a = model.args
    w, head_dim = gguf_writer(path, arch, a)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(a.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(a.num_experts)
        w.add_expert_used_count(a.num_experts_per_tok)
        w.add_expert_feed_forward_length(a.moe_intermediate_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    if spm:
        specials = GEMMA_SPECIALS
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([t for t, _ in vocab])
        w.add_token_scores([-float(i) for _, i in vocab])
        w.add_token_types([3 if t in specials else 6 if t.startswith("<0x") else 1
                           for t, _ in vocab])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(space_prefix)
    else:
        merges = json.loads(tok.to_str())["model"]["merges"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list([t for t, _ in vocab])
        w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, value in tree_flatten(model.parameters()):
        arr = np.array(value, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma norms: 1 + w
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, a.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, a.num_key_value_heads)
        w.add_tensor(gguf_name(name, arch), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe", "phi3", "llama"])
def test_each_architecture_converts_to_the_same_logits(tmp_path, arch):
    from mlx_lm import load

    spm = arch in ("gemma3", "llama")  # llama here: a Mistral-style SentencePiece file
    tok = sentencepiece_tokenizer(space_prefix=arch == "llama") if spm else make_tiny_tokenizer()
    model = random_model(arch, tok.get_vocab_size())
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, model, tok, spm, space_prefix=arch == "llama")
    out = convert_gguf(path, tmp_path / "out", progress=False)
    converted, tokenizer = load(str(out))
    text = "Hello world! The quick brown fox 12345"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text).ids
    assert tokenizer.decode(ids) == text
    np.testing.assert_allclose(_logits(converted, ids), _logits(model, ids), atol=1e-4, rtol=0)
    if arch == "gemma3":  # no template in the file: Gemma's chat format is written
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True, tokenize=False)
        assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
        assert tokenizer.encode(prompt, add_special_tokens=False)[:2] == [2, 4]


def test_an_unknown_architecture_is_named_with_the_list(tmp_path):
    w = GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFConversionError, match="'mamba'.*gemma3.*phi3"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
