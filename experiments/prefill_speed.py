"""Prefill speed at a long context, side by side: the package's (the target and the drafter's
context, `bench_context.prefilled`) and mlx-lm's `stream_generate` on the same code prompt.

    python experiments/prefill_speed.py [--context 16384] [--out FILE.json]
"""

from __future__ import annotations

import argparse

import mlx_dflash  # noqa: F401  (the fast BLAS, before mlx)
import mlx.core as mx
from mlx_dflash.bench_context import code_prompt, mlx_lm_prefill_tps, prefilled
from mlx_dflash.default_pair import load_default
from report import report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, drafter, tokenizer = load_default(progress=False)
    tokens = code_prompt(tokenizer, args.context, 0)
    pair, done, seconds = prefilled(model, drafter, tokens)
    del pair
    mx.clear_cache()
    result = {"mlx": mx.__version__, "prompt_tokens": len(tokens),
              "ours_tokens_per_s": done / seconds,
              "mlx_lm_tokens_per_s": mlx_lm_prefill_tps(model, tokenizer, tokens)}
    report(result, args.out)


if __name__ == "__main__":
    main()
