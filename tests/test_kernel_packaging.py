"""The kernel sources (the repository's top-level metal_kernels/) ship inside the wheel, where
mlx_dflash.kernels finds them: a wheel built from a copy of the checkout's sources, unpacked
and imported."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlx_dflash import kernels

REPO = Path(__file__).resolve().parents[1]
OFFLINE = ("Could not find a version", "Failed to establish a new connection",
           "Temporary failure in name resolution", "No matching distribution")


def source_copy(dest: Path) -> Path:
    """What a wheel build needs, without the (large) drafter assets."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "metal_kernels", dest / "metal_kernels")
    shutil.copytree(REPO / "mlx_dflash", dest / "mlx_dflash", symlinks=True,
                    ignore=shutil.ignore_patterns("assets", "__pycache__", "*.egg-info"))
    return dest


def test_kernel_sources_ship_inside_the_wheel(tmp_path):
    assert (REPO / "mlx_dflash" / "metal_kernels").is_symlink()
    src = source_copy(tmp_path)
    out = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=900)
    if build.returncode and any(s in build.stdout + build.stderr for s in OFFLINE):
        pytest.skip("building a wheel needs setuptools from the package index (offline)")
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = out.glob("*.whl")
    names = [n for spec in kernels.SPECS for n in (spec.body, *spec.headers)]
    with zipfile.ZipFile(wheel) as z:
        for name in set(names):
            shipped = z.read(f"mlx_dflash/metal_kernels/{name}").decode()
            assert shipped == (REPO / "metal_kernels" / name).read_text()
        z.extractall(tmp_path / "installed")
    # The unpacked wheel, imported: kernels reads every source from inside it.
    code = ("from mlx_dflash import kernels; "
            "print(kernels.KERNEL_DIR.resolve()); "
            "print(sum(len(s.source()) + len(s.header()) for s in kernels.SPECS))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "installed"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path / "installed")
    assert run.returncode == 0, run.stderr
    where, size = run.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "installed") and int(size) > 0
