"""Drafter training loop: AdamW with warm-up + cosine decay, clipping, checkpoints, resume.

Target features are computed once per sequence and kept in memory (float16), so later epochs
only pay for the drafter and the frozen LM head.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..drafters import DFlashDraftModel, DraftArgs, load_drafter, save_drafter
from ..target import Target
from .data import iter_examples
from .recipe import (
    block_inputs,
    block_loss,
    build_target_layer_ids,
    init_from_target,
    position_weights,
    sample_anchors,
)

# SmolLM2 has no mask token; <empty_output> (16) is one of its untrained special tokens.
DEFAULT_MASK_TOKEN = {"smollm2": 16}


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str
    block_size: int = 16
    num_layers: int = 2
    num_taps: int = 4
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    num_anchors: int = 32
    gamma: float = 7.0
    learning_rate: float = 6e-4
    warmup: float = 0.04
    epochs: float = 3.0
    grad_accum: int = 4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_seq_len: int = 1024
    save_every: int = 25
    val_fraction: float = 0.02
    init_from_target: bool = True
    init_from: str | None = None  # start from a saved drafter (e.g. a shipped one)
    seed: int = 0
    extra: dict = field(default_factory=dict)


def new_drafter(target: Target, config: TrainConfig) -> DFlashDraftModel:
    a = target.model.args
    if config.mask_token_id is None:
        raise ValueError("mask_token_id is required (the target's vocabulary has no MASK token)")
    ids = config.target_layer_ids or build_target_layer_ids(target.num_layers, config.num_taps)
    args = DraftArgs(
        hidden_size=target.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=getattr(a, "num_key_value_heads", a.num_attention_heads),
        head_dim=getattr(a, "head_dim", None) or target.hidden_size // a.num_attention_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=target.vocab_size,
        target_layer_ids=ids,
        mask_token_id=config.mask_token_id,
        block_size=config.block_size,
        rms_norm_eps=getattr(a, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),
        max_position_embeddings=getattr(a, "max_position_embeddings", None) or 8192,
        num_target_layers=target.num_layers,
    )
    drafter = DFlashDraftModel(args)
    if config.init_from_target:
        init_from_target(drafter, target)
    mx.eval(drafter.parameters())
    return drafter


def _schedule(config: TrainConfig, total_steps: int):
    warmup = max(1, int(config.warmup * total_steps))
    return optim.join_schedules(
        [optim.linear_schedule(0.0, config.learning_rate, warmup),
         optim.cosine_decay(config.learning_rate, max(1, total_steps - warmup),
                            config.learning_rate * 0.1)],
        [warmup],
    )


def feature_scale(features: list[mx.array]) -> mx.array:
    """Per-dimension 1/RMS of target features (position 0, the attention sink, left out).

    Target hidden states carry a few "massive" dimensions (100x the rest) that swamp a randomly
    initialised ``fc``; training on standardised features and folding the scale into ``fc``
    when saving keeps the z-lab architecture and conditions the optimisation.
    """
    x = mx.concatenate([f[0, 1:] for f in features], axis=0).astype(mx.float32)
    return 1.0 / mx.maximum(mx.sqrt((x * x).mean(axis=0)), 1e-3)


def _fold_scale(drafter, scale: mx.array, inverse: bool = False) -> None:
    """fc(x * s) == fc_folded(x) with fc_folded.weight = fc.weight * s."""
    drafter.fc.weight = drafter.fc.weight * (1.0 / scale if inverse else scale)[None, :]


def _save(out: Path, drafter, optimizer, state: dict, scale: mx.array) -> None:
    ckpt = out / "checkpoint"
    _fold_scale(drafter, scale)
    try:
        save_drafter(drafter, ckpt)
    finally:
        _fold_scale(drafter, scale, inverse=True)
    mx.save(str(ckpt / "feature_scale.npy"), scale)
    opt_state = dict(tree_flatten(optimizer.state))
    mx.savez(str(ckpt / "optimizer.npz"), **opt_state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")


def train(model: Any, config: TrainConfig, progress: bool = True) -> DFlashDraftModel:
    """Train a DFlash drafter for ``model`` on the shards in ``config.data_dir``."""
    from tqdm import tqdm

    target = model if isinstance(model, Target) else Target(model)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(iter_examples(config.data_dir))
    examples = [
        np.array((e["prompt_ids"] + e["response_ids"])[: config.max_seq_len], dtype=np.int32)
        for e in rows
    ]
    prompt_lens = [len(e["prompt_ids"]) for e in rows]
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(examples))
    n_val = max(1, int(config.val_fraction * len(examples))) if len(examples) > 10 else 0
    val_idx, train_idx = order[:n_val], order[n_val:]
    if len(train_idx) == 0:
        raise ValueError(f"no training examples in {config.data_dir}")

    ckpt = out / "checkpoint"
    step = 0
    if (ckpt / "trainer_state.json").exists():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        drafter = load_drafter(ckpt, model=target)
        scale = mx.load(str(ckpt / "feature_scale.npy"))
        _fold_scale(drafter, scale, inverse=True)  # checkpoints hold the folded fc
        step = state["step"]
        print(f"Resuming from {ckpt} at step {step}")
    else:
        if config.init_from:
            drafter = load_drafter(config.init_from, model=target, dtype=mx.float32)
            print(f"Starting from the drafter in {config.init_from}")
        else:
            drafter = new_drafter(target, config)
        sample = [mx.array(examples[i])[None] for i in train_idx[:16]]
        scale = feature_scale([target.hidden_states(x, None, drafter.target_layer_ids)[1]
                               for x in sample])
        mx.eval(scale)
        if config.init_from:
            _fold_scale(drafter, scale, inverse=True)  # saved fc reads raw features
    drafter.train()

    steps_per_epoch = max(1, len(train_idx) // config.grad_accum)
    total_steps = max(1, int(config.epochs * steps_per_epoch))
    optimizer = optim.AdamW(learning_rate=_schedule(config, total_steps),
                            weight_decay=config.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    if step and (ckpt / "optimizer.npz").exists():
        optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.npz")).items()))

    weights = position_weights(config.block_size, config.gamma)
    layer_ids = drafter.target_layer_ids
    feature_cache: dict[int, mx.array] = {}

    def features_of(i: int) -> mx.array:
        if i not in feature_cache:
            _, feats = target.hidden_states(mx.array(examples[i])[None], None, layer_ids)
            feature_cache[i] = (feats * scale).astype(mx.float16)
            mx.eval(feature_cache[i])
        return feature_cache[i].astype(mx.float32)

    def sequence_batch(i: int, gen: np.random.Generator):
        tokens = examples[i]
        anchors = sample_anchors(prompt_lens[i], len(tokens), config.num_anchors, gen)
        if len(anchors) == 0:
            return None
        blocks, labels, valid = block_inputs(tokens, anchors, config.block_size,
                                             drafter.mask_token_id)
        return (features_of(i), mx.array(blocks), mx.array(anchors), mx.array(labels),
                mx.array(valid))

    loss_and_grad = nn.value_and_grad(
        drafter, lambda *b: block_loss(drafter, target, *b, weights)
    )

    def epoch_order(epoch: int) -> np.ndarray:
        return np.random.default_rng(config.seed + 1 + epoch).permutation(train_idx)

    log = open(out / "train_log.jsonl", "a")
    bar = tqdm(total=total_steps, initial=step, desc="training drafter", unit="step",
               disable=not progress)
    tic, positions, smooth = time.perf_counter(), 0, None
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        seq_ids = epoch_order(epoch)[within * config.grad_accum : (within + 1) * config.grad_accum]
        gen = np.random.default_rng([config.seed, step])
        grads_sum, loss_sum, acc_sum, n = None, 0.0, None, 0
        for i in seq_ids:
            batch = sequence_batch(int(i), gen)
            if batch is None:
                continue
            (loss, acc), grads = loss_and_grad(*batch)
            grads_sum = grads if grads_sum is None else tree_map(mx.add, grads_sum, grads)
            loss_sum += loss
            acc_sum = acc if acc_sum is None else acc_sum + acc
            positions += int(batch[4].size)
            n += 1
        step += 1
        if n == 0:
            continue
        grads = tree_map(lambda g, n=n: g / n, grads_sum)
        grads, grad_norm = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss_sum, acc_sum)
        loss_value = loss_sum.item() / n
        smooth = loss_value if smooth is None else 0.95 * smooth + 0.05 * loss_value
        acc = (acc_sum / n).tolist()
        rate = positions / (time.perf_counter() - tic)
        bar.set_postfix(loss=f"{smooth:.3f}", acc1=f"{acc[0]:.2f}", tok_s=f"{rate:.0f}")
        bar.update(1)
        lr = optimizer.learning_rate.item()
        log.write(json.dumps({"step": step, "loss": loss_value, "lr": lr,
                              "grad_norm": grad_norm.item(), "acc": acc,
                              "time": time.perf_counter() - tic}) + "\n")
        log.flush()
        if step % config.save_every == 0 or step == total_steps:
            _save(out, drafter, optimizer, {"step": step, "config": asdict(config)}, scale)
    bar.close()
    log.close()
    _fold_scale(drafter, scale)  # from here on the drafter reads raw target features
    drafter.eval()
    if len(val_idx):
        val = validate(drafter, target, [examples[i] for i in val_idx],
                       [prompt_lens[i] for i in val_idx], config)
        (out / "validation.json").write_text(json.dumps(val, indent=2) + "\n")
        print(f"held-out block accuracy by position: {[round(a, 3) for a in val['accuracy']]}")
        print(f"expected acceptance length (teacher-forced): {val['expected_tau']:.2f}")
    return drafter


def validate(drafter, target: Target, examples, prompt_lens, config: TrainConfig) -> dict:
    """Teacher-forced held-out metrics: per-position accuracy and the greedy acceptance length
    implied by each block's correct prefix (blocks whose labels all exist)."""
    gen = np.random.default_rng(12345)
    correct_by_pos, valid_by_pos, prefix_lens = 0, 0, []
    for tokens, plen in zip(examples, prompt_lens):
        anchors = sample_anchors(plen, len(tokens), config.num_anchors, gen)
        if len(anchors) == 0:
            continue
        blocks, labels, valid = block_inputs(tokens, anchors, config.block_size,
                                             drafter.mask_token_id)
        _, feats = target.hidden_states(mx.array(tokens)[None], None, drafter.target_layer_ids)
        hidden = drafter.train_hidden(target.embed(mx.array(blocks)), feats, mx.array(anchors))
        pred = np.array(mx.argmax(target.lm_head(hidden[:, 1:]), axis=-1))
        correct = (pred == labels) & valid
        correct_by_pos = correct_by_pos + correct.sum(axis=0)
        valid_by_pos = valid_by_pos + valid.sum(axis=0)
        full = valid.all(axis=1)
        prefix_lens += np.cumprod(correct[full], axis=1).sum(axis=1).tolist()
    accuracy = (np.asarray(correct_by_pos) / np.maximum(valid_by_pos, 1)).tolist()
    tau = 1.0 + float(np.mean(prefix_lens)) if prefix_lens else 1.0
    return {"accuracy": accuracy, "expected_tau": tau, "blocks": len(prefix_lens)}
