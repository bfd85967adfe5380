"""Pieces the drafter families share: config, KV-injected attention, the decoder layer.

Every drafter layer attends from the block tokens to ``[context ; block]``: the context is the
fused target features (``hidden_norm(fc(taps))``), projected by the *same* ``k_proj`` / ``v_proj``
as the block. At inference only the context K/V are cached; block K/V are rebuilt every cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope


Args = TypeVar("Args", bound="DraftArgs")


def config_field(config: dict, name: str, default: Any = None) -> Any:
    """A field of a drafter ``config.json``: from ``dflash_config`` if there, else the top level
    (exports put the same fields in either place)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


@dataclass
class DraftArgs:
    """What every family reads from config.json (DFlash's own args: the z-lab layout). A family
    with more fields subclasses it, reads them in ``from_config`` and writes them in
    ``to_config``."""

    architecture: ClassVar[str] = "DFlashDraftModel"  # what to_config writes in architectures
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    rope_traditional: bool = False
    max_position_embeddings: int = 40960
    num_target_layers: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    # Drafts verified per cycle when the caller does not say (the block width the drafter runs
    # at is always block_size); the measured best on a machine can be well below block_size.
    verify_block_size: int | None = None
    # Reduced draft vocabulary: the head uses only these many target rows (ids in the weights).
    draft_vocab_size: int | None = None
    # At inference the block attends to the last this many context positions only (None: all):
    # the drafter's pass then costs the same at any context length.
    context_window: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Whether a layer's block attention is causal; z-lab's rule: sliding layers are,
        unless the config says otherwise."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == "sliding_attention"

    @classmethod
    def from_config(cls: type[Args], config: dict, **family: Any) -> Args:
        """Read a z-lab style ``config.json`` (fields may sit at top level or in dflash_config);
        ``family``: a subclass's own fields, which it reads itself."""

        def pick(name, default=None):
            return config_field(config, name, default)

        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "vocab_size")
            if k not in config
        ]
        if pick("target_layer_ids") is None:
            missing.append("dflash_config.target_layer_ids")
        if pick("mask_token_id") is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ValueError(f"drafter config.json lacks required fields: {', '.join(missing)}")
        rope_params = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0))
        rope_scaling = config.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        softcap = pick("final_logit_softcapping")
        return cls(
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            target_layer_ids=[int(i) for i in pick("target_layer_ids")],
            mask_token_id=int(pick("mask_token_id")),
            block_size=int(pick("block_size", 16)),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            num_target_layers=config.get("num_target_layers"),
            layer_types=config.get("layer_types"),
            sliding_window=config.get("sliding_window"),
            is_causal=config.get("is_causal"),
            attention_bias=config.get("attention_bias", False),
            output_multiplier=float(pick("output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
            input_embedding_scale=float(pick("input_embedding_scale", 1.0) or 1.0),
            verify_block_size=pick("verify_block_size"),
            draft_vocab_size=pick("draft_vocab_size"),
            context_window=pick("context_window", pick("sliding_window_size")),
            **family,
        )

    def to_config(self) -> dict:
        """The config.json that ``from_config`` reads back, in the z-lab layout."""
        config = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"target_layer_ids": self.target_layer_ids,
                              "mask_token_id": self.mask_token_id},
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "num_target_layers": self.num_target_layers,
            "tie_word_embeddings": False,
        }
        if self.verify_block_size is not None:
            config["verify_block_size"] = self.verify_block_size
        if self.context_window is not None:
            config["context_window"] = self.context_window
        if self.draft_vocab_size:
            config["dflash_config"]["draft_vocab_size"] = self.draft_vocab_size
        if self.sliding_window is not None:
            config["layer_types"] = self.layer_types
            config["sliding_window"] = self.sliding_window
        return config


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class InjectedAttention(nn.Module):
    """Queries from the block; keys/values from ``[context ; block]`` with shared projections."""

    def __init__(self, args: DraftArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim,
            base=args.rope_theta,
            traditional=args.rope_traditional,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def context_kv(self, ctx: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        keys = self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads))
        values = self._heads(self.v_proj(ctx), self.n_kv_heads)
        return self.rope(keys, offset=offset), values

    def __call__(
        self,
        x: mx.array,
        ctx_keys: mx.array,
        ctx_values: mx.array,
        block_offset: Any,
        mask: mx.array | None,
    ) -> mx.array:
        """Attend from block ``x`` [N, B, D] over cached/given context K/V and the block itself."""
        N, B, _ = x.shape
        queries = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        keys = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
        values = self._heads(self.v_proj(x), self.n_kv_heads)
        queries = self.rope(queries, offset=block_offset)
        keys = self.rope(keys, offset=block_offset)
        if ctx_keys.shape[0] != N:  # training: each context shared by many blocks
            out = shared_context_attention(queries * self.scale, keys, values, ctx_keys,
                                           ctx_values, mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))
        keys = mx.concatenate([ctx_keys, keys], axis=2)
        values = mx.concatenate([ctx_values, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


def shared_context_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    mask: mx.array,
) -> mx.array:
    """Attention of G*N training blocks over their sequence's context and their own block.

    queries [G*N, H, B, d] (scaled), keys/values [G*N, KV, B, d] (the blocks'), ctx_keys/values
    [G, KV, T, d] (blocks n*G'..: sequence g owns blocks g*N..g*N+N-1), mask [G*N, 1, B, T+B].
    The context part is one matmul per sequence and KV head instead of N broadcast copies of
    the context through SDPA: MLX's CPU SDPA is slow, its matmuls go through BLAS.
    """
    GN, H, B, d = queries.shape
    G, KV, T, _ = ctx_keys.shape
    N, rep = GN // G, H // KV
    # [G*N, H, B, d] -> [G, KV, N*rep*B, d]: the queries that read each context K/V head.
    q = queries.reshape(G, N, KV, rep * B, d).transpose(0, 2, 1, 3, 4).reshape(G, KV, -1, d)
    ctx_scores = (q @ ctx_keys.transpose(0, 1, 3, 2)).reshape(G, KV, N, rep * B, T)
    ctx_scores = ctx_scores.transpose(0, 2, 1, 3, 4).reshape(GN, KV, rep * B, T)
    q_blk = queries.reshape(GN, KV, rep * B, d)
    blk_scores = q_blk @ keys.transpose(0, 1, 3, 2)  # [G*N, KV, rep*B, B]
    scores = mx.concatenate([ctx_scores, blk_scores], axis=-1).reshape(GN, H, B, T + B)
    scores = mx.where(mask, scores, mx.array(-1e30, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(GN, KV, rep * B, T + B)
    p_ctx = probs[..., :T].reshape(G, N, KV, rep * B, T).transpose(0, 2, 1, 3, 4)
    out = (p_ctx.reshape(G, KV, -1, T) @ ctx_values).reshape(G, KV, N, rep * B, d)
    out = out.transpose(0, 2, 1, 3, 4).reshape(GN, KV, rep * B, d)
    out = out + probs[..., T:] @ values
    return out.reshape(GN, H, B, d)


class DraftLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_idx: int):
        super().__init__()
        self.self_attn = InjectedAttention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        layer_type = args.layer_types[layer_idx]
        self.sliding_window = args.sliding_window if layer_type == "sliding_attention" else None
        self.is_causal = args.layer_is_causal(layer_idx)

    def __call__(self, x, ctx_keys, ctx_values, block_offset, mask) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx_keys, ctx_values, block_offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(
    ctx_len: int, block_len: int, block_start: int, sliding_window: int | None, is_causal: bool,
    ctx_start: int = 0,
) -> mx.array | None:
    """Inference mask for one block at positions block_start.. over ctx positions
    ctx_start..ctx_start+ctx_len-1."""
    if sliding_window is None and not is_causal:
        return None
    q_pos = mx.arange(block_start, block_start + block_len)[:, None]
    ctx_pos = mx.arange(ctx_start, ctx_start + ctx_len)[None, :]
    blk_pos = mx.arange(block_start, block_start + block_len)[None, :]
    ctx_ok = mx.ones((block_len, ctx_len), dtype=mx.bool_)
    blk_ok = mx.ones((block_len, block_len), dtype=mx.bool_)
    if sliding_window is not None:
        ctx_ok = (q_pos - ctx_pos) < sliding_window
    if is_causal:
        blk_ok = blk_pos <= q_pos
    return mx.concatenate([ctx_ok, blk_ok], axis=1)


def make_context_cache(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]
