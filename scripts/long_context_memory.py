"""Memory at long contexts, with and without quantized KV caches (--kv-bits).

For each setting, the default target's caches are made to hold CONTEXT positions (256 tokens
prefilled, their keys and values repeated: schedule.stretch; a prefill of 16k takes ~10 minutes
on a 2-core CPU and does not change what the caches weigh), the drafter's context cache beside
them, then 16 verify cycles of 8 tokens (each rolled back to 3 accepted) run while MLX's peak
memory is read. Reported: the caches' bytes, the peak over the cycles, and the model weights.
A prefill chunk adds its attention scores on top (chunk x context x heads x 4 bytes, one layer
at a time), given as a formula's figure.

    python scripts/long_context_memory.py --context 16384 \
        --out results/long_context_memory_2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import platform

import mlx_dflash  # noqa: F401  (loads the fast BLAS first)
import mlx.core as mx

from mlx_dflash.default_pair import load_default
from mlx_dflash.schedule import PREFILLED, kv_bytes_per_position, stretch
from mlx_dflash.target import as_target, quantize_kv


def measure(model, drafter, context: int, bits: int | None) -> dict:
    quantize_kv(model, bits)
    target = as_target(model)
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    tokens = mx.zeros((1, PREFILLED), dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, cache, drafter.target_layer_ids)
    drafter.commit(feats, draft_cache, tokens)
    for c in [*cache, *draft_cache]:
        stretch(c, context)
    mx.eval([c.state for c in [*cache, *draft_cache]])
    target_bytes = sum(c.nbytes for c in cache)
    # nbytes counts whole buffers; what the positions themselves need:
    held_bytes = kv_bytes_per_position(target) * context
    mx.reset_peak_memory()
    for _ in range(16):
        logits, feats = target.hidden_states(mx.ones((1, 8), dtype=mx.uint32), cache,
                                             drafter.target_layer_ids)
        mx.eval(logits, feats)
        target.rollback(cache, 5)
    peak = mx.get_peak_memory()
    row = {"kv_bits": bits, "target_cache_bytes": target_bytes,
           "target_cache_bytes_per_position_formula": held_bytes,
           "drafter_cache_bytes": sum(c.nbytes for c in draft_cache),
           "peak_bytes_during_verify": peak, "active_bytes": mx.get_active_memory()}
    del cache, draft_cache
    mx.clear_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, drafter, _ = load_default(progress=False)
    weights = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(
        model.parameters()))
    a = model.args
    rows = [measure(model, drafter, args.context, bits) for bits in (None, 8, 4)]
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "mlx": mx.__version__, "device": str(mx.default_device())},
        "settings": {"context": args.context, "model": "default pair (SmolLM2-135M-Instruct "
                     "float32, smollm2-135m-dspark-b7)", "verify_tokens": 8, "group_size": 64},
        "target_weight_bytes": weights,
        "prefill_chunk_scores_bytes_per_layer": 2048 * args.context * a.num_attention_heads * 4,
        "rows": rows,
    }
    for r in rows:
        print(f"kv_bits={r['kv_bits']}: target cache {r['target_cache_bytes'] / 2**20:.0f} MiB, "
              f"drafter cache {r['drafter_cache_bytes'] / 2**20:.0f} MiB, peak during verify "
              f"{r['peak_bytes_during_verify'] / 2**20:.0f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
