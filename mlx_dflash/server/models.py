"""The models a server serves by name: tokenizers always loaded, weights loaded on first use and
the least recently used unloaded above a memory budget; each loaded model with its prefix cache.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..drafters.base import drafting
from ..fingerprint import pair_fingerprint
from ..pair_cache import needs_checkpoints
from ..prefix_cache import PrefixCache
from ..target import as_target

log = logging.getLogger("mlx_dflash.server")

DEFAULT_CONTEXT = 4096
DEFAULT_CACHE_MEMORY = 2 << 30  # bytes of prefix caches kept in memory, per loaded model

Loader = Callable[[], tuple[Any, Any, Any]]  # -> (model, drafter, tokenizer)


def context_size(model: Any) -> int:
    """The target's context length from its config, or DEFAULT_CONTEXT."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length", "n_ctx"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def weight_bytes(*modules: Any) -> int:
    return sum(p.nbytes for m in modules if m is not None
               for _, p in tree_flatten(m.parameters()))


@dataclass
class CacheSettings:
    """Prefix caches: ``memory`` bytes per loaded model (0: none in memory); with ``directory``
    also on disk, at most ``disk`` bytes per model (None: no limit)."""

    memory: int = DEFAULT_CACHE_MEMORY
    directory: str | None = None
    disk: int | None = None

    @property
    def enabled(self) -> bool:
        return self.memory > 0 or self.directory is not None


@dataclass(eq=False)
class ServedModel:
    """One model served by name. The tokenizer, context size and vocabulary size stay known while
    the weights (``model``, ``drafter``) may be unloaded; ``load`` brings them back."""

    name: str
    tokenizer: TokenizerWrapper
    context: int
    vocab_size: int | None
    block_size: int | None = None
    load: Loader | None = None  # None: given as objects, never unloaded
    model: Any = None
    drafter: Any = None
    nbytes: int = 0
    drafter_label: str = ""  # what drafts for it, for people (drafters.published.describe)
    checkpoints: bool = False  # its caches cannot be cut back: store checkpoints
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # every request's, by default
    prefix_cache: PrefixCache | None = field(default=None, repr=False)

    @property
    def loaded(self) -> bool:
        return self.load is None or self.model is not None


def served_model(
    name: str, model: Any, drafter: Any, tokenizer: Any, *, block_size: int | None = None,
    max_context: int | None = None, load: Loader | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ServedModel:
    """A ServedModel from loaded objects (``load``: how to load them again once unloaded;
    ``template_kwargs``: the chat template's arguments, e.g. ``enable_thinking``)."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    served = ServedModel(name, tokenizer, max_context or context_size(model),
                         getattr(getattr(model, "args", None), "vocab_size", None), block_size,
                         load, template_kwargs=dict(template_kwargs or {}))
    _attach(served, model, drafter)
    return served


def lazy_model(name: str, load: Loader, *, block_size: int | None = None,
               max_context: int | None = None,
               template_kwargs: dict[str, Any] | None = None) -> ServedModel:
    """A ServedModel loaded once now (to know its tokenizer and context), unloadable later."""
    model, drafter, tokenizer = load()
    return served_model(name, model, drafter, tokenizer, block_size=block_size,
                        max_context=max_context, load=load, template_kwargs=template_kwargs)


def _attach(served: ServedModel, model: Any, drafter: Any) -> None:
    from ..drafters.published import describe

    served.model, served.drafter = model, drafter
    served.drafter_label = describe(drafter)
    if model is None:  # a stand-in (tests of the worker)
        return
    served.nbytes = weight_bytes(model, drafter)
    served.checkpoints = needs_checkpoints(as_target(model))


class ModelPool:
    """Served models by name, the first being the default; at most ``max_bytes`` of weights
    stay loaded (least recently used unloaded first; None: no limit)."""

    def __init__(self, models: list[ServedModel], *, max_bytes: int | None = None,
                 cache: CacheSettings | None = None):
        if not models:
            raise ValueError("no models to serve")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ: {names}")
        self.models = {m.name: m for m in models}
        self.default = names[0]
        self.max_bytes = max_bytes
        self.cache = cache or CacheSettings()
        self._lru: OrderedDict[str, None] = OrderedDict()  # loaded models, oldest use first
        self._lock = threading.Lock()
        for m in models:
            if m.loaded:
                self._lru[m.name] = None
        self._unload_above_budget(keep=self.default)

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str | None) -> ServedModel | None:
        return self.models.get(self.default if name is None else name)

    def loaded(self) -> list[str]:
        return [name for name in self._lru if self.models[name].loaded]

    def acquire(self, name: str | None) -> ServedModel:
        """The model, loaded (run on the worker thread: loading runs MLX)."""
        served = self.models[self.default if name is None else name]
        with self._lock:
            if not served.loaded:  # only models with a loader are ever unloaded
                log.info("loading model '%s'", served.name)
                model, drafter, _ = served.load()
                _attach(served, model, drafter)
            self._lru[served.name] = None
            self._lru.move_to_end(served.name)
            self._unload_above_budget(keep=served.name)
            if served.prefix_cache is None and self.cache.enabled and served.model is not None:
                served.prefix_cache = self._prefix_cache(served)
        return served

    def _prefix_cache(self, served: ServedModel) -> PrefixCache:
        # Without drafting no drafter context is kept: entries hold the target's caches only.
        drafter = drafting(served.drafter, served.block_size)
        return PrefixCache(self.cache.memory, directory=self.cache.directory,
                           max_disk_bytes=self.cache.disk,
                           fingerprint=pair_fingerprint(served.model, drafter))

    def _unload_above_budget(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while sum(self.models[n].nbytes for n in self._lru) > self.max_bytes:
            victims = [n for n in self._lru if n != keep and self.models[n].load is not None]
            if not victims:
                break
            self._unload(victims[0])

    def _unload(self, name: str) -> None:
        served = self.models[name]
        log.info("unloading model '%s' (memory budget)", name)
        served.model = served.drafter = served.prefix_cache = None  # the disk tier stays
        del self._lru[name]
        gc.collect()
        mx.clear_cache()


# -- what `serve` reads ----------------------------------------------------------------------------
@dataclass
class ModelEntry:
    """One model of a config file: ``{"name": ..., "model": ..., "drafter": ..., "block_size":
    ..., "chat_template_kwargs": {...}}`` (``model`` null: the default pair; ``drafter``
    "none": the target alone)."""

    name: str | None
    model: str | None
    drafter: str | None = None
    block_size: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def read_models_config(path: str | Path) -> list[ModelEntry]:
    """``{"models": [...]}`` or a bare list of entries, as JSON."""
    data = json.loads(Path(path).read_text())
    items = data.get("models") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a JSON list of models (or {{\"models\": [...]}})")
    entries = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - {"name", "model", "drafter", "block_size",
                                                       "chat_template_kwargs"}:
            raise ValueError(f"{path}: model {i} must be an object with name, model, drafter, "
                             "block_size, chat_template_kwargs")
        block = item.get("block_size")
        if block is not None and (not isinstance(block, int) or block < 1):
            raise ValueError(f"{path}: model {i}: block_size must be a positive integer")
        kwargs = item.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"{path}: model {i}: chat_template_kwargs must be an object")
        entries.append(ModelEntry(item.get("name"), item.get("model"), item.get("drafter"),
                                  block, kwargs))
    return entries
