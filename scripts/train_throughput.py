"""Training throughput, side by side: block positions per second of one drafter step.

    python scripts/train_throughput.py STORE [--sequences 12]

Variants, interleaved sequence by sequence on the same store sequences (32 anchors x 16):
  before   the previous recipe: the target's full 49k-row head, hard CE only
  vocabN   reduced draft vocabulary of N rows (most frequent response tokens), CE
  vocabN+tv  the same plus the total-variation distillation term
Features come from the store in every variant (the previous loop also cached them in memory
after computing them once per sequence, so "before" is its steady state, not its first epoch).
"""

import argparse
import json
import time

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load

from mlx_dflash.default_target import ensure_default_target
from mlx_dflash.target import Target
from mlx_dflash.train.loop import Batches, TrainConfig, feature_scale, new_drafter
from mlx_dflash.train.recipe import block_loss, choose_draft_vocab, position_weights
from mlx_dflash.train.store import FeatureStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--sequences", type=int, default=12)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192])
    args = ap.parse_args()
    model, _ = load(str(ensure_default_target()))
    target = Target(model)
    store = FeatureStore(args.store)
    store.check(target)
    config = TrainConfig(store_dir=args.store, out_dir="/dev/null", mask_token_id=16)
    scale = feature_scale([np.asarray(store[i].features) for i in range(8)])
    weights = position_weights(16, 7.0)
    response = store.response_tokens()
    variants = {}
    for name, size, tv in [("before", None, 0.0)] + [
            (f"vocab{n}" + ("+tv" if tv else ""), n, tv) for n in args.vocab for tv in (0.0, 1.0)]:
        mx.random.seed(0)
        drafter = new_drafter(target, config, store.layer_ids)
        if size:
            drafter.set_draft_vocab(mx.array(choose_draft_vocab(response, target.vocab_size,
                                                                size)[0]))
        fn = nn.value_and_grad(drafter, lambda b, d=drafter, tv=tv: block_loss(
            d, target, b, weights, 1.0, tv))
        variants[name] = (fn, Batches(store, drafter, config, scale))
    seconds = {name: 0.0 for name in variants}
    positions = {name: 0 for name in variants}
    for i in range(args.sequences + 2):
        for name, (fn, batches) in variants.items():
            batch = batches(i % len(store), np.random.default_rng(i))
            tic = time.perf_counter()
            (loss, _), grads = fn(batch)
            mx.eval(loss, grads)
            if i >= 2:  # the first two are warm-up
                seconds[name] += time.perf_counter() - tic
                positions[name] += int(batch.valid.size)
    rates = {name: positions[name] / seconds[name] for name in variants}
    for name, rate in rates.items():
        print(f"{name:14s} {rate:8.0f} block positions/s  ({rate / rates['before']:.2f}x)")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
