"""Generation entry points: the speculative decode loop, streaming, and through a prefix store.

After the prefill, every cycle verifies a block after the anchor (the last committed token): what
it verifies is the block policy's choice (``policy.py``), the cycle itself is built and synced
in ``cycle.py``, and the loop below commits its tokens up to a stop or ``max_tokens``. The output
equals the target's own (greedy: token for token; sampled: in distribution).
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .accept import SamplingParams, sample_first, seeded
from .grammar import FORCED_REACH, Grammar, Matcher
from .cycle import (
    COPY,
    DEFAULT_PREFILL_STEP,
    DRAFTER,
    NGRAM,
    TARGET,
    TREE,
    Cycle,
    Speculator,
    TreeCycle,
    prefill,
)
from .drafters import check_fits
from .drafters.base import Drafter, drafting, verify_width
from .drafters.published import describe
from .pair_cache import PairCache, needs_checkpoints
from .policy import COPY_DRAFTS, COPY_NGRAM, BlockPolicy
from .prefix_cache import PrefixCache
from .prompts import encode_prompt
from .tree import AUTO, TREE_MAX, DraftTree
from .target import Target, as_target


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
    tree_cycles: int = 0  # cycles that verified a tree of drafts (tree.py)
    branched_cycles: int = 0  # lookup cycles that verified several continuations as a tree
    cached_tokens: int = 0  # prompt tokens a prompt_cache already held (not prefilled)
    forced_tokens: int = 0  # committed tokens a grammar admitted alone (grammar.py)
    # source (drafter, copy, ngram, tree) -> [tokens verified after the anchor, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    drafter: str = ""  # what drafted (drafters.published.describe)

    def record(self, cycle: Cycle, accepted: int) -> None:
        self.acceptance_lengths.append(accepted + 1)
        self.draft_lengths.append(cycle.num_drafts)
        self.copy_cycles += cycle.looked_up
        self.ngram_cycles += cycle.source == NGRAM
        self.tree_cycles += cycle.source == TREE
        self.branched_cycles += cycle.looked_up and isinstance(cycle, TreeCycle)
        self.forced_tokens += sum(cycle.forced[:accepted])
        if cycle.num_drafts:
            counts = self.by_source.setdefault(cycle.source, [0, 0])
            counts[0] += cycle.num_drafts
            counts[1] += accepted

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
            + (f" | drafter: {self.drafter}" if self.drafter else "")
        )


@dataclass
class GenerationResponse:
    text: str  # the new text segment
    tokens: list[int]  # the new token ids
    accepted: int  # drafted tokens accepted in this cycle
    stats: GenerationStats
    finish_reason: str | None = None  # "stop" | "length" on the last response
    # ``text`` in runs of (how its tokens came: a draft source, "forced" or "target", text)
    pieces: list[tuple[str, str]] = field(default_factory=list)

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


class TextStream:
    """The text side of one generation: stop tokens, ``max_tokens``, detokenizing, counts."""

    def __init__(self, tokenizer: TokenizerWrapper, stats: GenerationStats, max_tokens: int,
                 own_detokenizer: bool = False):
        self.stop_ids = set(tokenizer.eos_token_ids)
        # The wrapper's detokenizer is shared: a generation running beside others needs a copy.
        self.detokenizer = tokenizer.detokenizer
        if own_detokenizer:
            self.detokenizer = copy.copy(self.detokenizer)
        self.detokenizer.reset()
        self.stats, self.max_tokens = stats, max_tokens
        self.pieces: list[tuple[str, str]] = []  # the last commit's text, by origin
        self.tic = time.perf_counter()

    def commit(self, tokens: list[int], origins: list[str] | None = None
               ) -> tuple[list[int], str | None]:
        """The tokens up to a stop token or ``max_tokens``, and why generation ends (or None).
        ``origins``: how each token came (Cycle.origins; None: all the target's)."""
        reason = None
        for i, tok in enumerate(tokens):
            if tok in self.stop_ids:
                tokens, reason = tokens[:i], "stop"
                break
        room = self.max_tokens - self.stats.generation_tokens
        if len(tokens) >= room and reason is None:
            tokens, reason = tokens[:room], "length"
        self.pieces = []
        runs = itertools.groupby(zip(origins or [TARGET] * len(tokens), tokens), itemgetter(0))
        for origin, run in runs:  # the text of each run of tokens of one origin
            for _, tok in run:
                self.detokenizer.add_token(tok)
            self.pieces.append((origin, self.detokenizer.last_segment))
        stats = self.stats
        stats.generation_tokens += len(tokens) + (reason == "stop")
        stats.generation_tps = stats.generation_tokens / max(time.perf_counter() - self.tic, 1e-9)
        return tokens, reason

    def response(self, tokens: list[int], accepted: int,
                 reason: str | None = None) -> GenerationResponse:
        pieces = [p for p in self.pieces if p[1]]
        if reason is not None:
            self.detokenizer.finalize()
            self.stats.peak_memory = mx.get_peak_memory() / 1e9
            if tail := self.detokenizer.last_segment:
                pieces.append((pieces[-1][0] if pieces else TARGET, tail))
        return GenerationResponse("".join(text for _, text in pieces), tokens, accepted,
                                  self.stats, reason, pieces)


def _check_request(model: Any, drafter: Drafter | None, tokenizer: Any, max_tokens: int,
                   block_size: int | None, schedule: bool):
    """(target, drafter or None when nothing is drafted, tokenizer wrapper, verify width),
    after checking the arguments and that the drafter fits the target."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    target = as_target(model)
    if drafter is not None:
        check_fits(drafter, target)
    width = verify_width(drafter, block_size, schedule)
    if width < 1:
        raise ValueError(f"block_size must be >= 1, got {width}")
    return target, drafting(drafter, block_size, schedule), tokenizer, width


def check_tree(target: Target, drafter: Drafter | None, size: int | str) -> None:
    if size != AUTO and (not isinstance(size, int) or size < 1):
        raise ValueError(f"tree must be a number of drafted nodes (>= 1) or 'auto', got {size!r}")
    if drafter is None or not hasattr(drafter, "grow_tree"):
        raise ValueError("tree drafts need a drafter that grows trees (DFlash, DFlash 2 or "
                         "DSpark)")
    reason = target.why_no_trees()
    if reason is not None:
        raise ValueError(f"tree drafts need a target that takes tree passes; model type "
                         f"'{target.model_type}': {reason}")


def stream_generate(
    model: Any,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: str | Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    block_size: int | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    prompt_progress: Any = None,
    copy_drafts: bool = COPY_DRAFTS,
    copy_ngram: int = COPY_NGRAM,
    schedule: bool = True,
    prompt_cache: PairCache | None = None,
    tree: int | str | None = None,
    grammar: Grammar | None = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``prompt`` with speculative decoding; yields one response per cycle.

    ``drafter=None``: the target alone. ``seed``: sampled tokens are a function of the seed and
    their positions alone (accept.PositionNoise), so the reply is the same whatever the blocks,
    drafter, trees or lookups; without one, sampling draws from MLX's global key (rejection
    sampling, the most drafts accepted). ``block_size`` fixes the most tokens a cycle verifies
    (else the scheduler chooses); ``copy_drafts``: blocks looked up from the context too.
    ``tree``: every drafter cycle verifies a tree of that many drafted nodes instead of a
    chain, or with ``"auto"`` as many of TREE_MAX as pay by the measured pass costs (tree.py;
    targets whose layers are all full attention).
    ``prompt_cache`` (a :class:`PairCache` holding a proper prefix of the prompt) is continued
    from and holds the whole sequence at the end (``tokens`` None if closed early where the
    caches could not be cut back). ``grammar`` (grammar.Grammar): the reply keeps to it, as
    plain decoding under the grammar's mask would write it (greedy: token for token)."""
    params = SamplingParams(temperature, top_p, top_k, **seeded(seed))
    label = describe(drafter)
    target, drafter, tokenizer, width = _check_request(model, drafter, tokenizer, max_tokens,
                                                       block_size, schedule)
    if tree is not None:
        check_tree(target, drafter, tree)
    matcher = Matcher(grammar, tokenizer, target.vocab_size) if grammar is not None else None
    tokens = encode_prompt(tokenizer, prompt)
    stats = GenerationStats(prompt_tokens=len(tokens), block_size=width, drafter=label)
    out = TextStream(tokenizer, stats, max_tokens)
    if max_tokens == 0:
        yield out.response([], 0, "length")
        return
    with wired_limit(target.model, [generation_stream]), mx.stream(generation_stream):
        # Before any clock starts: the scheduler's first use times the passes (then cached).
        policy = BlockPolicy.for_request(target, drafter, width, tokens,
                                         block_size is None and schedule and tree in (None, AUTO),
                                         copy_drafts, copy_ngram, size_trees=tree == AUTO,
                                         reach=len(tokens) + max_tokens)
        spec = Speculator(target, drafter, params, width, tokens, prompt_cache, matcher)

        def plan(anchor: mx.array, room: int, context: int, may_look_up: bool = True) -> Cycle:
            K, block, source = policy.choose(room, context, may_look_up)
            if tree and source == COPY:  # other earlier continuations become branches
                branches = policy.copy_branches(block)
                if len(branches) > 1:
                    size = TREE_MAX if tree == AUTO else tree
                    return spec.verify_tree(anchor, DraftTree.of_branches(branches, size), COPY,
                                            position=context)
            if tree and source == DRAFTER:
                if tree == AUTO:
                    return spec.tree_cycle(anchor, TREE_MAX,
                                           lambda scores: policy.tree_sizer.choose(scores, context),
                                           position=context)
                return spec.tree_cycle(anchor, tree, position=context)
            return spec.cycle(anchor, K, block, source, position=context,
                              room=min(max(width - 1, FORCED_REACH), room))

        stats.cached_tokens = spec.cached
        tic = time.perf_counter()
        anchor = sample_first(spec.prefill(tokens, prefill_step_size, prompt_progress), params,
                              len(tokens))
        new_tokens = [anchor.item()]
        stats.prompt_tps = stats.prefilled_tokens / (time.perf_counter() - tic)
        out.tic = time.perf_counter()
        accepted, pending = 0, None  # pending: the next cycle, started ahead
        origins = [TARGET]
        while True:
            spec.hold(new_tokens)  # before the cut: the caches hold them all the same
            new_tokens, reason = out.commit(new_tokens, origins)
            if reason is not None:
                spec.close(pending)
                yield out.response(new_tokens, accepted, reason)
                return
            policy.extend(new_tokens)
            done, context = stats.generation_tokens, len(tokens) + stats.generation_tokens
            # Start the next cycle before handing these tokens to the caller, so its compute
            # overlaps whatever the caller does with them.
            cycle = pending or plan(anchor, max_tokens - done - 1, context)
            cycle.start()
            pending = None
            if (cycle.num_drafts == 0 and done + 1 < max_tokens and matcher is None
                    and not policy.finds_lookup(max_tokens - done - 1, context)):
                # A plain cycle commits exactly one token, known lazily: build the next cycle
                # from it now, as mlx-lm does (lookups wait for a synced cycle).
                spec.feed(cycle)
                pending = plan(cycle.next_tokens[:1], max_tokens - done - 2, context + 1,
                               may_look_up=False)
                pending.start()
            try:
                yield out.response(new_tokens, accepted)
            except GeneratorExit:
                spec.abandon()
                raise
            accepted, new_tokens = cycle.resolve()
            origins = cycle.origins(accepted)
            policy.observe(cycle, accepted)
            spec.settle(cycle, accepted, fed=pending is not None)
            anchor = cycle.next_tokens[accepted : accepted + 1]
            stats.record(cycle, accepted)
            if stats.cycles % 256 == 0:
                mx.clear_cache()


def generate(
    model: Any, drafter: Drafter | None, tokenizer: Any, prompt: str | Sequence[int] | mx.array,
    **kwargs: Any,
) -> str:
    """Generate and return the full text (same arguments as :func:`stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, drafter, tokenizer, prompt, **kwargs))


def stream_generate_cached(
    store: PrefixCache,
    model: Any,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: str | Sequence[int],
    *,
    take: bool | None = None,
    checkpoints: Sequence[int] = (),
    generate: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Generator[Any, None, None]:
    """``stream_generate`` continuing from the store's longest usable prefix; the finished pair
    goes back into the store. ``stats.cached_tokens`` counts the prompt tokens reused.

    For targets whose caches cannot be cut back, the pair is also stored at each position in
    ``checkpoints`` (e.g. where the system prompt ends) and where the prompt ends, less its last
    token: the states later requests can continue from exactly. ``generate`` stands in for
    ``stream_generate`` (it must accept ``prompt_cache``).
    """
    tokens = encode_prompt(tokenizer, prompt)
    # As stream_generate does: nothing to draft (or lookups only), no drafter context to keep.
    context_drafter = drafting(drafter, kwargs.get("block_size"), kwargs.get("schedule", True))
    tic = time.perf_counter()
    pair, cached = continue_from(
        store, tokens, as_target(model), context_drafter, take=take,
        checkpoints=checkpoints if kwargs.get("max_tokens", 1) > 0 else None,
        step=kwargs.get("prefill_step_size", DEFAULT_PREFILL_STEP),
        progress=kwargs.get("prompt_progress"))
    checkpoint_s = time.perf_counter() - tic
    generate = generate or stream_generate
    gen = generate(model, drafter, tokenizer, tokens, prompt_cache=pair, **kwargs)
    try:
        for i, response in enumerate(gen):
            if i == 0 and response.stats.cached_tokens != cached and response.stats.prompt_tps:
                stats = response.stats
                inner_s = stats.prefilled_tokens / max(stats.prompt_tps, 1e-9)
                stats.cached_tokens = cached
                stats.prompt_tps = stats.prefilled_tokens / max(inner_s + checkpoint_s, 1e-9)
            yield response
    finally:
        gen.close()
        if pair.tokens:
            store.insert(pair)


def continue_from(
    store: PrefixCache, tokens: Sequence[int], target: Target, drafter: Drafter | None, *,
    take: bool | None = None, checkpoints: Sequence[int] | None = (),
    step: int = DEFAULT_PREFILL_STEP, progress: Callable[[int, int], Any] | None = None,
) -> tuple[PairCache, int]:
    """The pair a generation of ``tokens`` continues from (the store's longest usable prefix)
    and the prompt tokens it holds. For targets whose caches cannot be cut back, the pair is
    first prefilled to each of ``checkpoints`` and to the prompt's end less its last token,
    and stored there (None: no checkpoints, nothing prefilled here)."""
    pair, cached = store.fetch(tokens, take=take)
    if drafter is not None and pair.drafter is None and pair.tokens:
        pair, cached = PairCache(), 0  # kept without a drafter context: of no use here
    pair.ensure(target, drafter)
    if checkpoints is None or not needs_checkpoints(target):
        return pair, cached
    end = len(tokens) - 1
    for stop in sorted({p for p in (*checkpoints, end) if cached < p <= end}):
        start = pair.begin(tokens, target, drafter)
        prefill(target, tokens[start:stop], pair.target, drafter, pair.drafter, step, progress)
        pair.hold(tokens[:stop])
        store.insert(pair.fork())
    return pair, cached
