"""Refit a DSpark drafter's confidence temperatures and offsets (sequential temperature
scaling, plus a per-position offset) on sequences it never trained on, and write them into its
config.json.

    python scripts/calibrate_dspark.py DRAFTER_DIR --store STORE --ids held_out.json \
        [--anchors 128] [--json OUT]

``--ids``: a JSON list of store sequence ids that the drafter never saw in training. Half of
them fit the temperatures, the other half measure the ECE of the running product before and
after, per position; the result file names both halves' ids.
"""

import argparse
import json

import mlx_dflash  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import numpy as np

from mlx_dflash.cli.common import load_pair
from mlx_dflash.target import as_target
from mlx_dflash.train.loop import Batches, TrainConfig, calibrate
from mlx_dflash.train.store import FeatureStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("--store", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, drafter, _ = load_pair(None, args.drafter)
    drafter.set_dtype(mx.float32)
    if "confidence_head" not in drafter:
        raise SystemExit(f"{args.drafter} has no confidence head to calibrate")
    target = as_target(model)
    store = FeatureStore(args.store)
    store.check(target, drafter.target_layer_ids)
    wanted = set(json.load(open(args.ids)))
    idx = np.array([i for i, sid in enumerate(store.id_list()) if sid in wanted])
    if len(idx) < 4:
        raise SystemExit(f"only {len(idx)} of the {len(wanted)} ids are in {args.store}")
    idx = np.random.default_rng(0).permutation(idx)  # both halves mix every domain
    batch_of = Batches(store, drafter, TrainConfig(args.store, ""), mx.array(1.0))
    result = calibrate(drafter, target, batch_of, idx, anchors=args.anchors)
    result["sequences"] = len(idx)
    ids = store.id_list()  # which sequences fitted, which measured (calibrate's halves)
    result["fit_ids"] = [ids[i] for i in idx[::2]]
    result["test_ids"] = [ids[i] for i in idx[1::2]]
    print("ECE by position before / after: " + ", ".join(
        f"{b:.3f}/{a:.3f}" for b, a in zip(result["ece_before"], result["ece_after"])))
    print("ECE with temperatures alone: " + ", ".join(
        f"{e:.3f}" for e in result["ece_temperatures_only"]))
    if "ece_previous_calibration" in result:
        print("ECE with the drafter's previous calibration: " + ", ".join(
            f"{e:.3f}" for e in result["ece_previous_calibration"]))
    print(f"temperatures {[round(t, 3) for t in result['temperatures']]}, offsets "
          f"{[round(b, 2) for b in result['offsets']]} "
          f"({result['fit_blocks']} fit / {result['test_blocks']} test blocks)")
    config_file = drafter.source_path / "config.json"
    config = json.loads(config_file.read_text())
    config["confidence_temperatures"] = result["temperatures"]
    config["confidence_offsets"] = result["offsets"]
    tmp = config_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(config_file)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
