"""Build a drafter's n-gram table (mlx_dflash/ngram.py) from a feature store's responses (the
target's own greedy text on the training prompts) and write it into the drafter directory.

    python scripts/build_ngram.py STORE DRAFTER_DIR [--max-n 4] [--min-count 2] [--min-prob 0.2]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from mlx_dflash.ngram import FILE_NAME, NgramTable
from mlx_dflash.train.store import FeatureStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("drafter_dir")
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--min-prob", type=float, default=0.2)
    args = ap.parse_args()
    out = Path(args.drafter_dir)
    config = json.loads((out / "config.json").read_text())
    store = FeatureStore(args.store)
    if store.manifest["target"].get("vocab_size", config.get("vocab_size")) != config.get(
            "vocab_size"):
        raise SystemExit(f"{args.store} was made for another vocabulary than {out}'s")
    sequences = ((np.asarray(s.tokens).tolist(), s.prompt_len) for s in store)
    table = NgramTable.build(sequences, args.max_n, args.min_count, args.min_prob)
    table.save(out / FILE_NAME)
    size = (out / FILE_NAME).stat().st_size
    print(f"{len(table)} contexts from {len(store)} sequences -> {out / FILE_NAME} "
          f"({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
