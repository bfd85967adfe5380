"""The scheduler alone on the hostile prompts: plain mlx-lm against the default settings with
lookups (copy and n-gram drafts) off, chains (`auto`) and trees (`tree="auto"`), interleaved
prompt by prompt.

    python experiments/hostile_no_copy.py [docs/hostile_prompts.jsonl]
"""

import json
import sys
import time

from mlx_dflash import load_default, stream_generate  # first: it loads the fast BLAS
from mlx_dflash.bench import _plain, load_prompt_sets

VARIANTS = {"auto": None, "tree-auto": "auto"}  # name -> tree


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/hostile_prompts.jsonl"
    model, drafter, tok = load_default(progress=False)
    texts = next(iter(load_prompt_sets([path], None).values()))
    plain_s, plain_n = 0.0, 0
    runs = {name: {"seconds": 0.0, "tokens": 0, "equal": 0, "lengths": []} for name in VARIANTS}
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True)
        ref, elapsed = _plain(model, tok, ids, 96)
        plain_s, plain_n = plain_s + elapsed, plain_n + len(ref)
        for name, tree in VARIANTS.items():
            run, tic, out = runs[name], time.perf_counter(), []
            for r in stream_generate(model, drafter, tok, ids, max_tokens=96, copy_drafts=False,
                                     tree=tree):
                out += r.tokens
            run["seconds"] += time.perf_counter() - tic
            run["tokens"] += len(out)
            run["equal"] += out == ref
            run["lengths"] += r.stats.draft_lengths
    plain_tps = plain_n / plain_s
    result = {"prompts": len(texts), "plain_tps": plain_tps}
    for name, run in runs.items():
        tps = run["tokens"] / run["seconds"]
        result[name] = {"tps": tps, "speedup": tps / plain_tps, "equal": run["equal"],
                        "plain_cycle_share": (sum(k == 0 for k in run["lengths"])
                                              / len(run["lengths"]))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
