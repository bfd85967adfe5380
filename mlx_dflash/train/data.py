"""Training prompts: JSON Lines prompt sets and HumanEval-shaped prompts from the stdlib.

A drafter must imitate the target, so only prompts are read here: the responses are the
target's own, generated into the feature store (``store.py``).
"""

from __future__ import annotations

import inspect
import json
import os
import random
from typing import Any
from pathlib import Path


def prompt_text(row: dict) -> str | None:
    """The prompt of a JSON Lines row: `prompt`, `question`, or the first of `turns`."""
    for key in ("prompt", "question"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key]
    turns = row.get("turns")
    if isinstance(turns, list) and turns:
        first = turns[0]
        if isinstance(first, dict):
            first = first.get("content") or first.get("value")
        if isinstance(first, str) and first.strip():
            return first
    return None


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {id, prompt} from a JSON Lines file; rows without a usable prompt are skipped."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    rows = []
    with path.open() as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n + 1}: not valid JSON: {e}") from e
            text = prompt_text(row) if isinstance(row, dict) else None
            if text is None:
                continue
            rows.append({"id": f"{path.stem}:{row.get('id', n)}", "prompt": text})
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _add_code_prompt(rows: list[dict], seen: set, module: str, qualname: str, fn: Any,
                     head: str) -> None:
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 40 or (module, qualname) in seen:
        return
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return
    seen.add((module, qualname))
    indent = head.rsplit("\n", 1)[1]
    body = f"\n{indent}".join(doc.strip().splitlines()[:12])
    head = head.replace("{attr}", qualname).replace("{sig}", sig)
    rows.append({"id": f"stdlib:{module}.{qualname}",
                 "prompt": f'{head}"""{body}\n{indent}"""\n'})


def stdlib_code_prompts(limit: int | None = None, seed: int = 0) -> list[dict]:
    """HumanEval-shaped prompts (signature + docstring) from the standard library's functions."""
    import importlib
    import pkgutil
    import sys
    import warnings

    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "lib2to3", "ensurepip")
    rows, seen = [], set()
    stdlib = os.path.dirname(os.__file__)  # site-packages lives below it: compare exactly
    names = sorted(m.name for m in pkgutil.iter_modules()
                   if getattr(m.module_finder, "path", None) == stdlib
                   and not m.name.startswith(("_",) + skip))
    for name in names + sorted(sys.builtin_module_names):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isfunction(obj):
                _add_code_prompt(rows, seen, name, attr, obj, "def {attr}{sig}:\n    ")
            elif inspect.isclass(obj):  # methods: most of the library's code lives in classes
                for meth, fn in sorted(vars(obj).items()):
                    if not meth.startswith("_") and inspect.isfunction(fn):
                        _add_code_prompt(rows, seen, name, f"{attr}.{meth}", fn,
                                         f"class {attr}:\n    def {meth}{{sig}}:\n        ")
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit else rows
