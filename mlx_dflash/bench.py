"""Benchmark: speculative decoding against plain mlx-lm greedy decoding, side by side.

For every prompt the runs are interleaved (plain, then each block size), so drift in machine
load hits all variants alike. Each speculative output is also checked against the plain one.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from .drafters.base import LookupDrafts, verify_width
from .decode import stream_generate
from .prompts import read_prompts
from .target import as_target
from .tree import AUTO, TREE_MAX


def load_prompt_sets(files: list[str], limit: int | None) -> dict[str, list[str]]:
    """{domain: [prompt text]}; the domain is the file name without 'eval_' and extension."""
    sets = {}
    for f in files:
        name = Path(f).stem.removeprefix("eval_").split("_")[0]
        rows = read_prompts(f, limit=limit)
        if not rows:
            raise ValueError(f"{f}: no rows with a 'prompt', 'question' or 'turns' field")
        sets[name] = [r["prompt"] for r in rows]
    return sets


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """A user turn through the chat template (the text alone without one)."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
    return tokenizer.encode(text)


def measure_pass_costs(
    model: Any, block_size: int, drafter: Any = None, context: int = 256, reps: int = 5
) -> dict:
    """Best-of-``reps`` seconds for a 1-token and a B-token target pass (and, with a drafter, one
    drafter pass as stream_generate runs it) over a ``context``-token cache, and their ratio."""
    from .schedule import best_times, snapshot_passes

    passes = snapshot_passes(as_target(model), drafter, context, block_size, (1, block_size))
    one, block, *draft = best_times(passes, reps)  # in turn, as the scheduler's snapshot
    costs = {"decode_s": one, "verify_s": block, "ratio": block / one}
    if draft:
        costs["draft_s"] = draft[0]
    return costs


def _plain(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int,
           prompt_cache: Any = None) -> tuple[list, float]:
    """mlx-lm's greedy decoding (continuing from ``prompt_cache``, mlx-lm's layer caches,
    when given)."""
    from mlx_lm import stream_generate as mlx_stream_generate

    tic = time.perf_counter()
    tokens = [r.token for r in mlx_stream_generate(model, tokenizer, prompt,
                                                   max_tokens=max_tokens,
                                                   prompt_cache=prompt_cache)]
    elapsed = time.perf_counter() - tic
    if tokens and tokens[-1] in tokenizer.eos_token_ids:
        tokens = tokens[:-1]
    return tokens, elapsed


def _speculative(model, drafter, tokenizer, prompt, max_tokens, options):
    tic = time.perf_counter()
    tokens, last = [], None
    for last in stream_generate(model, drafter, tokenizer, prompt, max_tokens=max_tokens,
                                **options):
        tokens += last.tokens
    return tokens, time.perf_counter() - tic, last.stats


def run_bench(
    model: Any,
    drafter: Any,
    tokenizer: Any,
    prompt_sets: dict[str, list[str]],
    block_sizes: list[int],
    max_tokens: int = 128,
    progress: bool = True,
    copy_drafts: bool = False,
    auto: bool = True,
    trees: Sequence[int | str] = (),
) -> dict:
    """Per domain: plain decoding, then the drafter at each fixed block size (and with copy
    drafts when asked: variant "B+copy"), trees of each size in ``trees`` (variant "treeN",
    no copy drafts; "auto": variant "tree-auto", sized per cycle, copy drafts on), and the
    default settings (variant "auto": the scheduler, copy drafts as
    the package default), interleaved prompt by prompt."""
    from tqdm import tqdm

    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "mlx": mx.__version__},
        "settings": {"max_tokens": max_tokens, "block_sizes": block_sizes, "greedy": True,
                     "copy_drafts": copy_drafts,
                     "dtype": str(model.model.embed_tokens.weight.dtype)},
        "domains": {},
    }
    try:
        from . import _blas

        provider = _blas.sgemm_provider()  # the library's file name, not where it lies
        results["machine"]["blas"] = Path(provider).name if provider else "default"
    except Exception:  # noqa: BLE001 - informational only
        pass
    fixed_trees = [n for n in trees if n != AUTO]
    cost = {B: measure_pass_costs(model, B) for B in [*block_sizes,
                                                      *(n + 1 for n in fixed_trees)]}
    results["verify_decode_cost"] = {str(B): c for B, c in cost.items()}
    results["settings"]["trees"] = list(trees)
    variants = {str(B): (B, {"block_size": B, "copy_drafts": False}) for B in block_sizes}
    variants.update({f"tree{n}": (n + 1, {"tree": n, "copy_drafts": False})
                     for n in fixed_trees})
    if AUTO in trees:  # sized per cycle, with the package's defaults otherwise (as "auto")
        variants["tree-auto"] = (TREE_MAX + 1, {"tree": AUTO})
    if copy_drafts:
        variants.update({f"{B}+copy": (B, {"block_size": B, "copy_drafts": True})
                         for B in block_sizes})
    if auto:
        variants["auto"] = (verify_width(drafter) if isinstance(drafter, LookupDrafts)
                            else drafter.max_drafts + 1, {})
    total = sum(len(p) for p in prompt_sets.values()) * (1 + len(variants))
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    for domain, prompts in prompt_sets.items():
        plain_tokens, plain_time = 0, 0.0
        spec = {name: {"tokens": 0, "time": 0.0, "acc": [], "pos_hits": [0] * (B - 1),
                       "pos_tries": [0] * (B - 1), "mismatches": 0, "copy_cycles": 0,
                       "ngram_cycles": 0, "branched_cycles": 0, "drafted": 0}
                for name, (B, _) in variants.items()}
        for text in prompts:
            prompt = chat_prompt(tokenizer, text)
            ref, elapsed = _plain(model, tokenizer, prompt, max_tokens)
            plain_tokens += len(ref)
            plain_time += elapsed
            bar.update(1)
            for name, (_, options) in variants.items():
                out, elapsed, stats = _speculative(model, drafter, tokenizer, prompt,
                                                   max_tokens, options)
                s = spec[name]
                s["copy_cycles"] += stats.copy_cycles
                s["ngram_cycles"] += stats.ngram_cycles
                s["branched_cycles"] += stats.branched_cycles
                s["tokens"] += len(out)
                s["time"] += elapsed
                s["acc"] += stats.acceptance_lengths
                s["drafted"] += stats.drafted_tokens
                s["mismatches"] += int(out != ref)
                for a, k in zip(stats.acceptance_lengths, stats.draft_lengths):
                    for pos in range(min(k, len(s["pos_tries"]))):  # a tree: by depth
                        s["pos_tries"][pos] += 1
                        s["pos_hits"][pos] += int(a - 1 > pos)
                bar.update(1)
        plain_tps = plain_tokens / plain_time
        entry = {"prompts": len(prompts), "plain": {"tokens": plain_tokens,
                                                     "seconds": plain_time,
                                                     "tokens_per_s": plain_tps},
                 "speculative": {}}
        for name, s in spec.items():
            B = variants[name][0]
            tps = s["tokens"] / s["time"]
            entry["speculative"][name] = {
                "tokens": s["tokens"],
                "seconds": s["time"],
                "tokens_per_s": tps,
                "speedup": tps / plain_tps,
                "mean_acceptance_length": sum(s["acc"]) / max(len(s["acc"]), 1),
                "drafted_per_cycle": s["drafted"] / max(len(s["acc"]), 1),
                "acceptance_by_position": [h / t if t else None
                                           for h, t in zip(s["pos_hits"], s["pos_tries"])],
                "verify_decode_ratio": cost[B]["ratio"] if B in cost and name[-4:] != "auto"
                else None,
                "outputs_differing_from_plain": s["mismatches"],
                "copy_cycle_share": s["copy_cycles"] / max(len(s["acc"]), 1),  # n-gram too
                "ngram_cycle_share": s["ngram_cycles"] / max(len(s["acc"]), 1),
                # copies verified with their other continuations as branches (trees on)
                "branched_cycle_share": s["branched_cycles"] / max(len(s["acc"]), 1),
            }
        results["domains"][domain] = entry
    bar.close()
    return results


def format_table(results: dict) -> str:
    """The results as a Markdown table (one row per domain and variant)."""
    lines = ["| domain | prompts | variant | tok/s | speedup | mean acceptance length | "
             "verify/decode cost | outputs equal to plain |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for domain, e in results["domains"].items():
        lines.append(f"| {domain} | {e['prompts']} | plain mlx-lm | "
                     f"{e['plain']['tokens_per_s']:.1f} | 1.00x | 1.00 | 1.00 | - |")
        for B, s in e["speculative"].items():
            same = e["prompts"] - s["outputs_differing_from_plain"]
            ratio = s.get("verify_decode_ratio")
            label = B if B == "auto" or B.startswith("tree") else f"B={B}"
            lines.append(
                f"| {domain} | {e['prompts']} | {label} | "
                f"{s['tokens_per_s']:.1f} | {s['speedup']:.2f}x | "
                f"{s['mean_acceptance_length']:.2f} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | {same}/{e['prompts']} |")
    return "\n".join(lines)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _arrivals(n: int, gap: float) -> list[float]:
    """When each of a group's ``n`` requests arrives, in seconds from the group's start."""
    return [i * gap for i in range(n)]


def _serve(submit: Callable[[list[int]], Any], step: Callable[[], list[tuple[Any, list[int],
           bool]]], prompts: list[list[int]], gap: float) -> tuple[list[list[int]], float, dict]:
    """Drive a batching generator over prompts arriving ``gap`` seconds apart: submit each
    when it arrives, step while any runs. ``step`` returns (id, new tokens, finished) triples.
    Returns (tokens of each, wall seconds, each request's first-token and finish times from
    its arrival)."""
    arrive = _arrivals(len(prompts), gap)
    ids: list[Any] = []
    out: dict[Any, list[int]] = {}
    first: dict[Any, float] = {}
    finish: dict[Any, float] = {}
    tic = time.perf_counter()
    while len(finish) < len(prompts):
        now = time.perf_counter() - tic
        while len(ids) < len(prompts) and arrive[len(ids)] <= now:
            ids.append(submit(prompts[len(ids)]))
            out[ids[-1]] = []
        if len(ids) == len(finish):  # all that arrived are done: wait for the next one
            time.sleep(max(0.0, arrive[len(ids)] - now))
            continue
        for rid, tokens, done in step():
            at = time.perf_counter() - tic - arrive[ids.index(rid)]
            out[rid] += tokens
            first.setdefault(rid, at)
            if done:
                finish[rid] = at
    return [out[i] for i in ids], time.perf_counter() - tic, {
        "ttft": [first[i] for i in ids], "latency": [finish[i] for i in ids]}


def _engine_run(model: Any, drafter: Any, tokenizer: Any, prompts: list[list[int]],
                max_tokens: int, gap: float = 0.0, **options: Any
                ) -> tuple[list[list[int]], float, dict]:
    """Our batch engine on prompts arriving ``gap`` seconds apart (see ``_serve``)."""
    from .batch import BatchEngine

    engine = BatchEngine(model, drafter, tokenizer, max_batch=len(prompts), **options)
    return _serve(lambda p: engine.submit(p, max_tokens=max_tokens),
                  lambda: [(i, r.tokens, r.finish_reason is not None) for i, r in engine.step()],
                  prompts, gap)


def _mlx_lm_run(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                gap: float = 0.0) -> tuple[list[list[int]], float, dict]:
    """mlx-lm's ``BatchGenerator`` (plain batched decoding) on the same arrivals; tokens as
    ``mlx_lm.batch_generate`` returns them (the stop token left out)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    try:
        return _serve(lambda p: gen.insert([p], [max_tokens])[0],
                      lambda: [(r.uid, [r.token] if r.finish_reason != "stop" else [],
                                r.finish_reason is not None) for r in gen.next_generated()],
                      prompts, gap)
    finally:
        gen.close()


def run_batch_bench(
    model: Any, drafter: Any, tokenizer: Any, prompt_sets: dict[str, list[str]],
    concurrency: list[int], max_tokens: int = 96, block_size: int = 4, progress: bool = True,
    stagger: float = 0.0, trees: Sequence[int | str] = (),
) -> dict:
    """Per domain and concurrency c: the prompts in groups of c, arriving together (or
    ``stagger`` seconds apart), each group run by mlx-lm's ``BatchGenerator`` (plain batched
    decoding), our batch engine with the default settings ("auto") and with a fixed block
    ("B=block_size"), and our single-request path one request after another ("one by one");
    with ``trees``, the engine with tree drafts too ("tree-auto": the default settings with
    tree="auto"; "treeN": N nodes per drafting request); interleaved group by group.
    Greedy. Latency and time to first token count from each request's arrival."""
    from tqdm import tqdm

    def one_by_one(group: list[list[int]]) -> tuple[list[list[int]], float, dict]:
        arrive = _arrivals(len(group), stagger)
        tic, outs, first, finish = time.perf_counter(), [], [], []
        for prompt, at in zip(group, arrive):
            time.sleep(max(0.0, at - (time.perf_counter() - tic)))
            tokens = []
            for r in stream_generate(model, drafter, tokenizer, prompt, max_tokens=max_tokens):
                if not tokens:
                    first.append(time.perf_counter() - tic - at)
                tokens += r.tokens
            finish.append(time.perf_counter() - tic - at)
            outs.append(tokens)
        return outs, time.perf_counter() - tic, {"ttft": first, "latency": finish}

    variants = {"mlx-lm batched plain": lambda g: _mlx_lm_run(model, tokenizer, g, max_tokens,
                                                              stagger),
                "auto": lambda g: _engine_run(model, drafter, tokenizer, g, max_tokens,
                                              stagger),
                f"B={block_size}": lambda g: _engine_run(model, drafter, tokenizer, g,
                                                         max_tokens, stagger,
                                                         block_size=block_size),
                "one by one": one_by_one}
    for n in trees:
        variants["tree-auto" if n == AUTO else f"tree{n}"] = (
            lambda g, n=n: _engine_run(model, drafter, tokenizer, g, max_tokens, stagger,
                                       tree=n))
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "mlx": mx.__version__},
        "settings": {"max_tokens": max_tokens, "concurrency": concurrency, "greedy": True,
                     "block_size": block_size, "trees": list(trees),
                     "arrivals": f"{stagger:g} s apart" if stagger else "together"},
        "domains": {},
    }
    from .batch import BatchEngine

    BatchEngine(model, drafter, tokenizer)  # the first one times the passes: before any clock
    if AUTO in trees:  # its passes are timed as wide as its trees
        BatchEngine(model, drafter, tokenizer, tree=AUTO)
    total = sum(len(p) // c for p in prompt_sets.values() for c in concurrency)
    bar = tqdm(total=total * len(variants), desc="batch bench", unit="run",
               disable=not progress)
    for domain, texts in prompt_sets.items():
        prompts = [chat_prompt(tokenizer, t) for t in texts]
        entry = results["domains"][domain] = {}
        for c in concurrency:
            groups = [prompts[i : i + c] for i in range(0, len(prompts) - c + 1, c)]
            rows = {name: {"tokens": 0, "seconds": 0.0, "ttft": [], "latency": [],
                           "differing": 0} for name in variants}
            for group in groups:
                ref = None
                for name, run in variants.items():
                    outs, seconds, times = run(group)
                    ref = ref or outs  # mlx-lm's, the first variant run
                    row = rows[name]
                    row["tokens"] += sum(len(t) for t in outs)
                    row["seconds"] += seconds
                    row["ttft"] += times["ttft"]
                    row["latency"] += times["latency"]
                    row["differing"] += sum(o != r for o, r in zip(outs, ref))
                    bar.update(1)
            plain_tps = rows["mlx-lm batched plain"]["tokens"] / rows["mlx-lm batched plain"][
                "seconds"]
            entry[str(c)] = {name: {
                "requests": len(groups) * c, "tokens": row["tokens"], "seconds": row["seconds"],
                "tokens_per_s": row["tokens"] / row["seconds"],
                "speedup": row["tokens"] / row["seconds"] / plain_tps,
                "ttft_mean_s": sum(row["ttft"]) / len(row["ttft"]) if row["ttft"] else None,
                "latency_p50_s": _percentile(row["latency"], 0.5) if row["latency"] else None,
                "latency_p95_s": _percentile(row["latency"], 0.95) if row["latency"] else None,
                "outputs_differing_from_mlx_lm": row["differing"],
            } for name, row in rows.items()}
    bar.close()
    return results


def format_batch_table(results: dict) -> str:
    """The batch bench as a Markdown table (one row per domain, concurrency and variant)."""
    lines = ["| domain | concurrency | variant | aggregate tok/s | vs mlx-lm batched | "
             "p50 / p95 latency (s) | outputs equal to mlx-lm |",
             "|---|---:|---|---:|---:|---|---:|"]
    for domain, by_c in results["domains"].items():
        for c, variants in by_c.items():
            for name, v in variants.items():
                lat = ("-" if v["latency_p50_s"] is None
                       else f"{v['latency_p50_s']:.1f} / {v['latency_p95_s']:.1f}")
                n = v["requests"]
                same = ("-" if name == "mlx-lm batched plain"
                        else f"{n - v['outputs_differing_from_mlx_lm']}/{n}")
                lines.append(f"| {domain} | {c} | {name} | {v['tokens_per_s']:.1f} | "
                             f"{v['speedup']:.2f}x | {lat} | {same} |")
    return "\n".join(lines)
