"""Speculative decoding with the target split across machines (``mx.distributed``).

Launched with ``mlx.launch`` (``mlx.launch --backend ring -n 2 mlx-dflash generate ...``), every
process (rank) loads the pair and mlx-lm shards the target (:func:`shard_target`): tensor
parallel where mlx-lm's model has ``shard(group)`` (each layer's projections split across the
ranks; the layer sums its output over them, two ``all_sum`` per layer per pass), else pipeline
parallel (each rank runs some whole layers and hands the hidden state on, split by mlx-lm's
``pipeline``, which every family target.py runs can take: target.py runs the stages as mlx-lm
does, and sums the tap features each stage computed so that every rank's drafter reads them
all). Nothing else is parallel: every rank runs the whole decode loop. The drafter is small
and runs on every rank; identical inputs give identical drafts, so no draft crosses the
network, and a verify pass crosses it as one decoded token does (the same messages, whatever
the block's length): that is where speculation pays.

The accept decision must be the same on every rank, or the ranks' passes stop matching: the
logits and tap features are (a tensor split's sums reach every rank alike; a pipeline's last
stage's output is gathered to all), the random seed is rank 0's
(:func:`common_seed`), and what a rank measures of itself is made common: the pass costs the
scheduler sizes blocks with are rank 0's (schedule.cached_costs), and the free memory is the
smallest over the ranks, read once (schedule.memory_headroom).

A rank that fails (or is stopped) makes the others' next message fail at once: MLX raises
``RuntimeError`` ("connection to a peer was lost"), which the CLI reports, unless mlx.launch
has stopped them first.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.pipeline import PipelineMixin

_group: mx.distributed.Group | None = None  # the run's group, when it has several ranks


def init() -> mx.distributed.Group | None:
    """Join the run ``mlx.launch`` started (the group of all its ranks), or None when this
    process runs alone."""
    global _group
    if _group is None and mx.distributed.is_available():
        g = mx.distributed.init()
        if g.size() > 1:
            _group = g
    return _group


def group() -> mx.distributed.Group | None:
    """The run's group (after :func:`init`), None when alone."""
    return _group


def rank() -> int:
    return 0 if _group is None else _group.rank()


def is_root() -> bool:
    """Whether this process speaks for the run (prints, serves): rank 0, or alone."""
    return rank() == 0


def from_root(values: Any, dtype: Any = np.float32) -> np.ndarray:
    """Rank 0's ``values`` (an array of the same shape on every rank) on every rank."""
    values = np.asarray(values, dtype=dtype)
    if _group is None:
        return values
    mine = mx.array(values if is_root() else np.zeros_like(values))
    return np.array(mx.distributed.all_sum(mine, group=_group, stream=mx.cpu))


def share(obj: Any) -> Any:
    """Rank 0's ``obj`` (anything JSON can write) on every rank; what the others pass is
    ignored. Two messages (its size, then its bytes), one for None. As in mlx-lm's server, a
    rank waiting here polls its link (it keeps a core busy until rank 0 sends)."""
    if _group is None:
        return obj
    data = json.dumps(obj).encode() if is_root() and obj is not None else b""
    size = int(from_root([len(data)], np.int32)[0])
    if size == 0:
        return None
    data = from_root(np.frombuffer(data, np.uint8) if is_root() else np.zeros(size), np.uint8)
    return json.loads(data.tobytes())


def smallest(value: float) -> float:
    """The smallest of every rank's ``value``."""
    if _group is None:
        return value
    return float(mx.distributed.all_min(mx.array([value], dtype=mx.float32), group=_group,
                                         stream=mx.cpu)[0].item())


def common_seed(seed: int | None) -> int | None:
    """The seed every rank samples with: ``seed``, or one rank 0 drew (None when alone and
    none was given: the global random state stays as it is)."""
    if _group is None:
        return seed
    if seed is None:
        seed = int(np.random.default_rng().integers(1, 2**31 - 1))
    return int(from_root([seed], np.int32)[0])


def barrier() -> None:
    """Wait until every rank is here."""
    if _group is not None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=_group, stream=mx.cpu))


# -- sharding -----------------------------------------------------------------------------------
def shard_target(model: nn.Module, group: mx.distributed.Group | None = None,
                 mode: str = "auto") -> str:
    """Split ``model`` across ``group`` (default: the run's) with mlx-lm's own sharding and
    return how: "tensor" (``model.shard``: every layer split by heads), or "pipeline" (each
    rank runs a run of whole layers, the first ranks the last layers, and passes the hidden
    state on). ``mode`` "auto": tensor where mlx-lm has it and the heads divide among the
    ranks, else pipeline. Refuses, naming the model type, a split that cannot be made."""
    group = group or _group
    if group is None or group.size() == 1:
        return "none"
    if mode not in ("auto", "tensor", "pipeline"):
        raise ValueError(f"mode must be 'auto', 'tensor' or 'pipeline', got {mode!r}")
    text = getattr(model, "language_model", model)
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    args, n = text.args, group.size()
    heads = [getattr(args, "num_attention_heads", 0), getattr(args, "num_key_value_heads", 0)]
    divisible = not any(h % n for h in heads if h)
    if mode == "auto":
        mode = "tensor" if hasattr(text, "shard") and divisible else "pipeline"
    if mode == "tensor":
        if not hasattr(text, "shard"):
            raise ValueError(f"model type '{model_type}' cannot be split across machines by "
                             "tensor: mlx-lm gives it no tensor-parallel sharding (model.shard);"
                             " split it by layers (--split pipeline)")
        if not divisible:
            raise ValueError(f"model type '{model_type}': {heads[0]} query / {heads[1]} "
                             f"key-value heads do not divide among {n} ranks; split it by "
                             "layers (--split pipeline) or run a number of ranks that divides "
                             "them")
        text.shard(group)
    else:
        if len(text.model.layers) < n:
            raise ValueError(f"model type '{model_type}': {len(text.model.layers)} layers "
                             f"cannot be split among {n} ranks")
        _split_layers(text, group)
    mx.eval(model.parameters())
    barrier()
    return mode


def _split_layers(text: nn.Module, group: mx.distributed.Group) -> None:
    """Split the decoder stack by layers: mlx-lm's ``pipeline`` where the model has one, else
    the same split (mlx-lm's ``PipelineMixin.pipeline`` on the stack) for a family mlx-lm does
    not pipeline (llama, qwen3, gpt_oss, gemma3_text). Either way target.py runs the stage and its
    messages; such a model's own ``__call__`` does not, and its caches are made here."""
    inner = text.model
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        return
    every_layer = make_prompt_cache(text)  # before the split: one per layer, of its kind
    PipelineMixin.pipeline(inner, group)
    here = every_layer[inner.start_idx:inner.end_idx]
    text.make_cache = lambda: copy.deepcopy(here)  # empty caches of this stage's layers


# -- a slower link, for measurement -------------------------------------------------------------
_slow = {"delay": 0.0, "counter": None}  # what slow_links set for the pipeline's messages


class _SlowLink(nn.Module):
    """A sharded layer whose sum over the ranks takes ``delay`` seconds longer, as over a link
    with that much more latency per message."""

    def __init__(self, inner: nn.Module, delay: float, counter: list[int]):
        super().__init__()
        self.inner, self.delay, self.counter = inner, delay, counter

    def __call__(self, x: mx.array) -> mx.array:
        return _delayed(self.inner(x), self.delay, self.counter)


def _delayed(y: mx.array, delay: float, counter: list[int]) -> mx.array:
    mx.eval(y)  # the message is sent and received here
    counter[0] += 1
    if delay:
        time.sleep(delay)
    return y


def over_link(y: mx.array) -> mx.array:
    """``y``, the result of a pipeline stage's message (target.py): as it is, or, after
    :func:`slow_links`, evaluated and ``delay`` seconds late."""
    if _slow["counter"] is None:
        return y
    return _delayed(y, _slow["delay"], _slow["counter"])


def slow_links(model: nn.Module, delay: float) -> list[int]:
    """Make every message between the ranks in ``model`` wait ``delay`` seconds more (a tensor
    split's sums over the ranks; a pipeline's hand-on and gather); returns a one-item list
    counting the messages received from now on. ``delay`` 0 undoes it."""
    counter = [0]
    _slow.update(delay=delay, counter=counter if delay else None)
    sharded = (nn.layers.distributed.ShardedToAllLinear,
               nn.layers.distributed.QuantizedShardedToAllLinear)

    def walk(module: nn.Module) -> None:
        for name, child in module.children().items():
            children = child if isinstance(child, list) else [child]
            for i, c in enumerate(children):
                if isinstance(c, _SlowLink):  # slowed before: this delay instead, or none
                    c.delay, c.counter = delay, counter
                    if not delay:
                        if isinstance(child, list):
                            child[i] = c.inner
                        else:
                            setattr(module, name, c.inner)
                elif isinstance(c, sharded) and delay:
                    slow = _SlowLink(c, delay, counter)
                    if isinstance(child, list):
                        child[i] = slow
                    else:
                        setattr(module, name, slow)
                elif isinstance(c, nn.Module):
                    walk(c)

    walk(model)
    return counter
