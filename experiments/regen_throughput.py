"""Regeneration throughput, side by side on the same prompts (default target, float32).

    python experiments/regen_throughput.py [--prompts FILE] [--n 128]

  before      mlx-lm's continuous-batching batch_generate, tokens only (the previous pipeline;
              its features were computed by a second target pass during training)
  store x1    build_store in one process: tokens + tap features + top-k target probabilities
  store x2    the same in two single-BLAS-thread worker processes, half the batch each (the
              same number of sequences in flight)
  before+features  the previous pipeline end to end: batch_generate, then the previous training
              loop's feature pass (one target forward per whole sequence)
Response tokens per second of wall time, model loading excluded for the in-process variants.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate

from mlx_dflash.default_pair import ensure_default_target
from mlx_dflash.target import Target
from mlx_dflash.train.data import read_prompts
from mlx_dflash.train.store import FeatureStore, build_store, build_store_parallel

LAYERS = [1, 10, 18, 27]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="../shared/datasets/train_math_gsm8k.jsonl")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--skip-before", action="store_true")
    args = ap.parse_args()
    path = str(ensure_default_target())
    model, tok = load(path)
    rows = read_prompts(args.prompts, limit=args.n)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       add_generation_prompt=True) for r in rows]
    rates = {}
    if not args.skip_before:
        before(model, tok, prompts, args.max_tokens, rates)
    for name, workers in (("store x1 (tokens+features+top-k)", 1),
                          ("store x2 workers (tokens+features+top-k)", 2)):
        tmp = Path(tempfile.mkdtemp())
        tic = time.perf_counter()
        if workers == 1:
            build_store(model, tok, rows, tmp, LAYERS, max_tokens=args.max_tokens,
                        batch_size=args.batch, progress=False)
        else:
            build_store_parallel(path, rows, tmp, LAYERS, workers=workers,
                                 max_tokens=args.max_tokens, batch_size=args.batch // 2,
                                 progress=False)
        n = sum(length - p for p, length in FeatureStore(tmp).lengths())
        rates[name] = n / (time.perf_counter() - tic)
        shutil.rmtree(tmp)
    for name, rate in rates.items():
        print(f"{name:45s} {rate:7.1f} response tokens/s")
    print(json.dumps(rates))


def before(model, tok, prompts, max_tokens, rates) -> None:
    tic = time.perf_counter()
    out = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True,
                         completion_batch_size=48, prefill_batch_size=16)
    gen_s = time.perf_counter() - tic
    n_resp = sum(len(t) for t in out.token_ids)
    rates["before (batch_generate, tokens only)"] = n_resp / gen_s
    target = Target(model)
    tic = time.perf_counter()
    for p, t in zip(prompts, out.token_ids):
        mx.eval(target.hidden_states(mx.array(p + list(t))[None], None, LAYERS)[1])
    rates["before+features (batch_generate + feature pass)"] = (
        n_resp / (gen_s + time.perf_counter() - tic))


if __name__ == "__main__":
    main()
