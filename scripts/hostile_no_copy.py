"""The scheduler alone on the hostile prompts: plain mlx-lm vs the default settings without copy
drafts (python scripts/hostile_no_copy.py)."""
import time
import json
from mlx_dflash import load_default, stream_generate
from mlx_dflash.bench import load_prompt_sets, _plain
model, drafter, tok = load_default(progress=False)
texts = load_prompt_sets(["docs/hostile_prompts.jsonl"], 8)["hostile"]
tp = ts = 0.0; n = np_ = 0; same = 0; lengths = []
for t in texts:
    ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
    ref, el = _plain(model, tok, ids, 96); tp += el; np_ += len(ref)
    tic = time.perf_counter(); out = []
    for r in stream_generate(model, drafter, tok, ids, max_tokens=96, copy_drafts=False):
        out += r.tokens
    ts += time.perf_counter() - tic; n += len(out); same += out == ref
    lengths += r.stats.draft_lengths
print(json.dumps({"plain_tps": np_/tp, "auto_nocopy_tps": n/ts, "speedup": (n/ts)/(np_/tp), "equal": same,
                  "plain_cycle_share": sum(1 for k in lengths if k == 0)/len(lengths)}))
