"""Tree drafts in the batch engine: one tree pass over every row (each its own tree mask,
depths and padding) equals each row's own tree pass; every request's greedy output equals its
own run, with accepted paths on side branches, on full-attention, sliding-window and Gated
DeltaNet targets; sampled rows follow the target; tree="auto" ranks all requests' nodes."""

import mlx.core as mx
import numpy as np
import pytest
from test_batch import (
    MAX_TOKENS, PROMPTS, BatchOracle, batch_costs, batch_samples, check_against_solo, run_engine,
)
from test_lossless_greedy import reference
from test_lossless_sampling import V, assert_follows, exact_joint
from test_schedule import COSTS
from test_tree import TreeOracle, record_side_branches, record_tree_sizes
from tiny import make_drafter, make_family_target, make_target, make_tokenizer

import mlx_dflash.batch as batch
import mlx_dflash.policy as policy
from mlx_dflash.accept import SamplingParams
from mlx_dflash.batch import BatchEngine
from mlx_dflash.batch_cache import make_batch_cache
from mlx_dflash.target import Target
from mlx_dflash.tree import DraftTree


class BatchTreeOracle(BatchOracle):
    """BatchOracle's requests, each drafted as test_tree.TreeOracle drafts its one sequence:
    the true token often second among a position's candidates, sometimes absent."""

    def __init__(self, drafter, sequences, seed=0):
        super().__init__(drafter, sequences, seed=seed)
        self.trees = TreeOracle(drafter, None, seed)

    def grow_tree(self, target, anchor, cache, width, beam):
        self.trees.sequence = self.by_cache[id(cache[0])]
        return self.trees.grow_tree(target, anchor, cache, width, beam)


def family_model(family):
    if family == "qwen3":
        return make_target("qwen3", seed=2)
    return make_family_target(family, seed=1)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "qwen3_next"])
def test_a_batched_tree_pass_equals_each_rows_own(family):
    """Three rows of different contexts: a tree, a chain, and a smaller tree padded; each
    row's logits are its own tree pass's, and after keeping a side path in one row and a
    prefix in another the next pass continues each as its own caches would."""
    target = Target(family_model(family), check=False)
    contexts = [[5, 9, 14, 3, 9, 14, 22, 8, 11, 4, 6], [7, 8], [3, 4, 5, 6, 30, 31]]
    trees = [DraftTree([10, 20, 11, 30, 21], [-1, 0, -1, 1, 0]),
             DraftTree([40, 41, 42], [-1, 0, 1]),
             DraftTree([50, 51], [-1, -1])]
    kept = [[0, 3], [0, 1, 2], [0, 2]]
    anchors = [7, 9, 12]
    W = 1 + max(len(t) for t in trees)
    singles, batch_cache = [], make_batch_cache(target)
    for context in contexts:
        cache = target.make_cache()
        target.hidden_states(mx.array([context], dtype=mx.uint32), cache, ())
        batch_cache.add_row(cache)
        singles.append(cache)
    tokens, depths, visible = [], [], []
    for a, t in zip(anchors, trees):
        pad = W - 1 - len(t)
        tokens.append([a] + t.tokens + [0] * pad)
        depths.append(t.depths() + [1] * pad)
        seen = np.zeros((W, W), dtype=bool)
        seen[: len(t) + 1, : len(t) + 1] = t.visible()
        seen[len(t) + 1 :, 0] = True
        seen[np.arange(len(t) + 1, W), np.arange(len(t) + 1, W)] = True
        visible.append(seen)
    got, _ = target.forward_tree(mx.array(tokens, dtype=mx.uint32), mx.array(depths),
                                 mx.array(np.stack(visible)), batch_cache, max_depth=W - 1)
    for i, (a, t, cache) in enumerate(zip(anchors, trees, singles)):
        want, _ = target.forward_tree(mx.array([[a] + t.tokens], dtype=mx.uint32), t.depths(),
                                      t.visible(), cache)
        assert mx.allclose(got[i, : len(t) + 1], want[0], atol=1e-3).item(), i
        target.keep_rows(cache, kept[i])
    batch_cache.commit_rows(kept)
    nxt = mx.array([[60, 61], [62, 63], [64, 65]], dtype=mx.uint32)
    got, _ = target.forward(nxt, batch_cache)
    for i, cache in enumerate(singles):
        want, _ = target.forward(nxt[i : i + 1], cache)
        assert mx.allclose(got[i], want[0], atol=1e-3).item(), i


# 30 nodes from 5 draft positions: more than TREE_BEAM paths a level would hold (20)
@pytest.mark.parametrize("family,size", [("qwen3", 6), ("gemma3_text", 6), ("qwen3_next", 6),
                                         ("qwen3", 30)])
def test_batched_greedy_trees_equal_each_solo_run(family, size, monkeypatch):
    side = record_side_branches(monkeypatch)
    sizes = record_tree_sizes(monkeypatch, batch)
    model = family_model(family)
    text = Target(model, check=False).model
    sequences = [p + reference(model, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
    drafter = BatchTreeOracle(make_drafter(text, block_size=6, layer_ids=(0, 1, 3)), sequences)
    outputs, reasons, accepted = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=3,
                                            block_size=6, tree=size, copy_drafts=False)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)
    assert accepted > 0 and any(side) and set(sizes) == {size}


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark", "dspark-gated"])
def test_one_drafter_pass_grows_each_requests_own_tree(family):
    """The batch engine grows every drafting request's tree in one drafter pass: each row's
    candidate nodes, parents and scores are its own ``grow_tree``'s (contexts of different
    lengths, padded and masked; DSpark's vocabulary reduced)."""
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    from mlx_dflash.drafters.base import grow_trees
    from mlx_dflash.tree import TREE_BEAM

    model = make_target("qwen3", seed=2)
    target = Target(model, check=False)
    drafter = {"dflash": lambda: make_drafter(model, block_size=6),
               "dflash2": lambda: make_dflash2(model),
               "dspark": lambda: make_dspark(model, vocab=list(range(0, 128, 2))),
               "dspark-gated": lambda: make_dspark(model, kind="gated")}[family]()
    contexts = [[5, 9, 14, 3, 9, 14, 22, 8, 11, 4, 6], [7, 8], [3, 4, 5, 6, 30, 31]]
    anchors = [mx.array([a], dtype=mx.uint32) for a in (7, 9, 12)]
    caches = []
    for context in contexts:
        tokens = mx.array([context], dtype=mx.uint32)
        _, features = target.hidden_states(tokens, target.make_cache(),
                                           drafter.target_layer_ids)
        caches.append(drafter.make_cache())
        drafter.commit(features, caches[-1], tokens)
    together = grow_trees(drafter, target, anchors, caches, 8, TREE_BEAM)
    for got, anchor, cache in zip(together, anchors, caches):
        want = drafter.grow_tree(target, anchor, cache, 8, TREE_BEAM)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
        assert mx.allclose(got[2], want[2], atol=1e-4).item()


def test_batched_trees_beside_copy_drafts_and_a_real_drafter():
    model = make_target("qwen3", seed=2)
    outputs, reasons, _ = run_engine(model, make_drafter(model, block_size=6), PROMPTS,
                                     MAX_TOKENS, max_batch=4, block_size=6, tree=5)
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)


def test_auto_ranks_every_requests_nodes_in_one_budget(monkeypatch):
    """tree="auto": TREE_MAX nodes grown per drafting request, cut by one ranking across the
    batch (schedule.plan_nodes); output equal to each solo run, some trees verified."""
    monkeypatch.setattr(policy, "cached_costs", lambda *a: COSTS)
    monkeypatch.setattr(batch, "cached_batch_costs", lambda *a: batch_costs(0.2))
    monkeypatch.setattr("mlx_dflash.schedule.memory_headroom", lambda: 1 << 40)
    planned = []
    plan_nodes = batch.plan_nodes
    monkeypatch.setattr(batch, "plan_nodes",
                        lambda survival, *a: planned.append(len(survival)) or plan_nodes(
                            survival, *a))
    model = make_target("qwen3", seed=2)
    sequences = [p + reference(model, p, n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
    drafter = BatchTreeOracle(make_drafter(model, block_size=8), sequences)
    engine_trees = []
    record = batch.BatchEngine._tree_pass

    def counted(self, proposals, trees, *a):
        engine_trees.append(len(trees))
        return record(self, proposals, trees, *a)

    monkeypatch.setattr(batch.BatchEngine, "_tree_pass", counted)
    outputs, reasons, accepted = run_engine(model, drafter, PROMPTS, MAX_TOKENS, max_batch=4,
                                            tree="auto")
    check_against_solo(model, PROMPTS, outputs, reasons, MAX_TOKENS)
    assert accepted > 0 and max(planned) > 1 and max(engine_trees) > 1


def test_sampled_rows_with_trees_follow_the_target():
    """Sampled requests verifying trees beside a greedy one: each row's first four tokens
    follow the target's exact joint distribution."""
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    params = SamplingParams(1.0, 0.9, 0)
    joint, marginal4 = exact_joint(model, params)
    counts, counts4, accepted = batch_samples(model, drafter, 13, block_size=4, tree=5,
                                              copy_drafts=False)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def test_trees_need_a_drafter_that_grows_them():
    model = make_target("qwen3", seed=2)
    with pytest.raises(ValueError, match="drafter"):
        BatchEngine(model, None, make_tokenizer(128), tree=4)
    with pytest.raises(ValueError, match="tree must be"):
        BatchEngine(model, make_drafter(model, block_size=4), make_tokenizer(128), tree=0)
