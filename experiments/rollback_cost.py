"""Rollback cost for a hybrid target (Gated DeltaNet + attention): replay vs per-position states.

A qwen3_5-shaped random model (mlx-lm's own classes) with a cache of ``--context`` tokens runs one
verify cycle of B tokens and rolls back to ``accepted + 1`` of them, for each strategy of
``mlx_dflash.target``:

* replay: the pass keeps the recurrent state before it (a reference) and the layers' inputs;
  rollback restores the state and runs the accepted positions through the linear attention again;
* per position: the pass runs each linear attention one position at a time and keeps the state
  after every position; rollback picks one.

Reported per B and accepted count: verify time, rollback time (both evaluated), their sum (the
cycle), extra bytes the pass holds for the rollback, and the peak-memory rise over the cycle.
Usage: python experiments/rollback_cost.py [--hidden 1024] [--layers 12] [--context 512]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import mlx_dflash  # noqa: F401  (loads the fast BLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache

from mlx_dflash.target import PER_POSITION, REPLAY, Target


def make_model(hidden: int, layers: int, vocab: int) -> qwen3_5.Model:
    """Qwen3.5-small-like proportions: 3 Gated DeltaNet layers per attention layer."""
    config = dict(
        model_type="qwen3_5", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=2,
        head_dim=hidden // 4, rms_norm_eps=1e-6, vocab_size=vocab, tie_word_embeddings=True,
        linear_num_value_heads=hidden // 64, linear_num_key_heads=hidden // 64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4,
    )
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p * 0.5, model.parameters()))
    mx.eval(model.parameters())
    return model


def snapshot(cache: list) -> list:
    return [list(c.cache) if isinstance(c, ArraysCache) else c.state for c in cache]


def restore(cache: list, saved: list) -> None:
    for c, s in zip(cache, saved):
        if isinstance(c, ArraysCache):
            c.cache = list(s)
        else:
            c.state = s


def cache_arrays(cache: list) -> list:
    return [a for c in cache for a in (c.cache if isinstance(c, ArraysCache) else c.state[:2])
            if a is not None]


def one_cycle(target: Target, cache: list, block: mx.array, accepted: int) -> tuple:
    """(verify seconds, rollback seconds, bytes held for the rollback, peak rise)."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    logits, _ = target.forward(block, cache)
    mx.eval(logits, cache_arrays(cache))
    held = cache.rollback_nbytes
    mid = time.perf_counter()
    Target.rollback(cache, block.shape[1] - 1 - accepted)
    mx.eval(cache_arrays(cache))
    end = time.perf_counter()
    return mid - tic, end - mid, held, mx.get_peak_memory() - base


def measure(targets: dict, context: int, B: int, accepted: int, reps: int) -> dict:
    """Best-of-``reps`` cycle figures per strategy. The strategies take turns within each
    round, so a burst of load from other processes hits both alike."""
    rng = np.random.default_rng(0)
    vocab = next(iter(targets.values())).vocab_size
    prompt = mx.array(rng.integers(0, vocab, size=(1, context)))
    block = mx.array(rng.integers(0, vocab, size=(1, B)))
    caches = {}
    for name, target in targets.items():
        cache = target.make_cache()
        target.hidden_states(prompt, cache, ())
        mx.eval(cache_arrays(cache))
        caches[name] = (cache, snapshot(cache))
    runs = {name: [] for name in targets}
    for _ in range(reps + 1):  # the first round is a warm-up
        for name, target in targets.items():
            cache, saved = caches[name]
            restore(cache, saved)
            runs[name].append(one_cycle(target, cache, block, accepted))
    out = {}
    for name, rows in runs.items():
        rows = rows[1:]
        out[name] = dict(verify=min(r[0] for r in rows), rollback=min(r[1] for r in rows),
                         cycle=min(r[0] + r[1] for r in rows), held=rows[-1][2],
                         peak=max(r[3] for r in rows))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", default="2,4,8,16")
    args = parser.parse_args()
    model = make_model(args.hidden, args.layers, args.vocab)
    targets = {REPLAY: Target(model), PER_POSITION: Target(model, recurrent_rollback=PER_POSITION)}
    n_linear = targets[REPLAY].layer_kinds.count("linear_attention")
    print(f"Machine: {platform.platform()}, {os.cpu_count()} cores, MLX {mx.__version__}, "
          f"{mx.default_device()}. Random qwen3_5 target (float32): hidden {args.hidden}, "
          f"{args.layers} layers ({n_linear} Gated DeltaNet), vocab {args.vocab}; cache of "
          f"{args.context} tokens; best of {args.reps}.\n")
    # Twice: the first call also pays for warming up MLX's allocator.
    plain = min(measure({REPLAY: targets[REPLAY]}, args.context, 1, 0, args.reps)[REPLAY]
                ["verify"] for _ in range(2))
    print(f"One-token decode step: {plain * 1e3:.1f} ms\n")
    print("| B | accepted | strategy | verify | rollback | cycle | held for rollback "
          "| peak rise |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for B in (int(b) for b in args.blocks.split(",")):
        for accepted in sorted({0, (B - 1) // 2, B - 1}):
            for name, m in measure(targets, args.context, B, accepted, args.reps).items():
                print(f"| {B} | {accepted} | {name} | {m['verify'] * 1e3:.1f} ms | "
                      f"{m['rollback'] * 1e3:.1f} ms | {m['cycle'] * 1e3:.1f} ms | "
                      f"{m['held'] / 2**20:.2f} MiB | {m['peak'] / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
