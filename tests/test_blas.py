"""The package binds MLX's BLAS calls to a fast library on Linux."""

import os
import subprocess
import sys

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def run(code: str, **env) -> str:
    environ = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, check=True).stdout.strip()


PROBE = (
    "import mlx_dflash, mlx.core as mx; from mlx_dflash import _blas;"
    "a = mx.random.normal((64, 64)); mx.eval(a @ a);"
    "print(_blas.loaded_blas, _blas.sgemm_provider(), sep='|')"
)


@linux_only
def test_fast_blas_is_the_one_in_use():
    loaded, provider = run(PROBE).split("|")
    if loaded == "None":
        pytest.skip("no fast BLAS installed on this machine (apt-get install libopenblas0-pthread)")
    assert "openblas" in provider or "mkl" in provider, provider
    assert os.path.realpath(loaded) == provider or "openblas" in provider


@linux_only
def test_fast_blas_can_be_turned_off():
    loaded, provider = run(PROBE, MLX_DFLASH_FAST_BLAS="0").split("|")
    assert loaded == "None" and provider == "None"


@linux_only
def test_matmul_is_correct_with_fast_blas():
    code = (
        "import mlx_dflash, mlx.core as mx, numpy as np;"
        "a = np.random.default_rng(0).standard_normal((96, 80)).astype(np.float32);"
        "b = np.random.default_rng(1).standard_normal((80, 72)).astype(np.float32);"
        "print(float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max()))"
    )
    assert float(run(code)) < 1e-3
