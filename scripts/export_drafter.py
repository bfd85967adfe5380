"""Export a training checkpoint as a shipped drafter (bfloat16 weights, z-lab layout).

Usage: python scripts/export_drafter.py RUN/checkpoint mlx_dflash/assets/drafters/NAME
       [--verify-block-size N] [--bits 8] [--path-bits markov_head=4]

--bits quantizes the linear and embedding layers whose input width splits into groups of 64
(affine, the rest stays bfloat16): a DSpark drafter's Markov head doubles its size otherwise.
Loading dequantizes it again where there is no Metal GPU. A DFlash 2 drafter's codebooks (raw
tensors in the published layout) are stored quantized the same way (``X`` packed, ``X_scales``,
``X_biases``) and always dequantized on loading. --path-bits gives the layers under a path
other bits (the shipped DSpark drafter: its Markov tables at 4 bits keep the file < 20 MiB).
"""

import argparse

from mlx_dflash import load_drafter, save_drafter  # first: it loads the fast BLAS
from mlx_dflash.convert.save import quantize_drafter

import mlx.core as mx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--verify-block-size", type=int, default=None)
    parser.add_argument("--bits", type=int, default=None, choices=[4, 8])
    parser.add_argument("--path-bits", action="append", default=[], metavar="PREFIX=BITS",
                        help="other bits for the layers under a path, e.g. markov_head=4")
    args = parser.parse_args()
    drafter = load_drafter(args.checkpoint, dtype=mx.bfloat16)
    drafter.args.verify_block_size = args.verify_block_size
    extra = None
    if args.bits:
        path_bits = {}
        for item in args.path_bits:
            prefix, _, b = item.partition("=")
            if b not in ("4", "8"):
                parser.error(f"--path-bits wants PREFIX=4 or PREFIX=8, got '{item}'")
            path_bits[prefix] = int(b)
        extra = quantize_drafter(drafter, args.bits, path_bits=path_bits)
    save_drafter(drafter, args.out, extra_config=extra)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
