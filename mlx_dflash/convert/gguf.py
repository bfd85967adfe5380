"""Convert a llama.cpp GGUF checkpoint into an mlx-lm model directory.

The weights are dequantized with the ``gguf`` package (the reference Python implementation that
ships with llama.cpp) rather than MLX's own GGUF loader, which is slightly off on Q4_1 and cannot
read K-quants. The output is a plain Hugging Face style directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that ``mlx_lm.load`` reads.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dflash.convert.atomic import atomic_output_dir

# GGUF's architecture names (Mistral's and most Llama-derived models' files say "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
# -> mlx-lm's model_type and the Hugging Face architecture name
_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_DTYPES = ("float32", "float16", "bfloat16")

# GGUF tensor name (without .weight/.bias) -> HF / mlx-lm name.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture, where its names differ from the table above.
_ARCH_LAYER_NAMES = {
    "gemma3": {  # four norms a layer
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen3moe": {  # the router, and the experts stacked as mlx-lm's SwitchGLU holds them
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj",
        "ffn_down_exps": "mlp.switch_mlp.down_proj",
    },
    "phi3": {  # fused projections, as mlx-lm's phi3 has them too
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
}
# What every layer must have, per architecture (the default: attention + gated MLP).
_LAYER_PARTS = {
    "default": ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj"),
    "gemma3": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "qwen3moe": ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                 "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate",
                 "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj",
                 "mlp.switch_mlp.down_proj"),
    "phi3": ("input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj",
             "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Gemma's chat format, for Gemma GGUF files that carry no chat template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% if m['role'] == 'system' %}{{ '<start_of_turn>user\\n' + m['content'] | trim + '\\n\\n' }}"
    "{% else %}{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'system' %}"
    "{{ '<start_of_turn>' + role + '\\n' }}{% endif %}"
    "{{ m['content'] | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Pre-tokenizer split regexes, per llama.cpp's `tokenizer.ggml.pre` (see llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, str] = {
    # Each digit on its own, then the GPT-2 regex (SmolLM, StarCoder lineage).
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "digits+gpt2",
    ),
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais", "default"), "gpt2"),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), "llama3"
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), "qwen2"),
}

# llama.cpp token types.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (bad file, unsupported architecture or tokenizer)."""


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model directory at ``out_dir`` and return its path.

    Quantized tensors are dequantized (llama.cpp semantics) and stored as ``dtype``. The directory
    is written atomically: on failure nothing is left at ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        GGUFConversionError: not a GGUF file, or an architecture/tokenizer this converter lacks.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    import mlx.core as mx

    gguf_path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if out_dir.exists() and not overwrite:
        # Fail before the (slow) read; atomic_output_dir checks again.
        raise FileExistsError(
            f"Output directory already exists: {out_dir}. Pass overwrite=True to replace it."
        )

    reader = _open_reader(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"Unsupported GGUF architecture {arch!r} in {gguf_path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )

    tensors = {t.name: t for t in reader.tensors}
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & tensors.keys():
        raise GGUFConversionError(
            f"{gguf_path} has rope_factors tensors (long-context 'longrope' scaling), which this "
            "converter cannot map back to an mlx-lm rope_scaling config.")
    if "rope_freqs.weight" in tensors:
        raise GGUFConversionError(
            f"{gguf_path} has a rope_freqs tensor (Llama-3.1 style rope scaling), which this "
            "converter cannot map back to an mlx-lm rope_scaling config."
        )
    if "token_embd.weight" not in tensors:
        raise GGUFConversionError(f"{gguf_path} has no token_embd.weight tensor.")
    config = _build_config(meta, arch, tensors)
    tokenizer_json, tokenizer_config, special_map = _build_tokenizer(meta, config["vocab_size"])
    if arch == "gemma3" and "chat_template" not in tokenizer_config:
        tokenizer_config["chat_template"] = GEMMA_CHAT_TEMPLATE
        if progress:
            print("The GGUF file has no chat template: writing Gemma's chat format.",
                  file=sys.stderr, flush=True)

    n_head = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    target_dtype = getattr(mx, dtype)
    total = len(tensors)
    reporter = _Progress(total, enabled=progress)

    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        weights: dict[str, mx.array] = {}
        for i, (gname, t) in enumerate(tensors.items(), start=1):
            name = _hf_name(gname, arch)
            arr = _dequantize(t, gname)
            if arch == "gemma3" and name.endswith("norm.weight"):
                arr = arr - 1.0  # llama.cpp stores Gemma's norms as 1 + w (HF's x * (1 + w))
            # llama.cpp reorders Q/K rows of llama models for its interleaved rope; mlx-lm (like
            # HF) uses the rotate-half layout, so undo it. Qwen GGUFs are not permuted.
            if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "q_proj.bias")):
                arr = _unpermute(arr, n_head)
            elif arch == "llama" and name.endswith(("self_attn.k_proj.weight", "k_proj.bias")):
                arr = _unpermute(arr, n_kv)
            weights[name] = mx.array(arr).astype(target_dtype)
            reporter.update(i)
        _check_complete(weights, config, arch)
        mx.eval(weights)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights

        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer.json", tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "special_tokens_map.json", special_map)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        if "pad_token_id" in config:
            gen["pad_token_id"] = config["pad_token_id"]
        _write_json(tmp / "generation_config.json", gen)
    if progress:
        print(f"Wrote {out_dir} ({total} tensors, {dtype})", file=sys.stderr, flush=True)
    return out_dir


# ----------------------------------------------------------------------------- reading


def _open_reader(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not gguf_path.is_file():
        raise GGUFConversionError(f"Not a file: {gguf_path}")
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFConversionError(
            f"{gguf_path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')."
        )
    try:
        return GGUFReader(gguf_path, "r")
    except Exception as e:  # truncated or corrupt file
        raise GGUFConversionError(f"Could not read GGUF file {gguf_path}: {e}") from e


def _read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _dequantize(t: Any, gname: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise GGUFConversionError(
            f"Tensor {gname}: type {t.tensor_type.name} cannot be dequantized ({e})."
        ) from e
    # GGUF shapes are fastest-dimension first; numpy/HF are the reverse.
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py).

    The forward op is ``w.reshape(n_head, 2, hd // 2, ...).swapaxes(1, 2)``; this undoes it.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"Cannot unpermute {w.shape} rows into {n_head} heads.")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gname: str, arch: str = "llama") -> str:
    stem, _, suffix = gname.rpartition(".")
    if suffix in ("weight", "bias") and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _LAYER_RE.match(gname)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise GGUFConversionError(f"Unexpected tensor {gname!r}: no mlx-lm equivalent is known.")


def _check_complete(weights: dict[str, Any], config: dict[str, Any], arch: str = "llama"
                    ) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    parts = _LAYER_PARTS.get(arch, _LAYER_PARTS["default"])
    for i in range(config["num_hidden_layers"]):
        needed += [f"model.layers.{i}.{part}.weight" for part in parts]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise GGUFConversionError(f"GGUF is missing tensors: {missing[:5]} ({len(missing)} total)")


# ----------------------------------------------------------------------------- config


def _f32(x: float) -> float:
    # GGUF stores float32; print the shortest decimal that round-trips (1e-05, not 9.9999e-06).
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def _build_config(meta: dict[str, Any], arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise GGUFConversionError(f"GGUF metadata lacks {full!r}.")
        return default

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer counts; only uniform ones map onto mlx-lm
        if len(set(n_kv)) != 1:
            raise GGUFConversionError(f"Per-layer KV head counts are not supported: {n_kv}")
        n_kv = n_kv[0]
    n_kv = int(n_kv)
    embed_shape = [int(d) for d in tensors["token_embd.weight"].shape]  # [hidden, vocab]
    vocab = embed_shape[1]
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFConversionError(f"Partial rotary ({rope_dim} of {head_dim} dims) not supported.")

    model_type, architecture = _MODEL_TYPES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0, required=False)),
        "vocab_size": vocab,
        "max_position_embeddings": int(get("context_length", 4096, required=False)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch in ("qwen3", "qwen3moe", "gemma3") or head_dim != hidden // n_head:
        if arch in ("qwen2", "phi3"):
            raise GGUFConversionError("qwen2 with head_dim != hidden/heads is not supported.")
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch == "qwen3moe":
        config.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "gemma3":
        # llama.cpp's Gemma 3: local layers' rope base 10000, every sixth layer global, the
        # query scaled by 1/sqrt(head_dim) (by 1/sqrt(hidden/heads) for the 27B model).
        config.update(
            rope_local_base_freq=10000.0, sliding_window_pattern=6,
            sliding_window=int(get("attention.sliding_window", 512, required=False)),
            query_pre_attn_scalar=(hidden // n_head if config["num_hidden_layers"] == 62
                                   else head_dim))
        config.pop("tie_word_embeddings")  # always tied
    if arch == "phi3":
        config["original_max_position_embeddings"] = config["max_position_embeddings"]

    scaling = get("rope.scaling.type", "none", required=False)
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": _f32(get("rope.scaling.factor", 1.0, required=False)),
        }
    elif scaling not in ("none", None):
        raise GGUFConversionError(f"Rope scaling type {scaling!r} is not supported.")

    for key in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(value)
    return config


# ----------------------------------------------------------------------------- tokenizer


def _build_tokenizer(
    meta: dict[str, Any], vocab_size: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Rebuild ``tokenizer.json`` + configs from the ``tokenizer.ggml.*`` metadata."""
    from tokenizers import Tokenizer, models

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFConversionError(
            f"Tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece BPE 'llama' are)."
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(tokens) > vocab_size:
        raise GGUFConversionError(
            f"Tokenizer has {len(tokens)} tokens but the embedding only {vocab_size} rows."
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, vocab)
    else:
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                   byte_fallback=False))
        _byte_level(tok, meta)
    return _finish_tokenizer(tok, meta, tokens, types, vocab, kind)


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], vocab: dict[str, int]) -> Any:
    """A SentencePiece BPE vocabulary (Llama 2, Gemma, Phi-3, Mistral's early models) as a
    ``tokenizers`` BPE: merges rebuilt from the pieces' scores (as Hugging Face's converter
    does for a SentencePiece model), "▁" for spaces, bytes by fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    merges = []
    for piece, score in zip(tokens, scores):  # every split of a piece into two known pieces
        found = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(found, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges],
                               unk_token=tokens[int(unk)] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _byte_level(tok: Any, meta: dict[str, Any]) -> None:
    """A byte-level BPE's pre-tokenizer (per ``tokenizer.ggml.pre``) and decoder."""
    from tokenizers import Regex, decoders, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    style = _PRE_TOKENIZERS.get(pre)
    if style is None:
        print(
            f"warning: unknown tokenizer.ggml.pre {pre!r}; using the GPT-2 split",
            file=sys.stderr,
        )
        style = "gpt2"
    if style == "digits+gpt2":
        # Same as the original HF tokenizer.json of SmolLM/StarCoder.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    elif style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[style]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()


def _finish_tokenizer(tok: Any, meta: dict[str, Any], tokens: list[str], types: list[int],
                      vocab: dict[str, int], kind: str
                      ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Special tokens, the BOS/EOS template, the configs and the chat template."""
    from tokenizers import AddedToken, processors

    def token_of(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos, unk, pad = (token_of(k) for k in ("bos", "eos", "unknown", "padding"))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):

        def seq(piece: str, type_id: int) -> list[str]:
            out = [f"{bos}:{type_id}"] if add_bos and bos else []
            out.append(f"{piece}:{type_id}")
            return out + ([f"{eos}:{type_id}"] if add_eos and eos else [])

        specials = {t: vocab[t] for t in (bos if add_bos else None, eos if add_eos else None) if t}
        template = processors.TemplateProcessing(
            single=seq("$A", 0), pair=seq("$A", 0) + seq("$B", 1),
            special_tokens=list(specials.items()))
        tok.post_processor = (processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                   template]) if kind == "gpt2" else template)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens (<|im_start|>, <|endoftext|>, ...) must be matched whole, never split.
    control = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tokenizer_json = json.loads(tok.to_str())

    special_map = {
        k: v
        for k, v in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
        if v
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(
            meta.get(f"{meta.get('general.architecture')}.context_length", 2048)
        ),
        "added_tokens_decoder": {
            str(vocab[t]): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": t in control,
            }
            for t in control + user
        },
    }
    extra = [t for t in control if t not in special_map.values()]
    if extra:
        tokenizer_config["additional_special_tokens"] = extra
        special_map = {**special_map, "additional_special_tokens": extra}
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return tokenizer_json, tokenizer_config, special_map


# ----------------------------------------------------------------------------- misc


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


class _Progress:
    """Tensor counter on stderr: live on a terminal, a few lines otherwise (logs stay short)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.marks = {max(1, round(total * f)) for f in (0.25, 0.5, 0.75, 1.0)}

    def update(self, i: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            end = "\n" if i == self.total else ""
            print(f"\rConverting tensors {i}/{self.total}", end=end, file=sys.stderr, flush=True)
        elif i in self.marks:
            print(f"Converting tensors {i}/{self.total}", file=sys.stderr, flush=True)
