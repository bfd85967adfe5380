"""The speculative decode loop: prefill, then draft -> verify -> accept -> rollback, streaming.

One cycle: the drafter proposes K = B-1 tokens after the anchor (the last committed token); the
target scores ``[anchor] + drafts`` in one pass; the acceptance rule keeps ``a`` drafts plus one
token of the target's own; both caches drop what was not kept. One host sync per cycle.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Generator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .accept import SamplingParams, greedy_accept, point_mass, rejection_accept, sample_first
from .drafters import check_fits
from .lookup import CopyIndex
from .prompt_cache import PairCache
from .schedule import Scheduler, bytes_per_verified_token, cached_costs
from .target import Target

DEFAULT_PREFILL_STEP = 2048
# Copy drafts (lookup.py) by default, with this window: the rule measured best on the eval
# files (scripts/copy_rule.py, docs/training.md).
COPY_DRAFTS = True
COPY_NGRAM = 2
COPY_LONGEST = 4  # copy lookups try the last 4, 3, then 2 tokens (lookup.py)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    block_size: int = 1
    peak_memory: float = 0.0  # GB
    acceptance_lengths: list[int] = field(default_factory=list)  # per cycle: accepted + 1
    draft_lengths: list[int] = field(default_factory=list)  # per cycle: drafts verified
    copy_cycles: int = 0  # cycles that verified a looked-up block instead of the drafter's
    ngram_cycles: int = 0  # of those, blocks from the drafter's n-gram table (ngram.py)
    cached_tokens: int = 0  # prompt tokens a prompt_cache already held (not prefilled)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def drafted_tokens(self) -> int:
        return sum(self.draft_lengths)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.acceptance_lengths) - len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target pass (accepted drafts + the target's own token)."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 0.0

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s | "
            f"generated {self.generation_tokens} tok @ {self.generation_tps:.1f} tok/s | "
            f"mean acceptance length {self.mean_acceptance_length:.2f} (block {self.block_size})"
            f" | peak memory {self.peak_memory:.2f} GB"
        )


@dataclass
class GenerationResponse:
    text: str  # the new text segment
    tokens: list[int]  # the new token ids
    accepted: int  # drafted tokens accepted in this cycle
    stats: GenerationStats
    finish_reason: str | None = None  # "stop" | "length" on the last response

    # mlx-lm style accessors for the run statistics.
    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self.stats.generation_tokens

    @property
    def generation_tps(self) -> float:
        return self.stats.generation_tps

    @property
    def prompt_tps(self) -> float:
        return self.stats.prompt_tps

    @property
    def mean_acceptance_length(self) -> float:
        return self.stats.mean_acceptance_length

    @property
    def peak_memory(self) -> float:
        return self.stats.peak_memory


_checked: dict[int, weakref.ref] = {}  # models whose tapped forward was checked once


def as_target(model: Any) -> Target:
    """The Target wrapper for an mlx-lm model; the forward check runs once per model object.

    Only weak references are kept, so a model that is dropped is freed.
    """
    if isinstance(model, Target):
        return model
    ref = _checked.get(id(model))
    if ref is not None and ref() is model:
        return Target(model, check=False)
    target = Target(model)
    key = id(model)
    _checked[key] = weakref.ref(model, lambda _, key=key: _checked.pop(key, None))
    return target


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | mx.array) -> list[int]:
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


def prefill(
    target: Target,
    tokens: list[int],
    cache: list[Any],
    drafter: Any,
    draft_cache: list[Any] | None,
    step: int = DEFAULT_PREFILL_STEP,
    progress: Any = None,
) -> mx.array:
    """Run the prompt through the target in chunks; feed its tap features to the drafter.

    Returns the target's logits [V] at the last prompt position.
    """
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    prompt = mx.array(tokens, dtype=mx.uint32)[None]
    n = len(tokens)
    if progress is not None:
        progress(0, n)
    for start in range(0, n, step):
        hidden, features = target.hidden_states(prompt[:, start : start + step], cache, layer_ids)
        if drafter is not None:
            drafter.commit(features, draft_cache)
        last = hidden[:, -1]
        mx.eval([c.state for c in cache] + ([c.state for c in draft_cache] if drafter else []))
        if progress is not None:
            progress(min(start + step, n), n)
    return target.lm_head(last)[0]


def block_width(drafter: Any, block_size: int | None = None, schedule: bool = True) -> int:
    """Most tokens one cycle verifies: ``block_size`` if given; else the drafter's block for the
    scheduler to choose within, or its configured ``verify_block_size`` without one."""
    if drafter is None:
        return 1
    B = block_size or (None if schedule else drafter.args.verify_block_size)
    B = B or drafter.block_size
    if hasattr(drafter, "max_drafts"):  # a fixed-width family (DSpark: g inputs, g drafts)
        B = min(B, drafter.max_drafts + 1)
    return B


def stream_generate(
    model: Any,
    drafter: Any,
    tokenizer: Any,
    prompt: str | Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    prompt_progress: Any = None,
    copy_drafts: bool = COPY_DRAFTS,
    copy_ngram: int = COPY_NGRAM,
    schedule: bool = True,
    prompt_cache: PairCache | None = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``prompt`` with speculative decoding; yields one response per cycle.

    The output equals the target's own (greedy: token for token; sampled: in distribution).
    ``drafter=None`` decodes with the target alone (one token per pass). With
    ``copy_drafts``, a cycle whose last ``copy_ngram`` tokens occurred earlier verifies the
    tokens that followed them instead of the drafter's block (see ``lookup.py``).

    ``prompt_cache`` (a :class:`~mlx_dflash.prompt_cache.PairCache` holding a proper prefix of
    the prompt, or empty) is continued from: only the rest of the prompt is prefilled
    (``stats.cached_tokens`` says how much was not). When generation ends its caches hold the
    whole sequence (with any verified tokens past a stop), named by ``prompt_cache.tokens``; if
    the generator is closed early they are cut back where that is exact, else ``tokens`` stays
    None (unusable).
    """
    params = SamplingParams(temperature, top_p, top_k)
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    target = as_target(model)
    if drafter is not None:
        check_fits(drafter, target)
    auto = drafter is not None and block_size is None and schedule
    B = block_width(drafter, block_size, schedule)
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    if B == 1:
        drafter = None  # nothing to draft
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    stop_ids = set(tokenizer.eos_token_ids)
    tokens = encode_prompt(tokenizer, prompt)
    stats = GenerationStats(prompt_tokens=len(tokens), block_size=B)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()

    def finish(reason: str) -> GenerationResponse:
        detokenizer.finalize()
        stats.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(detokenizer.last_segment, [], 0, stats, reason)

    if max_tokens == 0:
        yield finish("length")
        return

    with wired_limit(target.model, [generation_stream]), mx.stream(generation_stream):
        scheduler = None
        if auto:  # before any clock starts: the first use times the passes (then cached)
            scheduler = Scheduler(cached_costs(target, drafter, B), B - 1,
                                  bytes_per_verified_token(target))
        if prompt_cache is None:
            cache = target.make_cache()
            draft_cache = drafter.make_cache() if drafter is not None else None
        else:
            stats.cached_tokens = prompt_cache.begin(tokens, target, drafter)
            cache, draft_cache = prompt_cache.target, prompt_cache.drafter
        tic = time.perf_counter()
        last_logits = prefill(target, tokens[stats.cached_tokens :], cache, drafter, draft_cache,
                              prefill_step_size, prompt_progress)
        anchor = sample_first(last_logits, params)
        first = anchor.item()
        stats.prompt_tps = stats.prefilled_tokens / (time.perf_counter() - tic)
        tic = time.perf_counter()

        copy_index = (CopyIndex(tokens, copy_ngram, COPY_LONGEST) if copy_drafts and drafter
                      else None)
        ngram = getattr(drafter, "ngram", None) if copy_index is not None else None

        def lookup(K: int, context: int) -> tuple[list[int], bool]:
            """(a block copied from the context, else one from the n-gram table when the
            scheduler expects it to beat the drafter (without one: whenever there is one),
            whether it came from the table)."""
            copied = copy_index.lookup(K)
            if copied or ngram is None:
                return copied, False
            found, probs = ngram.draft(copy_index.tokens, K)
            n = scheduler.lookup_length(probs, K, context) if scheduler else len(found)
            return found[:n], True
        backlog: list[mx.array] = []  # committed target features the drafter has not read

        def draft_and_verify(anchor: mx.array, K: int, copied: list[int]):
            """Build (lazily) one cycle: K drafts after the anchor, one verify, acceptance."""
            draft_probs = None
            if copied:  # a point-mass proposal: exact under rejection sampling too
                drafts = mx.array(copied, dtype=mx.uint32)
                draft_probs = None if params.greedy else point_mass(drafts)
            elif K > 0:
                if backlog:  # read only when drafting: plain cycles cost the drafter nothing
                    drafter.commit(mx.concatenate(backlog, axis=1), draft_cache)
                    backlog.clear()
                # A drafter trained on blocks of size b always drafts with b inputs (its
                # attention over the MASK positions is bidirectional); we verify the first K.
                draft_block = max(B, drafter.block_size)
                drafts, draft_probs = drafter.propose(target, anchor, draft_cache, draft_block,
                                                      K, params)
            else:
                drafts = mx.zeros((0,), dtype=mx.uint32)
            # Verify: one target pass over [anchor] + drafts.
            logits, features = target.forward(mx.concatenate([anchor, drafts])[None], cache,
                                              layer_ids)
            if params.greedy:
                accepted_len, next_tokens = greedy_accept(drafts, logits[0])
            elif K > 0:
                accepted_len, next_tokens = rejection_accept(drafts, draft_probs, logits[0], params)
            else:
                accepted_len, next_tokens = mx.array(0), sample_first(logits[0, -1], params)
            packed = mx.concatenate([accepted_len.astype(mx.uint32)[None], drafts, next_tokens])
            confidence = getattr(drafter, "last_confidence", None) if K and not copied else None
            return packed, next_tokens, features, confidence

        def start_cycle(anchor: mx.array, generated: int, may_copy: bool = True):
            """Choose what to verify after ``anchor`` (a copied block, K drafts, or nothing)
            with ``generated`` tokens committed, and build the cycle."""
            K = min(B - 1, max_tokens - generated - 1)  # never draft past max_tokens
            context = len(tokens) + generated
            copied, from_table = (lookup(K, context) if copy_index is not None and may_copy
                                  else ([], False))
            if copied:
                K = len(copied)
                stats.copy_cycles += 1
                stats.ngram_cycles += from_table
            elif scheduler is not None:
                K = scheduler.choose(K, context)
            return K, copied, draft_and_verify(anchor, K, copied)

        new_tokens = [first]
        accepted = 0
        pending = None  # the next cycle, already started (after a plain cycle)
        held = list(tokens) if prompt_cache is not None else None  # what the caches hold, + anchor
        while True:
            if held is not None:
                held += new_tokens  # before the cut below: the caches hold them all the same
            # Commit this cycle's tokens up to a stop token or max_tokens.
            reason = None
            for i, tok in enumerate(new_tokens):
                if tok in stop_ids:
                    new_tokens, reason = new_tokens[:i], "stop"
                    break
            room = max_tokens - stats.generation_tokens
            if len(new_tokens) >= room and reason is None:
                new_tokens, reason = new_tokens[:room], "length"
            for tok in new_tokens:
                detokenizer.add_token(tok)
            if copy_index is not None and reason is None:
                copy_index.extend(new_tokens)
            stats.generation_tokens += len(new_tokens) + (reason == "stop")
            stats.generation_tps = stats.generation_tokens / max(time.perf_counter() - tic, 1e-9)
            if reason is not None:
                if prompt_cache is not None:
                    _settle(prompt_cache, target, drafter, held, backlog, pending, layer_ids)
                final = finish(reason)
                final.tokens, final.accepted = new_tokens, accepted
                yield final
                return

            # Start the next cycle before handing these tokens to the caller, so its compute
            # overlaps whatever the caller does with them.
            K, copied, cycle = pending or start_cycle(anchor, stats.generation_tokens)
            packed, next_tokens, features, confidence = cycle
            mx.async_eval(packed, *([confidence] if confidence is not None else []))
            pending = None
            if K == 0 and stats.generation_tokens + 1 < max_tokens and not (
                    copy_index is not None
                    and lookup(1, len(tokens) + stats.generation_tokens)[0]):
                # A plain cycle commits exactly one token, known lazily: start the next cycle
                # from it now (as mlx-lm does). Lookups wait for a synced cycle; here one is
                # skipped only when the stale suffix found nothing either.
                if drafter is not None:
                    backlog.append(features)  # its one position, read before the next draft
                pending = start_cycle(next_tokens[:1], stats.generation_tokens + 1, False)
                mx.async_eval(pending[2][0])
            try:
                yield GenerationResponse(detokenizer.last_segment, new_tokens, accepted, stats)
            except GeneratorExit:
                if prompt_cache is not None:
                    _cut_back(prompt_cache, drafter, held[:-1], backlog)
                raise

            values = packed.tolist()  # the one host sync of the cycle
            accepted = values[0]
            if scheduler is not None and not copied:
                scheduler.observe(K, accepted, None if confidence is None
                                  else confidence.tolist())  # computed with packed
            new_tokens = values[1 : 1 + accepted] + [values[1 + K + accepted]]
            target.rollback(cache, K - accepted)
            if drafter is not None and pending is None:
                backlog.append(features[:, : accepted + 1])
            anchor = next_tokens[accepted : accepted + 1]
            stats.acceptance_lengths.append(accepted + 1)
            stats.draft_lengths.append(K)
            if stats.cycles % 256 == 0:
                mx.clear_cache()


# -- leaving a prompt_cache named (used only with stream_generate(prompt_cache=...)) ----------
def _settle(
    prompt_cache: PairCache, target: Target, drafter: Any, held: list[int],
    backlog: list[mx.array], pending: Any, layer_ids: Sequence[int],
) -> None:
    """At the end of generation: run the last token through the target (the cycle started
    ahead already did: keep only that of its pass) and give the drafter the features it has not
    read, so both caches hold exactly ``held``. Lazy: evaluated while the caller reads on."""
    cache = prompt_cache.target
    if pending is not None:
        target.rollback(cache, pending[0])  # its drafts; its first position is the last token
        features = pending[2][2]
    else:
        _, features = target.hidden_states(mx.array([held[-1:]], dtype=mx.uint32), cache,
                                           layer_ids)
    if drafter is not None:
        backlog.append(features[:, :1])
        drafter.commit(mx.concatenate(backlog, axis=1), prompt_cache.drafter)
        backlog.clear()
    prompt_cache.hold(held)


def _cut_back(
    prompt_cache: PairCache, drafter: Any, held: list[int], backlog: list[mx.array]
) -> None:
    """The generator was closed mid-stream, with one or two cycles started past ``held``.
    Caches that can be cut anywhere are cut back to ``held``; others are left unnamed."""
    if backlog:
        drafter.commit(mx.concatenate(backlog, axis=1), prompt_cache.drafter)
        backlog.clear()
    if prompt_cache.trim_to(len(held)):
        prompt_cache.hold(held)


def generate(
    model: Any, drafter: Any, tokenizer: Any, prompt: str | Sequence[int] | mx.array, **kwargs
) -> str:
    """Generate and return the full text (same arguments as :func:`stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, drafter, tokenizer, prompt, **kwargs))
