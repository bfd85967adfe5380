"""What the experiments share: the options of those on the extraction tasks, and their result,
printed and written as JSON."""

from __future__ import annotations

import argparse
import json


def task_options(tasks: int, max_tokens: int) -> argparse.Namespace:
    """``--tasks`` (the first N extraction tasks), ``-n`` (tokens per reply) and ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=tasks)
    ap.add_argument("-n", type=int, default=max_tokens)
    ap.add_argument("--out")
    return ap.parse_args()


def report(result: dict, out: str | None, show: bool = True) -> None:
    """Print ``result`` (when ``show``) and write it to ``out`` when one is given."""
    if show:
        print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
