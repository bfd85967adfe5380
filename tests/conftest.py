# Import the package first so its fast BLAS loads before mlx (see mlx_dflash/_blas.py).
import mlx_dflash  # noqa: F401

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _pass_costs_in_a_temp_dir(tmp_path_factory):
    """Tiny models' pass timings stay out of the user's cache (~/.cache/mlx_dflash/costs)."""
    from mlx_dflash import schedule

    root = tmp_path_factory.mktemp("costs")
    original = schedule._cache_file
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule, "_cache_file", lambda *a: root / original(*a).name)
        yield
