"""Fill a feature store with train-file rows that no DSpark drafter of the lineage trained on,
for refitting and checking the confidence calibration; write their ids for
``calibrate_dspark.py --ids``.

    python scripts/build_unseen_store.py runs/unseen-store --ids runs/unseen-ids.json \
        [--workers 2] [--list-only]

Which rows (the lineage's stores: docs/training.md, "Data"; only the two train files, never
the eval files):

- ``id-hash``: rows whose id falls in the 2% split (``train.loop.held_out_split``, seed 0) that
  every training run since 2026-12-01 02:04 held out, in every store, at or past row 2,000 of
  each file. The runs before that split (the first DSpark drafter and the DFlash drafter whose
  backbone it started from) trained on the first 2,752 sequences of a store that began at each
  file's start (1,256 math and 1,388 chat rows) with an index-based split, so the first rows
  are left out.
- ``chat-gap``: chat rows that no store reached, most likely (the first stores' extent is not
  recorded row by row): before 50% of the file (where the middle-of-file store of 2026-12-03
  began) and past the first four generation windows (4 x 1,024 prompts) of the store from 30%
  on (2026-12-04; it stopped at 3,456 sequences inside its fourth window). The stores from the
  file's start held ~1,200 and ~3,200 chat rows; the tail store began at row ~6,440.

Math has no such gap (the stores from the start, from 30%, from 50% and the tail cover it).
Prompts longer than 512 tokens are skipped, as every store did.
"""

import argparse
import hashlib
import json
from collections import Counter

import mlx_dflash  # noqa: F401  (fast BLAS first)
from mlx_dflash.default_pair import ensure_default_target
from mlx_dflash.drafters import load_drafter
from mlx_dflash.drafters.shipped import resolve_drafter
from mlx_dflash.train.data import read_prompts, stdlib_code_prompts
from mlx_dflash.train.store import build_store_parallel

DATASETS = "../shared/datasets"
FILES = {"math": "train_math_gsm8k.jsonl", "chat": "train_chat_sharegpt.jsonl"}
FIRST_ROW = 2000  # id-hash rows before this row of each file may have trained the first runs
RATIO = (("math", 4), ("chat", 3), ("code", 2))  # build_store.py's interleave
WINDOW = 16 * 64  # build_store's length-sorting window (16 batches of 64)
MAX_PROMPT_TOKENS = 512


def held_out(row_id: str, fraction: float = 0.02, seed: int = 0) -> bool:
    """train.loop.held_out_split's rule for one id (stores of 1,000 sequences and more)."""
    h = int.from_bytes(hashlib.sha1(f"{seed}:{row_id}".encode()).digest()[:8], "big")
    return h / 2.0**64 < fraction


def interleaved_from(sources: dict[str, list[dict]], start: float) -> list[tuple[str, int]]:
    """(source, row index) in build_store.py's order from ``start`` of each file."""
    cut = {k: int(start * len(v)) for k, v in sources.items()}
    rest = {k: iter(list(range(cut[k], len(v))) + list(range(cut[k]))) for k, v in
            sources.items()}
    order: list[tuple[str, int]] = []
    while True:
        before = len(order)
        for name, n in RATIO:
            for _ in range(n):
                i = next(rest[name], None)
                if i is not None:
                    order.append((name, i))
        if len(order) == before:
            return order


def select(tokenizer) -> list[tuple[str, int, str]]:
    """(source, row index, why) of the rows no drafter of the lineage trained on."""
    sources = {k: read_prompts(f"{DATASETS}/{f}") for k, f in FILES.items()}
    fits = {k: [len(tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True))
        <= MAX_PROMPT_TOKENS for r in v] for k, v in sources.items()}
    picked = [(k, i, "id-hash") for k, v in sources.items() for i, r in enumerate(v)
              if i >= FIRST_ROW and fits[k][i] and held_out(r["id"])]
    # The 30%-on store: the rows of its first four windows (over the prompts it kept).
    code = stdlib_code_prompts(limit=4400)
    order = interleaved_from({**sources, "code": code}, 0.3)
    kept = [(k, i) for k, i in order if k == "code" or fits[k][i]]
    reached = set(kept[: 4 * WINDOW])
    chat = sources["chat"]
    half = int(0.5 * len(chat))
    gap = [i for i in range(int(0.3 * len(chat)), half)
           if ("chat", i) not in reached and fits["chat"][i]]
    seen = {(k, i) for k, i, _ in picked}
    picked += [("chat", i, "chat-gap") for i in gap if ("chat", i) not in seen]
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--ids", required=True, help="where to write the selected ids (JSON list)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--drafter", default="smollm2-135m-dspark-b7")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--list-only", action="store_true", help="write the ids, build nothing")
    args = ap.parse_args()
    from mlx_lm.utils import load_tokenizer

    target_dir = ensure_default_target()
    picked = select(load_tokenizer(target_dir))
    sources = {k: read_prompts(f"{DATASETS}/{f}") for k, f in FILES.items()}
    rows = [sources[k][i] for k, i, _ in picked]
    print(f"{len(rows)} rows: " + ", ".join(f"{n} {k} ({why})" for (k, why), n in
                                             sorted(Counter((k, w) for k, _, w in picked).items())))
    with open(args.ids, "w") as f:
        json.dump([r["id"] for r in rows], f, indent=0)
    if args.list_only:
        return
    layer_ids = load_drafter(resolve_drafter(args.drafter)).target_layer_ids
    build_store_parallel(str(target_dir), rows, args.store, layer_ids, workers=args.workers,
                         max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
