"""Copy lookup or drafter block, cycle by cycle: rules that read the DSpark drafter's
confidence, by exact greedy simulation on the eval files (B = 8, 16 prompts per domain).

    python experiments/copy_rules.py [DRAFTER] [--json results/copy_rules_DATE.json]

The decode loop verifies a copy whenever one is found (longest window 4, 3, then 2), without
a drafter pass. The rules here may ask the drafter first: E_d is its expected accepted length
(the sum of the running products of its calibrated confidences over the block), c1 its first
slot's confidence, n the copy's window. "oracle" takes whichever block accepts more.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx_dflash  # noqa: F401  (fast BLAS first)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eval_drafters import FILES, block_predictions, prefix_match  # noqa: E402

from mlx_dflash.bench import load_prompt_sets
from mlx_dflash.cli.common import load_pair
from mlx_dflash.decode import stream_generate
from mlx_dflash.target import as_target
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.drafters import load_drafter
from mlx_dflash.lookup import CopyIndex

K = 7  # drafted tokens at B = 8


def tau(seqs, rule) -> float:
    tokens = cycles = 0
    for full, P, drafts, conf in seqs:
        T, a = len(full), P
        index = CopyIndex(full[: P + 1], 2, 4)
        while a < T - 1:
            room = min(K, T - 1 - a)
            n, copied = index.lookup_window(room)
            d_acc = prefix_match(list(drafts[a - P][:room]), full[a + 1 :])
            acc = d_acc
            if copied:
                c_acc = prefix_match(copied, full[a + 1 :])
                survival = np.cumprod(conf[a - P][:room])
                if rule(n, survival.sum(), survival[0], c_acc, d_acc):
                    acc = c_acc
            step = min(acc + 1, T - 1 - a)
            index.extend(full[a + 1 : a + 1 + step])
            a, cycles = a + step, cycles + 1
        tokens += T - 1 - P
    return tokens / cycles


RULES = {"copy whenever found (the decode loop)": lambda n, e, c1, c, d: True,
         "oracle": lambda n, e, c1, c, d: c > d,
         "copy only n >= 3": lambda n, e, c1, c, d: n >= 3}
for t in (0.5, 1.0, 1.5, 2.0, 2.5):
    RULES[f"copy unless E_d > {t}"] = lambda n, e, c1, c, d, t=t: e <= t
    RULES[f"n = 4 or E_d <= {t}"] = lambda n, e, c1, c, d, t=t: n >= 4 or e <= t
for t in (0.5, 0.7, 0.9):
    RULES[f"copy unless c1 > {t}"] = lambda n, e, c1, c, d, t=t: c1 <= t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", nargs="?", default="smollm2-135m-dspark-b7")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, _, tok = load_pair(None, None)
    target = as_target(model)
    drafter = load_drafter(resolve_drafter(args.drafter), model=model)
    domains = {}
    for domain, texts in load_prompt_sets(FILES, 16).items():
        seqs = []
        for text in texts:
            prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
            ref = []
            for r in stream_generate(model, None, tok, prompt, max_tokens=96):
                ref += r.tokens
            if len(ref) >= 2:
                full = prompt + ref
                seqs.append((full, len(prompt),
                             *block_predictions(drafter, target, full, len(prompt), True)))
        domains[domain] = seqs
    report = {}
    for name, rule in RULES.items():
        report[name] = {d: round(tau(seqs, rule), 3) for d, seqs in domains.items()}
        print(f"{name:40s} " + "  ".join(f"{d} {v:.2f}" for d, v in report[name].items()),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"drafter": args.drafter, "block_size": K + 1, "tau": report}, f, indent=2)


if __name__ == "__main__":
    main()
