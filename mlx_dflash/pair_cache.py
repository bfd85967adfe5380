"""The caches one generation holds: the target's per-layer caches, the drafter's context cache
and the tokens both hold.

``stream_generate(..., prompt_cache=pair)`` prefills only what the pair does not hold yet and
leaves it holding the whole sequence when generation ends; ``prefix_cache.PrefixCache`` keeps
finished pairs for later requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from .target import FULL, TargetCache, can_cut_back, cut_back, fork_layer_cache, positions_held


@dataclass(eq=False)
class PairCache:
    """The target's caches, the drafter's context cache and the tokens they hold.

    ``tokens`` is None while a generation runs on the pair, or after one that ended where the
    caches could not be named (then the pair is unusable).
    """

    target: TargetCache | None = None
    drafter: list[Any] | None = None
    tokens: list[int] | None = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in (self.target or []) + (self.drafter or []))

    @property
    def layers(self) -> list[Any]:
        return list(self.target or []) + list(self.drafter or [])

    def trimmable(self) -> bool:
        """Whether the caches can be cut back to any shorter prefix, exactly."""
        return can_cut_back(self.layers)

    def ensure(self, target: Any, drafter: Any) -> None:
        """Make the empty caches a first use needs; check that a used pair fits the models."""
        if self.target is None:
            self.target = target.make_cache()
        elif len(self.target) != len(target.layers_here):  # split by layers: this rank's
            raise ValueError(f"the prompt cache has {len(self.target)} target layers, the target "
                             f"{len(target.layers_here)}")
        if drafter is None:
            self.drafter = None  # the drafter's context stops following the target
        elif self.drafter is None:
            if self.tokens:
                raise ValueError("the prompt cache holds no drafter context")
            self.drafter = drafter.make_cache()

    def begin(self, tokens: Sequence[int], target: Any, drafter: Any) -> int:
        """Check that the pair holds a proper prefix of ``tokens`` and take it into use; returns
        the length of that prefix (the tokens not to prefill)."""
        if self.tokens is None:
            raise ValueError("the prompt cache is in use, or its last generation did not end "
                             "where its contents could be named")
        n = len(self.tokens)
        if n >= len(tokens) or list(tokens[:n]) != self.tokens:
            raise ValueError("the prompt cache must hold a proper prefix of the prompt (at least "
                             "one prompt token is left to prefill)")
        self.ensure(target, drafter)
        self.tokens = None  # the contents change from here on
        return n

    def hold(self, tokens: Sequence[int]) -> None:
        """Name the contents: the caches hold exactly ``tokens``. Starts evaluating them."""
        if self.target is not None:
            self.target.last_pass = None  # a rollback record would keep the last pass alive
        mx.async_eval([c.state for c in self.layers])
        self.tokens = list(tokens)

    def trim_to(self, n: int) -> bool:
        """Cut both caches back to their first ``n`` positions if that is exact (else False)."""
        held = [positions_held(c) for c in self.layers]
        if all(h == n for h in held):
            return True  # nothing to cut: exact whatever the caches' kinds
        if not self.trimmable() or any(h is None or h < n for h in held):
            return False
        cut_back(self.layers, n)
        if self.tokens is not None:
            self.tokens = self.tokens[:n]
        return True

    def fork(self, keep: int | None = None) -> PairCache:
        """A pair to continue from, holding the first ``keep`` tokens (all by default); it shares
        this one's arrays, and nothing done to it changes this one."""
        if self.tokens is None:
            raise ValueError("cannot fork a prompt cache whose contents are unknown")
        target = None if self.target is None else TargetCache(map(fork_layer_cache, self.target))
        drafter = None if self.drafter is None else [fork_layer_cache(c) for c in self.drafter]
        pair = PairCache(target, drafter, list(self.tokens))
        if keep is not None and keep < len(self.tokens) and not pair.trim_to(keep):
            raise ValueError("this prompt cache cannot be cut back (recurrent or wrapped layers)")
        return pair


def needs_checkpoints(target: Any) -> bool:
    """Targets whose caches may not be cut back (recurrent or sliding-window layers)."""
    return any(kind != FULL for kind in target.layer_kinds)
