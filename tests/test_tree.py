"""Tree drafts (tree.py): the tree's shape, one target pass over it equal to ordinary passes,
and generation with trees equal to the target's own output (greedy: token for token, with
accepted paths ending on side branches; sampled: in distribution)."""

import mlx.core as mx
import numpy as np
import pytest
from test_lossless_greedy import reference
from test_lossless_sampling import (
    N_SAMPLES,
    V,
    assert_follows,
    exact_joint,
    sample_runs,
)
from test_schedule import COSTS
from tiny import make_drafter, make_family_target, make_target, make_tokenizer

import mlx_dflash.policy as policy
from mlx_dflash import generate, stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.target import Target
from mlx_dflash.tree import (
    TREE_BEAM,
    TREE_CANDIDATES,
    DraftTree,
    grow_tree,
    independent,
    select_tree,
)


@pytest.fixture(autouse=True)
def fixed_pass_costs(monkeypatch):
    """tree="auto" and the scheduler size blocks from measured pass times; on a loaded machine
    a tiny model's timings can make plain decoding pay, leaving nothing drafted to check."""
    monkeypatch.setattr(policy, "cached_costs", lambda *a: COSTS)


def test_the_tree_is_the_best_nodes_of_the_best_paths():
    logits = np.full((3, 40), -1e9, np.float32)
    for d, (a, b) in enumerate([(0.7, 0.3), (0.6, 0.4), (0.9, 0.1)]):
        logits[d, 10 * (d + 1)], logits[d, 10 * (d + 1) + 1] = np.log(a), np.log(b)
    grown = independent(mx.array(logits), 2, None, beam=2)
    chosen = select_tree(*grown, 5)
    tree = DraftTree(chosen.tokens.tolist(), chosen.parents.tolist(), chosen.scores.tolist())
    # levels keep 10 .7, 11 .3 | 10-20 .42, 10-21 .28 | 10-20-30 .378, 10-21-30 .252
    assert tree.tokens == [10, 20, 30, 11, 21]
    assert tree.parents == [-1, 0, 1, -1, 0]
    assert np.allclose(tree.scores, [0.7, 0.42, 0.378, 0.3, 0.28])
    assert tree.depths() == [0, 1, 2, 3, 1, 2] == chosen.depths.tolist()
    visible = tree.visible()
    assert (visible == np.array(chosen.visible)).all()
    assert visible[3].tolist() == [True, True, True, True, False, False]  # 10-20-30
    assert visible[5].tolist() == [True, True, False, False, False, True]  # 10-21
    assert all(s <= tree.scores[p] for s, p in zip(tree.scores, tree.parents) if p >= 0)


def select_on_host(tokens, parents, scores, size):
    """The reference: the ``size`` best nodes by score, then depth, in numpy."""
    depth = np.zeros(len(tokens), dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    order = np.lexsort((depth, -scores))[:size]
    new_index = {int(old): new for new, old in enumerate(order)}
    return DraftTree([int(tokens[old]) for old in order],
                     [-1 if parents[old] < 0 else new_index[int(parents[old])] for old in order],
                     [float(np.exp(scores[old])) for old in order])


def test_the_tree_chosen_on_the_device_is_the_hosts():
    """select_tree (on the device: no sync before the pass) picks the reference's nodes in
    its order, with its parents, depths and mask, over random grown trees of every shape."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        K, beam, size = int(rng.integers(1, 8)), int(rng.integers(1, 5)), int(rng.integers(1, 20))
        first = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
        steps = mx.array(rng.standard_normal((K, 8, 8)).astype(np.float32) * 2)
        ids = mx.array(rng.integers(0, 100, (K, 8)).astype(np.uint32))
        grown = grow_tree(first, lambda d, p, _: steps[d][p], ids, beam)  # noqa: B023
        host = select_on_host(*(np.array(a) for a in grown), size)
        lazy = select_tree(*grown, size)
        assert np.array(lazy.tokens).tolist() == host.tokens
        assert np.array(lazy.parents).tolist() == host.parents
        assert np.array(lazy.depths).tolist() == host.depths()
        assert (np.array(lazy.visible) == host.visible()).all()
        assert np.allclose(np.array(lazy.scores), host.scores, rtol=1e-5)


def test_a_child_tying_its_parent_comes_after_it():
    """A confident drafter gives a child its parent's path probability (a transition of
    probability 1): the device's order puts the parent first even with the child listed
    first and scores too large for a small nudge to separate them."""
    tokens = mx.array([12, 10, 11, 13], dtype=mx.uint32)
    parents = mx.array([1, -1, -1, 1], dtype=mx.int32)
    scores = mx.array([-20.0, -20.0, -30.0, -40.0])
    for size, want in [(1, [10]), (2, [10, 12]), (3, [10, 12, 11])]:
        lazy = select_tree(tokens, parents, scores, size)
        assert np.array(lazy.tokens).tolist() == want
        assert np.array(lazy.parents).tolist() == [-1, 0, -1][:size]


@pytest.mark.parametrize("family", ["dspark", "dflash2"])
def test_a_tree_of_one_path_is_the_drafters_greedy_walk(family):
    """Each node's children are scored given its token (DSpark: the Markov head; DFlash 2:
    the selector's pair scores): with one path per level the tree is the walk's greedy chain."""
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    from mlx_dflash.cycle import prefill

    model = make_target("qwen3", seed=2)
    drafter = make_dspark(model) if family == "dspark" else make_dflash2(model)
    target = Target(model)
    cache, dcache = target.make_cache(), drafter.make_cache()
    prefill(target, [5, 9, 14, 3], cache, drafter, dcache)
    anchor = mx.array([7], dtype=mx.uint32)
    width = drafter.block_size
    chain = drafter.propose(target, anchor, dcache, width, drafter.max_drafts, SamplingParams())
    grown = drafter.grow_tree(target, anchor, dcache, width, beam=1)
    assert np.array(grown[0]).tolist() == np.array(chain.drafts).tolist()
    assert np.array(grown[1]).tolist() == [-1] + list(range(drafter.max_drafts - 1))


def test_the_walk_follows_the_target_down_any_branch():
    tree = DraftTree(tokens=[10, 20, 11, 30, 21], parents=[-1, 0, -1, 1, 0])
    # rows: 0 anchor, 1 "10", 2 "10-20", 3 "11", 4 "10-20-30", 5 "10-21"
    assert tree.walk([10, 21, 0, 0, 0, 7]) == ([1, 5], 7)  # a side branch, then the bonus
    assert tree.walk([11, 0, 0, 8, 0, 0]) == ([3], 8)
    assert tree.walk([12, 0, 0, 0, 0, 0]) == ([], 12)
    assert tree.walk([10, 20, 30, 0, 9, 0]) == ([1, 2, 4], 9)


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen3", True),
                                         ("qwen3_next", True), ("qwen3_5", True)])
def test_a_tree_pass_equals_ordinary_passes(family, tied):
    """Each row's logits are its own path's, run as a chain (Gated DeltaNet layers included);
    after keeping a side branch the caches continue as that branch's own pass."""
    model = (make_target(family, tied=tied, seed=3) if family == "qwen3"
             else make_family_target(family, seed=3, scale=1.0))
    target = Target(model)
    assert target.tree_ready
    context = mx.array([[5, 9, 14, 3]], dtype=mx.uint32)
    tree = DraftTree(tokens=[10, 20, 11, 30, 21], parents=[-1, 0, -1, 1, 0])
    rows = mx.array([[7] + tree.tokens], dtype=mx.uint32)
    cache = target.make_cache()
    target.hidden_states(context, cache, ())
    logits, _ = target.forward_tree(rows, tree.depths(), tree.visible(), cache)
    for row in range(len(tree) + 1):  # each row against its own path run as a chain
        path, r = [], row
        while r:
            path.insert(0, tree.tokens[r - 1])
            r = tree.parents[r - 1] + 1
        plain = target.make_cache()
        target.hidden_states(context, plain, ())
        want = target.forward(mx.array([[7] + path], dtype=mx.uint32), plain)[0][0, -1]
        assert mx.allclose(logits[0, row], want, atol=1e-4).item(), row
    # Keeping the path 11 (row 3): the cache continues as if 7, 11 had been run alone.
    target.keep_rows(cache, [0, 3])
    plain = target.make_cache()
    target.hidden_states(context, plain, ())
    target.hidden_states(mx.array([[7, 11]], dtype=mx.uint32), plain, ())
    nxt = mx.array([[40]], dtype=mx.uint32)
    assert mx.allclose(target.forward(nxt, cache)[0], target.forward(nxt, plain)[0],
                       atol=1e-4).item()


class TreeOracle:
    """A drafter whose position candidates hold the target's true continuation, often in
    second place (so the accepted path leaves the best chain for a side branch) and sometimes
    not at all (so cycles end early)."""

    def __init__(self, drafter, sequence, seed=0):
        self.inner, self.sequence = drafter, sequence
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def grow_tree(self, target, anchor, cache, width, beam):
        num_positions = self.inner.max_drafts
        pos = cache[0].offset
        want = self.sequence[pos + 1 : pos + 1 + num_positions]
        want += [0] * (num_positions - len(want))
        logits = self.rng.normal(0, 0.1, (num_positions, target.vocab_size)).astype(np.float32)
        for k, t in enumerate(want):
            u = self.rng.random()
            if u < 0.7:  # the true token among the first two candidates
                logits[k, t] = 5.0 if u < 0.35 else 4.0
                other = (t + 1 + int(self.rng.integers(target.vocab_size - 1))) % target.vocab_size
                logits[k, other] = 4.5
        return independent(mx.array(logits), TREE_CANDIDATES, None, beam)


def record_side_branches(monkeypatch):
    """A list that gets, for each tree walked, whether its accepted path left the first
    chain (a node that is not its parent's first child)."""
    side_branches = []
    walk = DraftTree.walk

    def recorded(tree, choices):
        path, token = walk(tree, choices)
        side_branches.append(any(tree.parents.index(tree.parents[r - 1]) != r - 1
                                 for r in path))
        return path, token

    monkeypatch.setattr(DraftTree, "walk", recorded)
    return side_branches


@pytest.mark.parametrize("size", [1, 3, 8, 20, "auto"])
def test_greedy_trees_equal_the_target_on_every_branch(size, monkeypatch):
    side_branches = record_side_branches(monkeypatch)
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    prompt = [5, 9, 14, 3, 9, 14, 22, 8]
    want, _ = reference(model, prompt, 40)
    drafter = TreeOracle(make_drafter(model, block_size=6), prompt + want)
    out, accepted, trees = [], 0, 0
    for r in stream_generate(model, drafter, tok, prompt, max_tokens=40, tree=size,
                             copy_drafts=False):
        out += r.tokens
        accepted += r.accepted
        trees = r.stats.tree_cycles
    assert out == want
    assert trees > 0 and accepted > 0
    if size == "auto" or size >= 3:
        assert any(side_branches)


def record_tree_sizes(monkeypatch, module):
    """A list that gets the size of each tree ``module`` selects."""
    sizes = []

    def recorded(*grown):
        tree = select_tree(*grown)
        sizes.append(len(tree))
        return tree

    monkeypatch.setattr(module, "select_tree", recorded)
    return sizes


def test_a_tree_wider_than_the_default_beam_holds_the_nodes_asked_for(monkeypatch):
    """30 nodes from a drafter of 5 positions, more than TREE_BEAM paths a level hold (20):
    the levels keep more paths, the cycle verifies 30 nodes, the output is the target's."""
    import mlx_dflash.cycle as cycle

    sizes = record_tree_sizes(monkeypatch, cycle)
    model = make_target("qwen3", seed=2)
    prompt = [5, 9, 14, 3, 9, 14, 22, 8]
    want, _ = reference(model, prompt, 24)
    drafter = TreeOracle(make_drafter(model, block_size=6), prompt + want)
    assert drafter.max_drafts * TREE_BEAM < 30
    out = []
    for r in stream_generate(model, drafter, make_tokenizer(128), prompt, max_tokens=24,
                             tree=30, copy_drafts=False):
        out += r.tokens
    assert out == want and sizes and set(sizes) == {30}


def test_greedy_trees_with_a_random_drafter_and_copy_drafts():
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    for prompt in ([5, 9, 14, 3, 9, 14, 22, 8], [7] * 5 + [3, 4, 7, 7]):
        want, _ = reference(model, prompt, 30)
        got = generate(model, make_drafter(model, block_size=4), tok, prompt, max_tokens=30,
                       tree=6)
        assert got == tok.decode(want)


@pytest.mark.parametrize("family", ["dspark", "dflash2"])
def test_every_drafter_family_grows_trees(family):
    """DSpark (its block's slot logits, vocabulary reduced) and DFlash 2 grow trees too;
    greedy and sampled output as the target's."""
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    vocab = list(range(0, 128, 2)) if family == "dspark" else None
    drafter = (make_dspark(model, vocab=vocab) if family == "dspark" else make_dflash2(model))
    prompt = [5, 9, 14, 3, 9, 14, 22, 8]
    want, _ = reference(model, prompt, 24)
    out, trees = [], 0
    for r in stream_generate(model, drafter, tok, prompt, max_tokens=24, tree=6,
                             copy_drafts=False):
        out += r.tokens
        trees = r.stats.tree_cycles
    assert out == want and trees > 0
    mx.random.seed(5)
    sampled = generate(model, drafter, tok, prompt, max_tokens=12, tree=6, temperature=0.9)
    mx.random.seed(5)
    assert sampled == generate(model, drafter, tok, prompt, max_tokens=12, tree=6,
                               temperature=0.9)  # seeded: reproducible


@pytest.mark.parametrize("temperature,top_p,top_k,tree", [(1.0, 1.0, 0, 5), (0.7, 0.8, 3, 5),
                                                         (1.0, 1.0, 0, "auto")])
def test_sampled_trees_follow_the_target(temperature, top_p, top_k, tree):
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(temperature, top_p, top_k))
    counts, counts4, accepted, _ = sample_runs(model, drafter, 99, tree=tree,
                                               temperature=temperature, top_p=top_p,
                                               top_k=top_k)
    assert counts.sum() == N_SAMPLES
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def test_targets_without_tree_passes_are_refused_clearly(monkeypatch):
    model = make_target("qwen3", seed=5)
    monkeypatch.setattr(Target, "_tree_matches", lambda self: False)
    with pytest.raises(ValueError, match="does not match ordinary passes"):
        generate(model, make_drafter(model, block_size=4), make_tokenizer(128), [5, 6, 7],
                 max_tokens=4, tree=4)
    model = make_target("qwen3")
    with pytest.raises(ValueError, match="drafter"):
        generate(model, None, make_tokenizer(128), [5, 6, 7], max_tokens=4, tree=4)


def test_the_sizer_verifies_what_pays_and_learns_from_what_survives():
    from dataclasses import replace

    from test_schedule import COSTS

    from mlx_dflash.tree import TreeSizer

    scores = np.array([0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01])
    flat = replace(COSTS, verify_s={c: [0.01] * len(COSTS.sizes) for c in COSTS.contexts})
    steep = replace(COSTS, verify_s={c: [0.01 * n for n in COSTS.sizes] for c in COSTS.contexts})
    assert TreeSizer(flat).choose(scores, 100) == len(scores)  # every node is free: all
    assert TreeSizer(steep).choose(scores, 100) < 4  # every node costs a pass: the sure ones
    sizer = TreeSizer(flat)
    tree = DraftTree(tokens=list(range(10)), parents=[-1] + list(range(9)),
                     scores=scores.tolist())
    for _ in range(50):  # the best node survives, nothing else does
        sizer.observe(tree, [1])
    assert sizer.survival(np.array([0.8]))[0] > 0.95
    assert sizer.survival(np.array([0.5]))[0] < 0.05


def test_looked_up_branches_make_a_trie():
    tree = DraftTree.of_branches([[5, 6, 7], [5, 8], [9, 6], [4, 4, 4]], 6)
    assert tree.tokens == [5, 6, 7, 8, 9, 6]  # 5 shared; the last branch finds no room
    assert tree.parents == [-1, 0, 1, 0, -1, 4]
    assert len(DraftTree.of_branches([[1, 2, 3, 4]], 2)) == 4  # the first branch is whole


def truth_branches(sequence):
    """A copy_branches that offers the looked-up block first and the target's own
    continuation (``sequence``: prompt and greedy output) second, so accepted paths run down
    the second branch."""
    def copy_branches(self, block):
        done = len(self.copy_index.tokens)
        truth = sequence[done : done + len(block)]
        return [block, truth] if truth and truth != block else [block]
    return copy_branches


def test_greedy_lookup_branches_equal_the_target(monkeypatch):
    """Copied blocks with other continuations verified as a tree: the output is the target's,
    and accepted paths end on the second branch."""
    side = record_side_branches(monkeypatch)
    model = make_target("qwen3", seed=2)
    tok = make_tokenizer(128)
    prompt = [5, 9, 14, 3, 9, 14, 22, 8]
    want, _ = reference(model, prompt, 30)
    monkeypatch.setattr(policy.BlockPolicy, "copy_branches",
                        truth_branches(prompt + want))
    monkeypatch.setattr(policy.BlockPolicy, "lookup",
                        lambda self, room, context: ([7] * min(3, room), "copy"))
    out, branched = [], 0
    for r in stream_generate(model, make_drafter(model, block_size=4), tok, prompt,
                             max_tokens=30, tree=6):
        out += r.tokens
        branched = r.stats.branched_cycles
    assert out == want
    assert branched > 0 and any(side)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 3)])
def test_sampled_lookup_branches_follow_the_target(temperature, top_p, top_k, monkeypatch):
    """Every cycle verifies two looked-up branches (a fixed block and another): the output
    follows the target's distribution."""
    def copy_branches(self, block):
        return [block, [(t + 3) % V for t in block]]

    monkeypatch.setattr(policy.BlockPolicy, "copy_branches", copy_branches)
    monkeypatch.setattr(policy.BlockPolicy, "lookup",
                        lambda self, room, context: ([1, 2, 3][: min(3, room)], "copy"))
    model = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(temperature, top_p, top_k))
    counts, counts4, accepted, copies = sample_runs(model, drafter, 11, tree=5,
                                                    temperature=temperature, top_p=top_p,
                                                    top_k=top_k)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0 and copies > 0


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "gemma3_text", "qwen3_next", "qwen3_5"])
def test_greedy_trees_on_sliding_window_and_gated_deltanet_targets(family, monkeypatch):
    """Targets with sliding-window layers (window 8, wrapped by the prompt and again during
    generation: tree passes mask each window, the buffers keep the accepted path's rows) and
    hybrid ones (Gated DeltaNet layers read each row's path and keep the accepted one's state):
    the output is the target's, with accepted paths on side branches."""
    side = record_side_branches(monkeypatch)
    model = make_family_target(family, seed=1)
    assert Target(model).tree_ready
    tok = make_tokenizer(128)
    prompt = [5, 9, 14, 3, 9, 14, 22, 8, 11, 4, 6]
    want, _ = reference(model, prompt, 30)
    text = Target(model, check=False).model  # qwen3_5: the language model in its wrapper
    drafter = TreeOracle(make_drafter(text, block_size=6), prompt + want)
    out = []
    for r in stream_generate(model, drafter, tok, prompt, max_tokens=30, tree=8,
                             copy_drafts=False):
        out += r.tokens
    assert out == want
    assert any(side)


def test_sampled_trees_on_a_sliding_window_target_follow_it():
    """A window of 2 positions, wrapped within the 7 tokens the test samples over."""
    model = make_family_target("gemma3_text", vocab_size=V, hidden_size=32, seed=3, scale=1.5,
                               window=2)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(1.0))
    counts, counts4, accepted, _ = sample_runs(model, drafter, 5, tree=5, temperature=1.0)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0


def test_sampled_trees_on_a_gated_deltanet_target_follow_it():
    model = make_family_target("qwen3_next", vocab_size=V, hidden_size=32, seed=3, scale=1.5)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 1), mask_token_id=2, seed=7)
    joint, marginal4 = exact_joint(model, SamplingParams(1.0))
    counts, counts4, accepted, _ = sample_runs(model, drafter, 5, tree=5, temperature=1.0)
    assert_follows(counts, counts4, joint, marginal4)
    assert accepted > 0
