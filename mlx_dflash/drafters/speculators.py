"""The vLLM "speculators" checkpoint layout, read into ours and written from it.

A speculators config names its kind in ``speculators_model_type`` and nests the layer's
transformer config in ``transformer_layer_config`` (its ``vocab_size`` is the target's);
``speculators_config.proposal_methods[0].speculative_tokens`` is the drafts per cycle; the
tap layers (``eagle_aux_hidden_state_layer_ids`` / ``aux_hidden_state_layer_ids``) count as
vLLM does, the input of layer i, so ours (the output of layer i, as z-lab and SpecForge count)
are one less. A reduced vocabulary is ``draft_vocab_size`` with ``d2t`` (draft id -> target id
offset) and ``t2d`` (the target ids it holds). Weights keep their names but EAGLE-3's layer,
``layers.0.`` in speculators and ``midlayer.`` in SpecForge.

- eagle3 -> our EAGLE-3 (SpecForge layout).
- dflash -> z-lab's DFlash: the block's first slot is the anchor (``sample_from_anchor``
  false); its head is the target's, so ``lm_head`` (the target's rows, which speculators keeps
  frozen) is dropped and ``d2t`` becomes our ``draft_vocab``.
- dspark -> DeepSpec's DSpark. Whether its anchor slot predicts the first draft (DeepSpec's
  convention) or is the anchor's alone (speculators' earlier heads) follows from the block
  and ``speculative_tokens`` (``_from_anchor``). With a reduced vocabulary the Markov head's
  W1 has a row per target id (the previous token is the target's); ours has one per draft id
  and one for any other token, so ours is written with a row per target id.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

LAYER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                "max_position_embeddings", "attention_bias", "vocab_size", "num_hidden_layers",
                "layer_types", "sliding_window")
KINDS = ("eagle3", "dflash", "dspark")
VERSION = "0.3.0"  # the speculators version whose layout this writes


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def read_config(config: dict, where: str) -> dict:
    """A speculators config as the config.json of our layout for its family."""
    kind = config["speculators_model_type"]
    if kind not in KINDS:
        raise NotImplementedError(f"{where}: speculators drafters of type '{kind}' are not "
                                  f"supported (supported: {', '.join(KINDS)})")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: a speculators config needs transformer_layer_config")
    out = {k: layer[k] for k in LAYER_FIELDS if layer.get(k) is not None}
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    vocab = config.get("draft_vocab_size")
    if vocab is not None and vocab != out.get("vocab_size"):
        out["draft_vocab_size"] = vocab
    if kind == "eagle3":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        out.update(architectures=["LlamaForCausalLMEagle3"],
                   qk_norm=layer.get("model_type") == "qwen3",
                   target_hidden_size=config.get("target_hidden_size"),
                   norm_before_residual=bool(config.get("norm_before_residual", False)),
                   fc_norm=bool(config.get("fc_norm", False)),
                   norm_before_fc=bool(config.get("norm_before_fc", False)),
                   feed_normed=bool(config.get("norm_output", False)))  # "Eagle 3.1"
        if ids:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
        if tokens:
            out["block_size"] = tokens + 1
        return out
    # dflash / dspark: a block drafter, z-lab's / DeepSpec's fields
    from_anchor = _from_anchor(config, kind, tokens, where)
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux or config.get("mask_token_id") is None:
        raise ValueError(f"{where}: a speculators {kind} config needs "
                         "aux_hidden_state_layer_ids and mask_token_id")
    block = config.get("block_size", (tokens + (0 if from_anchor else 1)) if tokens else 8)
    dflash = {"target_layer_ids": [i - 1 for i in aux], "mask_token_id": config["mask_token_id"]}
    if "draft_vocab_size" in out:
        dflash["draft_vocab_size"] = out.pop("draft_vocab_size")
    if config.get("sliding_window_non_causal"):
        out["is_causal"] = False
    if kind == "dflash":
        out.update(architectures=["DFlashDraftModel"], block_size=block, dflash_config=dflash)
    else:
        out.update(architectures=["Qwen3DSparkModel"], block_size=block, **dflash,
                   markov_rank=config.get("markov_rank", 256),
                   markov_head_type=config.get("markov_head_type", "vanilla"),
                   enable_confidence_head=config.get("enable_confidence_head", True),
                   confidence_head_with_markov=config.get("confidence_head_with_markov", True),
                   sample_from_anchor=from_anchor,
                   markov_w1_target_rows="draft_vocab_size" in dflash)
    return out


def _from_anchor(config: dict, kind: str, tokens: int | None, where: str) -> bool:
    """Whether the block's anchor slot predicts the first draft. DFlash: never. DSpark: as
    ``block_size - speculative_tokens`` says (0: yes, 1: the anchor slot is the anchor's
    alone), else ``sample_from_anchor``; heads that name neither predate the field and keep
    the anchor slot to the anchor (as DFlash, whose config speculators' DSpark extends).
    Read wrongly, every draft lands one position off: lossless, but little is accepted."""
    if kind == "dflash":
        if config.get("sample_from_anchor", False):
            raise NotImplementedError(f"{where}: a speculators dflash drafter with "
                                      "sample_from_anchor true is not supported")
        return False
    block = config.get("block_size")
    if block and tokens:
        if block - tokens not in (0, 1):
            raise ValueError(f"{where}: a dspark block of {block} slots cannot propose "
                             f"{tokens} speculative_tokens (it proposes {block} or {block - 1})")
        return block == tokens
    return bool(config.get("sample_from_anchor", False))


def read_weights(config: dict, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A speculators checkpoint's weights under our names (``config``: its own config)."""
    kind = config["speculators_model_type"]
    if kind == "eagle3":
        return {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                for k, v in weights.items()}
    out = {k: v for k, v in weights.items()
           if not k.startswith(("embed_tokens.", "lm_head.")) and k not in ("d2t", "t2d")}
    if "d2t" in weights and config.get("draft_vocab_size") not in (
            None, config["transformer_layer_config"].get("vocab_size")):
        d2t = weights["d2t"]
        out["draft_vocab"] = (mx.arange(d2t.shape[0]) + d2t).astype(mx.int32)
    return out


def write(drafter: Any, target: Any = None, verifier: str | None = None
          ) -> tuple[dict, dict[str, mx.array]]:
    """(config.json, weights) of ``drafter`` in the speculators layout; ``verifier``: the
    target's name or path, which the layout records. A block drafter's layout carries the
    target's embedding and its head's rows (speculators' DFlash and DSpark own copies of
    them), so ``target`` (the loaded model) is needed for those."""
    from mlx.utils import tree_flatten

    from .eagle3 import Eagle3DraftModel

    a = drafter.args
    family = drafter.family
    if family not in KINDS:
        raise NotImplementedError(f"the speculators layout has no '{family}' drafters")
    layer = {"model_type": "llama" if family == "eagle3" and not a.qk_norm else "qwen3",
             "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
             "num_attention_heads": a.num_attention_heads,
             "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
             "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size,
             "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
             "rope_scaling": a.rope_scaling, "max_position_embeddings": a.max_position_embeddings,
             "attention_bias": a.attention_bias, "hidden_act": "silu"}
    if a.sliding_window is not None:
        layer.update(layer_types=a.layer_types, sliding_window=a.sliding_window)
    drafts = drafter.max_drafts  # DSpark drafts from its anchor slot: one more
    aux = [i + 1 for i in a.target_layer_ids]
    config = {
        "architectures": [{"eagle3": "Eagle3Speculator", "dflash": "DFlashSpeculator",
                           "dspark": "DSparkSpeculator"}[family]],
        "model_type": "speculator_model",
        "speculators_model_type": family,
        "speculators_version": VERSION,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": family,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "draft_vocab_size": a.draft_vocab_size or a.vocab_size,
    }
    weights = dict(tree_flatten(drafter.parameters()))
    if isinstance(drafter, Eagle3DraftModel):
        if not a.head_norm:
            raise NotImplementedError("the speculators layout has no EAGLE-3 without the norm "
                                      "before its head (SpecForge's norm_output false)")
        config.update(eagle_aux_hidden_state_layer_ids=aux,
                      target_hidden_size=a.target_hidden_size,
                      norm_before_residual=a.norm_before_residual, fc_norm=a.fc_norm,
                      norm_before_fc=a.norm_before_fc, norm_output=a.feed_normed)
        weights = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in weights.items()}
        return config, weights
    if target is None:
        raise ValueError(f"writing a {family} drafter in the speculators layout needs its "
                         "target: the layout carries the target's embedding and head rows")
    from ..target import as_target

    t = as_target(target)
    vocab = mx.arange(a.vocab_size)
    weights["embed_tokens.weight"] = t.embed(vocab[None])[0]
    weights["lm_head.weight"] = t.head_rows(drafter.vocab_ids if drafter.vocab_ids is not None
                                            else vocab)
    config.update(aux_hidden_state_layer_ids=aux, mask_token_id=a.mask_token_id,
                  block_size=a.block_size, target_hidden_size=None,
                  sample_from_anchor=family == "dspark" and a.sample_from_anchor)
    if family == "dspark":
        config.update(markov_rank=a.markov_rank, markov_head_type=a.markov_head_type,
                      enable_confidence_head=a.enable_confidence_head,
                      confidence_head_with_markov=a.confidence_head_with_markov)
        if drafter.vocab_ids is not None and not a.markov_w1_target_rows:
            # W1 with a row per target id: its draft id's row, or the one for any other token.
            rows = drafter.prev_rows(mx.arange(a.vocab_size))
            for k in [k for k in weights if k.startswith("markov_head.markov_w1.")]:
                weights[k] = weights[k][rows]  # weight (and scales, biases if quantized)
    ids = weights.pop("draft_vocab", None)
    if ids is not None:  # the reduced vocabulary as speculators maps it
        weights["d2t"] = ids.astype(mx.int64) - mx.arange(ids.shape[0], dtype=mx.int64)
        t2d = mx.zeros((a.vocab_size,), dtype=mx.bool_)
        t2d[ids] = True
        weights["t2d"] = t2d
    return config, weights
