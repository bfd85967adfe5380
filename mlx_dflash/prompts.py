"""Prompts in: text or ids to token ids, and JSON Lines prompt sets (bench, training)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | mx.array) -> list[int]:
    """Token ids of a prompt given as text, ids or an array; an empty prompt is refused."""
    if isinstance(prompt, str):
        # Same rule as mlx_lm.stream_generate: no second BOS if the text already has one.
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, mx.array):
        tokens = prompt.reshape(-1).tolist()
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty")
    return tokens


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
