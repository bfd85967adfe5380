"""DFlash 2: the DFlash backbone with a dynamic convolution around every sublayer, and a
low-rank path selector over each position's top-K draft candidates.

Convolution (per block, never across blocks): ``y_t = (base0 + d_t0) * x_t + (base1 + d_t1) *
x_(t-1)`` with ``x_(-1) = 0`` at the anchor; ``d`` comes from one linear projection of the
sublayer input, one value per group of ``conv_group_size`` channels, and that projection drives
both the pre-sublayer (side 0) and the post-sublayer (side 1) convolution.
Selector: ``S_t(a, b) = U_t(b) + <A[a] * P(h_t), B[b]>`` over the top-K candidates b of position
t, with a the token chosen at t-1 (the anchor at t = 1); the walk takes the argmax, or samples
``softmax(S_t / T)`` over the K candidates. At initialisation (``base = [1, 0]``, zero
projection, zero successor codebook) it proposes exactly what DFlash proposes.
Weight names follow the published DFlash2DraftModel checkpoints (SpecForge / SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..accept import CandidateProposal, SamplingParams
from ..kernels import path_select
from ..tree import grow_tree
from .base import Proposal
from .dflash import DFlashDraftModel
from .layers import DraftArgs, DraftLayer, config_field


@dataclass
class DFlash2Args(DraftArgs):
    """The published DFlash2DraftModel config: the sublayer convolutions and the path selector
    (zero: not given, which the drafter refuses)."""

    architecture: ClassVar[str] = "DFlash2DraftModel"
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_config(cls, config: dict, **family: Any) -> DFlash2Args:
        def pick(name):
            return int(config_field(config, name, 0) or 0)

        return super().from_config(
            config, conv_kernel_size=pick("conv_kernel_size"),
            conv_group_size=pick("conv_group_size"), selector_rank=pick("selector_rank"),
            selector_top_k=pick("selector_top_k"), **family)

    def to_config(self) -> dict:
        """The published layout: block size, convolution, selector and output scaling in
        dflash_config, and whether the block attention is causal."""
        config = super().to_config()
        config["is_causal"] = self.layer_is_causal(0)
        config["dflash_config"].update(
            block_size=config.pop("block_size"), conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size, selector_rank=self.selector_rank,
            selector_top_k=self.selector_top_k, output_multiplier=self.output_multiplier,
            final_logit_softcapping=self.final_logit_softcapping)
        return config


class GroupedConv(nn.Module):
    """A ``taps``-tap dynamic depthwise convolution within each block row of [N, B, D]."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        if not 1 <= taps <= block_size:
            raise ValueError(f"conv_kernel_size must be in 1..block_size ({block_size}), "
                             f"got {taps}")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size "
                             f"{hidden_size}")
        self.taps, self.group_size = taps, group_size
        self.num_groups = hidden_size // group_size
        base = mx.zeros((2, taps, hidden_size))  # [pre/post side, tap, channel]
        base[:, 0] = 1.0
        self.base_kernel = base
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def _convolve(self, x: mx.array, delta: mx.array, side: int) -> mx.array:
        N, B, D = x.shape
        G, g = self.num_groups, self.group_size
        coef = self.base_kernel[side].reshape(self.taps, G, g) + delta[..., None]  # [N,B,t,G,g]
        xg = x.reshape(N, B, G, g)
        out = coef[:, :, 0] * xg
        for tap in range(1, self.taps):
            shifted = mx.pad(xg[:, : B - tap], [(0, 0), (tap, 0), (0, 0), (0, 0)])
            out = out + coef[:, :, tap] * shifted
        return out.reshape(N, B, D)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Convolve the sublayer input; return it and the post-sublayer kernel deltas."""
        delta = self.kernel_projection(x).reshape(*x.shape[:2], 2, self.taps, self.num_groups)
        return self._convolve(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, x: mx.array, delta: mx.array) -> mx.array:
        return self._convolve(x, delta, 1)


class DFlash2Layer(DraftLayer):
    def __init__(self, args: DFlash2Args, layer_idx: int):
        super().__init__(args, layer_idx)
        conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size, args.block_size)
        self.attention_conv = GroupedConv(*conv)
        self.mlp_conv = GroupedConv(*conv)

    def __call__(self, x, ctx_keys, ctx_values, block_offset, mask) -> mx.array:
        y, post = self.attention_conv.prepare(self.input_layernorm(x))
        attn = self.self_attn(y, ctx_keys, ctx_values, block_offset, mask)
        h = x + self.attention_conv.finish(attn, post)
        y, post = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(y), post)


class CandidateSelector(nn.Module):
    """Predecessor/successor codebooks [rows, r] and the hidden projection H -> r.

    Rows are target ids, or with a reduced draft vocabulary the drafter's indices (the
    predecessor codebook then has one more row: a previous token outside the vocabulary)."""

    def __init__(self, hidden_size: int, n_prev: int, n_next: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= n_next:
            raise ValueError(f"selector_rank must be >= 1 and selector_top_k in 1..{n_next}, "
                             f"got {rank} and {top_k}")
        self.top_k = top_k
        self.predecessor_codebook = 0.02 * mx.random.normal((n_prev, rank))
        self.successor_codebook = mx.zeros((n_next, rank))  # zero: scores start as DFlash's
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidates(self, unary: mx.array) -> tuple[mx.array, mx.array]:
        """Top-K candidate indices [.., K] (best first) and their unary logits."""
        k = self.top_k
        top = mx.stop_gradient(mx.argpartition(-unary, kth=k - 1, axis=-1)[..., :k])
        vals = mx.take_along_axis(unary, top, axis=-1)
        order = mx.stop_gradient(mx.argsort(-vals, axis=-1))
        return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)

    def scores(self, cand: mx.array, unary_k: mx.array, hidden: mx.array,
               prev_rows: mx.array) -> mx.array:
        """S(prev, cand) [.., K] for one predecessor row per position (teacher forcing)."""
        context = self.predecessor_codebook[prev_rows] * self.hidden_projection(hidden)
        succ = self.successor_codebook[cand]  # [.., K, r]
        return unary_k + (succ @ context[..., None])[..., 0]

    def lattice(self, cand: mx.array, unary_k: mx.array, hidden: mx.array,
                anchor_row: mx.array) -> tuple[mx.array, mx.array]:
        """Scores of position 1 from the anchor [K], and of positions t >= 2 from each of the
        K candidates of t-1 [n-1, K, K]: all the walk needs, in two batched products."""
        proj = self.hidden_projection(hidden)  # [n, r]
        succ = self.successor_codebook[cand]  # [n, K, r]
        first = unary_k[0] + succ[0] @ (self.predecessor_codebook[anchor_row] * proj[0])
        prev = self.predecessor_codebook[cand[:-1]] * proj[1:, None, :]  # [n-1, K, r]
        rest = unary_k[1:, None, :] + prev @ succ[1:].transpose(0, 2, 1)
        return first, rest


def walk_path(first: mx.array, rest: mx.array, temperature: float = 0.0,
              key: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """The selector walk: candidate index per position [n], and at temperature > 0 the
    proposal over the K candidates [n, K]. The one sequential step of DFlash 2: one Metal
    kernel where there is a Metal GPU (kernels.path_select), MLX ops otherwise; lazy, no host
    sync."""
    if temperature == 0:
        picks, _ = path_select(first[None], rest[None])
        return picks[0], None
    uniforms = mx.random.uniform(shape=(1, rest.shape[0] + 1), key=key)
    picks, probs = path_select(first[None], rest[None], uniforms, temperature)
    return picks[0], probs[0]


class DFlash2DraftModel(DFlashDraftModel):
    family = "dflash2"
    args_class = DFlash2Args
    args: DFlash2Args
    layer_class = DFlash2Layer
    train_aux_weight = 1.0  # the selector's cross-entropy
    fixed_vocab = True

    def __init__(self, args: DFlash2Args):
        needed = {"conv_kernel_size": args.conv_kernel_size,
                  "conv_group_size": args.conv_group_size, "selector_rank": args.selector_rank,
                  "selector_top_k": args.selector_top_k}
        missing = [k for k, v in needed.items() if not v]
        if missing:
            raise ValueError(f"a DFlash 2 drafter needs dflash_config.{', '.join(missing)}")
        super().__init__(args)
        n_next = args.draft_vocab_size or args.vocab_size
        n_prev = n_next + 1 if args.draft_vocab_size else n_next
        self.candidate_selector = CandidateSelector(args.hidden_size, n_prev, n_next,
                                                    args.selector_rank, args.selector_top_k)

    def propose_from(self, target: Any, anchor: mx.array, hidden: mx.array, logits: mx.array,
                     params: SamplingParams) -> Proposal:
        """K drafts by the selector walk; when sampling, the proposal on each position's K
        candidates (verified by the candidates kernel: rejection sampling stays exact). The
        block widens to the cycle's width as DFlash's does."""
        sel = self.candidate_selector
        cand, unary_k = sel.candidates(logits.astype(mx.float32))
        first, rest = sel.lattice(cand, unary_k, hidden, self.prev_rows(anchor)[0])
        picks, q = walk_path(first, rest, params.temperature, params.key())
        idx = mx.take_along_axis(cand, picks[:, None], axis=-1)[:, 0]
        vocab = self.vocab_ids
        cand_ids = vocab[cand] if vocab is not None else cand
        drafts = (vocab[idx] if vocab is not None else idx).astype(mx.uint32)
        return Proposal(drafts,
                        None if q is None else CandidateProposal(cand_ids.astype(mx.uint32), q))

    def tree_from(self, target: Any, anchor: mx.array, hidden: mx.array, logits: mx.array,
                  beam: int) -> tuple[mx.array, mx.array, mx.array]:
        """The tree (tree.grow_tree, lazy) from the drafts' hidden states and logits: each
        node's children are the next position's K candidates, scored given the node's
        candidate by the selector's pair scores (the lattice its walk reads)."""
        sel = self.candidate_selector
        cand, unary_k = sel.candidates(logits.astype(mx.float32))
        first, rest = sel.lattice(cand, unary_k, hidden, self.prev_rows(anchor)[0])
        ids = self.vocab_ids[cand] if self.vocab_ids is not None else cand
        return grow_tree(first, lambda d, pick, _: rest[d - 1][pick], ids, beam)

    def train_logits(self, target: Any, features, blocks, anchors, prev):
        """(draft logits [N, n, V'], (selector scores [N, n, K], candidates [N, n, K])) of
        training blocks; the scores use the true previous token (teacher forcing)."""
        embeds = self.embed_block(target, blocks)
        hidden = self.train_hidden(embeds, features, anchors)[:, 1:]
        logits = self.head(target, hidden)
        sel = self.candidate_selector
        cand, unary_k = sel.candidates(logits.astype(mx.float32))
        scores = sel.scores(cand, unary_k, hidden, self.prev_rows(prev))
        return logits, (scores, cand)

    @classmethod
    def train_fields(cls, options: Any) -> dict:
        return dict(conv_kernel_size=options.conv_kernel_size,
                    conv_group_size=options.conv_group_size,
                    selector_rank=options.selector_rank, selector_top_k=options.selector_top_k)

    def aux_loss(self, aux: tuple[mx.array, mx.array], labels: mx.array, weights: mx.array,
                 tv: Callable[[], mx.array]) -> mx.array:
        """The selector's cross-entropy over each position's K candidates given the true
        previous token; positions whose label is not a candidate are left out."""
        scores, cand = aux
        hit = cand == labels[..., None]
        covered = hit.any(axis=-1)
        sel_ce = nn.losses.cross_entropy(scores, mx.argmax(hit, axis=-1), reduction="none")
        ws = weights * covered
        return (sel_ce * ws).sum() / mx.maximum(ws.sum(), 1e-6)

    def val_metrics(self, logits: mx.array, aux: tuple[mx.array, mx.array], labels: np.ndarray,
                    valid: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The selector's pick, and the recall of the candidates (label among them)."""
        scores, cand = (np.array(a) for a in aux)
        pred = np.take_along_axis(cand, scores.argmax(-1)[..., None], -1)[..., 0]
        found = (cand == labels[..., None]).any(-1) & valid
        return pred, {"recall": found.sum(axis=0)}

    def raw_weights(self) -> list[tuple[nn.Module, str]]:
        """The selector's codebooks (rows gathered, never multiplied as a matrix)."""
        sel = self.candidate_selector
        return [(sel, "predecessor_codebook"), (sel, "successor_codebook")]
