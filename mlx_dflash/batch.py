"""Many requests at once: one batched target pass verifies every running request's block.

Each request keeps what a single generation has (``cycle.Speculator``: the drafter's cache and
unread features; ``policy.BlockPolicy``: copy, n-gram and scheduler choices; ``decode.TextStream``:
stops, ``max_tokens``, detokenizing), except the target cache: all requests' target caches are
rows of one batch cache per layer (``batch_cache.make_batch_cache``: ragged KV rows for full
attention and sliding windows, stacked states for recurrent layers). A step:

1. admits waiting requests up to ``max_batch`` and memory: each is prefilled alone (whole when
   nothing runs, else ``prefill_chunk`` tokens a step, so that the others keep decoding), then
   added as a row;
2. drafts for every running request (its own K, 0 included: the blocks are ragged), all
   drafting requests in one drafter pass;
3. runs one target pass over ``[anchor] + drafts`` of every row, right-padded to the longest;
4. accepts each row with its own sampling parameters (``cycle.accepted_cycle``), one host sync
   for the whole batch, and each row keeps only its accepted prefix in the batch cache;
5. commits each request's tokens, and lets the finished and cancelled ones leave.

With ``tree``, a request that drafts verifies a tree of drafts instead of a chain (tree.py):
the pass becomes a tree pass for every row (chains and looked-up blocks as trees of width one,
each row with its own tree mask and depths) and each row keeps its anchor and accepted path.
The drafting requests' trees grow from one drafter pass (block drafters; a chain drafter
grows each on its own). ``tree="auto"`` grows TREE_MAX nodes per drafting request and
verifies, across all requests, the nodes that raise the batch's expected committed tokens per
second most (``schedule.plan_nodes``: one ranking of every request's nodes against the pass's
cost).

Requests join and leave between steps without stalling the others. Greedy output equals each
request's own greedy decode; sampled output follows the target's distribution per request.
Sliding-window and Gated DeltaNet layers roll each row back as a single generation does (the
window's mask per row; recurrent states restored from the recorded pass, per row).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import distributed
from .accept import SamplingParams, sample_first, seeded
from .grammar import Grammar, Matcher, apply_masks, constrain_proposal, constrain_tree
from .batch_cache import BatchNotSupported, make_batch_cache  # noqa: F401 (re-exported)
from .cycle import (
    DEFAULT_PREFILL_STEP, DRAFTER, PLAIN, TREE, Cycle, Speculator, TreeCycle, accepted_cycle,
    prefill,
)
from .decode import GenerationResponse, GenerationStats, TextStream, check_tree, continue_from
from .drafters import check_fits
from .drafters.base import (
    Drafter, Proposal, drafting, grow_trees, propose_all, verify_width,
)
from .drafters.published import describe
from .policy import COPY_DRAFTS, COPY_NGRAM, BlockPolicy
from .prefix_cache import PrefixCache
from .prompts import encode_prompt
from .schedule import (
    cached_batch_costs, kv_bytes_per_position, memory_headroom, plan_batch, plan_nodes,
)
from .target import as_target
from .tree import AUTO, TREE_MAX, DraftTree, LazyTree, select_tree, target_choices, tree_beam


@dataclass
class _Request:
    id: int
    tokens: list[int]
    params: SamplingParams
    max_tokens: int
    stats: GenerationStats
    text: TextStream
    spec: Speculator | None = None
    policy: BlockPolicy | None = None
    anchor: mx.array | None = None  # the last committed token, not yet in the target cache
    checkpoints: Sequence[int] = ()  # where to store the prompt's caches (see continue_from)
    prefilled: int = 0  # prompt tokens in its caches so far (a joining request's prefill)
    prefill_s: float = 0.0
    cancelled: bool = False
    matcher: Matcher | None = None  # its grammar's state, if it has one
    # Alone, the cycle after a plain one plans without lookups, as a single generation's
    # pipelined plain cycles do: so that a seeded request draws what ``generate`` draws.
    look_up: bool = True

    @property
    def room(self) -> int:
        """Drafts that still fit before ``max_tokens`` (the anchor's token is committed)."""
        return self.max_tokens - self.stats.generation_tokens - 1

    @property
    def context(self) -> int:
        return len(self.tokens) + self.stats.generation_tokens


@dataclass
class BatchResult:
    text: str
    tokens: list[int]
    finish_reason: str | None
    stats: GenerationStats = field(repr=False)


class BatchEngine:
    """Continuous batching with speculative verification; call :meth:`step` until
    :attr:`idle`. Each response is ``(request id, GenerationResponse)``."""

    def __init__(self, model: Any, drafter: Drafter | None, tokenizer: Any, *,
                 max_batch: int = 8, block_size: int | None = None, schedule: bool = True,
                 copy_drafts: bool = COPY_DRAFTS, copy_ngram: int = COPY_NGRAM,
                 prefill_step_size: int = DEFAULT_PREFILL_STEP, reserve_bytes: int = 256 << 20,
                 prefix_cache: PrefixCache | None = None, prefill_chunk: int = 256,
                 tree: int | str | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target = as_target(model)
        if tree is not None:
            check_tree(self.target, drafter, tree)
        self.tree = tree
        # One batch cache per layer, of its kind; BatchNotSupported for a kind it cannot hold.
        self.cache = make_batch_cache(self.target)
        if drafter is not None:
            check_fits(drafter, self.target)
        self.width = verify_width(drafter, block_size, schedule)
        if self.width < 1:
            raise ValueError(f"block_size must be >= 1, got {self.width}")
        self.drafter = drafting(drafter, block_size, schedule)
        self.drafter_label = describe(drafter)
        self.tokenizer = (tokenizer if isinstance(tokenizer, TokenizerWrapper)
                          else TokenizerWrapper(tokenizer))
        self.auto = block_size is None and schedule
        # One verify budget across the batch (measured once per model pair and machine).
        # (tree="auto": timed as wide as its trees verify)
        self.costs_width = max(self.width, TREE_MAX + 1 if self.tree == AUTO else 0)
        self.costs = (cached_batch_costs(self.target, self.drafter, self.costs_width)
                      if self.auto and self.drafter is not None else None)
        self.copy_drafts, self.copy_ngram = copy_drafts, copy_ngram
        self.max_batch, self.prefill_step = max_batch, prefill_step_size
        # Prompt tokens prefilled per step while others decode: a long prompt joins over
        # several steps instead of stalling them for its whole prefill.
        self.prefill_chunk = prefill_chunk
        self.reserve_bytes = reserve_bytes
        self.store = prefix_cache  # requests continue from it and leave their caches in it
        self.position_bytes = kv_bytes_per_position(self.target)
        self.layer_ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # in the batch cache's row order
        self.joining: _Request | None = None  # admitted, its prompt being prefilled
        self.last_pass: tuple[int, int] | None = None  # (rows, tokens a row) of the last pass
        self._ids = itertools.count()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self.joining is None

    def submit(self, prompt: str | Sequence[int] | mx.array, *, max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, checkpoints: Sequence[int] = (),
               grammar: Grammar | None = None) -> int:
        """Queue a request; returns its id (its responses carry it). ``seed``: the request
        samples from its own random stream; ``checkpoints``: see ``decode.continue_from``;
        ``grammar``: its reply keeps to it (as ``stream_generate``'s)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        params = SamplingParams(temperature, top_p, top_k, **seeded(seed))
        tokens = encode_prompt(self.tokenizer, prompt)
        stats = GenerationStats(prompt_tokens=len(tokens), block_size=self.width,
                                drafter=self.drafter_label)
        matcher = (Matcher(grammar, self.tokenizer, self.target.vocab_size)
                   if grammar is not None else None)
        request = _Request(next(self._ids), tokens, params, max_tokens, stats,
                           TextStream(self.tokenizer, stats, max_tokens, own_detokenizer=True),
                           checkpoints=checkpoints, matcher=matcher)
        self.waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        """Stop a request (it leaves at the next step, with no further response)."""
        joining = [self.joining] if self.joining is not None else []
        for r in itertools.chain(self.waiting, self.running, joining):
            if r.id == request_id:
                r.cancelled = True

    def step(self) -> list[tuple[int, GenerationResponse]]:
        """Admit what fits, then run one batched cycle; the responses it produced."""
        responses: list[tuple[int, GenerationResponse]] = []
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self._admit(responses)
        self._leave()
        if self.running:
            self._cycle(responses)
            self._leave()
        return responses

    def prompt_started(self, request_id: int) -> tuple[int, int] | None:
        """(prompt tokens, tokens continued from the prefix cache) once the request's prefill
        has begun; None before."""
        for r in itertools.chain(self.running, [self.joining] if self.joining else []):
            if r.id == request_id and r.spec is not None:
                return r.stats.prompt_tokens, r.stats.cached_tokens
        return None

    def _admit(self, responses: list) -> None:
        """Start waiting requests while they fit, and prefill them: ``prefill_step`` prompt
        tokens a step while nothing runs (a cancelled request leaves between chunks), else
        ``prefill_chunk``; a request whose prompt is in joins."""
        budget = self.prefill_chunk if self.running else self.prefill_step
        if self.joining is not None and self.joining.cancelled:
            r, self.joining = self.joining, None
            if r.spec.pair is not None:  # what it prefilled so far is worth keeping
                r.spec.pair.hold(r.tokens[: r.prefilled])
                self.store.insert(r.spec.pair)
        while budget > 0:
            if self.joining is None:
                if not (self.waiting and len(self.running) < self.max_batch
                        and self._fits(self.waiting[0])):
                    return
                self.joining = self.waiting.popleft()
                self._start(self.joining)
            r = self.joining
            left = len(r.tokens) - r.prefilled
            take = min(left, budget)
            logits = self._prefill(r, take)
            budget -= take
            if take < left:
                return
            self.joining = None
            self._join(r, logits, responses)

    def _fits(self, r: _Request) -> bool:
        """Whether free memory holds one more row for this request at its full length: the
        batch cache's rows all grow to the longest, and rejected tails leave holes (counted
        twice over). Waiting requests stay queued until it does; alone, one always runs."""
        if not self.running:
            return True
        longest = max(len(x.tokens) + x.max_tokens for x in (*self.running, r))
        need = 2 * self.position_bytes * (longest + self.width) * (len(self.running) + 1)
        held = int(distributed.smallest(self.cache.nbytes))  # across machines: alike on all
        return memory_headroom() + held - self.reserve_bytes >= need

    def _start(self, r: _Request) -> None:
        """A request's own state: its block policy and caches (continued from the prefix
        store when there is one)."""
        tic = time.perf_counter()
        reach = len(r.tokens) + r.max_tokens
        r.policy = BlockPolicy.for_request(self.target, self.drafter, self.width, r.tokens,
                                           self.auto, self.copy_drafts, self.copy_ngram,
                                           size_trees=self.tree == AUTO, reach=reach)
        if self.costs is not None and reach > self.costs.single.contexts[-1]:
            # the batch's budget as far as this request reaches (measured once, then cached)
            self.costs = cached_batch_costs(self.target, self.drafter, self.costs_width, reach)
        pair = None
        if self.store is not None:
            pair, _ = continue_from(self.store, r.tokens, self.target, self.drafter,
                                    checkpoints=r.checkpoints, step=self.prefill_step)
        r.spec = Speculator(self.target, self.drafter, r.params, self.width, r.tokens, pair,
                            r.matcher)
        r.stats.cached_tokens = r.prefilled = r.spec.cached
        r.prefill_s = time.perf_counter() - tic

    def _prefill(self, r: _Request, n: int) -> mx.array:
        """The next ``n`` prompt tokens into the request's own caches; the last one's logits."""
        tic = time.perf_counter()
        logits = prefill(self.target, r.tokens[r.prefilled : r.prefilled + n], r.spec.cache,
                         self.drafter, r.spec.draft_cache, self.prefill_step)
        r.prefilled += n
        r.prefill_s += time.perf_counter() - tic
        return logits

    def _join(self, r: _Request, logits: mx.array, responses: list) -> None:
        """The prompt is in: commit the first token and add the request as a batch row."""
        if r.matcher is not None:
            logits = apply_masks(logits[None], mx.array(r.matcher.allowed())[None])[0]
        r.anchor = sample_first(logits, r.params, len(r.tokens))
        r.text.tic = time.perf_counter()
        r.stats.prompt_tps = r.stats.prefilled_tokens / max(r.prefill_s, 1e-9)
        self.cache.add_row(r.spec.cache)
        r.spec.cache = None  # its rows in the batch cache stand in for it from now on
        if r.spec.pair is not None:
            r.spec.pair.target = None  # (given back as the rows when the request leaves)
        self.running.append(r)
        self._commit(r, [r.anchor.item()], 0, responses)

    def _cycle(self, responses: list) -> None:
        """One batched draft -> verify -> accept over every running request."""
        plans = self._plan()
        trees = self._grow_trees(plans) if self.tree else {}
        scores: dict[int, list[float]] = {}
        if trees and self.tree == AUTO:
            plans, scores = self._size_trees(plans, trees)
        proposals, masks = self._constrain(self._draft(plans, skip=trees), plans)
        if trees:
            self._constrain_trees(trees, scores, masks)
        cycles = (self._tree_pass(proposals, trees, scores, plans, masks) if trees
                  else self._chain_pass(proposals, plans, masks))
        # The one host sync of the batch's cycle (confidences too: the schedulers read them).
        mx.eval([c.packed for c in cycles] + [c.confidence for c in cycles
                                              if c.confidence is not None])
        kept = []
        for r, cycle in zip(self.running, cycles):
            accepted, tokens = cycle.resolve()
            r.policy.observe(cycle, accepted)
            r.spec.queue_features(cycle, accepted)
            kept.append(cycle.kept if isinstance(cycle, TreeCycle) else list(range(accepted + 1)))
            r.anchor = cycle.next_tokens[accepted : accepted + 1]
            r.stats.record(cycle, accepted)
            self._commit(r, tokens, accepted, responses, cycle.origins(accepted))
        if trees:
            self.cache.commit_rows(kept)
        else:
            self.cache.commit([len(k) for k in kept])  # recurrent rows: restored from the record
        self.cache.compact()  # when the rejected tails' holes take up a quarter of the slots

    def _constrain(self, proposals: list[Proposal | None], plans: list
                   ) -> tuple[list[Proposal | None], list[mx.array | None]]:
        """Rows with a grammar: their blocks kept to it and their rows' masks (grammar.py;
        one host read of their blocks)."""
        masks: list[mx.array | None] = [None] * len(proposals)
        for i, (r, p, (_, block, _)) in enumerate(zip(self.running, proposals, plans)):
            if r.matcher is not None and p is not None:
                proposals[i], masks[i] = constrain_proposal(
                    r.matcher, p, min(self.width - 1, r.room), r.params, bool(block))
        return proposals, masks

    def _constrain_trees(self, trees: dict[int, LazyTree], scores: dict[int, list[float]],
                         masks: list[mx.array | None]) -> None:
        """Trees of rows with a grammar kept to it (in place; one host read of each) and
        their rows' masks."""
        for i, lazy in list(trees.items()):
            matcher = self.running[i].matcher
            if matcher is None:
                continue
            host = DraftTree(lazy.tokens.tolist(), lazy.parents.tolist(), lazy.scores.tolist())
            kept, masks[i] = constrain_tree(matcher, host)
            trees[i] = LazyTree(mx.array(kept.tokens, dtype=mx.uint32),
                                mx.array(kept.parents, dtype=mx.int32),
                                mx.array(kept.scores), mx.array(kept.depths()),
                                mx.array(kept.visible()))
            if i in scores:
                scores[i] = kept.scores

    def _chain_pass(self, proposals: list[Proposal], plans: list,
                    masks: Sequence[mx.array | None] = ()) -> list[Cycle]:
        """One target pass over every row's ``[anchor] + drafts``, right-padded (``masks``:
        a grammar's, per row)."""
        width = 1 + max(p.drafts.shape[0] for p in proposals)
        self.last_pass = (len(proposals), width)
        rows = [mx.concatenate([r.anchor, p.drafts, mx.zeros((width - 1 - p.drafts.shape[0],),
                                                             dtype=mx.uint32)])
                for r, p in zip(self.running, proposals)]
        logits, features = self.target.forward(mx.stack(rows), self.cache, self.layer_ids)
        return [self._chain_cycle(i, r, p, source, logits, features,
                                  masks[i] if masks else None)
                for i, (r, p, (_, _, source)) in enumerate(zip(self.running, proposals, plans))]

    def _chain_cycle(self, i: int, r: _Request, p: Proposal, source: str, logits: mx.array,
                     features: mx.array | None, masks: mx.array | None = None) -> Cycle:
        n = p.drafts.shape[0] + 1
        row_features = features[i : i + 1, :n] if features is not None else None
        return accepted_cycle(r.anchor, p, apply_masks(logits[i, :n], masks), row_features,
                              r.params, source, r.context)

    def _tree_pass(self, proposals: list[Proposal | None], trees: dict[int, LazyTree],
                   scores: dict[int, list[float]], plans: list,
                   masks: Sequence[mx.array | None] = ()) -> list[Cycle]:
        """One tree pass over every row: the drafting requests' trees, the others' blocks as
        chains, each padded with children of its anchor that nothing sees."""
        sizes = [len(trees[i]) if i in trees else p.drafts.shape[0]
                 for i, p in enumerate(proposals)]
        W = 1 + max(sizes)
        self.last_pass = (len(sizes), W)
        tokens, depths, visible = [], [], []
        for i, (r, p, n) in enumerate(zip(self.running, proposals, sizes)):
            if i in trees:
                nodes, row_depths, seen = trees[i].tokens, trees[i].depths, trees[i].visible
            else:
                nodes, row_depths = p.drafts, mx.arange(n + 1)
                seen = mx.tril(mx.ones((n + 1, n + 1), dtype=mx.bool_))
            pad = W - 1 - n
            slot = mx.arange(W)
            padding = (slot > n)[:, None] & ((slot[None] == 0) | (slot[:, None] == slot[None]))
            tokens.append(mx.concatenate([r.anchor, nodes.astype(mx.uint32),
                                          mx.zeros((pad,), dtype=mx.uint32)]))
            depths.append(mx.concatenate([row_depths.astype(mx.int32),
                                          mx.ones((pad,), dtype=mx.int32)]))
            visible.append(mx.pad(seen.astype(mx.bool_), [(0, pad), (0, pad)]) | padding)
        logits, features = self.target.forward_tree(
            mx.stack(tokens), mx.stack(depths), mx.stack(visible), self.cache, self.layer_ids,
            max_depth=min(W - 1, max(self.width - 1, self.drafter.max_drafts)))
        cycles = []
        for i, (r, p, (_, _, source)) in enumerate(zip(self.running, proposals, plans)):
            row_masks = masks[i] if masks else None
            if i not in trees:
                cycles.append(self._chain_cycle(i, r, p, source, logits, features, row_masks))
                continue
            tree, n = trees[i], sizes[i]
            choices = target_choices(apply_masks(logits[i, : n + 1], row_masks), r.params,
                                     r.context, depths[i][: n + 1])
            packed = mx.concatenate([choices, tree.tokens.astype(mx.uint32),
                                     (tree.parents + 1).astype(mx.uint32)])
            row_features = features[i : i + 1, : n + 1] if features is not None else None
            cycles.append(TreeCycle(r.anchor, n, TREE, packed, choices, row_features,
                                    scores=scores.get(i)))
        return cycles

    def _grow_trees(self, plans: list[tuple[int, list[int], str]]) -> dict[int, LazyTree]:
        """The drafting requests' trees (tree mode): ``tree`` nodes each, or TREE_MAX to be
        sized across the batch (tree="auto")."""
        size = TREE_MAX if self.tree == AUTO else self.tree
        growing = [i for i, (K, block, _) in enumerate(plans) if K and not block]
        rows = [self.running[i] for i in growing]
        for r in rows:
            r.spec.catch_up()
        grown = grow_trees(self.drafter, self.target, [r.anchor for r in rows],
                           [r.spec.draft_cache for r in rows], self.width,
                           tree_beam(size, self.drafter.max_drafts))
        return {i: select_tree(*g, size) for i, g in zip(growing, grown)}

    def _size_trees(self, plans: list, trees: dict[int, LazyTree]
                    ) -> tuple[list, dict[int, list[float]]]:
        """tree="auto": how many nodes of each tree (cut in place), and of each looked-up
        block, one pass verifies, ranked together by survival against the batched pass's
        cost; one sync reads the trees' scores. A tree cut to no node leaves its request a
        plain step. Returns the plans and the kept nodes' scores."""
        read = mx.concatenate([t.scores for t in trees.values()]).tolist()  # one sync for all
        scores, at = {}, 0
        for i, t in trees.items():
            scores[i], at = read[at : at + len(t)], at + len(t)
        survival = []
        for i, (r, (_, block, _)) in enumerate(zip(self.running, plans)):
            if i in trees:
                survival.append(r.policy.tree_sizer.survival(np.array(scores[i])))
            elif block and r.policy.looked is not None:
                survival.append(r.policy.looked.survival[: len(block)])
            else:
                survival.append(np.zeros(len(block)))
        counts = plan_nodes(survival, [bool(b) for _, b, _ in plans], self.cache.slots,
                            self.costs) if self.costs is not None else [
            r.policy.tree_sizer.choose(np.array(scores[i]), r.context) if i in trees
            else len(plans[i][1]) for i, r in enumerate(self.running)]
        sized = []
        for i, (n, (K, block, source)) in enumerate(zip(counts, plans)):
            if i in trees:
                if n:
                    trees[i], scores[i] = trees[i].first(n), scores[i][:n]
                else:
                    del trees[i], scores[i]
                    K, source = 0, PLAIN
            elif block:
                block = block[:n]
                K = n
                source = source if n else PLAIN
            sized.append((K, block, source))
        return sized, scores

    def _draft(self, plans: list[tuple[int, list[int], str]], skip: Any = ()
               ) -> list[Proposal | None]:
        """Each running request's block: the drafter's for all that draft in one pass (its
        weights read once), looked-up blocks and empty ones as a single generation has them.
        None for the rows in ``skip`` (they verify trees)."""
        proposals: list[Proposal | None] = [None] * len(plans)
        drafting = [i for i, (K, block, _) in enumerate(plans)
                    if K and not block and i not in skip]
        if drafting:
            rows = [self.running[i] for i in drafting]
            for r in rows:
                r.spec.catch_up()
            batch = propose_all(self.drafter, self.target, [r.anchor for r in rows],
                                [r.spec.draft_cache for r in rows], self.width,
                                [plans[i][0] for i in drafting], [r.params for r in rows])
            for i, p in zip(drafting, batch):
                proposals[i] = p
        return [p if p is not None or i in skip else r.spec.draft(r.anchor, K, block)
                for i, (p, r, (K, block, _)) in enumerate(zip(proposals, self.running, plans))]

    def _plan(self) -> list[tuple[int, list[int], str]]:
        """Each running request's (drafts, looked-up block, source). Alone, a request plans as
        a single generation does; together, one verify budget is shared: lookups and drafts
        are weighed by their survival estimates against the batched pass's cost."""
        if self.costs is None or len(self.running) == 1:
            plans = []
            for r in self.running:
                plans.append(r.policy.choose(r.room, r.context, may_look_up=r.look_up))
                r.look_up = bool(plans[-1][0] or r.room <= 0
                                 or r.policy.finds_lookup(r.room, r.context))
            return plans
        for r in self.running:
            r.look_up = True
        looked = [r.policy.find(r.room, watch=True) for r in self.running]
        counts = plan_batch([r.policy.scheduler for r in self.running],
                            [r.room for r in self.running],
                            [None if f is None else f.survival for f in looked],
                            self.cache.slots, self.costs)
        return [(K, f.tokens[:K], f.source) if f is not None and K
                else (K, [], DRAFTER if K else PLAIN) for K, f in zip(counts, looked)]

    def _commit(self, r: _Request, tokens: list[int], accepted: int, responses: list,
                origins: list[str] | None = None) -> None:
        r.spec.hold(tokens)  # before the cut: the caches hold them all the same
        tokens, reason = r.text.commit(tokens, origins)
        if reason is None:
            r.policy.extend(tokens)
        else:
            r.cancelled = True  # done: it leaves the batch
        responses.append((r.id, r.text.response(tokens, accepted, reason)))

    def _leave(self) -> None:
        """Finished and cancelled requests leave the batch (their rows go)."""
        keep = [i for i, r in enumerate(self.running) if not r.cancelled]
        if len(keep) == len(self.running):
            return
        for i, r in enumerate(self.running):
            if r.cancelled and r.spec.pair is not None:
                self._store(i, r)
        self.running = [self.running[i] for i in keep]
        self.cache.keep_rows(keep)

    def _store(self, row: int, r: _Request) -> None:
        """Leave a request's caches in the prefix store: its row of the batch cache holds
        what it committed (recurrent rows too: each pass's rows are restored to what was kept)."""
        r.spec.pair.target = self.cache.row_cache(row)
        r.spec.release()
        if r.spec.pair.tokens:
            self.store.insert(r.spec.pair)


def batch_generate(
    model: Any, drafter: Drafter | None, tokenizer: Any,
    prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 256,
    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, **engine_options: Any,
) -> list[BatchResult]:
    """Generate from every prompt at once (continuous batching, ``max_batch`` at a time);
    returns each one's text, tokens, finish reason and stats, in the prompts' order."""
    engine = BatchEngine(model, drafter, tokenizer, **engine_options)
    ids = [engine.submit(p, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k) for p in prompts]
    parts: dict[int, list[GenerationResponse]] = {i: [] for i in ids}
    while not engine.idle:
        for request_id, response in engine.step():
            parts[request_id].append(response)
    results = []
    for i in ids:
        last = parts[i][-1]
        results.append(BatchResult("".join(r.text for r in parts[i]),
                                   [t for r in parts[i] for t in r.tokens],
                                   last.finish_reason, last.stats))
    return results
