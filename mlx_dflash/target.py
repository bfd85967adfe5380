"""The target model: an mlx-lm model that also returns hidden states at the drafter's tap layers.

mlx-lm models have no hook for hidden states, so `Target.forward` runs the same modules the
model's own ``__call__`` runs (embedding, layers with the model's masks, final norm, head) and
keeps the outputs of the tap layers. The model's parameter tree is never touched. On creation the
forward is checked against ``model(x, cache)`` once, so an architecture whose forward differs
(embedding scale, extra inputs) fails loudly instead of silently changing the output.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


class UnsupportedTargetError(ValueError):
    pass


class Target:
    """Wraps an mlx-lm model; owns all knowledge of mlx-lm model internals."""

    def __init__(self, model: nn.Module, check: bool = True):
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise UnsupportedTargetError(
                f"target model {type(model).__module__} has no .model.layers / .model.embed_tokens;"
                " only standard decoder-only mlx-lm models are supported"
            )
        self.model = model
        self.inner = inner
        args = getattr(model, "args", None)
        self.model_type = getattr(args, "model_type", type(model).__module__.split(".")[-1])
        self.num_layers = len(inner.layers)
        self.hidden_size = int(args.hidden_size)
        self.vocab_size = int(args.vocab_size)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(
            model, "lm_head"
        )
        if check:
            self._check_forward()

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the target computes in (its embedding's, or its scales' if quantized)."""
        emb = self.inner.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    # -- the pieces the drafter shares ------------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The LM head's rows for ``ids`` as a dense float matrix [len(ids), D]."""
        layer = self.inner.embed_tokens if self.tied else self.model.lm_head
        if hasattr(layer, "scales"):  # quantized embedding or linear
            biases = getattr(layer, "biases", None)
            return mx.dequantize(layer.weight[ids], layer.scales[ids],
                                 None if biases is None else biases[ids],
                                 group_size=layer.group_size, bits=layer.bits,
                                 mode=getattr(layer, "mode", "affine"))
        return layer.weight[ids]

    # -- forward with features ---------------------------------------------------------------
    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def hidden_states(
        self, tokens: mx.array, cache: list[Any] | None, layer_ids: Sequence[int]
    ) -> tuple[mx.array, mx.array | None]:
        """Run the decoder stack. Returns (final post-norm hidden, concatenated tap features)."""
        inner = self.inner
        h = inner.embed_tokens(tokens)
        if cache is None:
            cache = [None] * self.num_layers
        masks = self._masks(h, cache)
        taps = {}
        wanted = set(layer_ids)
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            h = layer(h, masks[i], c)
            if i in wanted:
                taps[i] = h
        features = mx.concatenate([taps[i] for i in layer_ids], axis=-1) if layer_ids else None
        return inner.norm(h), features

    def forward(
        self, tokens: mx.array, cache: list[Any] | None, layer_ids: Sequence[int] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """Logits (equal to ``model(tokens, cache)``) and the tap-layer features."""
        h, features = self.hidden_states(tokens, cache, layer_ids)
        return self.lm_head(h), features

    def _masks(self, h: mx.array, cache: list[Any]) -> list[Any]:
        inner = self.inner
        # llama.py (and its derivatives) mix full and sliding-window layers with two masks.
        if hasattr(inner, "fa_idx"):
            fa_mask = create_attention_mask(h, cache[inner.fa_idx])
            swa_idx = getattr(inner, "swa_idx", None)
            swa_mask = None
            if swa_idx is not None:
                swa_mask = create_attention_mask(
                    h, cache[swa_idx], window_size=inner.sliding_window
                )
            return [
                swa_mask if getattr(layer, "use_sliding", False) else fa_mask
                for layer in inner.layers
            ]
        mask = create_attention_mask(h, cache[0])
        return [mask] * self.num_layers

    @staticmethod
    def rollback(cache: list[Any], num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions from a KV cache (after a partial accept)."""
        if num_tokens > 0:
            trim_prompt_cache(cache, num_tokens)

    def _check_forward(self) -> None:
        probe = mx.array([[1, 2, 3, 4]]) % self.vocab_size
        expected = self.model(probe, cache=make_prompt_cache(self.model))
        got, _ = self.forward(probe, make_prompt_cache(self.model))
        if expected.shape != got.shape or not mx.array_equal(expected, got).item():
            raise UnsupportedTargetError(
                f"model type '{self.model_type}': the feature-tapping forward does not reproduce "
                "model(x) exactly; this architecture is not supported yet"
            )
