"""Drafter training loop over a feature store: AdamW with warm-up + cosine decay, clipping,
time-based checkpoints, resume, held-out validation.

Target features and distributions come from the store (computed once, see ``store.py``), so a
step costs only the drafter and its (reduced) head.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..convert.save import save_drafter
from ..drafters import DFlashDraftModel, load_drafter
from ..drafters.registry import drafter_family
from ..target import Target
from .recipe import (
    Batch,
    block_inputs,
    block_loss,
    choose_draft_vocab,
    grow_layers,
    init_from_target,
    position_weights,
    sample_anchors,
    step_gradients,
    train_logits,
)
from .store import FeatureStore

# SmolLM2 has no mask token; <empty_output> (16) is one of its untrained special tokens.
DEFAULT_MASK_TOKEN = {"smollm2": 16}


@dataclass
class TrainConfig:
    store_dir: str
    out_dir: str
    family: str = "dflash"  # a name in drafters.registry.FAMILIES
    block_size: int = 16
    num_layers: int | None = None  # None: 2, or as many as the drafter it starts from
    # Options a family reads when it builds a new drafter (its train_fields), others ignore.
    markov_rank: int = 256  # DSpark
    markov_head_type: str = "vanilla"  # DSpark
    mask_token_id: int | None = None
    draft_vocab_size: int | None = None  # None: the target's full head
    num_anchors: int = 32
    gamma: float | None = None  # position decay; None: the family's (train_gamma)
    ce_weight: float = 1.0
    tv_weight: float = 0.0
    # Weight of the family's own loss term (aux_loss); None: the family's (train_aux_weight).
    aux_weight: float | None = None
    selector_rank: int = 256  # DFlash 2
    selector_top_k: int = 16  # DFlash 2
    conv_kernel_size: int = 2  # DFlash 2
    conv_group_size: int = 16  # DFlash 2
    learning_rate: float = 6e-4
    warmup: float = 0.04
    epochs: float = 3.0
    max_steps: int | None = None  # caps epochs * steps_per_epoch (the schedule's length)
    # A time budget instead: warm-up + cosine run over this many minutes of training time
    # (kept across resumes), and the run stops when it is spent.
    max_minutes: float | None = None
    grad_accum: int = 4  # sequences per optimizer step
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_seq_len: int = 1024
    save_every_s: float = 300.0
    val_fraction: float = 0.02
    val_sequences: int = 48  # held-out sequences scored at each checkpoint
    init_from_target: bool = True
    init_from: str | None = None  # start from a saved drafter (e.g. a shipped one)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        family = drafter_family(self.family)
        if self.gamma is None:
            self.gamma = family.train_gamma
        if self.aux_weight is None:
            self.aux_weight = family.train_aux_weight
        family.train_fields(self)  # a bad family option fails here, before any training work


def new_drafter(
    target: Target, config: TrainConfig, layer_ids: list[int], vocab: mx.array | None = None
) -> DFlashDraftModel:
    a = target.model.args
    if config.mask_token_id is None:
        raise ValueError("mask_token_id is required (the target's vocabulary has no MASK token)")
    family = drafter_family(config.family)
    args = family.args_class(
        hidden_size=target.hidden_size,
        num_hidden_layers=config.num_layers or 2,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=getattr(a, "num_key_value_heads", a.num_attention_heads),
        head_dim=getattr(a, "head_dim", None) or target.hidden_size // a.num_attention_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=target.vocab_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=config.mask_token_id,
        block_size=config.block_size,
        rms_norm_eps=getattr(a, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),
        max_position_embeddings=getattr(a, "max_position_embeddings", None) or 8192,
        num_target_layers=target.num_layers,
        draft_vocab_size=None if vocab is None else int(vocab.shape[0]),
        **family.train_fields(config),
    )
    drafter = family(args)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    if config.init_from_target and "layers" in drafter:  # EAGLE-3's layer reads 2H: starts fresh
        init_from_target(drafter, target)
    mx.eval(drafter.parameters())
    return drafter


def held_out_split(store: FeatureStore, fraction: float, seed: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) sequence indices. Held out: the ids whose hash falls below
    ``fraction``, so a sequence stays held out as the store grows and in every run and family
    (a tiny store takes its lowest hashes instead, so that it has some)."""
    if len(store) <= 10:
        return np.arange(len(store)), np.zeros((0,), dtype=np.int64)
    h = np.array([int.from_bytes(hashlib.sha1(f"{seed}:{i}".encode()).digest()[:8], "big")
                  for i in store.id_list()], dtype=np.float64) / 2.0**64
    held = h < fraction
    if held.sum() < max(1, int(fraction * len(store))) and len(store) < 1000:
        held = np.zeros(len(store), dtype=bool)
        held[np.argsort(h)[: max(1, int(fraction * len(store)))]] = True
    idx = np.arange(len(store))
    return idx[~held], idx[held]


def _timed_lr(config: TrainConfig, seconds: float) -> float:
    """Warm-up + cosine to 10% over the time budget, as a function of training time spent."""
    frac = min(seconds / (config.max_minutes * 60), 1.0)
    if frac < config.warmup:
        return config.learning_rate * frac / config.warmup
    t = (frac - config.warmup) / max(1 - config.warmup, 1e-9)
    low = 0.1 * config.learning_rate
    return low + 0.5 * (config.learning_rate - low) * (1 + math.cos(math.pi * t))


def _schedule(config: TrainConfig, total_steps: int):
    if config.max_minutes:
        return _timed_lr(config, 0.0)  # set before every step from the time spent
    warmup = max(1, int(config.warmup * total_steps))
    return optim.join_schedules(
        [optim.linear_schedule(0.0, config.learning_rate, warmup),
         optim.cosine_decay(config.learning_rate, max(1, total_steps - warmup),
                            config.learning_rate * 0.1)],
        [warmup],
    )


def feature_scale(features: list[np.ndarray]) -> mx.array:
    """Per-dimension 1/RMS of target features (position 0, the attention sink, left out).

    Target hidden states carry a few "massive" dimensions (100x the rest) that swamp a randomly
    initialised ``fc``; training on standardised features and folding the scale into ``fc``
    when saving keeps the z-lab architecture and conditions the optimisation.
    """
    x = np.concatenate([f[1:] for f in features], axis=0).astype(np.float32)
    return mx.array(1.0 / np.maximum(np.sqrt((x * x).mean(axis=0)), 1e-3))


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
    mx.savez(str(ckpt / "optimizer.npz"), **dict(tree_flatten(optimizer.state)))
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")


class Batches:
    """Per-sequence training inputs from the store, in the drafter's vocabulary."""

    def __init__(self, store: FeatureStore, drafter, config: TrainConfig, scale: mx.array):
        self.store, self.config, self.scale = store, config, scale
        self.mask_id = drafter.mask_token_id
        self.width = drafter.block_size
        self.n_labels = drafter.max_drafts
        vocab = drafter.vocab_ids
        V = drafter.args.vocab_size
        self.to_draft = np.arange(V, dtype=np.int32)  # target id -> drafter index (-1: none)
        if vocab is not None:
            self.to_draft = np.full(V, -1, dtype=np.int32)
            self.to_draft[np.array(vocab)] = np.arange(vocab.shape[0], dtype=np.int32)

    def __call__(self, i: int, gen: np.random.Generator, num_anchors: int | None = None):
        c = self.config
        seq = self.store[i]
        T = min(len(seq.tokens), c.max_seq_len)
        tokens, P = seq.tokens[:T], seq.prompt_len
        anchors = sample_anchors(P, T, num_anchors or c.num_anchors, gen)
        if len(anchors) == 0:
            return None
        n = self.n_labels
        blocks, labels, valid = block_inputs(tokens, anchors, n + 1, self.mask_id)
        # Target distribution of token p sits at response row p - P.
        rows = np.minimum(anchors[:, None] + np.arange(1, n + 1)[None] - P, T - P - 1)
        topk_ids = self.to_draft[np.asarray(seq.topk_ids)[rows]]
        topk_probs = np.asarray(seq.topk_probs)[rows].astype(np.float32)
        prev = np.concatenate([tokens[anchors][:, None], labels[:, :-1]], axis=1)
        features = mx.array(np.asarray(seq.features[: T - 1]))[None].astype(mx.float32)
        return Batch(features * self.scale, mx.array(blocks[:, : self.width]),
                     mx.array(anchors), mx.array(self.to_draft[labels]), mx.array(valid),
                     mx.array(topk_ids), mx.array(topk_probs), mx.array(prev),
                     mx.array(np.asarray(tokens, dtype=np.int32))[None])


def _choose_vocab(store, train_idx, val_idx, target, size: int, out: Path) -> mx.array:
    """The draft vocabulary from the training responses; coverage reported and saved."""
    response, held_out = store.response_tokens(train_idx), store.response_tokens(val_idx)
    ids, coverage = choose_draft_vocab(response, target.vocab_size, size)
    held_cov = float(np.isin(held_out, ids).mean()) if len(held_out) else None
    print(f"draft vocabulary: {len(ids)} tokens cover {coverage:.2%} of {len(response)} "
          "training response tokens"
          + (f", {held_cov:.2%} of {len(held_out)} held-out ones" if held_cov else ""))
    (out / "draft_vocab.json").write_text(json.dumps(
        {"size": len(ids), "coverage": coverage, "response_tokens": len(response),
         "held_out_coverage": held_cov, "held_out_tokens": len(held_out)}) + "\n")
    return mx.array(ids)


def train(model: Any, config: TrainConfig, progress: bool = True) -> DFlashDraftModel:
    """Train a DFlash drafter for ``model`` on the feature store in ``config.store_dir``."""
    from tqdm import tqdm

    target = model if isinstance(model, Target) else Target(model)
    store = FeatureStore(config.store_dir)
    store.check(target)
    if len(store) == 0:
        raise ValueError(f"the feature store {config.store_dir} holds no sequences yet")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_idx, val_idx = held_out_split(store, config.val_fraction, config.seed)

    ckpt = out / "checkpoint"
    state = {"step": 0, "train_seconds": 0.0}
    if (ckpt / "trainer_state.json").exists():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        drafter = load_drafter(ckpt, model=target, dtype=mx.float32)
        scale = mx.load(str(ckpt / "feature_scale.npy"))
        _fold_scale(drafter, scale, inverse=True)  # checkpoints hold the folded fc
        print(f"Resuming from {ckpt} at step {state['step']}")
    else:
        base = None
        if config.init_from:
            base = load_drafter(config.init_from, model=target, dtype=mx.float32)
            print(f"Starting from the drafter in {config.init_from}")
        vocab = None
        if config.draft_vocab_size and (base is None or base.vocab_ids is None):
            vocab = _choose_vocab(store, train_idx, val_idx, target, config.draft_vocab_size, out)
        if base is not None and base.family == config.family:
            drafter = base
            if config.num_layers and grow_layers(drafter, config.num_layers):
                print(f"Grew the drafter to {config.num_layers} layers (new ones start as the "
                      "identity)")
            if vocab is not None:
                drafter.set_draft_vocab(vocab)
        else:
            mx.random.seed(config.seed)  # a run is reproducible from its config
            layer_ids = store.layer_ids if base is None else base.target_layer_ids
            if vocab is None and base is not None:
                vocab = base.vocab_ids  # another family's start keeps its vocabulary
            drafter = new_drafter(target, config, layer_ids, vocab)
            if base is not None:  # another family's checkpoint: start from its backbone
                shared = [(k, v) for k, v in tree_flatten(base.parameters())
                          if k != "draft_vocab"]
                drafter.load_weights(shared, strict=False)
        scale = feature_scale([np.asarray(store[int(i)].features) for i in train_idx[:16]])
        if config.init_from:
            _fold_scale(drafter, scale, inverse=True)  # saved fc reads raw features
    store.check(target, drafter.target_layer_ids)
    drafter.train()

    steps_per_epoch = max(1, len(train_idx) // config.grad_accum)
    total_steps = state.get("total_steps") or max(1, int(config.epochs * steps_per_epoch))
    if config.max_minutes:
        total_steps = config.max_steps or 10**9  # the time budget ends the run
    elif config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    optimizer = optim.AdamW(learning_rate=_schedule(config, total_steps),
                            weight_decay=config.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    step = state["step"]
    if step and (ckpt / "optimizer.npz").exists():
        optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.npz")).items()))

    batch_of = Batches(store, drafter, config, scale)
    weights = position_weights(batch_of.n_labels + 1, config.gamma)
    loss_and_grad = nn.value_and_grad(drafter, lambda b: block_loss(
        drafter, target, b, weights, config.ce_weight, config.tv_weight, config.aux_weight))

    def epoch_order(epoch: int) -> np.ndarray:
        return np.random.default_rng(config.seed + 1 + epoch).permutation(train_idx)

    def save_and_validate() -> None:
        # The same held-out sequences at every checkpoint, also when the store has grown; a
        # store still filling tops the set up to val_sequences. Below 1000 sequences the split
        # may hand a fallback pick back to training: such an id is dropped, never scored.
        ids = store.id_list()
        where = {sid: i for i, sid in enumerate(ids)}
        held = {ids[i] for i in val_idx}
        have = [sid for sid in state.get("val_ids", []) if sid in held]
        have += sorted(held - set(have), key=where.get)[: max(0, config.val_sequences - len(have))]
        state["val_ids"] = have
        scored = [where[sid] for sid in have]
        val = validate(drafter, target, batch_of, scored, config)
        state.update(step=step, total_steps=total_steps, config=asdict(config), val=val)
        _save(out, drafter, optimizer, state, scale)
        with open(out / "val_log.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "train_seconds": state["train_seconds"],
                                **val}) + "\n")

    log = open(out / "train_log.jsonl", "a")
    bar = tqdm(total=None if config.max_minutes else total_steps, initial=step,
               desc="training drafter", unit="step",
               disable=not progress)
    tic, positions, smooth, last_save = time.perf_counter(), 0, None, time.perf_counter()
    def finished() -> bool:
        spent = config.max_minutes and state["train_seconds"] >= config.max_minutes * 60
        return step >= total_steps or bool(spent)

    while not finished():
        t_step = time.perf_counter()
        if config.max_minutes:
            optimizer.learning_rate = _timed_lr(config, state["train_seconds"])
        epoch, within = divmod(step, steps_per_epoch)
        seq_ids = epoch_order(epoch)[within * config.grad_accum : (within + 1) * config.grad_accum]
        gen = np.random.default_rng([config.seed, step])
        batches = [b for b in (batch_of(int(i), gen) for i in seq_ids) if b is not None]
        step += 1
        if not batches:
            continue
        (loss, acc), grads = step_gradients(loss_and_grad, batches)
        positions += sum(int(b.valid.size) for b in batches)
        grads, grad_norm = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss, acc)
        state["train_seconds"] += time.perf_counter() - t_step
        loss_value = loss.item()
        smooth = loss_value if smooth is None else 0.95 * smooth + 0.05 * loss_value
        acc = acc.tolist()
        rate = positions / (time.perf_counter() - tic)
        bar.set_postfix(loss=f"{smooth:.3f}", acc1=f"{acc[0]:.2f}", pos_s=f"{rate:.0f}")
        bar.update(1)
        log.write(json.dumps({"step": step, "loss": loss_value,
                              "lr": optimizer.learning_rate.item(),
                              "grad_norm": grad_norm.item(), "acc": acc,
                              "train_seconds": state["train_seconds"],
                              "block_positions_per_s": rate}) + "\n")
        log.flush()
        if time.perf_counter() - last_save > config.save_every_s or finished():
            save_and_validate()
            last_save = time.perf_counter()
            # A store still being generated: train on what has arrived since (the held-out
            # split is by id hash, so it stays the same; the epoch order takes the new ids).
            grown = FeatureStore(config.store_dir)
            if len(grown) > len(store):
                print(f"feature store grew: {len(store)} -> {len(grown)} sequences")
                store = batch_of.store = grown
                train_idx, val_idx = held_out_split(store, config.val_fraction, config.seed)
                steps_per_epoch = max(1, len(train_idx) // config.grad_accum)
    bar.close()
    log.close()
    if state.get("step") != step:
        save_and_validate()
    if drafter.has_confidence and len(val_idx) >= 4:
        calibration = calibrate(drafter, target, batch_of, val_idx)
        state["calibration"] = calibration
        _save(out, drafter, optimizer, state, scale)  # the temperatures go into config.json
        (out / "calibration.json").write_text(json.dumps(calibration, indent=2) + "\n")
        print("confidence ECE by position before / after sequential temperature scaling: "
              + ", ".join(f"{b:.3f}/{a:.3f}" for b, a in zip(calibration["ece_before"],
                                                             calibration["ece_after"])))
    _fold_scale(drafter, scale)  # from here on the drafter reads raw target features
    drafter.eval()
    val = state.get("val")
    if val:
        print(f"held-out block accuracy by position: {[round(a, 3) for a in val['accuracy']]}")
        print(f"expected acceptance length (teacher-forced): {val['expected_tau']:.2f}")
    return drafter


def calibrate(drafter, target: Target, batch_of: Batches, idx, anchors: int = 32) -> dict:
    """Fit the confidence head's per-position temperatures and offsets on one half of the
    held-out sequences (``anchors`` blocks from each); report the running product's ECE before
    and after on the other half."""
    from .calibrate import expected_calibration_error, running_survival, sequential_temperatures

    def collect(part):
        gen, logits, accepted = np.random.default_rng(7), [], []
        for i in part:
            batch = batch_of(int(i), gen, num_anchors=anchors)
            if batch is None:
                continue
            out, conf = drafter.train_logits(target, batch.features, batch.blocks,
                                             batch.anchors, batch.prev)
            correct = np.array(mx.argmax(out, axis=-1)) == np.array(batch.labels)
            full = np.array(batch.valid).all(axis=1)
            logits.append(np.array(conf)[full])
            accepted.append(np.cumprod(correct[full], axis=1))
        return np.concatenate(logits), np.concatenate(accepted).astype(np.float64)

    fit_logits, fit_acc = collect(idx[::2])
    test_logits, test_acc = collect(idx[1::2])
    previous = drafter.args.confidence_temperatures, drafter.args.confidence_offsets
    temps_only, _, _, _ = sequential_temperatures(fit_logits, fit_acc, offsets=False)
    temps, offsets, _, _ = sequential_temperatures(fit_logits, fit_acc)
    drafter.args.confidence_temperatures = temps
    drafter.args.confidence_offsets = offsets

    def ece(t, b=None):
        running = running_survival(test_logits, t, b)
        return [expected_calibration_error(running[:, k], test_acc[:, k])
                for k in range(running.shape[1])]

    result = {"temperatures": temps, "offsets": offsets,
              "ece_before": ece([1.0] * len(temps)), "ece_after": ece(temps, offsets),
              "ece_temperatures_only": ece(temps_only), "fit_blocks": len(fit_logits),
              "test_blocks": len(test_logits)}
    if previous[0] and len(previous[0]) == len(temps):  # a refit: how the old values do
        result["ece_previous_calibration"] = ece(*previous)
    return result


def validate(drafter, target: Target, batch_of: Batches, idx, config: TrainConfig) -> dict:
    """Teacher-forced held-out metrics: per-position accuracy and the greedy acceptance length
    implied by each block's correct prefix (blocks whose labels all exist)."""
    gen = np.random.default_rng(12345)
    correct_by_pos, valid_by_pos, prefix_lens = 0, 0, []
    counts: dict[str, np.ndarray] = {}  # the family's own metrics, per position
    for i in idx:
        batch = batch_of(int(i), gen, num_anchors=32)
        if batch is None:
            continue
        logits, aux = train_logits(drafter, target, batch)
        valid = np.array(batch.valid)
        labels = np.array(batch.labels)
        pred, found = drafter.val_metrics(logits, aux, labels, valid)
        for name, n in found.items():
            counts[name] = counts.get(name, 0) + n
        correct = (pred == labels) & valid
        correct_by_pos = correct_by_pos + correct.sum(axis=0)
        valid_by_pos = valid_by_pos + valid.sum(axis=0)
        full = valid.all(axis=1)
        prefix_lens += np.cumprod(correct[full], axis=1).sum(axis=1).tolist()
    accuracy = (np.asarray(correct_by_pos) / np.maximum(valid_by_pos, 1)).tolist()
    tau = 1.0 + float(np.mean(prefix_lens)) if prefix_lens else 1.0
    out = {"accuracy": accuracy, "expected_tau": tau, "blocks": len(prefix_lens)}
    for name, n in counts.items():
        out[name] = (np.asarray(n) / np.maximum(valid_by_pos, 1)).tolist()
    return out
