"""Training prompts: JSON Lines prompt sets and HumanEval-shaped prompts from the stdlib.

A drafter must imitate the target, so only prompts are read here: the responses are the
target's own, generated into the feature store (``store.py``).
"""

from __future__ import annotations

import inspect
import os
import random
from typing import Any

from ..prompts import prompt_text, read_prompts  # noqa: F401  (the prompt sets' reader)


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
