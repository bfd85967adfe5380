"""The target's own multi-token-prediction (MTP) head as a drafter: nothing to train.

Qwen3-Next and Qwen3.5 checkpoints carry an MTP module (``mtp.*``), DeepSeek-V3 an extra layer
(``model.layers.N.*``). Both read the embedding of the next token and the target's final hidden
state (after its final norm), each normed, concatenated (the embedding first) and projected
(2H -> H), then one decoder layer of the target's own kind (its MoE included), a norm and the
target's LM head (vLLM's qwen3_next_mtp.py and deepseek_mtp.py). Drafting chains it
(chain.py): each step's output is the next step's hidden state. mlx-lm drops these weights
when it converts a model; ``mlx-dflash convert target`` keeps them beside the model in
``mtp.safetensors`` (convert/mtp.py), and :func:`load_mtp_drafter` (``--drafter mtp``) builds
the drafter from them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .chain import ChainDrafter

SIDECAR = "mtp.safetensors"
# model types whose MTP head is read
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v3")
DEFAULT_BLOCK = 4  # drafts per cycle + 1; Qwen's own serving recipes draft 2-3 with MTP


@dataclass
class MTPArgs:
    """What the decode loop reads of a drafter's args."""

    hidden_size: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int = DEFAULT_BLOCK
    verify_block_size: int | None = None
    draft_vocab_size: int | None = None
    num_target_layers: int | None = None
    mask_token_id: int = 0  # no mask slots: unused


class MTPDraftModel(ChainDrafter):
    """What every family's MTP module shares: the target's final norm over its hidden input,
    the target's head, a chain of ``block_size - 1`` drafts. :func:`build` picks the family."""

    family = "mtp"

    def __init__(self, text_model: nn.Module, block_size: int = DEFAULT_BLOCK):
        super().__init__()
        args = text_model.args
        self.args = MTPArgs(args.hidden_size, args.vocab_size, [args.num_hidden_layers - 1],
                            block_size)
        self.final_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.final_norm.weight = text_model.model.norm.weight  # the target's: not loaded

    def pass_key(self) -> tuple:
        return (self.args.hidden_size, self.block_size, type(self).__name__)

    def fuse(self, features: mx.array) -> mx.array:
        return self.final_norm(features)

    @staticmethod
    def decoder_layer(text_model: nn.Module, layer_idx: int) -> nn.Module:
        """A decoder layer of the target's own class (its MoE included) at ``layer_idx``."""
        module = sys.modules[type(text_model).__module__]
        return getattr(module, LAYER_CLASSES[family_of(text_model)])(text_model.args, layer_idx)


class Qwen3NextMTP(MTPDraftModel):
    """vLLM's qwen3_next_mtp: [pre_fc_norm_embedding(embed) ; pre_fc_norm_hidden(hidden)] ->
    fc -> one full-attention layer -> norm -> the target's head; the normed output is fed
    back."""

    def __init__(self, text_model: nn.Module, block_size: int = DEFAULT_BLOCK):
        super().__init__(text_model, block_size)
        args = text_model.args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [self.decoder_layer(text_model, args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(H, eps=eps)

    def step(self, target: Any, tokens: mx.array, hidden: mx.array, kv: KVCache) -> mx.array:
        x = mx.concatenate([self.pre_fc_norm_embedding(target.embed(tokens)),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.layers[0](self.fc(x), "causal" if x.shape[1] > 1 else None, kv)
        return self.norm(x)

    def logits(self, target: Any, out: mx.array) -> mx.array:
        return target.lm_head(out)


class _SharedHead(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


class DeepseekV3MTP(MTPDraftModel):
    """DeepSeek-V3's MTP layer (vLLM's deepseek_mtp): eh_proj([enorm(embed) ; hnorm(hidden)])
    -> one decoder layer (index N: MoE as the config places it) -> shared_head.norm -> the
    target's head; the pre-norm output is fed back."""

    def __init__(self, text_model: nn.Module, block_size: int = DEFAULT_BLOCK):
        super().__init__(text_model, block_size)
        args = text_model.args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layers = [self.decoder_layer(text_model, args.num_hidden_layers)]
        self.shared_head = _SharedHead(H, eps)

    def step(self, target: Any, tokens: mx.array, hidden: mx.array, kv: KVCache) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(target.embed(tokens)), self.hnorm(hidden)],
                                        axis=-1))
        L = x.shape[1]
        mask = None if L == 1 else create_attention_mask(x, kv, return_array=True)  # MLA
        return self.layers[0](x, mask, kv)

    def logits(self, target: Any, out: mx.array) -> mx.array:
        return target.lm_head(self.shared_head.norm(out))


# Keyed by the mlx-lm module of the text model (Qwen3.5's is qwen3_5, whatever its model type).
BUILDERS = {"qwen3_next": Qwen3NextMTP, "qwen3_5": Qwen3NextMTP, "deepseek_v3": DeepseekV3MTP}
LAYER_CLASSES = {"qwen3_next": "Qwen3NextDecoderLayer", "qwen3_5": "DecoderLayer",
                 "deepseek_v3": "DeepseekV3DecoderLayer"}


def family_of(text_model: nn.Module) -> str:
    return type(text_model).__module__.rsplit(".", 1)[-1]


def build(text_model: nn.Module, block_size: int = DEFAULT_BLOCK) -> MTPDraftModel:
    """The (untrained) MTP module of ``text_model``'s family."""
    family = family_of(text_model)
    if family not in BUILDERS:
        raise NotImplementedError(f"MTP drafters of model type '{family}' are not supported "
                                  "yet (Qwen3-Next, Qwen3.5 and DeepSeek-V3 are)")
    return BUILDERS[family](text_model, block_size)


def load_mtp_drafter(model_dir: str | Path, model: nn.Module,
                     block_size: int = DEFAULT_BLOCK) -> MTPDraftModel:
    """The MTP drafter of the target loaded from ``model_dir`` (``model``), from the
    ``mtp.safetensors`` that ``mlx-dflash convert target`` wrote beside it."""
    path = Path(model_dir).expanduser() / SIDECAR
    text = getattr(model, "language_model", model)
    if not path.exists():
        raise FileNotFoundError(
            f"{Path(model_dir)} has no {SIDECAR}: its MTP weights were not kept (mlx-lm's own "
            "conversion drops them); convert the Hugging Face checkpoint with `mlx-dflash "
            "convert target`, which keeps them")
    drafter = build(text, block_size)
    dtype = text.model.norm.weight.dtype  # the target's float dtype
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in mx.load(str(path)).items()}
    expected = {k for k, _ in tree_flatten(drafter.parameters())} - {"final_norm.weight"}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit a {family_of(text)} MTP module: "
                         + (f"lacks {', '.join(missing[:6])}" if missing else "")
                         + ("; " if missing and unexpected else "")
                         + (f"has unexpected {', '.join(unexpected[:6])}" if unexpected else ""))
    drafter.load_weights(list(weights.items()), strict=False)
    drafter.freeze()
    mx.eval(drafter.parameters())
    drafter.eval()
    drafter.source_path = path.parent
    return drafter
