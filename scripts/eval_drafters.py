"""Compare drafters, block sizes and copy-draft rules on the eval files by exact greedy
simulation (default target, float32).

    python scripts/eval_drafters.py DRAFTER[@M][=LABEL] ... [--limit 16] [--max-tokens 96]
           [--blocks 4 8] [--json OUT] [--refs REFS.json]

(``@M``: a DSpark drafter's Markov walk chooses among each slot's M top unary tokens; @0 all.)

For greedy decoding every committed token is the target's own, so once the target's plain
output is known each cycle's outcome is too: at every possible anchor we score the drafter's
block teacher-forced (one pass over the whole sequence; for DSpark the Markov walk sees the
true previous tokens, which is what it sees whenever its prefix is accepted) and the copy
block (CopyIndex over the history), then replay the decode loop (DFlash 2: the selector's
pick given the true previous token, which is what its walk sees on an accepted prefix).
Cycle time comes from passes measured here: drafter pass + verify of 1+K tokens (copy cycles
skip the drafter). With the drafter's n-gram table (``ngram.npz``), the rule "+ngram" also
tries a table block when no copy is found and verifies it when ``Scheduler.lookup_length``
says so, the decode loop's own rule (the drafter's survival from its observed acceptance, as
when it has no confidence head). The plain outputs are computed once and shared by every drafter.
Estimated speedups leave out the loop's own overhead (a few ms a cycle), so the bench's
measured figures run a little lower.
"""

import argparse
import json
import os

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import numpy as np

from mlx_dflash.bench import load_prompt_sets
from mlx_dflash.cli.common import load_pair
from mlx_dflash.decode import stream_generate
from mlx_dflash.target import as_target
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.drafters import load_drafter
from mlx_dflash.lookup import CopyIndex
from mlx_dflash.schedule import Scheduler, measure_costs

D = "../shared/datasets/"
FILES = [D + "eval_code_humaneval.jsonl", D + "eval_math_gsm8k.jsonl",
         D + "eval_chat_sharegpt.jsonl"]
# rule -> (copy window: length, (shortest, longest) or None; whether to try the n-gram table)
RULES = {"drafter": (None, False), "drafter+copy n=2": (2, False),
         "drafter+copy n=3": (3, False), "drafter+copy n=2+ngram": (2, True),
         "drafter+copy n=4..2": ((2, 4), False), "drafter+copy n=4..2+ngram": ((2, 4), True)}


def prefix_match(proposal, truth) -> int:
    n = 0
    for p, t in zip(proposal, truth):
        if p != t:
            break
        n += 1
    return n


def block_predictions(drafter, target, full: list[int], P: int, confidence: bool = False):
    """Greedy drafts [anchors, max drafts] (target ids) for every anchor P..T-2; with
    ``confidence``, also a DSpark drafter's calibrated per-slot confidences (same shape)."""
    T = len(full)
    _, feats = target.hidden_states(mx.array(full)[None], None, drafter.target_layer_ids)
    n = drafter.max_drafts
    anchors = np.arange(P, T - 1)
    padded = np.array(full + [0] * (n + 1))
    blocks = np.full((len(anchors), drafter.block_size), drafter.mask_token_id)
    blocks[:, 0] = padded[anchors]
    prev = padded[anchors[:, None] + np.arange(n)[None]]  # the anchor, then true tokens
    # DSpark: the walk picks among each slot's top unary candidates (walk_candidates).
    kw = {"candidates": drafter.walk_candidates} if drafter.walk_candidates else {}
    logits, aux = drafter.train_logits(target, feats, mx.array(blocks), mx.array(anchors),
                                       mx.array(prev), **kw)
    # The family's pick (DFlash 2: the selector's, given the true previous token).
    labels = padded[anchors[:, None] + 1 + np.arange(logits.shape[1])[None]]
    idx, _ = drafter.val_metrics(logits, aux, labels, np.ones(labels.shape, dtype=bool))
    idx = mx.array(idx)
    if drafter.vocab_ids is not None:
        idx = drafter.vocab_ids[idx]
    if confidence:
        return np.array(idx), np.array(drafter.calibrated(aux))
    return np.array(idx)


def simulate(full, P, drafts, K, ngram, t_draft, verify, table=None, scheduler=None):
    """(cycles, seconds, lookup cycles) of one greedy decode from the first generated token;
    with ``table`` and ``scheduler``, n-gram blocks where no copy is found and they pay."""
    T = len(full)
    shortest, longest = ngram if isinstance(ngram, tuple) else (ngram or 3, None)
    index = CopyIndex(full[: P + 1], shortest, longest)
    a, cycles, seconds, copies = P, 0, 0.0, 0
    while a < T - 1:
        room = min(K, T - 1 - a)
        copied = index.lookup(room) if ngram else []
        if not copied and table is not None:
            found, probs = table.draft(full[: a + 1], room)
            copied = found[: scheduler.lookup_length(probs, room, a + 1)]
        if copied:
            acc = prefix_match(copied, full[a + 1:])
            seconds += verify(1 + len(copied))
            copies += 1
        else:
            acc = prefix_match(drafts[a - P][:room], full[a + 1:])
            seconds += t_draft + verify(1 + room)
            if scheduler is not None:
                scheduler.observe(room, acc)
        step = min(acc + 1, T - 1 - a)
        index.extend(full[a + 1 : a + 1 + step])
        a += step
        cycles += 1
    return cycles, seconds, copies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--files", nargs="+", default=FILES)
    ap.add_argument("--json", default=None)
    ap.add_argument("--refs", default=None, help="cache of the target's plain outputs (JSON)")
    args = ap.parse_args()
    model, _, tok = load_pair(None, None)
    target = as_target(model)
    drafters = {}
    for spec in args.drafters:
        path, _, label = spec.partition("=")
        path, _, walk = path.partition("@")  # PATH@M: a DSpark walk among M candidates
        drafters[label or spec] = d = load_drafter(resolve_drafter(path), model=model)
        if walk:
            d.walk_candidates = int(walk)
    Bmax = max(args.blocks)
    # Pass costs once per architecture: drafters that differ only in weights (or n-gram table)
    # must be scored with the same costs, or timing noise picks different lookup decisions.
    measured, costs = {}, {}
    for name, d in drafters.items():
        arch = (type(d).__name__, d.block_size, d.args.hidden_size, d.args.num_hidden_layers,
                d.args.intermediate_size, d.args.draft_vocab_size,
                getattr(d, "walk_candidates", None))
        if arch not in measured:
            measured[arch] = measure_costs(target, d, Bmax, reps=3)
        costs[name] = measured[arch]
    some = next(iter(costs.values()))

    def verify(n: int) -> float:
        return some.verify(n, 256)

    report = {"settings": vars(args), "decode_s": verify(1),
              "draft_s": {k: c.draft_s for k, c in costs.items()}, "domains": {}}
    # The target's plain outputs, reused from --refs when it holds them for these settings.
    refs_key = [args.files, args.limit, args.max_tokens]
    refs = {}
    if args.refs and os.path.exists(args.refs):
        with open(args.refs) as f:
            saved = json.load(f)
        refs = saved["seqs"] if saved.get("key") == refs_key else {}
    for domain, texts in load_prompt_sets(args.files, args.limit).items():
        if domain not in refs:
            refs[domain] = []
            for text in texts:
                prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
                ref = []
                for r in stream_generate(model, None, tok, prompt, max_tokens=args.max_tokens):
                    ref += r.tokens
                if len(ref) >= 2:
                    refs[domain].append((prompt + ref, len(prompt)))
            if args.refs:
                with open(args.refs, "w") as f:
                    json.dump({"key": refs_key, "seqs": refs}, f)
        seqs = refs[domain]  # [full tokens, prompt length] pairs
        rows = {}
        for name, drafter in drafters.items():
            preds = [block_predictions(drafter, target, full, P) for full, P in seqs]
            for K in [b - 1 for b in args.blocks]:
                if drafter.fixed_width and K > drafter.max_drafts:
                    continue
                for rule, (ngram, use_table) in RULES.items():
                    table = drafter.ngram if use_table else None
                    if use_table and table is None:
                        continue
                    tokens = cycles = copies = 0
                    seconds = 0.0
                    for (full, P), drafts in zip(seqs, preds):
                        scheduler = None if table is None else Scheduler(
                            costs[name], K, token_bytes=1, headroom=lambda: 1 << 40)
                        c, s, k = simulate(full, P, drafts, K, ngram, costs[name].draft_s,
                                           verify, table, scheduler)
                        tokens, cycles, seconds, copies = (tokens + len(full) - 1 - P,
                                                           cycles + c, seconds + s, copies + k)
                    key = f"{name} | B={K + 1} | {rule}"
                    rows[key] = {"tau": tokens / cycles,
                                 "est_speedup": verify(1) * tokens / seconds,
                                 "copy_share": copies / cycles}  # copy + n-gram cycles
                    print(f"{domain:7s} {key:45s} tau {tokens / cycles:5.2f}  est. speedup "
                          f"{verify(1) * tokens / seconds:5.2f}x  lookups {copies / cycles:5.1%}",
                          flush=True)
        report["domains"][domain] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
