"""Export a training checkpoint as a shipped drafter (bfloat16 weights, z-lab layout).

Usage: python scripts/export_drafter.py RUN/checkpoint mlx_dflash/assets/drafters/NAME
       [--verify-block-size N] [--bits 8]

--bits quantizes the linear and embedding layers whose input width splits into groups of 64
(affine, the rest stays bfloat16): a DSpark drafter's Markov head doubles its size otherwise.
Loading dequantizes it again where there is no Metal GPU.
"""

import argparse

from mlx_dflash import load_drafter, save_drafter  # first: it loads the fast BLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--verify-block-size", type=int, default=None)
    parser.add_argument("--bits", type=int, default=None, choices=[4, 8])
    args = parser.parse_args()
    drafter = load_drafter(args.checkpoint, dtype=mx.bfloat16)
    drafter.args.verify_block_size = args.verify_block_size
    extra = None
    if args.bits:
        nn.quantize(drafter, group_size=64, bits=args.bits,
                    class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding))
                    and m.weight.shape[-1] % 64 == 0)
        extra = {"quantization": {"group_size": 64, "bits": args.bits, "mode": "affine"}}
    save_drafter(drafter, args.out, extra_config=extra)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
