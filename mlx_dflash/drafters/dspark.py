"""DSpark (DeepSpec): a DFlash backbone whose anchor slot already predicts the first draft,
a rank-r Markov head that conditions each draft on the previous one, and a confidence head.

Block ``[anchor, MASK x (g-1)]`` at positions ``a..a+g-1``: slot k predicts token ``a+k+1``
(g inputs, g drafts). Draft logits are ``U_k + B(x_(k-1), .)`` with ``U_k`` the head over the
backbone's final hidden state and ``B = W2(W1[x_(k-1)])`` (vanilla; gated and rnn variants as in
DeepSpec), ``x_(-1)`` = the anchor, sampled left to right; the walk never touches the backbone.
The confidence ``c_k = sigmoid(w . [h_k ; W1[x_(k-1)]] + b)`` estimates the chance that draft
k survives given that the ones before it did. Weight names follow DeepSpec's Qwen3DSparkModel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..accept import CandidateProposal, SamplingParams, sampling_logits
from ..tree import TREE_CANDIDATES, grow_tree, independent
from .base import Proposal
from .dflash import DFlashDraftModel
from .layers import DraftArgs, config_field

MARKOV_KINDS = ("vanilla", "gated", "rnn")


@dataclass
class DSparkArgs(DraftArgs):
    """DeepSpec's Qwen3DSparkModel config: the Markov head (rank 0: none), the confidence head
    and its calibration."""

    architecture: ClassVar[str] = "Qwen3DSparkModel"
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None
    confidence_offsets: list[float] | None = None  # ours: c_k = sigmoid(logit_k / T_k + b_k)
    # DeepSpec's slot 0 predicts the first draft; speculators' earlier DSpark heads keep slot 0
    # for the anchor alone, as DFlash does (g slots, g - 1 drafts).
    sample_from_anchor: bool = True
    # With a reduced vocabulary, W1 of the Markov head has a row per target id (speculators'
    # layout) instead of one per draft id and one for any token outside it (ours).
    markov_w1_target_rows: bool = False

    @classmethod
    def from_config(cls, config: dict, **family: Any) -> DSparkArgs:
        """DeepSpec's layout (fields at the top level) or a SpecForge-style export's (in
        dflash_config)."""

        def pick(name, default=None):
            return config_field(config, name, default)

        return super().from_config(
            config,
            markov_rank=int(pick("markov_rank", 0) or 0),
            markov_head_type=str(pick("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=bool(pick("enable_confidence_head", False)),
            confidence_head_with_markov=bool(pick("confidence_head_with_markov", True)),
            confidence_temperatures=pick("confidence_temperatures"),
            confidence_offsets=pick("confidence_offsets"),
            sample_from_anchor=bool(pick("sample_from_anchor", True)),
            markov_w1_target_rows=bool(pick("markov_w1_target_rows", False)),
            **family,
        )

    def to_config(self) -> dict:
        """DeepSpec's layout: the dflash_config fields at the top level, then the heads'."""
        config = super().to_config()
        config.update(config.pop("dflash_config"), markov_rank=self.markov_rank,
                      enable_confidence_head=self.enable_confidence_head,
                      num_anchors=self.extra.get("num_anchors", 512))
        if self.markov_rank:
            config["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            config["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.confidence_temperatures:
            config["confidence_temperatures"] = self.confidence_temperatures
        if self.confidence_offsets and any(self.confidence_offsets):
            config["confidence_offsets"] = self.confidence_offsets
        if not self.sample_from_anchor:
            config["sample_from_anchor"] = False
        if self.markov_w1_target_rows:
            config["markov_w1_target_rows"] = True
        return config


class MarkovHead(nn.Module):
    """B(prev, .): a rank-r bigram bias over the drafter's vocabulary."""

    def __init__(self, n_prev: int, n_out: int, rank: int, hidden: int, kind: str):
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type '{kind}' is not one of {', '.join(MARKOV_KINDS)}")
        self.kind = kind
        self.markov_w1 = nn.Embedding(n_prev, rank)
        self.markov_w2 = nn.Linear(rank, n_out, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, prev_emb: mx.array, h: mx.array, state: mx.array | None,
             w2_rows: mx.array | None = None):
        """One slot: (bias [.., n_out], new rnn state). prev_emb = W1[prev], h = slot hidden;
        with ``w2_rows`` [M, r] (rows of W2) the bias covers only those M tokens."""
        w2 = self.markov_w2 if w2_rows is None else (lambda x: w2_rows @ x)
        if self.kind == "vanilla":
            return w2(prev_emb), state
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([h, prev_emb], axis=-1)))
            return w2(gate * prev_emb), state
        if state is None:
            state = mx.zeros_like(prev_emb)
        g, c, o = mx.split(self.joint_proj(mx.concatenate([state, prev_emb, h], axis=-1)), 3,
                           axis=-1)
        g = mx.sigmoid(g)
        state = g * state + (1 - g) * mx.tanh(c)
        return w2(mx.tanh(o)), state

    def w2_rows(self, idx: mx.array) -> mx.array:
        """Rows ``idx`` of W2 (float, dequantized if W2 is quantized): [*idx.shape, r]."""
        w2 = self.markov_w2
        if not isinstance(w2, nn.QuantizedLinear):
            return w2.weight[idx]
        biases = w2.biases[idx] if w2.get("biases") is not None else None
        return mx.dequantize(w2.weight[idx], w2.scales[idx], biases, w2.group_size, w2.bits,
                             mode=w2.mode)


class ConfidenceHead(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)[..., 0]


class DSparkDraftModel(DFlashDraftModel):
    family = "dspark"
    args_class = DSparkArgs
    args: DSparkArgs
    train_gamma = 4.0  # g drafts a block: DeepSpec's decay
    train_aux_weight = 1.0  # the confidence head's BCE
    fixed_vocab = True
    fixed_width = True  # g inputs give g drafts; the block never widens
    # Tokens a Markov walk step chooses among (the slot's top unary logits); 0: all of them.
    walk_candidates = 256

    def __init__(self, args: DSparkArgs):
        super().__init__(args)
        a = args
        n_out = a.draft_vocab_size or a.vocab_size
        # With a reduced vocabulary, W1 has one more row: the previous token outside it.
        n_prev = n_out + 1 if a.draft_vocab_size else n_out
        if a.draft_vocab_size and a.markov_w1_target_rows:
            n_prev = a.vocab_size
        if a.markov_rank:  # rank 0: DeepSpec's anchor-first DFlash baseline
            self.markov_head = MarkovHead(n_prev, n_out, a.markov_rank, a.hidden_size,
                                          a.markov_head_type)
        if a.enable_confidence_head:
            with_markov = a.confidence_head_with_markov and a.markov_rank
            self.confidence_head = ConfidenceHead(a.hidden_size + (a.markov_rank
                                                                   if with_markov else 0))

    @property
    def first_draft_slot(self) -> int:  # type: ignore[override]
        """The block slot whose hidden state gives draft 1: the anchor's (DeepSpec), or the
        one after it (speculators' earlier heads)."""
        return 0 if self.args.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        """g inputs give g drafts when the anchor slot predicts the first; else g - 1."""
        return self.block_size - self.first_draft_slot

    def markov_rows(self, tokens: mx.array) -> mx.array:
        """Target ids -> rows of the Markov head's W1."""
        if self.args.markov_w1_target_rows:
            return tokens.astype(mx.int32)
        return self.prev_rows(tokens)

    def draft_rows(self, idx: mx.array) -> mx.array:
        """Draft-vocabulary indices (drafts, candidates) -> rows of W1."""
        if self.args.markov_w1_target_rows and self.vocab_ids is not None:
            return self.vocab_ids[idx].astype(mx.int32)
        return idx.astype(mx.int32)

    @property
    def has_confidence(self) -> bool:
        return "confidence_head" in self

    @classmethod
    def train_fields(cls, options: Any) -> dict:
        """The Markov head as the options say; the confidence head when its loss counts."""
        if options.markov_head_type not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type '{options.markov_head_type}' is not one of "
                             f"{', '.join(MARKOV_KINDS)}")
        return dict(markov_rank=options.markov_rank, markov_head_type=options.markov_head_type,
                    enable_confidence_head=options.aux_weight > 0)

    def aux_loss(self, aux: mx.array | None, labels: mx.array, weights: mx.array,
                 tv: Callable[[], mx.array]) -> mx.array | None:
        """The confidence head's BCE toward ``1 - TV``: the chance the target keeps a draft
        drawn from the drafter's distribution."""
        if aux is None:  # no confidence head
            return None
        soft = mx.stop_gradient(mx.clip(1.0 - tv(), 0.0, 1.0))
        bce = nn.losses.binary_cross_entropy(aux, soft, with_logits=True, reduction="none")
        return (bce * weights).sum() / mx.maximum(weights.sum(), 1e-6)

    def markov(self, prev: mx.array, hidden: mx.array, state: mx.array | None,
               w2_rows: mx.array | None = None):
        """(W1[prev] or None, Markov bias or 0, new state) for one slot or a [.., g] batch."""
        if "markov_head" not in self:
            return None, 0.0, state
        # Flat ids: a quantized embedding cannot look up a 0-d index (MLX 0.32).
        prev_emb = self.markov_head.markov_w1(prev.reshape(-1)).reshape(*prev.shape, -1)
        bias, state = self.markov_head.step(prev_emb, hidden, state, w2_rows)
        return prev_emb, bias, state

    def confidence_logits(self, hidden: mx.array, prev_emb: mx.array | None) -> mx.array | None:
        if "confidence_head" not in self:
            return None
        x = hidden
        if self.args.confidence_head_with_markov and prev_emb is not None:
            x = mx.concatenate([hidden, prev_emb], axis=-1)
        return self.confidence_head(x)

    def block_logits(
        self, target: Any, hidden: mx.array, prev: mx.array, candidates: int = 0
    ) -> tuple[mx.array, mx.array | None]:
        """Teacher-forced slots: hidden [N, g, D], prev [N, g] W1 rows of the previous tokens
        -> draft logits [N, g, V'] (with the Markov bias) and confidence logits [N, g]. With
        ``candidates`` M, logits outside each slot's top M unary ones are -inf, as in the walk."""
        unary = self.head(target, hidden)
        if 0 < candidates < unary.shape[-1]:
            kth = mx.partition(unary, -candidates, axis=-1)[..., -candidates, None]
            unary = mx.where(unary >= kth, unary, -mx.inf)
        if "markov_head" in self and self.markov_head.kind == "rnn":  # a recurrence over slots
            state, biases, embs = None, [], []
            for k in range(hidden.shape[1]):
                e, b, state = self.markov(prev[:, k], hidden[:, k], state)
                biases.append(b)
                embs.append(e)
            bias, prev_emb = mx.stack(biases, axis=1), mx.stack(embs, axis=1)
        else:
            prev_emb, bias, _ = self.markov(prev, hidden, None)
        return unary + bias, self.confidence_logits(hidden, prev_emb)

    def train_logits(self, target: Any, features, blocks, anchors, prev, candidates: int = 0):
        """(draft logits [N, K, V'], confidence logits [N, K]) of training blocks, K =
        ``max_drafts``: the k-th drafting slot is labelled with token anchor+k+1 and ``prev``
        [N, K] holds the true token before it (teacher forcing: the anchor, then the labels);
        ``candidates`` as in block_logits."""
        embeds = self.embed_block(target, blocks)
        hidden = self.train_hidden(embeds, features, anchors)[:, self.first_draft_slot :]
        return self.block_logits(target, hidden, self.markov_rows(prev), candidates)

    def block_width(self, width: int) -> int:
        return self.block_size  # the Markov head's slots are fixed

    def propose_from(self, target: Any, anchor: mx.array, hidden: mx.array, unary: mx.array,
                     params: SamplingParams) -> Proposal:
        """K <= g drafts by the Markov walk from the anchor (lazy: no host sync), with their
        calibrated survival confidences where the drafter has a confidence head; ``hidden``
        [K, D] and ``unary`` [K, V'] are the slots' states and head logits.

        With ``walk_candidates`` M, slot k draws only among the M tokens its unary logits rank
        highest, so a walk step reads M rows of W2 instead of all of them (most of the walk's
        cost on a CPU); the proposal is then zero outside them, which verification handles."""
        K = hidden.shape[0]
        M = self.walk_candidates
        cand = w2_rows = None
        if "markov_head" in self and 0 < M < unary.shape[-1]:
            cand = mx.argpartition(-unary, M - 1, axis=-1)[:, :M].astype(mx.int32)  # [K, M]
            unary = mx.take_along_axis(unary, cand, axis=-1)
            w2_rows = self.markov_head.w2_rows(cand)  # [K, M, r]
        prev, state = self.markov_rows(anchor)[0], None
        drafts, probs, conf = [], [], []
        for k in range(K):
            rows = w2_rows[k] if w2_rows is not None else None
            prev_emb, bias, state = self.markov(prev, hidden[k], state, rows)
            logits = unary[k] + bias
            c = self.confidence_logits(hidden[k], prev_emb)
            if c is not None:
                conf.append(c)
            if params.greedy:
                x = mx.argmax(logits, axis=-1)
            else:
                scaled = sampling_logits(logits[None], params)[0]
                x = mx.random.categorical(scaled, key=params.key())
                probs.append(mx.softmax(scaled, axis=-1))
            if cand is not None:
                x = cand[k][x]  # candidate slot -> draft-vocabulary index
            drafts.append(x)
            prev = self.draft_rows(x)
        confidence = self.calibrated(mx.stack(conf)) if conf else None
        idx = mx.stack(drafts)
        vocab = self.vocab_ids
        out = (vocab[idx] if vocab is not None else idx).astype(mx.uint32)
        if params.greedy:
            return Proposal(out, None, confidence)
        q = mx.stack(probs)  # [K, M] over cand, else [K, V'] over the draft vocabulary
        if cand is not None:
            ids = vocab[cand] if vocab is not None else cand
            return Proposal(out, CandidateProposal(ids.astype(mx.uint32), q), confidence)
        if vocab is not None:
            q = mx.put_along_axis(mx.zeros((K, target.vocab_size), dtype=q.dtype),
                                  mx.broadcast_to(vocab[None], q.shape), q, axis=-1)
        return Proposal(out, q, confidence)

    def tree_from(self, target: Any, anchor: mx.array, hidden: mx.array, unary: mx.array,
                  beam: int) -> tuple[mx.array, mx.array, mx.array]:
        """The tree (tree.grow_tree, lazy) from the slots' hidden states and unary logits:
        each node's children are slot d's ``walk_candidates`` best unary candidates, scored
        given the node's token by the Markov head, as the walk scores them (an rnn head's
        state belongs to one path: its slots are scored on their own)."""
        if "markov_head" not in self or self.markov_head.kind == "rnn":
            return independent(unary, TREE_CANDIDATES, self.vocab_ids, beam)
        M = min(self.walk_candidates, unary.shape[-1])
        cand = mx.argpartition(-unary, M - 1, axis=-1)[:, :M].astype(mx.int32)  # [K, M]
        cand_unary = mx.take_along_axis(unary, cand, axis=-1)
        w2 = self.markov_head.w2_rows(cand)  # [K, M, r]

        def scored(d: int, prev: mx.array) -> mx.array:
            """Logits [B, M] of slot d's candidates after each of B previous tokens."""
            prev_emb = self.markov_head.markov_w1(prev)  # [B, r]
            if self.markov_head.kind == "gated":
                h = mx.broadcast_to(hidden[d], (prev.shape[0], hidden.shape[-1]))
                gate = self.markov_head.gate_proj(mx.concatenate([h, prev_emb], axis=-1))
                prev_emb = mx.sigmoid(gate) * prev_emb
            return cand_unary[d] + prev_emb @ w2[d].T

        ids = self.vocab_ids[cand] if self.vocab_ids is not None else cand
        return grow_tree(scored(0, self.markov_rows(anchor))[0],
                         lambda d, pick, _: scored(d, self.draft_rows(cand[d - 1][pick])), ids,
                         beam)

    def calibrated(self, conf_logits: mx.array) -> mx.array:
        """sigmoid(logit_k / T_k + b_k) with the sequentially fitted temperatures and offsets
        (1 and 0 if none; positions past the fitted ones reuse the last)."""
        n = conf_logits.shape[-1]

        def per_position(values):
            return mx.array(values[:n] + [values[-1]] * max(0, n - len(values)))

        temps, offsets = self.args.confidence_temperatures, self.args.confidence_offsets
        if temps:
            conf_logits = conf_logits / per_position(temps)
        if offsets:
            conf_logits = conf_logits + per_position(offsets)
        return mx.sigmoid(conf_logits)
