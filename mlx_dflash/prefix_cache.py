"""Prefix stores for the speculative pair: keep the caches of finished requests, continue from them.

A :class:`PrefixCache` keeps finished pairs keyed by their tokens: least recently used first out
under a byte budget in memory, and optionally on disk (MLX's own ``save_prompt_cache`` /
``load_prompt_cache``, atomic files). A request continues from the entry holding the longest
usable prefix of its prompt:

* caches that can be cut back anywhere (every layer a plain KV cache, or a sliding-window cache
  that has not wrapped yet) are cut to the common prefix, as mlx-lm's server does;
* a cache that cannot (a Gated DeltaNet state, a wrapped sliding window) is reused only when the
  entry's tokens are a prefix of the prompt: the state is exact only where it was saved. For such
  targets ``decode.stream_generate_cached`` also saves checkpoints: at the end of each prompt (less
  its last token), so the next turn of a conversation finds an exact prefix even when the reply
  does not come back token for token, and at positions the caller names (the server: where the
  messages before the last one end, e.g. a shared system prompt).

Reuse is lossless: a cache holds exactly what a fresh prefill of its tokens would hold (up to
the rounding of a different prefill chunking).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from . import distributed
from .fingerprint import array_bytes
from .pair_cache import PairCache
from .target import TargetCache, positions_held

log = logging.getLogger("mlx_dflash.prefix_cache")

FORMAT = "mlx-dflash-prefix-cache/1"


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def usable_prefix(ids: np.ndarray, trimmable: bool, prompt: np.ndarray) -> int:
    """How many prompt tokens an entry holding ``ids`` can stand for (at least one prompt token
    is always prefilled, for the logits of the first new token)."""
    limit = len(prompt) - 1
    common = common_prefix_len(ids, prompt)
    if trimmable:
        return min(common, limit)
    return len(ids) if common == len(ids) <= limit else 0


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)  # compared many times: numpy, 4 bytes a token


def _key(ids: np.ndarray) -> str:
    return hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:40]


def _size(pair: PairCache) -> int:
    """The pair's bytes; across machines rank 0's, so that every rank keeps and evicts alike
    (split by layers, each rank holds a different share of the caches)."""
    return int(distributed.from_root([pair.nbytes])[0])


@dataclass(eq=False)
class _Entry:
    pair: PairCache
    ids: np.ndarray
    nbytes: int
    trimmable: bool


class PrefixCache:
    """Finished pairs keyed by their tokens, least recently used first out above ``max_bytes``
    (or ``max_entries``); with ``directory``, also on disk (at most ``max_disk_bytes``) for
    entries of the models named by ``fingerprint`` (see :func:`fingerprint`)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        max_entries: int | None = None,
        directory: str | os.PathLike | None = None,
        max_disk_bytes: int | None = None,
        fingerprint: str = "",
    ):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.disk = None
        if directory is not None:
            self.disk = DiskCache(Path(directory), fingerprint, max_disk_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget the entries in memory (the disk tier stays)."""
        self._entries.clear()
        self.nbytes = 0

    def fetch(self, tokens: Sequence[int], take: bool | None = None) -> tuple[PairCache, int]:
        """A pair holding the longest usable prefix of ``tokens`` and that prefix's length, or an
        empty pair and 0. ``take``: hand over the stored pair itself (it leaves the store) rather
        than a fork of it; by default only when it can be cut back and is a prefix of
        ``tokens`` (then the finished request's entry makes it redundant anyway)."""
        prompt = _ids(tokens)
        key, best = None, 0
        for k, e in self._entries.items():
            n = usable_prefix(e.ids, e.trimmable, prompt)
            if n > best:
                key, best = k, n
        entry = self._entries.get(key)
        if self.disk is not None:
            disk_key, n = self.disk.best(prompt)
            if n > best and (pair := self.disk.load(disk_key)) is not None:
                key, best = disk_key, n
                entry = _Entry(pair, _ids(pair.tokens), _size(pair), pair.trimmable())
                self._add(key, entry)  # kept in memory too, if it fits
        if entry is None:
            return PairCache(), 0
        if take is None:
            take = entry.trimmable and best == len(entry.ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            if not take:
                return entry.pair.fork(best), best
            self._pop(key)
        pair = entry.pair
        if best < len(entry.ids):
            pair.trim_to(best)
        return pair, best

    def insert(self, pair: PairCache) -> None:
        """Keep a finished pair (the store owns it from now on: do not use it any more)."""
        if not pair.tokens:
            return
        ids = _ids(pair.tokens)
        key = _key(ids)
        entry = _Entry(pair, ids, _size(pair), pair.trimmable())
        self._pop(key)
        if entry.trimmable:  # it can stand in for any entry holding a prefix of it
            for k in [k for k, e in self._entries.items() if _is_prefix(e.ids, ids)]:
                self._pop(k)
        if self.disk is not None:
            self.disk.save(key, pair, entry.trimmable)
        if entry.nbytes <= self.max_bytes:
            self._add(key, entry)

    def _add(self, key: str, entry: _Entry) -> None:
        self._pop(key)
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > 1 and (self.nbytes > self.max_bytes or len(self._entries) > (
                self.max_entries or len(self._entries))):
            self._pop(next(iter(self._entries)))
        if self.nbytes > self.max_bytes:
            self._pop(key)

    def _pop(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry


def _is_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) <= len(b) and bool(np.array_equal(a, b[: len(a)]))


# -- the disk tier ----------------------------------------------------------------------------
def _digest(layers: list[Any]) -> str:
    """A checksum of the cache states, written with them and checked on load."""
    h = hashlib.sha256()
    for path, leaf in tree_flatten([c.state for c in layers]):
        h.update(path.encode())
        h.update(array_bytes(leaf) if isinstance(leaf, mx.array) else repr(leaf).encode())
    return h.hexdigest()


LAYER_CLASSES = {"KVCache", "RotatingKVCache", "ArraysCache"}  # what a file may name


def _read_header(path: Path) -> dict[str, str]:
    """The metadata ``save_prompt_cache`` wrote (ours is its first part, ``0.name`` in the file;
    the layers' classes the second), after checking that the file holds all the data its
    header names and only cache classes a target or drafter uses."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 30:
            raise ValueError("header length out of range")
        header = json.loads(f.read(n))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
              default=0)
    if path.stat().st_size < 8 + n + end:
        raise ValueError("the file is truncated")
    meta = header.get("__metadata__", {})
    classes = {v for k, v in meta.items() if k.startswith("1.")}
    if not classes <= LAYER_CLASSES:
        raise ValueError(f"unexpected cache classes {sorted(classes - LAYER_CLASSES)}")
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


@dataclass
class _DiskEntry:
    path: Path
    ids: np.ndarray
    trimmable: bool
    size: int
    used: float


class DiskCache:
    """Pairs saved as ``<dir>/<pair>/<key>.safetensors`` (``save_prompt_cache``: target layers,
    then drafter layers; tokens, fingerprint and a checksum in the metadata). Files are written
    to a temporary name and renamed, so a crash never leaves half a file under a real name; a
    file that is truncated, corrupt or saved for another pair is skipped with a warning."""

    def __init__(self, directory: Path, fingerprint: str, max_bytes: int | None = None):
        self.fingerprint = fingerprint
        self.dir = directory / hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._index: dict[str, _DiskEntry] = {}
        for path in sorted(self.dir.glob("*.safetensors")):
            if not path.name.startswith("."):
                self._scan(path)

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def _scan(self, path: Path) -> None:
        try:
            meta = _read_header(path)
            self._check_meta(meta)
            ids = _ids(json.loads(meta["tokens"]))
            if path.stem != _key(ids):
                raise ValueError("the file name does not match its tokens")
        except Exception as e:  # noqa: BLE001 (any unreadable file is skipped, never fatal)
            log.warning("prompt cache: skipping %s: %s", path, e)
            return
        st = path.stat()
        self._index[path.stem] = _DiskEntry(path, ids, meta.get("trimmable") == "1",
                                            st.st_size, st.st_mtime)

    def _check_meta(self, meta: dict[str, str]) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} file")
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError("saved for another model or drafter")

    def best(self, prompt: np.ndarray) -> tuple[str | None, int]:
        key, best = None, 0
        for k, e in self._index.items():
            n = usable_prefix(e.ids, e.trimmable, prompt)
            if n > best:
                key, best = k, n
        return key, best

    def load(self, key: str) -> PairCache | None:
        """The pair saved under ``key``, checked; None (with a warning) if it does not check."""
        entry = self._index[key]
        try:
            self._check_meta(_read_header(entry.path))  # before anything is built from it
            layers, meta = load_prompt_cache(str(entry.path), return_metadata=True)
            self._check_meta(meta)
            n_target = int(meta["num_target_layers"])
            if _digest(layers) != meta["digest"]:
                raise ValueError("checksum mismatch")
            if any(positions_held(c) not in (None, len(entry.ids)) for c in layers):
                raise ValueError("the caches do not hold the saved tokens")
            mx.eval([c.state for c in layers])
        except Exception as e:  # noqa: BLE001 (a bad file costs a prefill, never a crash)
            log.warning("prompt cache: skipping %s: %s", entry.path, e)
            del self._index[key]
            return None
        os.utime(entry.path)
        entry.used = time.time()
        drafter = layers[n_target:] or None
        return PairCache(TargetCache(layers[:n_target]), drafter, entry.ids.tolist())

    def save(self, key: str, pair: PairCache, trimmable: bool) -> None:
        if key in self._index:
            return
        if self.max_bytes is not None and pair.nbytes > self.max_bytes:
            return
        compact = pair.fork()  # KV caches cut to their filled part
        layers = compact.layers
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": json.dumps(pair.tokens, separators=(",", ":")),
            "trimmable": "1" if trimmable else "0",
            "num_target_layers": str(len(compact.target or [])),
            "digest": _digest(layers),
        }
        path = self.dir / f"{key}.safetensors"
        tmp = self.dir / f".{key}.{os.getpid()}.tmp.safetensors"
        try:
            save_prompt_cache(str(tmp), layers, meta)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("prompt cache: could not write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return
        ids = _ids(pair.tokens)
        if trimmable:
            for k in [k for k, e in self._index.items() if _is_prefix(e.ids, ids)]:
                self._remove(k)
        self._index[key] = _DiskEntry(path, ids, trimmable, path.stat().st_size, time.time())
        self._evict(keep=key)

    def _evict(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while self.nbytes > self.max_bytes and len(self._index) > 1:
            oldest = min((k for k in self._index if k != keep), key=lambda k: self._index[k].used)
            self._remove(oldest)

    def _remove(self, key: str) -> None:
        entry = self._index.pop(key)
        entry.path.unlink(missing_ok=True)
