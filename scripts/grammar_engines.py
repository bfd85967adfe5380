"""Which grammar engine structured output uses, by measurement: llguidance against
outlines-core on the shipped extraction schemas and the default target's tokenizer.

For each engine: the tokenizer's one-off setup, each schema's compile time, the time of one
next-token mask (and the commit of a token) along each schema's answer, and the time to roll
back a cycle's worth of tokens. xgrammar is not measured: its wheel requires torch,
transformers and triton, too heavy a dependency for an MLX package.

    python scripts/grammar_engines.py --json results/grammar_engines_2026-12-07.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx_dflash  # noqa: F401  (the fast BLAS first, as everywhere)
from mlx_dflash.bench_structured import read_tasks
from mlx_dflash.default_pair import load_default


def _answer_tokens(tokenizer, task) -> list[int]:
    return tokenizer.encode(json.dumps(task["answer"]), add_special_tokens=False)


def measure_llguidance(tokenizer, tasks, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf

    from mlx_dflash.grammar import JSON_OPTIONS

    tic = time.perf_counter()
    llt = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - tic
    compile_s, mask_s, rollback_s = [], [], []
    for task in tasks:
        tic = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(task["schema"],
                                                               defaults=JSON_OPTIONS)
        m = llguidance.LLMatcher(llt, grammar)
        compile_s.append(time.perf_counter() - tic)
        tokens = _answer_tokens(tokenizer, task)
        tic = time.perf_counter()
        for t in tokens:
            m.compute_bitmask()
            m.consume_token(t)
        mask_s.append((time.perf_counter() - tic) / len(tokens))
        tic = time.perf_counter()
        m.rollback(min(7, len(tokens)))
        rollback_s.append(time.perf_counter() - tic)
    return {"version": llguidance.__version__, "setup_s": setup, "compile_s": compile_s,
            "mask_s_per_token": mask_s, "rollback_7_s": rollback_s}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (token text -> bytes)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def measure_outlines(tokenizer, tasks) -> dict:
    import numpy as np
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decode = _byte_decoder()
    eos = tokenizer.eos_token_id
    tic = time.perf_counter()
    words: dict[bytes, list[int]] = {}
    for text, i in tokenizer._tokenizer.get_vocab().items():
        if i != eos and all(c in decode for c in text):
            words.setdefault(bytes(decode[c] for c in text), []).append(i)
    vocab = Vocabulary(eos, words)
    setup = time.perf_counter() - tic
    compile_s, mask_s, rollback_s = [], [], []
    mask = np.zeros((len(tokenizer.vocab) + 31) // 32, dtype=np.int32)
    for task in tasks:
        tic = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(task["schema"]),
                                                    r"( )?"), vocab), max_rollback=16)
        compile_s.append(time.perf_counter() - tic)
        tokens = _answer_tokens(tokenizer, task)
        tic = time.perf_counter()
        n = 0
        for t in tokens:
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            try:
                guide.advance(t, return_tokens=False)
            except ValueError:  # its regex spells the JSON otherwise: stop this task here
                break
            n += 1
        mask_s.append((time.perf_counter() - tic) / max(n, 1))
        tic = time.perf_counter()
        guide.rollback_state(min(7, n))
        rollback_s.append(time.perf_counter() - tic)
    return {"version": getattr(outlines_core, "__version__", "?"), "setup_s": setup,
            "compile_s": compile_s, "mask_s_per_token": mask_s, "rollback_7_s": rollback_s}


def summary(r: dict) -> dict:
    return {"setup_s": r["setup_s"],
            "compile_s_median": statistics.median(r["compile_s"]),
            "compile_s_max": max(r["compile_s"]),
            "mask_us_per_token_median": 1e6 * statistics.median(r["mask_s_per_token"]),
            "rollback_7_us_median": 1e6 * statistics.median(r["rollback_7_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    model, _, tokenizer = load_default()
    tasks = read_tasks()
    vocab_size = model.args.vocab_size
    results = {"machine": {"platform": platform.platform()}, "tasks": len(tasks),
               "engines": {}}
    results["engines"]["llguidance"] = measure_llguidance(tokenizer, tasks, vocab_size)
    try:
        results["engines"]["outlines-core"] = measure_outlines(tokenizer, tasks)
    except ImportError:
        print("outlines-core is not installed: pip install outlines-core to compare")
    for name, r in results["engines"].items():
        r["summary"] = summary(r)
        print(name, r["version"], json.dumps(r["summary"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
