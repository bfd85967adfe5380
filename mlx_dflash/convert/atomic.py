"""Write an output directory all-or-nothing.

Converters write into a hidden sibling directory and rename it into place only once everything
succeeded, so an interrupted or failed conversion never leaves a half-written model that a later
run would mistake for a finished one.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_output_dir(path: Path | str, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``path`` when the block exits cleanly.

    The temporary directory sits next to ``path`` (same filesystem, so the final rename is atomic)
    under a hidden name. On any exception, ``KeyboardInterrupt`` included, it is removed and
    ``path`` is left untouched.

    Raises:
        FileExistsError: ``path`` already exists and ``overwrite`` is False.
    """
    path = Path(path).expanduser().absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"Output directory already exists: {path}. "
            "Choose another location or pass overwrite=True to replace it."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp) so the final directory gets the usual umask permissions, not 0700.
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        # Re-check: someone may have created it while we were writing.
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"Output directory appeared while converting: {path}")
            # Move the old one aside first so that `path` is missing only for an instant and the
            # old copy survives if the rename fails.
            old = path.parent / f".{path.name}.old-{secrets.token_hex(4)}"
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            _remove(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)
