"""The models a server serves by name: tokenizers always loaded, weights loaded on first use (or
at start, or over the API) after a check that they fit in memory, the least recently used
unloaded above a memory budget or after an idle time, pinned ones never; each loaded model with
its prefix cache.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..drafters.base import drafting
from ..fingerprint import pair_fingerprint
from ..pair_cache import needs_checkpoints
from ..prefix_cache import PrefixCache
from ..schedule import memory_headroom
from ..target import as_target

log = logging.getLogger("mlx_dflash.server")

DEFAULT_CONTEXT = 4096
DEFAULT_CACHE_MEMORY = 2 << 30  # bytes of prefix caches kept in memory, per loaded model

Loader = Callable[[], tuple[Any, Any, Any]]  # -> (model, drafter, tokenizer)


CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "context_length", "n_ctx")


def context_size(model: Any) -> int:
    """The target's context length from its config, or DEFAULT_CONTEXT."""
    args = getattr(model, "args", None)
    return context_of({k: getattr(args, k, None) for k in CONTEXT_KEYS})


def context_of(config: dict[str, Any]) -> int:
    """A config.json's context length (its text part's, for a multimodal one)."""
    text = config.get("text_config") or {}
    for name in CONTEXT_KEYS:
        value = config.get(name, text.get(name))
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def cache_bytes_per_token(config: dict[str, Any]) -> int:
    """Keys and values of one position in every layer, as a config.json describes the model
    (an upper bound for sliding-window and recurrent layers)."""
    c = {**(config.get("text_config") or {}), **config}
    heads = c.get("num_key_value_heads") or c.get("num_attention_heads") or 0
    dim = c.get("head_dim") or (c.get("hidden_size", 0) // max(c.get("num_attention_heads", 1), 1))
    itemsize = 4 if str(c.get("torch_dtype", "")).endswith("float32") else 2
    return 2 * int(c.get("num_hidden_layers", 0)) * int(heads) * int(dim) * itemsize


def weights_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def weight_bytes(*modules: Any) -> int:
    """Bytes of the modules' weights (a LookupDrafts has none)."""
    return sum(p.nbytes for m in modules if isinstance(m, nn.Module)
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
    pinned: bool = False  # never unloaded (budget or idle time)
    last_used: float = 0.0  # time.monotonic() of its last load or request
    need_bytes: int = 0  # weights on disk + caches at its context limit (the fit check)
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
               template_kwargs: dict[str, Any] | None = None,
               path: Path | None = None) -> ServedModel:
    """A ServedModel whose weights ``load`` brings in on first use. With ``path`` (its
    directory) only the tokenizer and config are read now; without, it is loaded once now to
    know them (and stays loaded)."""
    if path is None:
        model, drafter, tokenizer = load()
        return served_model(name, model, drafter, tokenizer, block_size=block_size,
                            max_context=max_context, load=load,
                            template_kwargs=template_kwargs)
    from mlx_lm.utils import load_tokenizer

    config = json.loads((Path(path) / "config.json").read_text())
    context = max_context or context_of(config)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))  # as mlx-lm
    served = ServedModel(name, tokenizer, context, vocab, block_size, load,
                         template_kwargs=dict(template_kwargs or {}),
                         drafter_label="not loaded yet")
    served.need_bytes = weights_on_disk(Path(path)) + cache_bytes_per_token(config) * context
    return served


def _attach(served: ServedModel, model: Any, drafter: Any) -> None:
    from ..drafters.published import describe

    served.model, served.drafter = model, drafter
    served.drafter_label = describe(drafter)
    served.last_used = time.monotonic()
    if model is None:  # a stand-in (tests of the worker)
        return
    served.nbytes = weight_bytes(model, drafter)
    served.need_bytes = max(served.need_bytes, served.nbytes)
    served.checkpoints = needs_checkpoints(as_target(model))


class ModelPool:
    """Served models by name, the first being the default; at most ``max_bytes`` of weights
    stay loaded (least recently used unloaded first; None: no limit)."""

    def __init__(self, models: list[ServedModel], *, max_bytes: int | None = None,
                 cache: CacheSettings | None = None, ttl: float | None = None,
                 headroom: Callable[[], int] | None = None):
        if not models:
            raise ValueError("no models to serve")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ: {names}")
        self.models = {m.name: m for m in models}
        self.default = names[0]
        self.max_bytes = max_bytes
        self.ttl = ttl  # seconds a model may sit idle before it is unloaded (None: forever)
        self.headroom = headroom or memory_headroom  # bytes MLX may still allocate
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

    def touch(self, name: str | None) -> None:
        served = self.get(name)
        if served is not None:
            served.last_used = time.monotonic()

    def fit_problem(self, name: str | None, busy: set[str] = frozenset()) -> str | None:
        """Why the model cannot be loaded without swapping (None: it fits, or is loaded):
        its weights and its caches at the context limit against the free memory plus what
        unloading the idle, unpinned models would free, and against ``max_bytes``."""
        served = self.get(name)
        if served is None or served.loaded or served.load is None:
            return None
        need = served.need_bytes
        if self.max_bytes is not None and need > self.max_bytes:
            return (f"'{served.name}' needs {_gib(need)} (weights and caches at its "
                    f"{served.context}-token context), more than --model-memory "
                    f"{_gib(self.max_bytes)}")
        free = self.headroom() + self._freeable(busy)
        if need > free:
            return (f"'{served.name}' needs {_gib(need)} (weights and caches at its "
                    f"{served.context}-token context) and {_gib(free)} can be had (free memory, "
                    "and idle unpinned models unloaded): loading it would swap. Unload or "
                    "unpin another model, or serve this one with a smaller --max-context or "
                    "quantized")
        return None

    def unload(self, name: str, why: str = "asked") -> bool:
        """Unload a loaded model (not a pinned one: ValueError); False if it was not loaded."""
        served = self.models[name]
        if served.pinned:
            raise ValueError(f"'{name}' is pinned: unpin it first")
        if served.load is None:
            raise ValueError(f"'{name}' was given as objects and cannot be loaded again")
        with self._lock:
            if name not in self._lru or not served.loaded:
                return False
            self._unload(name, why)
        return True

    def expired(self, now: float) -> list[str]:
        """Loaded, unpinned models idle for longer than the ttl."""
        if self.ttl is None:
            return []
        return [n for n in self._unloadable() if self.models[n].loaded
                and now - self.models[n].last_used >= self.ttl]

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the next loaded model's idle time runs out (None: no ttl or none)."""
        if self.ttl is None:
            return None
        times = [self.models[n].last_used + self.ttl - now for n in self._unloadable()]
        return max(0.0, min(times)) if times else None

    def room_for(self, name: str, busy: set[str]) -> bool:
        """Whether the model is loaded, or can be without unloading the ``busy`` ones."""
        served = self.models[name]
        if served.loaded:
            return True
        held = sum(self.models[n].nbytes for n in busy if n in self._lru)
        if self.max_bytes is not None and held + served.need_bytes > self.max_bytes:
            return False
        return self.headroom() + self._freeable(busy) >= served.need_bytes

    def _unloadable(self, protect: set[str] = frozenset()) -> list[str]:
        """Loaded models that may be unloaded (not pinned, not given as objects, not in
        ``protect``), least recently used first."""
        return [n for n in self._lru if not self.models[n].pinned
                and self.models[n].load is not None and n not in protect]

    def _freeable(self, busy: set[str]) -> int:
        """Bytes of weights that unloading the models without requests would free."""
        return sum(self.models[n].nbytes for n in self._unloadable(busy))

    def acquire(self, name: str | None, protect: set[str] = frozenset()) -> ServedModel:
        """The model, loaded (run on the worker thread: loading runs MLX); the models in
        ``protect`` (decoding now) are not unloaded for it."""
        served = self.models[self.default if name is None else name]
        with self._lock:
            if not served.loaded:  # only models with a loader are ever unloaded
                self._make_room(served, protect)
                log.info("loading model '%s'", served.name)
                model, drafter, _ = served.load()
                _attach(served, model, drafter)
            self._lru[served.name] = None
            self._lru.move_to_end(served.name)
            self._unload_above_budget(keep=served.name, protect=protect)
            if served.prefix_cache is None and self.cache.enabled and served.model is not None:
                served.prefix_cache = self._prefix_cache(served)
        return served

    def _prefix_cache(self, served: ServedModel) -> PrefixCache:
        # Without drafting no drafter context is kept: entries hold the target's caches only.
        drafter = drafting(served.drafter, served.block_size)
        return PrefixCache(self.cache.memory, directory=self.cache.directory,
                           max_disk_bytes=self.cache.disk,
                           fingerprint=pair_fingerprint(served.model, drafter))

    def _make_room(self, served: ServedModel, protect: set[str] = frozenset()) -> None:
        """Before a load: unload the least recently used unpinned models until the free memory
        holds what it needs (as far as they go)."""
        for name in self._unloadable(protect):
            if self.headroom() >= served.need_bytes:
                break
            self._unload(name, f"room for '{served.name}'")

    def _unload_above_budget(self, keep: str, protect: set[str] = frozenset()) -> None:
        if self.max_bytes is None:
            return
        while sum(self.models[n].nbytes for n in self._lru) > self.max_bytes:
            victims = [n for n in self._unloadable(protect) if n != keep]
            if not victims:
                break
            self._unload(victims[0])

    def _unload(self, name: str, why: str = "memory budget") -> None:
        served = self.models[name]
        log.info("unloading model '%s' (%s)", name, why)
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
