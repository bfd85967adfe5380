"""Benchmark at long contexts: speculative decoding against plain decoding, prompts of 1k-32k
tokens made of real text.

Two kinds of prompt, as agents and long chats send them: ``code`` (a Python standard-library
module's source, cut to length, then a question about it) and ``chat`` (a multi-turn chat of
earlier questions and answers from a prompt file, then a new question). Each prompt is
prefilled once; every variant continues from a copy of that cache, so the figures compare
decoding alone (on a CPU a 16k prefill takes minutes). Prefill speed is measured on its own
against mlx-lm's. Greedy; every output is checked against plain decoding's.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from . import attention
from .bench import _engine_run, _percentile, _plain, _speculative
from .cycle import prefill
from .drafters.base import verify_width
from .pair_cache import PairCache
from .prefix_cache import PrefixCache
from .schedule import best_times, cached_batch_costs, cached_costs, snapshot_passes
from .target import as_target

# Standard-library modules whose sources make the code prompts (large, plain Python).
CODE_MODULES = ("argparse", "difflib", "inspect", "typing", "pathlib", "tarfile", "textwrap",
                "dataclasses", "zipfile", "logging.__init__", "json.decoder", "shutil")
CODE_QUESTIONS = (
    "Explain what the last function above does, step by step, and write one unit test for it.",
    "Summarise how the code above is organised: its main classes and what each is for.",
    "Find a function above that could fail on unusual input, say why, and show a fix.",
    "Write a short docstring for each of the last three functions above.",
)


def _module_source(name: str) -> tuple[str, str]:
    """(module name, source text) of a standard-library module."""
    path = importlib.util.find_spec(name.removesuffix(".__init__")).origin
    return name.removesuffix(".__init__"), Path(path).read_text(encoding="utf-8")


def _template(tokenizer: Any, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def code_prompt(tokenizer: Any, length: int, index: int, question: int | None = None
                ) -> list[int]:
    """About ``length`` tokens: module sources (from the ``index``-th on) cut at a line, then a
    question about them (the ``question``-th; default the ``index``-th)."""
    question = CODE_QUESTIONS[(index if question is None else question) % len(CODE_QUESTIONS)]
    room = length - len(_template(tokenizer, [{"role": "user", "content": question}])) - 8
    lines: list[str] = []
    used = 0
    for i in range(len(CODE_MODULES)):
        name, source = _module_source(CODE_MODULES[(index + i) % len(CODE_MODULES)])
        lines.append(f"# file: {name.replace('.', '/')}.py")
        for line in source.splitlines():
            cost = len(tokenizer.encode(line + "\n", add_special_tokens=False))
            if used + cost > room:
                break
            lines.append(line)
            used += cost
        else:
            continue
        break
    text = "```python\n" + "\n".join(lines) + "\n```\n\n" + question
    return _template(tokenizer, [{"role": "user", "content": text}])


def chat_prompt(tokenizer: Any, length: int, index: int, turns: Sequence[tuple[str, str]],
                questions: Sequence[str], question: int | None = None) -> list[int]:
    """About ``length`` tokens: earlier (question, answer) turns from ``turns`` (from the
    ``index``-th on, as many as fit), then a new question (the ``question``-th; default the
    ``index``-th)."""
    last = {"role": "user", "content": questions[(index if question is None else question)
                                                 % len(questions)]}
    messages: list[dict] = []
    start = (index * 97) % len(turns)
    used = len(_template(tokenizer, [last]))
    for i in range(len(turns)):
        if used > length - 64:
            break
        q, a = turns[(start + i) % len(turns)]
        more = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        n = len(_template(tokenizer, messages + more + [last]))
        if n <= length:  # else a shorter pair may still fit
            messages, used = messages + more, n
    return _template(tokenizer, messages + [last])


def read_turns(path: str | Path) -> list[tuple[str, str]]:
    """(question, answer) pairs of a JSON Lines file with both fields (e.g. GSM8K)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    turns = [(r["question"], r["answer"]) for r in rows
             if isinstance(r, dict) and r.get("question") and r.get("answer")]
    if not turns:
        raise ValueError(f"{path}: no rows with both a 'question' and an 'answer' (the chat "
                         "prompts' earlier turns)")
    return turns


def prefilled(model: Any, drafter: Any, tokens: list[int], base: PairCache | None = None
              ) -> tuple[PairCache, int, float]:
    """The pair holding all of ``tokens`` but the last (target and drafter context), continued
    from what ``base`` holds of them; the tokens prefilled and the seconds that took."""
    target = as_target(model)
    pair = PairCache()
    if base is not None:
        shared = next((i for i, (a, b) in enumerate(zip(base.tokens, tokens)) if a != b),
                      min(len(base.tokens), len(tokens)))
        pair = base.fork(keep=min(shared, len(tokens) - 2))
    done = pair.begin(tokens, target, drafter)
    tic = time.perf_counter()
    prefill(target, tokens[done:-1], pair.target, drafter, pair.drafter)
    mx.eval([c.state for c in pair.layers])
    seconds = time.perf_counter() - tic
    pair.hold(tokens[:-1])
    return pair, len(tokens) - 1 - done, seconds


def mlx_lm_prefill_tps(model: Any, tokenizer: Any, tokens: list[int]) -> float:
    """mlx-lm's own prompt tokens per second on ``tokens``."""
    from mlx_lm import stream_generate as mlx_stream_generate

    for r in mlx_stream_generate(model, tokenizer, tokens, max_tokens=1):
        return r.prompt_tps
    return 0.0


def _batched(model: Any, drafter: Any, tokenizer: Any, prompts: list[list[int]],
             pairs: list[PairCache], max_tokens: int) -> tuple[list[list[int]], float, list]:
    """Our batch engine on ``prompts`` arriving together, each continuing from a copy of its
    prefilled pair (``drafter`` None: plain batched decoding): (outputs, seconds, latencies)."""
    store = PrefixCache(1 << 62)
    for pair in pairs:
        store.insert(pair.fork())
    outs, seconds, times = _engine_run(model, drafter, tokenizer, prompts, max_tokens,
                                       prefix_cache=store)
    return outs, seconds, times["latency"]


def pass_costs(model: Any, drafter: Any, context: int, width: int, windows: Sequence[int],
               reps: int = 3) -> dict:
    """Seconds of a 1-token and a ``width``-token target pass and of a drafter pass over a
    ``context``-token cache, the drafter with each of ``windows`` too (0: all the context),
    timed in turn; the drafter's share of a cycle (draft / (draft + verify))."""
    target = as_target(model)
    saved = drafter.args.context_window

    def with_window(fn: Any, window: int | None) -> Any:
        def run() -> None:  # the drafter reads its window when it runs
            drafter.args.context_window = window
            try:
                fn()
            finally:
                drafter.args.context_window = saved
        return run

    one, block, draft = snapshot_passes(target, drafter, context, width, (1, width))
    draft_passes = [with_window(draft, w or None) for w in windows]
    times = best_times([one, block, draft, *draft_passes], reps)
    one, block = times[:2]
    row = {"decode_s": one, "verify_s": block, "verify_decode_ratio": block / one,
           "draft_s": times[2], "drafter_share": times[2] / (times[2] + block)}
    for w, t in zip(windows, times[3:]):
        row[f"draft_s_window{w}"] = t
        row[f"drafter_share_window{w}"] = t / (t + block)
    return row


def run_context_bench(model: Any, drafter: Any, tokenizer: Any, lengths: Sequence[int], *,
                      turns: Sequence[tuple[str, str]], questions: Sequence[str],
                      prompts: int = 2, max_tokens: int = 128, concurrency: Sequence[int] = (),
                      windows: Sequence[int] = (), kinds: Sequence[str] = ("code", "chat"),
                      compare_prefill: bool = True, shared_context: bool = False,
                      progress: bool = True) -> dict:
    """Per context length and kind: plain mlx-lm decoding, our default settings ("auto") and
    the same with the drafter's context window at each of ``windows``, on ``prompts`` prompts
    interleaved; with ``concurrency`` c, groups of c prompts through our batch engine with and
    without the drafter. Pass costs at each length; the first prompt's prefill tokens/s, ours
    and (with ``compare_prefill``: one more prefill of it) mlx-lm's. With
    ``shared_context`` a kind's prompts share their long part (one source text or chat
    history, prefilled once) and differ in the last question, as an agent's requests do."""
    from . import _blas

    width = verify_width(drafter)  # what stream_generate and the batch engine time
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "mlx": mx.__version__,
                    "blas": Path(_blas.sgemm_provider() or "default").name},
        "settings": {"max_tokens": max_tokens, "lengths": list(lengths), "prompts": prompts,
                     "concurrency": list(concurrency), "windows": list(windows),
                     "shared_context": shared_context,
                     "greedy": True, "dtype": str(model.model.embed_tokens.weight.dtype)},
        "lengths": {},
    }
    variants = {"auto": None, **{f"auto+window{w}": w for w in windows}}
    saved = drafter.args.context_window
    target = as_target(model)
    reach = max(lengths) + max_tokens
    for w in variants.values():  # the scheduler's pass costs: timed before any clock
        drafter.args.context_window = w or saved
        cached_costs(target, drafter, width, reach)
        if concurrency:
            cached_batch_costs(target, drafter, width, reach)
    drafter.args.context_window = saved
    for length in lengths:
        entry = results["lengths"][str(length)] = {
            "pass_costs": pass_costs(model, drafter, length, width, windows)}
        for kind in kinds:
            n = max(prompts, *concurrency) if concurrency else prompts
            sources = [0 if shared_context else i for i in range(n)]  # the long part's
            toks = [code_prompt(tokenizer, length, s, i) if kind == "code" else
                    chat_prompt(tokenizer, length, s, turns, questions, i)
                    for i, s in enumerate(sources)]
            pairs, prefill_n, prefill_s = [], [], []
            for t in toks:
                pair, done, s = prefilled(model, drafter, t, pairs[0] if shared_context and pairs
                                          else None)
                pairs.append(pair)
                prefill_n.append(done)
                prefill_s.append(s)
                if progress:
                    print(f"[{kind} {length}] prefilled {done} of {len(t)} tokens in {s:.1f} s",
                          flush=True)
            row: dict[str, Any] = {
                "prompt_tokens_mean": sum(map(len, toks)) / len(toks),
                "prefill_tps": prefill_n[0] / prefill_s[0],
                "prefilled_tokens": prefill_n,
                "mlx_lm_prefill_tps": (mlx_lm_prefill_tps(model, tokenizer, toks[0])
                                       if compare_prefill else None),
            }
            plain = {"tokens": 0, "seconds": 0.0}
            # mlx-lm's decoding with the attention our target passes use on the CPU
            # (attention.py): the speedup that is speculation's alone.
            same = {"tokens": 0, "seconds": 0.0, "differing": 0}
            spec = {v: {"tokens": 0, "seconds": 0.0, "acc": [], "differing": 0} for v in variants}
            for t, pair in list(zip(toks, pairs))[:prompts]:
                ref, s = _plain(model, tokenizer, t[-1:], max_tokens, list(pair.fork().target))
                plain["tokens"] += len(ref)
                plain["seconds"] += s
                if attention.enabled():
                    with attention.on_cpu():
                        out, s = _plain(model, tokenizer, t[-1:], max_tokens,
                                        list(pair.fork().target))
                    same["tokens"] += len(out)
                    same["seconds"] += s
                    same["differing"] += int(out != ref)
                for name, w in variants.items():
                    drafter.args.context_window = w or saved
                    out, s, stats = _speculative(model, drafter, tokenizer, t, max_tokens,
                                                 {"prompt_cache": pair.fork()})
                    drafter.args.context_window = saved
                    v = spec[name]
                    v["tokens"] += len(out)
                    v["seconds"] += s
                    v["acc"] += stats.acceptance_lengths
                    v["differing"] += int(out != ref)
                if progress:
                    print(f"[{kind} {length}] prompt done: plain {plain['tokens']} tokens in "
                          f"{plain['seconds']:.1f} s so far", flush=True)
            plain_tps = plain["tokens"] / plain["seconds"]
            row["plain"] = {**plain, "tokens_per_s": plain_tps}
            same_tps = same["tokens"] / same["seconds"] if same["seconds"] else None
            if same_tps:
                row["plain_same_attention"] = {**same, "tokens_per_s": same_tps}
            row["speculative"] = {name: {
                "tokens": v["tokens"], "seconds": v["seconds"],
                "tokens_per_s": v["tokens"] / v["seconds"],
                "speedup": v["tokens"] / v["seconds"] / plain_tps,
                "speedup_vs_same_attention": (v["tokens"] / v["seconds"] / same_tps
                                              if same_tps else None),
                "mean_acceptance_length": sum(v["acc"]) / max(len(v["acc"]), 1),
                "outputs_differing_from_plain": v["differing"]} for name, v in spec.items()}
            for c in concurrency:
                row[f"concurrency{c}"] = _batched_row(model, drafter, tokenizer, toks[:c],
                                                      pairs[:c], max_tokens)
            entry[kind] = row
            del pairs
    return results


def _batched_row(model: Any, drafter: Any, tokenizer: Any, prompts: list[list[int]],
                 pairs: list[PairCache], max_tokens: int) -> dict:
    """One group through the batch engine, without and with the drafter."""
    plain_out, plain_s, plain_lat = _batched(model, None, tokenizer, prompts, pairs, max_tokens)
    out, s, lat = _batched(model, drafter, tokenizer, prompts, pairs, max_tokens)
    plain_tps = sum(map(len, plain_out)) / plain_s
    tps = sum(map(len, out)) / s
    return {"requests": len(prompts),
            "plain_batched_tokens_per_s": plain_tps, "tokens_per_s": tps,
            "speedup": tps / plain_tps, "latency_p50_s": _percentile(lat, 0.5),
            "plain_latency_p50_s": _percentile(plain_lat, 0.5),
            "outputs_differing_from_plain": sum(o != r for o, r in zip(out, plain_out))}


def format_context_table(results: dict) -> str:
    """The long-context bench as a Markdown table (one row per length, kind and variant)."""
    lines = ["| context | kind | variant | tok/s | vs plain (vs plain with our CPU attention) | "
             "mean acceptance length | "
             "outputs equal to plain |", "|---:|---|---|---:|---:|---:|---:|"]
    n = results["settings"]["prompts"]
    for entry in results["lengths"].values():
        for kind, row in entry.items():
            if kind == "pass_costs":
                continue
            ctx = f"{row['prompt_tokens_mean']:.0f}"
            lines.append(f"| {ctx} | {kind} | plain mlx-lm | {row['plain']['tokens_per_s']:.2f}"
                         f" | 1.00x | 1.00 | - |")
            same = row.get("plain_same_attention")
            if same:
                lines.append(f"| {ctx} | {kind} | plain mlx-lm, our CPU attention | "
                             f"{same['tokens_per_s']:.2f} | "
                             f"{same['tokens_per_s'] / row['plain']['tokens_per_s']:.2f}x | 1.00 |"
                             f" {n - same['differing']}/{n} |")
            for name, v in row["speculative"].items():
                versus = (f"{v['speedup']:.2f}x" if not v.get("speedup_vs_same_attention")
                          else f"{v['speedup']:.2f}x ({v['speedup_vs_same_attention']:.2f}x)")
                lines.append(f"| {ctx} | {kind} | {name} | {v['tokens_per_s']:.2f} | "
                             f"{versus} | {v['mean_acceptance_length']:.2f} | "
                             f"{n - v['outputs_differing_from_plain']}/{n} |")
            for key, b in row.items():
                if key.startswith("concurrency"):
                    c = b["requests"]
                    lines.append(f"| {ctx} | {kind} | {c} at once: auto vs batched plain | "
                                 f"{b['tokens_per_s']:.2f} | {b['speedup']:.2f}x | - | "
                                 f"{c - b['outputs_differing_from_plain']}/{c} |")
    return "\n".join(lines)
