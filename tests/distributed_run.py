"""Run by tests/test_distributed.py under ``mlx.launch`` (two ranks, ring backend): tiny random
targets split across the ranks (tensor and pipeline parallel), decoded with and without
speculation; rank 0 writes every output to the JSON file named on the command line.

Usage: distributed_run.py OUT.json [die]   ("die": rank 1 leaves mid-generation)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import mlx_dflash  # noqa: E402,F401 (before mlx: the fast BLAS)
import mlx.core as mx  # noqa: E402
from test_mtp import make_mtp  # noqa: E402
from tiny import make_drafter, make_family_target, make_target, make_tokenizer  # noqa: E402

from mlx_dflash import batch_generate, distributed, generate, stream_generate  # noqa: E402

PROMPT = [5, 9, 14, 3, 9, 14, 22, 8, 9, 14, 22]  # a repeat: copy drafts find something
BATCH_PROMPTS = [PROMPT, [7, 8, 9], [40, 41, 40, 41, 40, 41, 42]]
# family -> (a tiny target, how it is split)
FAMILIES = {"qwen3": (lambda: make_target("qwen3", seed=2), "tensor"),
            "llama": (lambda: make_family_target("llama", seed=1), "tensor"),  # sliding windows
            "qwen2": (lambda: make_family_target("qwen2", seed=1), "pipeline"),
            "qwen3_next": (lambda: make_family_target("qwen3_next", seed=2), "pipeline"),
            # split by layers where mlx-lm gives the model no pipeline (distributed._split_layers)
            "llama by layers": (lambda: make_family_target("llama", seed=1), "pipeline"),
            "gemma3_text": (lambda: make_family_target("gemma3_text", seed=1), "pipeline"),
            "gpt_oss by layers": (lambda: make_family_target("gpt_oss", seed=1), "pipeline")}
MTP_FAMILIES = ("qwen3_next",)  # split by layers, decoded with the target's own MTP head too


def tokens(model, drafter, **kw):
    out = []
    for r in stream_generate(model, drafter, make_tokenizer(128), PROMPT, **kw):
        out += r.tokens
    return out


def main(out_path: str, die: bool = False) -> None:
    group = distributed.init()
    assert group is not None and group.size() == 2, "run me with mlx.launch -n 2"
    results = {}
    only = os.environ.get("DIST_FAMILIES")  # a comma-separated subset, when debugging
    for family, (make, how) in FAMILIES.items():
        if only and family not in only.split(","):
            continue
        model = make()
        drafter = make_drafter(model, block_size=4)  # the same weights on every rank
        mtp = make_mtp(model) if family in MTP_FAMILIES else None  # the target's own head
        assert distributed.shard_target(model, mode=how) == how
        if die and distributed.rank() == 1:
            os._exit(3)  # a rank that dies: the other's next message fails
        results[family] = {
            "plain": tokens(model, None, max_tokens=24),
            "greedy": tokens(model, drafter, max_tokens=24, block_size=4),
            # the scheduler's choices: the same on both ranks (rank 0's pass costs)
            "auto": tokens(model, drafter, max_tokens=24),
            "tree": tokens(model, drafter, max_tokens=24, tree=4),
            # the prompt prefilled in chunks (each chunk's messages run with its caches)
            "chunked": tokens(model, drafter, max_tokens=24, block_size=4,
                              prefill_step_size=4),
        }
        mx.random.seed(distributed.common_seed(7))
        results[family]["sampled"] = tokens(model, drafter, max_tokens=24, block_size=4,
                                            temperature=1.0)
        results[family]["text"] = generate(model, drafter, make_tokenizer(128), PROMPT,
                                           max_tokens=8)
        # the batch engine with its verify budget (rank 0's batch pass costs) and with trees
        results[family]["batch"] = [r.tokens for r in batch_generate(
            model, drafter, make_tokenizer(128), BATCH_PROMPTS, max_tokens=16, max_batch=2)]
        results[family]["batch_trees"] = [r.tokens for r in batch_generate(
            model, drafter, make_tokenizer(128), BATCH_PROMPTS, max_tokens=16, max_batch=3,
            tree="auto")]
        if mtp is not None:  # its features are the last stage's, summed to every rank
            results[family]["mtp"] = tokens(model, mtp, max_tokens=24, block_size=3)
            mx.random.seed(distributed.common_seed(7))
            results[family]["mtp_sampled"] = tokens(model, mtp, max_tokens=24, block_size=3,
                                                    temperature=1.0)
    if distributed.is_root():
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], die=sys.argv[2:] == ["die"])
