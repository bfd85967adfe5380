"""Fill a feature store from the train prompt sets in an interleaved order, resumably.

The order the DSpark lineage's stores have used since 2026-12-01: each file from a starting
fraction onward (so a new store can cover rows an earlier, lost one never reached), then its
rows before it, 4 math : 3 chat : 2 code (stdlib docstring prompts), so that a store stopped
early still holds every domain. Rerun the same command to continue; the store skips the ids it
holds.

Usage: python scripts/build_store.py STORE [--start 0.5] [--workers 2] [--drafter NAME]
Eval files are never read. Taps: the drafter's (default: the shipped one), so its lineage
can train on the store.
"""

import argparse
import itertools

import mlx_dflash  # noqa: F401  (fast BLAS first)
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.default_pair import ensure_default_target
from mlx_dflash.drafters import load_drafter
from mlx_dflash.train.data import read_prompts, stdlib_code_prompts
from mlx_dflash.train.store import build_store_parallel

DATASETS = "../shared/datasets"
RATIO = (("math", 4), ("chat", 3), ("code", 2))


def interleaved(sources: dict[str, list[dict]], start: float) -> list[dict]:
    """Rows of every source from ``start`` (a fraction) to its end, then from its beginning,
    taken RATIO at a time."""
    cut = {k: int(start * len(v)) for k, v in sources.items()}
    rest = {k: iter(v[cut[k]:] + v[:cut[k]]) for k, v in sources.items()}
    rows: list[dict] = []
    while True:
        before = len(rows)
        for name, n in RATIO:
            rows += itertools.islice(rest[name], n)
        if len(rows) == before:
            return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store")
    p.add_argument("--start", type=float, default=0.5, help="fraction of each file to skip")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--drafter", default="smollm2-135m-dspark-b7")
    p.add_argument("--max-tokens", type=int, default=192)
    args = p.parse_args()
    if not 0.0 <= args.start < 1.0:
        p.error(f"--start must be in [0, 1), got {args.start}")
    sources = {"math": read_prompts(f"{DATASETS}/train_math_gsm8k.jsonl"),
               "chat": read_prompts(f"{DATASETS}/train_chat_sharegpt.jsonl"),
               "code": stdlib_code_prompts(limit=4400)}
    rows = interleaved(sources, args.start)
    layer_ids = load_drafter(resolve_drafter(args.drafter)).target_layer_ids
    print(f"{len(rows)} prompts from {args.start:.0%} of each file on, taps {layer_ids}")
    build_store_parallel(str(ensure_default_target()), rows, args.store, layer_ids,
                         workers=args.workers, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
