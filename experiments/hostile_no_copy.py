"""The scheduler alone on the hostile prompts: plain mlx-lm against the default settings with
copy drafts off, interleaved prompt by prompt.

    python experiments/hostile_no_copy.py [docs/hostile_prompts.jsonl]
"""

import json
import sys
import time

from mlx_dflash import load_default, stream_generate  # first: it loads the fast BLAS
from mlx_dflash.bench import _plain, load_prompt_sets


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/hostile_prompts.jsonl"
    model, drafter, tok = load_default(progress=False)
    texts = next(iter(load_prompt_sets([path], None).values()))
    plain_s = spec_s = 0.0
    plain_n = spec_n = equal = 0
    lengths = []
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True)
        ref, elapsed = _plain(model, tok, ids, 96)
        plain_s, plain_n = plain_s + elapsed, plain_n + len(ref)
        tic, out = time.perf_counter(), []
        for r in stream_generate(model, drafter, tok, ids, max_tokens=96, copy_drafts=False):
            out += r.tokens
        spec_s, spec_n = spec_s + time.perf_counter() - tic, spec_n + len(out)
        equal += out == ref
        lengths += r.stats.draft_lengths
    print(json.dumps({"plain_tps": plain_n / plain_s, "auto_no_copy_tps": spec_n / spec_s,
                      "speedup": (spec_n / spec_s) / (plain_n / plain_s), "equal": equal,
                      "prompts": len(texts),
                      "plain_cycle_share": sum(k == 0 for k in lengths) / len(lengths)}))


if __name__ == "__main__":
    main()
