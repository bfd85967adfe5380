"""The kernel variants the decode loop can launch and the inputs of their first-use check, for
the CI check (tests/test_kernel_variants.py) and scripts/bench_kernels.py. They live in
kernels.py, which runs the check."""

from .kernels import (
    CANDIDATES,
    CHECK_VOCAB,
    DTYPES,
    check,
    decode_variants,
    disagreement,
    example,
    run,
)

__all__ = ["CANDIDATES", "CHECK_VOCAB", "DTYPES", "check", "decode_variants", "disagreement",
           "example", "run"]
