"""EAGLE-3: an autoregressive drafter of one decoder layer over the target's fused features.

The layout SpecForge trains (``LlamaForCausalLMEagle3``; the speculators layout is converted to
it on load, speculators.py). Three tap layers' outputs are fused by ``fc`` (3H -> H). Position t
of the drafter pairs the fused target features h_t with the embedding of the next token
x_{t+1} (the target's embedding): the layer's input is ``[input_layernorm(embed) ;
hidden_norm(h)]`` (2H wide, the embedding first), the residual is h, and
``lm_head(norm(out))`` over its own (possibly reduced) vocabulary predicts x_{t+2}. A chain of
drafts feeds each step's pre-norm output back as the next step's h (its normed output in
"Eagle 3.1"), with the drafted token as its next token; its own KV cache holds the committed
positions. Trees grow EAGLE-2's way (``grow_tree``); training unrolls the chain as SpecForge's
training-time test does (``train_logits``).

Draft ids map to target ids as ``draft + d2t[draft]``; ``t2d`` marks the target ids the draft
vocabulary holds (both kept to write the checkpoint back).

The chain itself (how committed positions wait for their next token, then the drafts) is
chain.py's, shared with the target's own MTP heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..tree import grow_tree
from .chain import ChainDrafter
from .layers import MLP, DraftArgs


class _Memo:
    """Derived arrays kept off the module's parameters."""

    d2t: mx.array | None = None
    ids: mx.array | None = None


@dataclass
class Eagle3Args(DraftArgs):
    """SpecForge's EAGLE-3 config (a Llama config with ``draft_vocab_size`` and
    ``eagle_config``). ``block_size`` is ours: the chain's drafts plus one."""

    architecture: ClassVar[str] = "LlamaForCausalLMEagle3"
    mask_token_id: int = 0  # no mask slots: unused
    target_hidden_size: int | None = None
    fc_norm: bool = False  # a norm over each tap's third of the features before fc
    norm_before_fc: bool = False  # one norm over all of them (speculators' input_norm)
    norm_before_residual: bool = False  # the residual is the normed hidden (speculators)
    qk_norm: bool = False  # per-head q/k norms (a Qwen3 layer config, speculators)
    head_norm: bool = True  # the final norm before lm_head (SpecForge's norm_output)
    feed_normed: bool = False  # the normed state fed back too ("Eagle 3.1", speculators'
    # norm_output; SpecForge's layout cannot say it: our config.json writes feed_normed)

    @classmethod
    def from_config(cls, config: dict, **family: Any) -> Eagle3Args:
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"EAGLE-3 config.json lacks required fields: {', '.join(missing)}")
        if config.get("num_hidden_layers", 1) != 1:
            raise NotImplementedError(
                f"EAGLE-3 drafters of {config['num_hidden_layers']} layers are not supported "
                "yet (one layer is)")
        eagle = config.get("eagle_config") or {}
        ids = config.get("eagle_aux_hidden_state_layer_ids",
                         eagle.get("eagle_aux_hidden_state_layer_ids"))
        rope_params = config.get("rope_parameters") or {}
        H = config["hidden_size"]
        return cls(
            hidden_size=H,
            num_hidden_layers=1,
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            target_layer_ids=[int(i) for i in ids] if ids else [],  # []: the target's default
            block_size=int(config.get("block_size", 8)),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(config.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            num_target_layers=config.get("num_target_layers"),
            attention_bias=config.get("attention_bias", False),
            verify_block_size=config.get("verify_block_size"),
            draft_vocab_size=(config.get("draft_vocab_size")
                              if config.get("draft_vocab_size") != config["vocab_size"]
                              else None),
            target_hidden_size=config.get("target_hidden_size"),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            qk_norm=bool(config.get("qk_norm", False)),
            head_norm=bool(config.get("norm_output", True)),
            feed_normed=bool(config.get("feed_normed", False)),
            **family,
        )

    def to_config(self) -> dict:
        """SpecForge's layout (what its trainer writes and SGLang loads), with our block size."""
        config = {
            "architectures": [self.architecture],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.target_layer_ids,
                             "use_aux_hidden_state": True},
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
        }
        for name in ("target_hidden_size", "verify_block_size"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        for name in ("fc_norm", "norm_before_fc", "norm_before_residual", "qk_norm",
                     "feed_normed"):
            if getattr(self, name):
                config[name] = True
        if not self.head_norm:
            config["norm_output"] = False
        return config


def default_layer_ids(num_layers: int) -> list[int]:
    """SpecForge's taps when the config names none: outputs of layers 1, N/2 - 1 and N - 4."""
    return [1, num_layers // 2 - 1, num_layers - 4] if num_layers >= 5 else [0, 0, 0]


class Eagle3Attention(nn.Module):
    """Queries, keys and values from the 2H-wide ``[embedding ; hidden]`` input."""

    def __init__(self, a: Eagle3Args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (a.num_attention_heads,
                                                        a.num_key_value_heads, a.head_dim)
        self.scale = self.head_dim**-0.5
        dim, bias = 2 * a.hidden_size, a.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, a.hidden_size, bias=bias)
        if a.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        self.rope = initialize_rope(self.head_dim, base=a.rope_theta, traditional=False,
                                    scaling_config=a.rope_scaling,
                                    max_position_embeddings=a.max_position_embeddings)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, cache: KVCache, seen: mx.array | None = None,
                 position: int | None = None) -> mx.array:
        """A run of positions [1, L, 2H] after the cache; or, with ``seen`` [B, T] (which of
        the cache's T entries after this call each row attends to), B tree nodes [B, 1, 2H] of
        one depth, all at ``position``: their keys join the cache side by side."""
        B, L, _ = x.shape
        q, k, v = self.project(x, cache.offset if position is None else position)
        if seen is None:
            k, v = cache.update_and_fetch(k, v)
            mask = "causal" if L > 1 else None
        else:  # tree nodes: rows of a batch in, positions of the one cache out
            k, v = cache.update_and_fetch(k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3))
            k, v = (mx.broadcast_to(a, (B, *a.shape[1:])) for a in (k, v))
            mask = seen[:, None, None, :]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, ...]:
        """q, k, v [B, heads, L, head_dim] of ``x`` [B, L, 2H], rotated from ``offset`` (one
        position, or one per row)."""
        q = self._heads(self.q_proj(x), self.n_heads)
        k = self._heads(self.k_proj(x), self.n_kv_heads)
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v


class Eagle3Layer(nn.Module):
    """SpecForge's ``midlayer``."""

    def __init__(self, a: Eagle3Args):
        super().__init__()
        self.norm_before_residual = a.norm_before_residual
        self.hidden_norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.self_attn = Eagle3Attention(a)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: KVCache,
                 seen: mx.array | None = None, position: int | None = None) -> mx.array:
        x, residual = self.inputs(embeds, hidden)
        return self.finish(residual, self.self_attn(x, cache, seen, position))

    def inputs(self, embeds: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """The attention's input [embedding ; hidden], each normed, and the residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), residual

    def finish(self, residual: mx.array, attended: mx.array) -> mx.array:
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(ChainDrafter):
    family = "eagle3"
    args_class: ClassVar[type[DraftArgs]] = Eagle3Args
    own_head = True  # its lm_head is its own (over the draft vocabulary), kept on load
    train_gamma: ClassVar[float] = 4.48  # position k weighs exp(-k/4.48) = 0.8^k, as SpecForge
    train_aux_weight: ClassVar[float] = 0.0

    @classmethod
    def train_fields(cls, options: Any) -> dict:
        if options.num_layers not in (None, 1):
            raise ValueError("an EAGLE-3 drafter has one layer (--layers 1)")
        return {}

    def aux_loss(self, aux: Any, labels: mx.array, weights: mx.array, tv: Any) -> None:
        return None

    def val_metrics(self, logits: mx.array, aux: Any, labels: Any, valid: Any) -> tuple:
        return np.array(mx.argmax(logits, axis=-1)), {}

    def train_logits(self, target: Any, features: mx.array, blocks: mx.array,
                     anchors: mx.array, prev: mx.array, tokens: mx.array | None = None
                     ) -> tuple[mx.array, None]:
        """Training-time test (SpecForge's unrolled objective): logits [N, n, V'] of each
        block's chain, teacher-forced. Step 0 runs every pair (features t, token t + 1) of the
        sequences ``tokens`` [G, T] at once, causally; a block anchored at a starts at pair
        a - 1, and its step j (input token ``prev[:, j]``, the state step j - 1 handed on, at
        position a - 1 + j) attends to step 0's keys up to a - 1 and its own steps' keys, as
        drafting does."""
        if tokens is None:
            raise ValueError("EAGLE-3 training reads the sequences' tokens")
        G, L = features.shape[:2]
        seq = mx.arange(anchors.shape[0]) // (anchors.shape[0] // G)  # each block's sequence
        kv = KVCache()
        out0 = self.midlayer(target.embed(tokens[:, 1 : L + 1]), self.fuse(features), kv)
        keys, values = kv.keys[..., :L, :][seq], kv.values[..., :L, :][seq]  # [N, kvh, L, hd]
        idx = anchors - 1
        h = self.fed_back(out0[seq, idx])
        logits, own = [self.logits(target, h)], []
        for j in range(1, prev.shape[1]):
            h = self.fed_back(self._chain_step(target.embed(prev[:, j]), h, keys, values,
                                               idx, j, own))
            logits.append(self.logits(target, h))
        return mx.stack(logits, axis=1), None

    def _chain_step(self, embeds: mx.array, hidden: mx.array, keys: mx.array,
                    values: mx.array, idx: mx.array, j: int, own: list) -> mx.array:
        """One teacher-forced step for N blocks ([N, H] in and out): the context's keys up to
        each block's ``idx``, and the block's own earlier steps' keys (``own``, grown here)."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x, residual = layer.inputs(embeds, hidden)
        q, k, v = attn.project(x[:, None], idx + j)  # [N, heads, 1, hd]
        own.append((k, v))
        rep = attn.n_heads // attn.n_kv_heads

        def heads(a: mx.array) -> mx.array:
            return mx.repeat(a, rep, axis=1) if rep > 1 else a

        q = q * attn.scale
        L = keys.shape[2]
        ctx = q @ heads(keys).swapaxes(-1, -2)  # [N, heads, 1, L]
        ctx = mx.where((mx.arange(L)[None] <= idx[:, None])[:, None, None], ctx,
                       mx.array(-mx.inf, ctx.dtype))
        mine = mx.concatenate([(q * heads(ki)).sum(-1, keepdims=True) for ki, _ in own],
                              axis=-1)  # [N, heads, 1, j]
        w = mx.softmax(mx.concatenate([ctx, mine], axis=-1).astype(mx.float32), axis=-1)
        w = w.astype(q.dtype)
        out = w[..., :L] @ heads(values)
        for i, (_, vi) in enumerate(own):
            out = out + w[..., L + i : L + i + 1] * heads(vi)
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(x.shape[0], 1, -1))[:, 0]
        return layer.finish(residual, out)

    def __init__(self, args: Eagle3Args):
        super().__init__()
        self.args = args
        H = args.hidden_size
        Ht = args.target_hidden_size or H
        n_taps = len(args.target_layer_ids) or 3
        if args.fc_norm:
            self.fc_norm = [nn.RMSNorm(Ht, eps=args.rms_norm_eps) for _ in range(n_taps)]
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(n_taps * Ht, eps=args.rms_norm_eps)
        self.fc = nn.Linear(n_taps * Ht, H, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        Vd = args.draft_vocab_size or args.vocab_size
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if args.draft_vocab_size:
            self.d2t = mx.zeros((Vd,), dtype=mx.int64)
            self.t2d = mx.zeros((args.vocab_size,), dtype=mx.bool_)
            self.freeze(keys=["d2t", "t2d"])
        self._memo = _Memo()

    # -- what the decode loop reads -------------------------------------------------------------
    @property
    def vocab_ids(self) -> mx.array | None:
        """Target ids of the draft vocabulary (draft id + d2t), None with the full one."""
        if "d2t" not in self:
            return None
        if self._memo.d2t is not self.d2t:  # read per drafted token: worked out once
            self._memo.d2t = self.d2t
            self._memo.ids = (mx.arange(self.d2t.shape[0]) + self.d2t).astype(mx.int32)
        return self._memo.ids

    def set_draft_vocab(self, ids: mx.array) -> None:
        """Use the target ids ``ids`` as the draft vocabulary, in ascending order (d2t's
        offsets need it): d2t and t2d from them, for a head of a row per id (its rows follow
        that order: set before training)."""
        ids = mx.sort(ids.astype(mx.int64))
        self.args.draft_vocab_size = int(ids.shape[0])
        self.d2t = ids - mx.arange(ids.shape[0], dtype=mx.int64)
        self.t2d = mx.zeros((self.args.vocab_size,), dtype=mx.bool_)
        self.t2d[ids] = True
        self.freeze(keys=["d2t", "t2d"])

    def pass_key(self) -> tuple:
        a = self.args
        return (a.hidden_size, a.draft_vocab_size, self.block_size, type(self).__name__)

    def fuse(self, features: mx.array) -> mx.array:
        """Concatenated tap features [.., T, taps*Ht] -> [.., T, H]."""
        if "fc_norm" in self:
            parts = mx.split(features, len(self.fc_norm), axis=-1)
            features = mx.concatenate([n(p) for n, p in zip(self.fc_norm, parts)], axis=-1)
        if "input_norm" in self:
            features = self.input_norm(features)
        return self.fc(features)

    def step(self, target: Any, tokens: mx.array, hidden: mx.array, kv: KVCache) -> mx.array:
        """The layer over pairs (``hidden`` [1, n, H], next ``tokens`` [1, n]): the outputs
        [1, n, H] fed back as the next step's hidden; their keys join ``kv``."""
        return self.fed_back(self.midlayer(target.embed(tokens), hidden, kv))

    def fed_back(self, out: mx.array) -> mx.array:
        """What a step hands on: its pre-norm output, or the normed one ("Eagle 3.1")."""
        return self.norm(out) if self.args.feed_normed else out

    def logits(self, target: Any, out: mx.array) -> mx.array:
        if self.args.head_norm and not self.args.feed_normed:
            out = self.norm(out)
        return self.lm_head(out)

    def grow_tree(self, target: Any, anchor: mx.array, cache: list[Any], width: int,
                  beam: int) -> tuple[mx.array, mx.array, mx.array]:
        """A tree's candidate nodes below ``anchor`` (tree.grow_tree, lazy), EAGLE-2's way: each
        level's ``beam`` best nodes by path probability each run one step (side by side in the
        cache, each row seeing the context and its own ancestors) to score its children over
        the whole draft vocabulary. The tree's keys leave the cache again, as a chain's do."""
        kv = cache[0]
        out, held = self.first_pass(target, anchor, cache)
        base = kv.offset  # the context and the anchor's pair
        first = self.logits(target, out[:, -1])[0]
        ids = self.vocab_ids if self.vocab_ids is not None else mx.arange(first.shape[0])
        K = self.max_drafts
        state = {"out": out[0], "seen": mx.zeros((1, 0), dtype=mx.bool_)}

        def transition(d: int, pick: mx.array, rows: mx.array) -> mx.array:
            """Step the level-d nodes (tokens ``ids[pick]``, under rows ``rows`` of the level
            before): their children's logits [B, V']."""
            B = pick.shape[0]
            # each node sees its parent's ancestors and itself (the anchor's children: rows 0)
            seen = mx.concatenate([state["seen"][rows], mx.eye(B, dtype=mx.bool_)], axis=1)
            mask = mx.concatenate([mx.ones((B, base), dtype=mx.bool_), seen], axis=1)
            tokens = ids[pick].astype(mx.uint32)[:, None]
            hidden = state["out"][rows][:, None]
            out = self.fed_back(self.midlayer(target.embed(tokens), hidden, kv, mask,
                                              held + d))[:, 0]
            state["out"], state["seen"] = out, seen
            return self.logits(target, out)

        grown = grow_tree(first, transition, mx.broadcast_to(ids[None], (K, ids.shape[0])),
                          beam)
        kv.trim(kv.offset - held)
        return grown
