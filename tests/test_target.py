"""The target adapter: exact logits, tap features, rollback, parameter tree intact."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from tiny import make_target

from mlx_dflash import attention
from mlx_dflash.target import Target


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_model_call(model_type, tied):
    model = make_target(model_type, tied=tied)
    n_params = len(tree_flatten(model.parameters()))
    target = Target(model)
    tokens = mx.array([[5, 9, 2, 7, 3, 11, 4]])
    c_ref, c_ours = make_prompt_cache(model), make_prompt_cache(model)
    c_mlx = make_prompt_cache(model)
    for chunk in (tokens[:, :4], tokens[:, 4:6], tokens[:, 6:]):
        with attention.on_cpu():  # the attention the target's passes use: exactly equal
            want = model(chunk, cache=c_ref)
        got, features = target.forward(chunk, c_ours, layer_ids=[0, 2, 3])
        assert mx.array_equal(want, got)
        # against MLX's own attention: equal up to rounding
        assert mx.allclose(model(chunk, cache=c_mlx), got, rtol=1e-5, atol=1e-5)
        assert features.shape == (1, chunk.shape[1], 3 * model.args.hidden_size)
    assert len(tree_flatten(model.parameters())) == n_params


def test_features_are_layer_outputs():
    model = make_target("qwen3")
    target = Target(model)
    tokens = mx.array([[1, 2, 3]])
    _, features = target.forward(tokens, None, layer_ids=[1])
    h = model.model.embed_tokens(tokens)
    mask = "causal"
    with attention.on_cpu():
        for layer in model.model.layers[:2]:
            h = layer(h, mask, None)
    assert mx.allclose(features, h)


def test_rollback_restores_cache_state():
    model = make_target("llama")
    target = Target(model)
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3, 4]]), cache)
    after_prompt = model(mx.array([[5]]), cache=make_prompt_cache(model))  # warm
    target.forward(mx.array([[9, 8, 7]]), cache)
    Target.rollback(cache, 2)
    assert cache[0].offset == 5
    got, _ = target.forward(mx.array([[6]]), cache)
    ref_cache = make_prompt_cache(model)
    want = model(mx.array([[1, 2, 3, 4, 9, 6]]), cache=ref_cache)[:, -1:]
    assert mx.allclose(got, want, atol=1e-5)
    del after_prompt


def test_unsupported_model_is_rejected():
    import mlx.nn as nn

    with pytest.raises(ValueError, match="only standard decoder-only"):
        Target(nn.Linear(2, 2))
