"""The host cost of TextStream.commit + response per cycle, with the text split by origin
(GenerationResponse.pieces) or not: the per-cycle work the dashboard's token colours add.

    python experiments/text_commit_cost.py   # the default target's tokenizer, 3-token cycles
"""

import time

import mlx_dflash  # noqa: F401  (the fast BLAS first)
from mlx_lm.utils import load_tokenizer

from mlx_dflash.decode import GenerationStats, TextStream
from mlx_dflash.default_pair import ensure_default_target


def cost(tokenizer, ids, origins_of) -> float:
    stats = GenerationStats()
    out = TextStream(tokenizer, stats, 10**9)
    cycles, tic = 0, time.perf_counter()
    for i in range(0, len(ids) - 3, 3):
        block = ids[i:i + 3]
        out.commit(block, origins_of(block))
        out.response(block, 2)
        cycles += 1
    return (time.perf_counter() - tic) / cycles * 1e6


if __name__ == "__main__":
    tokenizer = load_tokenizer(ensure_default_target())
    ids = tokenizer.encode(open("README.md").read()[:20000])
    def two(block):  # the accepted drafts, then the target's own token
        return ["drafter"] * (len(block) - 1) + ["target"]

    for _ in range(2):
        print(f"one origin  {cost(tokenizer, ids, lambda b: None):.1f} us/cycle")
        print(f"two origins {cost(tokenizer, ids, two):.1f} us/cycle")
