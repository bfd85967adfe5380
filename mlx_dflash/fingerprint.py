"""Names for models: what a cached file was made for, so that it is never used for another.

``target_fingerprint`` (shape facts and a hash of a few weights) names a target for the feature
store and the pass-cost cache; ``pair_fingerprint`` (configurations and a sample of every weight)
names a (target, drafter) pair for the prefix cache's disk tier.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .target import Target, as_target


def target_fingerprint(target: Target) -> dict:
    """Shape facts plus a hash of a few weights: enough to refuse a store of another model."""
    h = hashlib.sha256()
    rows = target.embed(mx.arange(min(16, target.vocab_size)))
    last = tree_flatten(target.inner.layers[-1].parameters())[0][1]
    for arr in (rows, last.reshape(-1)[:256]):
        h.update(np.array(arr.astype(mx.float32)).tobytes())
    facts = {"model_type": target.model_type, "num_layers": target.num_layers,
             "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
             "weights_sha256": h.hexdigest()[:16]}
    if target.kv_quantization is not None:  # its passes cost otherwise (the cost cache)
        facts["kv_quantization"] = list(target.kv_quantization)
    return facts


def pair_fingerprint(target: Any, drafter: Any) -> str:
    """Names a (target, drafter) pair: their configurations and a sample of every weight, so a
    cache saved for other weights with the same shapes is never loaded."""
    h = hashlib.sha256()
    quantized = as_target(target).kv_quantization
    if quantized is not None:  # its caches hold quantized keys and values
        h.update(f"kv{quantized}".encode())
    for module in (target.model if isinstance(target, Target) else target, drafter):
        if module is None:
            h.update(b"none")
            continue
        h.update(type(module).__module__.encode())
        h.update(repr(sorted(vars(module.args).items())).encode())
        for name, p in tree_flatten(module.parameters()):
            sample = p.reshape(-1)[:64]
            h.update(name.encode() + array_bytes(sample))
    return h.hexdigest()


def array_bytes(a: mx.array) -> bytes:
    """Dtype, shape and raw bytes of an array (for hashing)."""
    head = f"{a.dtype}{a.shape}".encode()
    if a.size == 0:
        return head
    return head + np.array(mx.contiguous(a).view(mx.uint8)).tobytes()
