"""Benchmark of structured output: JSON extraction tasks (a text and a schema; the reply fills
the schema from the text), four ways on the same prompts, greedy:

- ``plain``: mlx-lm's decoding, unconstrained;
- ``plain+schema``: mlx-lm's decoding with the schema's mask as a logits processor (what
  constrained decoding is without speculation);
- ``auto``: our default settings, unconstrained;
- ``auto+schema``: our default settings under the schema (grammar.py).

Per variant: tokens per second from the request's start, and while decoding (after the
prompt's prefill and first token: replies of different lengths otherwise carry the same prefill
in different shares), tokens per target pass; under the schema also the share of tokens the
grammar forced, whether each reply parses and validates against its schema, and
whether it equals ``plain+schema``'s token for token. The host's mask work per token is timed
on its own (``Matcher.constrain``).
"""

from __future__ import annotations

import json
import platform
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from .bench import _speculative
from .drafters.base import drafting, verify_width
from .grammar import Grammar, Matcher
from .schedule import cached_costs
from .target import as_target


def read_tasks(path: str | Path | None = None) -> list[dict]:
    """The extraction tasks (JSON Lines: name, text, schema, question, answer); default: the
    24 that ship with the package."""
    if path is None:
        text = resources.files("mlx_dflash").joinpath("assets/structured/extraction.jsonl")
        lines = text.read_text(encoding="utf-8").splitlines()
    else:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    tasks = [json.loads(line) for line in lines if line.strip()]
    for t in tasks:
        missing = {"name", "text", "schema", "question"} - set(t)
        if missing:
            raise ValueError(f"{path}: task {t.get('name', '?')} lacks {sorted(missing)}")
    return tasks


def task_prompt(tokenizer: Any, task: dict) -> list[int]:
    """The chat prompt of a task: its text, its question and the schema to follow."""
    content = (f"{task['text']}\n\n{task['question']} Reply with JSON only, following this "
               f"JSON schema:\n{json.dumps(task['schema'])}")
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _mask_processor(matcher: Matcher, prompt_len: int) -> Any:
    """The grammar's mask as an mlx-lm logits processor."""
    seen = [prompt_len]

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        matcher.commit(tokens[seen[0]:].tolist())
        seen[0] = tokens.shape[0]
        return mx.where(mx.array(matcher.allowed()), logits, -mx.inf)

    return process


def _plain(model: Any, tokenizer: Any, prompt: list[int], grammar: Grammar | None,
           max_tokens: int) -> tuple[list[int], float, float]:
    """mlx-lm's greedy decoding, with the grammar's mask as a logits processor when given:
    (tokens, seconds, seconds to the first token)."""
    from mlx_lm import stream_generate as mlx_stream_generate

    processors = []
    if grammar is not None:
        matcher = Matcher(grammar, tokenizer, as_target(model).vocab_size)
        processors.append(_mask_processor(matcher, len(prompt)))
    tic = time.perf_counter()
    responses = list(mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                         logits_processors=processors))
    elapsed = time.perf_counter() - tic
    tokens = [r.token for r in responses]
    if tokens and tokens[-1] in tokenizer.eos_token_ids:
        tokens = tokens[:-1]
    return tokens, elapsed, responses[-1].prompt_tokens / responses[-1].prompt_tps


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def mask_seconds_per_token(tokenizer: Any, tasks: Sequence[dict], replies: Sequence[list[int]],
                           vocab_size: int) -> float:
    """Host time of the grammar's work per token along the given replies: each position's
    mask, as a cycle's ``Matcher.constrain`` computes it, and the commit."""
    seconds, tokens = 0.0, 0
    for task, reply in zip(tasks, replies):
        matcher = Matcher(Grammar.json_schema(task["schema"]), tokenizer, vocab_size)
        tic = time.perf_counter()
        for t in reply:
            matcher.allowed()
            matcher.commit([t])
        seconds += time.perf_counter() - tic
        tokens += len(reply)
    return seconds / max(tokens, 1)


def run_structured_bench(model: Any, drafter: Any, tokenizer: Any, tasks: Sequence[dict],
                         max_tokens: int = 256, progress: bool = True) -> dict:
    """The four variants on every task, interleaved task by task."""
    from . import _blas

    target = as_target(model)
    cached_costs(target, drafting(drafter), verify_width(drafter))  # timed before any clock
    variants = ("plain", "plain+schema", "auto", "auto+schema")
    totals = {v: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0,
                  "cycles": 0, "forced": 0, "valid": 0, "equal_to_plain_schema": 0}
              for v in variants}
    rows, schema_replies = [], []
    for task in tasks:
        prompt = task_prompt(tokenizer, task)
        grammar = Grammar.json_schema(task["schema"])
        plain, s_plain, first_plain = _plain(model, tokenizer, prompt, None, max_tokens)
        ref, s_ref, first_ref = _plain(model, tokenizer, prompt, grammar, max_tokens)
        auto, s_auto, st_auto = _speculative(model, drafter, tokenizer, prompt, max_tokens, {})
        out, s_out, st_out = _speculative(model, drafter, tokenizer, prompt, max_tokens,
                                          {"grammar": grammar})
        schema_replies.append(ref)
        row = {"name": task["name"], "prompt_tokens": len(prompt)}
        for name, toks, secs, first, stats in (
                ("plain", plain, s_plain, first_plain, None),
                ("plain+schema", ref, s_ref, first_ref, None),
                ("auto", auto, s_auto, st_auto.prefilled_tokens / st_auto.prompt_tps, st_auto),
                ("auto+schema", out, s_out, st_out.prefilled_tokens / st_out.prompt_tps,
                 st_out)):
            t = totals[name]
            t["tokens"] += len(toks)
            t["seconds"] += secs
            t["decode_tokens"] += max(len(toks) - 1, 0)  # those after the first
            t["decode_seconds"] += secs - first
            t["cycles"] += stats.cycles if stats is not None else len(toks)
            t["forced"] += stats.forced_tokens if stats is not None else 0
            valid = _valid(tokenizer.decode(toks), task["schema"])
            t["valid"] += valid
            t["equal_to_plain_schema"] += toks == ref
            row[name] = {"tokens": len(toks), "seconds": secs, "first_token_s": first,
                         "valid": valid}
        rows.append(row)
        if progress:
            print(f"[structured] {task['name']}: plain {len(plain)} tok {s_plain:.1f}s, "
                  f"plain+schema {len(ref)} tok {s_ref:.1f}s, auto {s_auto:.1f}s, "
                  f"auto+schema {s_out:.1f}s (equal {out == ref}, forced "
                  f"{st_out.forced_tokens})", flush=True)
    summary = {}
    for name, t in totals.items():
        summary[name] = {
            "tokens": t["tokens"], "seconds": t["seconds"],
            "tokens_per_s": t["tokens"] / t["seconds"],
            "decode_tokens_per_s": t["decode_tokens"] / t["decode_seconds"],
            "tokens_per_pass": t["tokens"] / max(t["cycles"], 1),
            "forced_share": t["forced"] / max(t["tokens"], 1),
            "valid": t["valid"], "equal_to_plain_schema": t["equal_to_plain_schema"]}
    base = summary["plain+schema"]
    for name in variants:
        summary[name]["vs_plain_schema"] = summary[name]["tokens_per_s"] / base["tokens_per_s"]
        summary[name]["decode_vs_plain_schema"] = (summary[name]["decode_tokens_per_s"]
                                                   / base["decode_tokens_per_s"])
    return {
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                    "mlx": mx.__version__,
                    "blas": Path(_blas.sgemm_provider() or "default").name},
        "settings": {"max_tokens": max_tokens, "tasks": len(tasks), "greedy": True,
                     "dtype": str(model.model.embed_tokens.weight.dtype)},
        "summary": summary,
        "mask_s_per_token": mask_seconds_per_token(tokenizer, tasks, schema_replies,
                                                   target.vocab_size),
        "tasks": rows,
    }


def format_structured_table(results: dict) -> str:
    lines = ["| variant | tok/s | vs plain+schema | decoding tok/s | vs plain+schema | "
             "tokens per target pass | forced share | valid | equal to plain+schema |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    n = results["settings"]["tasks"]
    for name, v in results["summary"].items():
        lines.append(f"| {name} | {v['tokens_per_s']:.2f} | {v['vs_plain_schema']:.2f}x | "
                     f"{v['decode_tokens_per_s']:.2f} | {v['decode_vs_plain_schema']:.2f}x | "
                     f"{v['tokens_per_pass']:.2f} | {v['forced_share']:.0%} | {v['valid']}/{n}"
                     f" | {v['equal_to_plain_schema']}/{n} |")
    lines.append(f"\nmask work per token on the host: "
                 f"{results['mask_s_per_token'] * 1e6:.0f} us")
    return "\n".join(lines)
