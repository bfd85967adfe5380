"""Plain against speculative decoding with the target split across ranks (mx.distributed).

Run under mlx.launch (``mlx.launch --backend ring -n 3 python scripts/bench_distributed.py
...``), or with ``--ranks N`` to start N ranks on this machine itself (ring backend over
loopback), with the environment mlx.launch gives them but without its output relay, which
polls and on a 2-core machine takes a core from the ranks:

    python scripts/bench_distributed.py --ranks 3 \
        --prompts ../shared/datasets/eval_code_humaneval.jsonl \
        --prompts ../shared/datasets/eval_math_gsm8k.jsonl --limit 2 --max-tokens 32 \
        --delay 0 --delay 0.001 --json results/bench_distributed_smollm2_cpu_DATE.json

The default pair's target is split as ``--split`` says (distributed.shard_target; auto: tensor
parallel where SmolLM2-135M's 9 query and 3 key-value heads divide among the ranks, as on 3,
else by layers, as on 2; ``--pad-heads`` adds heads of zeros until they divide, 12 / 4 on 2
ranks, so that a tensor split runs on 2). Every prompt is decoded plainly (plain distributed
decoding) and by ours with the default settings, back to back, greedy; the outputs must be
equal. Plain is mlx-lm's own loop on a tensor split (what ``mlx_lm.generate`` does under
mlx.launch) and ours with no drafter on a split by layers (mlx-lm's llama has no pipeline, so
its loop cannot run one; ours sends the same messages per token: a hand-on per stage and one
gather). ``--delay D`` adds D seconds to every message between the ranks
(distributed.slow_links: each sum over the ranks, two per layer per pass, or each hand-on and
gather), standing in for a slower link; 0 runs the split model as it is. Rank 0 writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import mlx_dflash  # noqa: F401 (before mlx: the fast BLAS)
import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream

from mlx_dflash import distributed, stream_generate
from mlx_dflash.cli.common import chat_prompt
from mlx_dflash.default_pair import load_default
from mlx_dflash.bench import load_prompt_sets
from mlx_dflash.prompts import encode_prompt


def pad_heads(model, ranks: int) -> tuple[int, int]:
    """Give every attention layer heads of zeros until its query and key-value heads divide
    among ``ranks``, so that a tensor split can be made (SmolLM2-135M: 9 / 3 heads become
    12 / 4 on 2 ranks). A zero key-value head with its zero query heads adds exactly zero to
    the layer's output, so the model computes what it did (up to the summation order of the
    wider projections); the split's cost grows with the padded width. Returns the new counts."""
    args = model.args
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    per_kv = heads // kv
    new_kv = kv
    while new_kv % ranks or new_kv * per_kv % ranks:
        new_kv += 1
    new_heads = new_kv * per_kv

    def wider(w: mx.array, extra: int, axis: int) -> mx.array:  # ``extra`` zeros along axis
        shape = list(w.shape)
        shape[axis] = extra
        return mx.concatenate([w, mx.zeros(shape, w.dtype)], axis=axis)

    for layer in model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        for proj, extra in ((attn.q_proj, new_heads - heads), (attn.k_proj, new_kv - kv),
                            (attn.v_proj, new_kv - kv)):
            proj.weight = wider(proj.weight, extra * d, 0)
            if "bias" in proj:
                proj.bias = wider(proj.bias, extra * d, 0)
        attn.o_proj.weight = wider(attn.o_proj.weight, (new_heads - heads) * d, 1)
        attn.n_heads, attn.n_kv_heads = new_heads, new_kv
    args.num_attention_heads, args.num_key_value_heads = new_heads, new_kv
    args.head_dim = model.layers[0].self_attn.head_dim
    mx.eval(model.parameters())
    return new_heads, new_kv


def plain(model, tokenizer, prompt: list[int], max_tokens: int, loop: str) -> list[int]:
    out = []
    if loop == "ours":  # no drafter: one pass per token
        for r in stream_generate(model, None, tokenizer, prompt, max_tokens=max_tokens):
            out += r.tokens
        return out
    for r in mlx_lm_stream(model, tokenizer, prompt, max_tokens=max_tokens):
        if r.finish_reason != "stop":
            out.append(r.token)
    return out


def speculative(model, drafter, tokenizer, prompt: list[int], max_tokens: int
                ) -> tuple[list[int], int]:
    out, cycles = [], 0
    for r in stream_generate(model, drafter, tokenizer, prompt, max_tokens=max_tokens):
        out += r.tokens
        cycles = r.stats.cycles
    return out, cycles


def sum_latency(hidden: int, tokens: int, reps: int = 50) -> float:
    """Seconds of one sum over the ranks of a [1, tokens, hidden] float32 message."""
    x = mx.ones((1, tokens, hidden))
    mx.eval(mx.distributed.all_sum(x))
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(mx.distributed.all_sum(x))
    return (time.perf_counter() - tic) / reps


def pipeline_latency(hidden: int, tokens: int, reps: int = 50) -> float:
    """Seconds of one pass's messages on a split by layers, without its layers: each stage
    hands a [1, tokens, hidden] float32 state on, then one gather (as target.py does)."""
    r, n = distributed.rank(), distributed.group().size()

    def once():
        h = mx.ones((1, tokens, hidden))
        if r < n - 1:
            h = mx.distributed.recv_like(h, r + 1)
        if r != 0:
            h = mx.distributed.send(h, r - 1)
        mx.eval(mx.distributed.all_gather(h))

    once()
    tic = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - tic) / reps


def share_latency(shape: tuple[int, ...], dtype, reps: int = 50) -> float:
    """Seconds of sending rank 0's array of ``shape`` to every rank (distributed.from_root):
    what drafting on rank 0 alone would add to each cycle, for the drafts it hands on."""
    import numpy as np

    values = np.ones(shape, dtype)
    distributed.from_root(values, dtype)
    tic = time.perf_counter()
    for _ in range(reps):
        distributed.from_root(values, dtype)
    return (time.perf_counter() - tic) / reps


def start_ranks(n: int, port: int = 5730) -> int:
    """Run this script as ``n`` ranks on this machine (ring backend, loopback); rank 0's
    output is ours. Returns the first failing rank's exit code (0: none failed)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port + r}"] for r in range(n)], f)
    argv = [a for i, a in enumerate(sys.argv) if a != "--ranks" and sys.argv[i - 1] != "--ranks"]
    procs = [subprocess.Popen([sys.executable, *argv],
                              env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": f.name,
                                   "MLX_DFLASH_STARTED_RANKS": "1"},
                              stdout=None if r == 0 else subprocess.DEVNULL,
                              stderr=None if r == 0 else subprocess.DEVNULL)
             for r in range(n)]
    codes = [p.wait() for p in procs]
    os.unlink(f.name)
    return next((c for c in codes if c), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=None,
                        help="start this many ranks here (instead of mlx.launch)")
    parser.add_argument("--prompts", action="append", required=True)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--split", default="auto", choices=("auto", "tensor", "pipeline"))
    parser.add_argument("--pad-heads", action="store_true",
                        help="pad the target's heads with zero heads so that they divide among "
                             "the ranks (a tensor split on 2 ranks)")
    parser.add_argument("--plain", default="auto", choices=("auto", "mlx-lm", "ours"),
                        help="plain decoding's loop (auto: mlx-lm's on a tensor split, ours "
                             "with no drafter on a split by layers)")
    parser.add_argument("--also-plain", default=None, choices=("mlx-lm", "ours"),
                        help="time this plain loop too, after the first (its outputs must equal)")
    parser.add_argument("--delay", type=float, action="append", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--messages-only", action="store_true",
                        help="time the messages (and the drafter pass) only, no decoding")
    args = parser.parse_args()
    if args.ranks and "MLX_RANK" not in os.environ:
        sys.exit(start_ranks(args.ranks))
    group = distributed.init()
    if group is None:
        sys.exit("run under mlx.launch with 2 or more ranks")
    model, drafter, tokenizer = load_default(progress=distributed.is_root())
    heads = (model.args.num_attention_heads, model.args.num_key_value_heads)
    padded_logits_diff = None
    if args.pad_heads:  # the padded model must compute what the model did
        probe = mx.array([list(range(1, 33))])
        before = model(probe)
        heads = pad_heads(model, group.size())
        padded_logits_diff = mx.abs(model(probe) - before).max().item()
    split = distributed.shard_target(model, mode=args.split)
    loop = args.plain if args.plain != "auto" else "mlx-lm" if split == "tensor" else "ours"
    sets = load_prompt_sets(args.prompts, args.limit)
    # Before any clock: the scheduler's pass costs (measured by all ranks together, once).
    speculative(model, drafter, tokenizer, [1, 2, 3], 4)
    hidden = model.args.hidden_size
    sums = {str(n): sum_latency(hidden, n) for n in (1, 8)}
    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "mlx": mx.__version__,
                    "ranks": group.size(), "backend": "ring (loopback)",
                    "launched": ("--ranks (no output relay)"
                                 if os.environ.get("MLX_DFLASH_STARTED_RANKS") else "mlx.launch")},
        "settings": {"max_tokens": args.max_tokens, "limit": args.limit, "greedy": True,
                     "split": {"tensor": "tensor parallel (mlx-lm shard)",
                               "pipeline": "by layers (pipeline)"}[split],
                     "heads": f"{heads[0]} query / {heads[1]} key-value"
                              + (" (padded with zero heads)" if args.pad_heads else ""),
                     "padded_logits_max_diff": padded_logits_diff,
                     "plain": {"mlx-lm": "mlx-lm stream_generate",
                               "ours": "mlx_dflash stream_generate, no drafter"}[loop],
                     "also_plain": args.also_plain,
                     "messages_per_pass": (2 * len(model.layers) if split == "tensor" else
                                           f"{group.size() - 1} hand-on(s) and 1 gather")},
        "sum_latency_s": sums,
        # a pass's messages alone (no compute), by the pass's tokens
        "pass_messages_s": {str(n): (2 * len(model.layers) * sums[str(n)]
                                     if split == "tensor" else pipeline_latency(hidden, n))
                            for n in (1, 8)},
        "delays": {},
    }
    # Every rank drafts (no message); drafting on rank 0 alone would send each cycle's drafts:
    # the block's tokens when greedy, its draft distributions too when sampling.
    import numpy as np

    from mlx_dflash.schedule import cached_costs
    from mlx_dflash.target import as_target

    block = drafter.block_size
    results["draft_on_rank_0"] = {
        "drafter_pass_s": cached_costs(as_target(model), drafter, block).draft_s,
        "send_tokens_s": share_latency((block - 1,), np.int32),
        "send_distributions_s": share_latency((block - 1, model.args.vocab_size), np.float32),
        "block_size": block, "vocab_size": model.args.vocab_size,
    }
    if distributed.is_root():
        print(json.dumps(results["draft_on_rank_0"]), flush=True)
    if args.messages_only:
        args.delay = []
    # Each prompt runs at every delay in turn (plain, then speculative), so that the machine's
    # drift over the run falls on every delay alike.
    delays = [0.0] if args.delay is None else args.delay
    rows = {d: {domain: {"plain_s": 0.0, "spec_s": 0.0, "tokens": 0, "cycles": 0,
                         "differing": 0} for domain in sets} for d in delays}
    counted = {d: 0 for d in delays}
    for domain, texts in sets.items():
        for text in texts:
            prompt = encode_prompt(tokenizer, chat_prompt(tokenizer, text))
            for delay in delays:
                row = rows[delay][domain]
                counter = distributed.slow_links(model, delay)
                distributed.barrier()
                tic = time.perf_counter()
                want = plain(model, tokenizer, prompt, args.max_tokens, loop)
                row["plain_s"] += time.perf_counter() - tic
                if args.also_plain:
                    distributed.barrier()
                    tic = time.perf_counter()
                    other = plain(model, tokenizer, prompt, args.max_tokens, args.also_plain)
                    row["also_plain_s"] = (row.get("also_plain_s", 0.0)
                                           + time.perf_counter() - tic)
                    row["differing"] += other != want
                distributed.barrier()
                tic = time.perf_counter()
                got, cycles = speculative(model, drafter, tokenizer, prompt, args.max_tokens)
                row["spec_s"] += time.perf_counter() - tic
                row["tokens"] += len(want)
                row["cycles"] += cycles
                row["differing"] += got != want
                counted[delay] += counter[0]
    distributed.slow_links(model, 0.0)
    for delay in delays:
        for domain, row in rows[delay].items():
            row["plain_tps"] = row["tokens"] / row["plain_s"]
            row["spec_tps"] = row["tokens"] / row["spec_s"]
            row["speedup"] = row["spec_tps"] / row["plain_tps"]
            if args.also_plain:
                row["also_plain_tps"] = row["tokens"] / row["also_plain_s"]
            row["tokens_per_cycle"] = row["tokens"] / max(row["cycles"], 1)
            if distributed.is_root():
                print(f"delay {delay * 1e3:g} ms {domain}: plain {row['plain_tps']:.1f} tok/s, "
                      f"speculative {row['spec_tps']:.1f} tok/s ({row['speedup']:.2f}x), "
                      f"{row['tokens_per_cycle']:.2f} tokens/pass, differing "
                      f"{row['differing']}" + (f", plain ({args.also_plain}) "
                                               f"{row['also_plain_tps']:.1f} tok/s"
                                               if args.also_plain else ""), flush=True)
        results["delays"][f"{delay * 1e3:g} ms"] = rows[delay]
        if delay:
            results["delays"][f"{delay * 1e3:g} ms"]["messages_counted"] = counted[delay]
    if distributed.is_root() and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
