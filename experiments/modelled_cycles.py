"""The cycles `auto` chooses on the long-context bench's prompts, and what the scheduler's own
cost model says they cost: each cycle's source, drafts verified and accepted, and the
"modelled speedup" (plain decoding's passes over the cycles' passes, at the cached pass costs
of each context length) beside the measured one. Where the two differ, the time is outside
the cost model (host work and syncs). Variants by environment: LOOKUP_DECAY, LOOKUP_PRIOR,
COPY_SCORE (mlx_dflash.policy); NOPLAIN=1 skips the plain run (modelled figures only).

    python experiments/modelled_cycles.py chat 1024 2   # kind, context length, prompts
"""

import collections
import os
import sys

import mlx_dflash  # noqa: F401  (the fast BLAS before mlx)
from mlx_dflash import decode
from mlx_dflash import policy as lookup_policy
from mlx_dflash.bench import _plain, _speculative, load_prompt_sets
from mlx_dflash.bench_context import chat_prompt, code_prompt, prefilled, read_turns
from mlx_dflash.cli.common import load_pair
from mlx_dflash.drafters.base import verify_width
from mlx_dflash.schedule import cached_costs
from mlx_dflash.target import as_target

D = "../shared/datasets"
MARK = {"drafter": "d", "copy": "c", "plain": ".", "ngram": "n", "tree": "t"}


def main() -> None:
    kind, length, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for name in ("LOOKUP_DECAY", "COPY_SCORE", "LOOKUP_PRIOR"):
        if name in os.environ:
            setattr(lookup_policy, name, float(os.environ[name]))
    model, drafter, tok = load_pair(None, None)
    turns = read_turns(f"{D}/eval_math_gsm8k.jsonl")
    questions = [q for texts in load_prompt_sets([f"{D}/eval_chat_sharegpt.jsonl"], None)
                 .values() for q in texts]
    log = []
    record = decode.GenerationStats.record

    def logged(self, cycle, accepted):
        log.append((cycle.source, cycle.num_drafts, accepted))
        record(self, cycle, accepted)

    decode.GenerationStats.record = logged
    costs = cached_costs(as_target(model), drafter, verify_width(drafter), length + 200)
    for i in range(n):
        tokens = (code_prompt(tok, length, i) if kind == "code"
                  else chat_prompt(tok, length, i, turns, questions))
        pair, _, _ = prefilled(model, drafter, tokens)
        plain_s = None
        if not os.environ.get("NOPLAIN"):
            ref, plain_s = _plain(model, tok, tokens[-1:], 128, list(pair.fork().target))
        log.clear()
        out, spec_s, _ = _speculative(model, drafter, tok, tokens, 128,
                                      {"prompt_cache": pair.fork()})
        context, modelled = len(tokens), 0.0
        by_kind = collections.defaultdict(lambda: [0, 0])
        for source, k, accepted in log:
            modelled += costs.verify(k + 1, context) + (
                costs.draft(k, context) if source == "drafter" else 0.0)
            context += accepted + 1
            by_kind[source, k][0] += 1
            by_kind[source, k][1] += accepted
        plain_modelled = sum(costs.verify(1, len(tokens) + j) for j in range(len(out)))
        measured = f", measured {plain_s / spec_s:.3f}" if plain_s else ""
        print(f"prompt {i}: {len(tokens)} tokens, modelled speedup "
              f"{plain_modelled / modelled:.3f}{measured}")
        for key in sorted(by_kind):
            print(f"    {key}: {by_kind[key][0]} cycles, {by_kind[key][1]} accepted")
        print("    " + "".join(MARK.get(s, "?") + str(a) for s, _, a in log))


if __name__ == "__main__":
    main()
