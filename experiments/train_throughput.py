"""Training throughput, side by side: block positions per second of a drafter step.

    python experiments/train_throughput.py STORE [--steps 8]

Every variant trains on the same store sequences (4 a step), interleaved step by step:
  before        the issue's baseline: DFlash block 16, the target's full 49k-row head, CE,
                32 anchors, one forward per sequence, the old attention and loss code
  old dspark    the DSpark recipe of 2026-12-01 on the old code: g = 7, 16k draft vocabulary,
                0.1 CE + 1.8 TV + confidence BCE, 16 anchors, one forward per sequence
  now dflash    the baseline's recipe on the current code (matmul attention over shared contexts,
                one-pass softmax; its 32 x 16 block rows a sequence are not collated)
  now dspark    the DSpark recipe on the current code (the step's sequences collated)
"The old code" (the training step as of 2026-12-01) is kept here as a reference: SDPA over
broadcast copies of each context and MLX's own softmax / cross-entropy (see
mlx_dflash/train/softmax.py for why they are slow here).
"""

import argparse
import json
import time
from contextlib import contextmanager

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm import load

import mlx_dflash.drafters.layers as layers
import mlx_dflash.train.recipe as recipe
from mlx_dflash.default_pair import ensure_default_target
from mlx_dflash.drafters import load_drafter
from mlx_dflash.target import Target
from mlx_dflash.train.loop import Batches, TrainConfig, feature_scale, new_drafter
from mlx_dflash.train.recipe import block_loss, position_weights, step_gradients
from mlx_dflash.train.store import FeatureStore


def _old_attention(self, x, ctx_keys, ctx_values, block_offset, mask):
    N, B, _ = x.shape
    queries = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
    keys = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
    values = self._heads(self.v_proj(x), self.n_kv_heads)
    queries = self.rope(queries, offset=block_offset)
    keys = self.rope(keys, offset=block_offset)
    if ctx_keys.shape[0] != N:
        ctx_keys = mx.broadcast_to(ctx_keys, (N, *ctx_keys.shape[1:]))
        ctx_values = mx.broadcast_to(ctx_values, (N, *ctx_values.shape[1:]))
    keys = mx.concatenate([ctx_keys, keys], axis=2)
    values = mx.concatenate([ctx_values, values], axis=2)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                               mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


def _old_softmax_logsumexp(logits):
    return mx.softmax(logits, axis=-1), mx.logsumexp(logits, axis=-1)


@contextmanager
def old_code():
    attn, sm = layers.InjectedAttention.__call__, recipe.softmax_logsumexp
    layers.InjectedAttention.__call__ = _old_attention
    recipe.softmax_logsumexp = _old_softmax_logsumexp
    try:
        yield
    finally:
        layers.InjectedAttention.__call__, recipe.softmax_logsumexp = attn, sm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dspark", default="smollm2-135m-dspark-b7")
    args = ap.parse_args()
    model, _ = load(str(ensure_default_target()))
    target = Target(model)
    store = FeatureStore(args.store)
    store.check(target)
    scale = feature_scale([np.asarray(store[i].features) for i in range(8)])
    dflash_cfg = TrainConfig(store_dir=args.store, out_dir="/dev/null", mask_token_id=16,
                             num_anchors=32)
    dspark_cfg = TrainConfig(store_dir=args.store, out_dir="/dev/null", family="dspark",
                             block_size=7, num_anchors=16)
    mx.random.seed(0)
    dflash = new_drafter(target, dflash_cfg, store.layer_ids)
    dspark = load_drafter(args.dspark, model=target, dtype=mx.float32)
    variants = {}
    for name, drafter, cfg, old in [("before", dflash, dflash_cfg, True),
                                    ("old dspark", dspark, dspark_cfg, True),
                                    ("now dflash", dflash, dflash_cfg, False),
                                    ("now dspark", dspark, dspark_cfg, False)]:
        drafter.train()
        batches = Batches(store, drafter, cfg, scale)
        w = position_weights(batches.n_labels + 1, 7.0 if drafter is dflash else 4.0)
        mix = (1.0, 0.0, 0.0) if drafter is dflash else (0.1, 1.8, 1.0)
        fn = nn.value_and_grad(drafter, lambda b, d=drafter, w=w, m=mix: block_loss(
            d, target, b, w, *m))
        variants[name] = (fn, batches, old)
    order = np.random.default_rng(0).permutation(len(store))
    seconds = {name: 0.0 for name in variants}
    positions = {name: 0 for name in variants}
    for step in range(args.steps + 1):
        ids = order[4 * step : 4 * step + 4] % len(store)
        for name, (fn, batches, old) in variants.items():
            seqs = [batches(int(i), np.random.default_rng([step, int(i)])) for i in ids]
            seqs = [s for s in seqs if s is not None]
            mx.eval(seqs)
            tic = time.perf_counter()
            if old:  # one forward per sequence, gradients summed (the old loop)
                with old_code():
                    total = None
                    for s in seqs:
                        (loss, _), grads = fn(s)
                        total = grads if total is None else tree_map(mx.add, total, grads)
                    mx.eval(loss, total)
            else:
                (loss, _), grads = step_gradients(fn, seqs)
                mx.eval(loss, grads)
            if step >= 1:  # the first is warm-up
                seconds[name] += time.perf_counter() - tic
                positions[name] += sum(int(s.valid.size) for s in seqs)
    rates = {name: positions[name] / seconds[name] for name in variants}
    for name, rate in rates.items():
        print(f"{name:12s} {rate:8.0f} block positions/s  ({rate / rates['before']:.2f}x "
              f"before, {rate / rates['old dspark']:.2f}x old dspark)")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
