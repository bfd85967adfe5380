"""Export a training checkpoint as a shipped drafter (bfloat16 weights, z-lab layout).

Usage: python scripts/export_drafter.py RUN/checkpoint mlx_dflash/assets/drafters/NAME
       [--verify-block-size N]
"""

import argparse

from mlx_dflash import load_drafter, save_drafter  # first: it loads the fast BLAS

import mlx.core as mx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--verify-block-size", type=int, default=None)
    args = parser.parse_args()
    drafter = load_drafter(args.checkpoint, dtype=mx.bfloat16)
    drafter.args.verify_block_size = args.verify_block_size
    save_drafter(drafter, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
