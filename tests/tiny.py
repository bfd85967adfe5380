"""Tiny random models and a word-level tokenizer for fast tests."""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_dflash.drafters import DFlashDraftModel

EOS_ID = 1


def make_tokenizer(vocab_size: int, eos_id: int = EOS_ID) -> TokenizerWrapper:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab.pop(f"w{eos_id}", None)
    vocab["<eos>"] = eos_id  # an id >= vocab_size gives a stop token the model never emits
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")
    return TokenizerWrapper(hf, eos_token_ids=[eos_id])


def make_target(
    model_type: str = "qwen3",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
    seed: int = 0,
    scale: float = 3.0,
):
    """A random float32 mlx-lm model; weights scaled up so logits have clear gaps."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = dict(
        model_type=model_type,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        head_dim=hidden_size // heads,
        max_position_embeddings=4096,
    )
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def make_drafter(
    target_model,
    block_size: int = 8,
    layer_ids=(0, 2),
    num_layers: int = 1,
    mask_token_id: int = 2,
    seed: int = 1,
    cls=DFlashDraftModel,
    **overrides,
) -> DFlashDraftModel:
    a = target_model.args
    args = cls.args_class(
        hidden_size=a.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * a.hidden_size,
        vocab_size=a.vocab_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        block_size=block_size,
        num_target_layers=a.num_hidden_layers,
        rope_theta=10000.0,
        **overrides,
    )
    mx.random.seed(seed)
    drafter = cls(args)
    mx.eval(drafter.parameters())
    return drafter


def zlab_config(drafter: DFlashDraftModel) -> dict:
    """config.json exactly as z-lab publishes a DFlash drafter (their fields and names)."""
    a = drafter.args
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": a.block_size,
        "dflash_config": {"mask_token_id": a.mask_token_id,
                          "target_layer_ids": a.target_layer_ids},
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.num_hidden_layers,
        "num_target_layers": a.num_target_layers,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def save_target(model, tokenizer: TokenizerWrapper, path, chat_template: str | None = None):
    """Write a tiny target as an mlx-lm model directory (config, weights, tokenizer)."""
    import json

    from mlx.utils import tree_flatten

    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    (path / "config.json").write_text(json.dumps(config))
    hf = tokenizer._tokenizer
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return path


# Every target family mlx_dflash.target covers, as the model types mlx-lm loads them.
FAMILY_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe",
                "gpt_oss", "gemma3_text", "deepseek_v3")
WINDOW = 8  # sliding windows this small wrap within a short test


def family_config(model_type: str, vocab_size: int, hidden_size: int, num_layers: int,
                  tied: bool, window: int = WINDOW) -> dict:
    """A tiny config.json for one family: two attention layers out of four are sliding-window
    (llama, gpt_oss, gemma3_text) or full attention among Gated DeltaNet layers (qwen3_next,
    qwen3_5); MoE families route 2 of 4 experts."""
    heads, head_dim = 4, hidden_size // 4
    config = dict(
        model_type=model_type, hidden_size=hidden_size, num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=vocab_size, rope_theta=10000.0,
        tie_word_embeddings=tied, max_position_embeddings=4096,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                  partial_rotary_factor=0.5)
    if model_type == "llama":
        config.update(sliding_window=window, layer_types=["sliding_attention", "full_attention"]
                      * (num_layers // 2))
    elif model_type == "qwen3_moe":
        config.update(**moe)
    elif model_type == "qwen3_next":
        config.update(**moe, **linear, shared_expert_intermediate_size=hidden_size // 2)
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        config.update(**linear, rope_parameters={"type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5,
                                               "mrope_section": [2, 1, 1]})
        if model_type == "qwen3_5_moe":
            config.update(**moe, shared_expert_intermediate_size=hidden_size // 2)
    elif model_type == "gpt_oss":
        config.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                      layer_types=["sliding_attention", "full_attention"] * (num_layers // 2))
    elif model_type == "deepseek_v3":  # MLA attention, the first layer dense, then MoE
        config.update(num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4,
                      moe_intermediate_size=hidden_size // 2, kv_lora_rank=16, q_lora_rank=32,
                      qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                      num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1)
    elif model_type == "gemma3_text":
        config.update(sliding_window=window, sliding_window_pattern=2,
                      query_pre_attn_scalar=head_dim)
    return config


def make_family_target(
    model_type: str,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    tied: bool = True,
    seed: int = 0,
    scale: float = 3.0,
    window: int = WINDOW,
    bits: int | None = None,
):
    """A random float32 model of any covered family, built from mlx-lm's own ModelArgs; matrices
    (and expert stacks) scaled up so logits have clear gaps. ``bits``: quantize it the way
    ``mlx_lm.convert`` does (mlx_lm.utils.quantize_model, group size 32)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = family_config(model_type, vocab_size, hidden_size, num_layers, tied, window)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))

    def scaled(path, p):
        if p.ndim in (2, 3) and "conv1d" not in path:
            return p * scale
        if path.endswith("sinks"):  # gpt-oss attention sinks start at zero: make them matter
            return mx.random.normal(p.shape)
        return p

    from mlx.utils import tree_map_with_path

    model.update(tree_map_with_path(scaled, model.parameters()))
    mx.eval(model.parameters())
    if bits is not None:
        from mlx_lm.utils import quantize_model

        model, _ = quantize_model(model, {}, group_size=32, bits=bits)
        mx.eval(model.parameters())
    return model


def make_text_tokenizer(words=(), chars=None) -> TokenizerWrapper:
    """A byte-level BPE tokenizer (as most chat models have): id 0 is ``<eos>``, then one
    token per character of ``chars`` (default: all 256 bytes), then each of ``words`` built
    by merges. Its vocabulary size is ``len(tokenizer.vocab)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def byte_level(text):
        return "".join(piece for piece, _ in level.pre_tokenize_str(text))

    alphabet = (sorted(pre_tokenizers.ByteLevel.alphabet()) if chars is None
                else [byte_level(c) for c in chars])
    vocab = {"<eos>": 0}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in map(byte_level, words):
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = level
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    return TokenizerWrapper(hf, eos_token_ids=[0])
