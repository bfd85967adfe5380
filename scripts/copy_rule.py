"""Choose the copy-draft rule on the eval files by exact greedy simulation.

    python scripts/copy_rule.py [--drafter NAME] [--limit 16] [--max-tokens 96] [--block 4]

For greedy decoding the accepted tokens are always the target's own, so every cycle's outcome
is known once the target's plain output is: at each possible anchor we score the drafter's
block (teacher-forced, one pass over the whole sequence) and the copy block (CopyIndex over
the history), then replay the decode loop under each rule. Cycle time comes from passes
measured on this machine (drafter pass + verify of 1+K tokens; copy cycles skip the drafter).
"""

import argparse
import json
import time

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import numpy as np

from mlx_dflash.bench import load_prompt_sets
from mlx_dflash.cli.common import load_pair
from mlx_dflash.decode import as_target, stream_generate
from mlx_dflash.default import resolve_drafter
from mlx_dflash.lookup import CopyIndex

D = "../shared/datasets/"
FILES = [D + "eval_code_humaneval.jsonl", D + "eval_math_gsm8k.jsonl",
         D + "eval_chat_sharegpt.jsonl"]


def prefix_match(proposal, truth) -> int:
    n = 0
    for p, t in zip(proposal, truth):
        if p != t:
            break
        n += 1
    return n


def pass_costs(target, drafter, B, reps=3):
    cache = target.make_cache()
    _, f = target.hidden_states(mx.zeros((1, 256), dtype=mx.uint32), cache,
                                drafter.target_layer_ids)
    dcache = drafter.make_cache()
    drafter.commit(f, dcache)
    mx.eval([c.state for c in cache + dcache])

    def best(fn):
        fn()
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tic)
        return min(times)

    def verify(n):
        mx.eval(target.forward(mx.ones((1, n), dtype=mx.uint32), cache,
                               drafter.target_layer_ids))
        target.rollback(cache, n)

    draft = best(lambda: mx.eval(drafter.draft_logits(
        target, mx.zeros((1,), dtype=mx.uint32), dcache, max(B, drafter.block_size), B - 1)))
    return draft, {n: best(lambda n=n: verify(n)) for n in range(1, B + 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, drafter, tok = load_pair(None, resolve_drafter(args.drafter) if args.drafter else None)
    target = as_target(model)
    B, K = args.block, args.block - 1
    t_draft, t_verify = pass_costs(target, drafter, B)
    rules = {"drafter only": None, **{f"copy n={n}": (n, 1) for n in (2, 3, 4)},
             **{f"copy n={n}, >= 2 tokens": (n, 2) for n in (2, 3)}}
    report = {"block": B, "draft_s": t_draft, "verify_s": t_verify, "domains": {}}
    for domain, texts in load_prompt_sets(FILES, args.limit).items():
        totals = {r: [0, 0, 0.0, 0] for r in rules}  # tokens, cycles, seconds, copy cycles
        for text in texts:
            prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
            ref = []
            for r in stream_generate(model, None, tok, prompt, max_tokens=args.max_tokens):
                ref += r.tokens
            full = prompt + ref
            P, T = len(prompt), len(full)
            if T - P < 2:
                continue
            _, feats = target.hidden_states(mx.array(full)[None], None, drafter.target_layer_ids)
            anchors = np.arange(P, T - 1)
            block = np.full((len(anchors), drafter.block_size), drafter.mask_token_id)
            block[:, 0] = np.array(full)[anchors]
            hidden = drafter.train_hidden(target.embed(mx.array(block)), feats,
                                          mx.array(anchors))
            logits = drafter.head(target, hidden[:, 1 : 1 + K])
            drafts = mx.argmax(logits, axis=-1)
            if drafter.vocab_ids is not None:
                drafts = drafter.vocab_ids[drafts]
            drafts = np.array(drafts)
            for name, rule in rules.items():
                index = CopyIndex(full[: P + 1], rule[0] if rule else 3)
                a, cycles, seconds, copies = P, 0, 0.0, 0
                while a < T - 1:
                    room = T - 1 - a
                    copied = index.lookup(min(K, room)) if rule else []
                    if rule and len(copied) >= rule[1]:
                        acc = prefix_match(copied, full[a + 1 :])
                        seconds += t_verify[1 + len(copied)]
                        copies += 1
                    else:
                        acc = prefix_match(drafts[a - P][: min(K, room)], full[a + 1 :])
                        seconds += t_draft + t_verify[1 + min(K, room)]
                    step = min(acc + 1, room)
                    index.extend(full[a + 1 : a + 1 + step])
                    a += step
                    cycles += 1
                t = totals[name]
                t[0] += T - 1 - P
                t[1] += cycles
                t[2] += seconds
                t[3] += copies
        plain = t_verify[1]
        rows = {}
        for name, (tokens, cycles, seconds, copies) in totals.items():
            rows[name] = {"tau": tokens / cycles, "est_speedup": plain * tokens / seconds,
                          "copy_share": copies / cycles}
            print(f"{domain:5s} {name:24s} tau {tokens / cycles:5.2f}  est. speedup "
                  f"{plain * tokens / seconds:5.2f}x  copy cycles {copies / cycles:5.1%}")
        report["domains"][domain] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
