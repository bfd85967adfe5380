"""EAGLE-3 drafters: SpecForge's checkpoint layout (and the speculators one, test_speculators)
loads with its reduced vocabulary, drafts a chain that matches a pass over the whole context,
and decodes losslessly (greedy equal to the target's, sampled in distribution), alone, in the
batch engine and continued from a prefix cache; malformed checkpoints are refused by name."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_lossless_greedy import reference
from test_lossless_sampling import V, assert_drafter_samples_the_target
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import batch_generate, load_drafter, stream_generate
from mlx_dflash.accept import SamplingParams
from mlx_dflash.drafters import DrafterMismatchError, Eagle3DraftModel
from mlx_dflash.drafters import chain as chain_mod
from mlx_dflash.target import Target

PROMPT = [5, 9, 14, 3, 9, 14, 22, 8, 9, 14, 22]


def make_eagle3(model, vocab_ids=None, block_size=5, layer_ids=(0, 1, 2), seed=3):
    drafter = make_drafter(model, block_size=block_size, layer_ids=layer_ids, seed=seed,
                           cls=Eagle3DraftModel,
                           draft_vocab_size=None if vocab_ids is None else len(vocab_ids))
    if vocab_ids is not None:
        drafter.set_draft_vocab(mx.array(vocab_ids))
    mx.eval(drafter.parameters())
    return drafter


def specforge_config(drafter) -> dict:
    """config.json as SpecForge writes an EAGLE-3 drafter (configs/llama3-8B-eagle3.json's
    fields; eagle_config as in its gpt-oss / deepseek configs)."""
    a = drafter.args
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": a.hidden_size, "initializer_range": 0.02,
        "intermediate_size": a.intermediate_size, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "num_hidden_layers": 1,
        "pad_token_id": 0, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": a.vocab_size, "draft_vocab_size": a.draft_vocab_size or a.vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": a.target_layer_ids,
                         "use_aux_hidden_state": True},
    }


def write_specforge(drafter, model, path, config=None, drop=(), extra=None):
    """A SpecForge checkpoint directory: its config, and its weights under its names
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` int64, ``t2d`` bool), with the
    embedding copy its HF export carries."""
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(drafter.parameters()))
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight
    weights.update(extra or {})
    for k in drop:
        weights.pop(k)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config or specforge_config(drafter)))
    return path


@pytest.fixture(scope="module")
def model():
    return make_target("qwen3", seed=2)


@pytest.fixture(scope="module")
def drafter(model, tmp_path_factory):
    """The tiny EAGLE-3 drafter written as SpecForge writes one and loaded back, with a
    reduced vocabulary of every other id (so drafts outside it are never proposed)."""
    made = make_eagle3(model, vocab_ids=list(range(0, 128, 2)))
    path = write_specforge(made, model, tmp_path_factory.mktemp("eagle3") / "ckpt")
    loaded = load_drafter(path, model=model)
    for (k, a), (_, b) in zip(tree_flatten(made.parameters()), tree_flatten(loaded.parameters())):
        assert mx.array_equal(a, b), k
    return loaded


def test_the_specforge_layout_loads_with_its_vocabulary_maps(drafter):
    assert isinstance(drafter, Eagle3DraftModel) and drafter.target_layer_ids == [0, 1, 2]
    assert drafter.vocab_ids.tolist() == list(range(0, 128, 2))
    assert drafter.d2t.dtype == mx.int64 and drafter.t2d.dtype == mx.bool_
    assert drafter.lm_head.weight.shape == (64, 64)  # its own head over the draft vocabulary


@pytest.mark.parametrize("block_size", [2, 4, 6])
def test_greedy_is_the_targets_own(model, drafter, block_size):
    want = reference(model, PROMPT, 30)[0]
    got = []
    for r in stream_generate(model, drafter, make_tokenizer(128), PROMPT, max_tokens=30,
                             block_size=block_size, copy_drafts=False):
        got += r.tokens
    assert got == want
    assert r.stats.drafted_tokens > 0


def test_the_chain_matches_one_pass_over_the_whole_context(model, drafter, monkeypatch):
    """Committed in pieces (prefill chunks, then cycles), read in small chunks: the drafts
    equal those of the layer run once over every (features, next token) pair, then stepped
    on its own outputs."""
    monkeypatch.setattr(chain_mod, "PENDING_CHUNK", 3)
    target = Target(model)
    tokens = mx.array([PROMPT + [40, 41, 42, 43]], dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)
    greedy = SamplingParams()
    cache = drafter.make_cache()
    drafter.commit(feats[:, :4], cache, tokens[:, :4])
    drafter.commit(feats[:, 4:11], cache, tokens[:, 4:11])
    first = drafter.propose(target, tokens[0, 11:12], cache, 5, 4, greedy).drafts
    drafter.commit(feats[:, 11:14], cache, tokens[:, 11:14])  # a cycle: anchor + 2 accepted
    got = drafter.propose(target, tokens[0, 14:15], cache, 5, 4, greedy).drafts

    def from_scratch(n):
        """Drafts after tokens[:n + 1] (the anchor last), by one pass from nothing."""
        kv = chain_mod.KVCache()
        hidden = drafter.fuse(feats[:, :n])
        out = drafter.midlayer(target.embed(tokens[:, 1 : n + 1]), hidden, kv)[:, -1:]
        drafts = []
        for _ in range(4):
            ids = mx.argmax(drafter.logits(target, out[:, -1]), axis=-1)
            drafts.append(drafter.vocab_ids[ids])
            out = drafter.midlayer(target.embed(drafts[-1][None]), out, kv)
        return mx.concatenate(drafts).tolist()

    assert first.tolist() == from_scratch(11)
    assert got.tolist() == from_scratch(14)
    assert cache[0].offset == 13  # the pairs whose next token is committed; one waits


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 3)])
def test_sampled_output_follows_the_target(temperature, top_p, top_k):
    """Chi-square against the target's exact joint (test_lossless_sampling), with a reduced
    draft vocabulary (ids 0-5 of 8): the chain samples each draft from its own distribution."""
    small = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    eagle = make_eagle3(small, vocab_ids=list(range(6)), block_size=4, layer_ids=(0, 1, 1),
                        seed=7)
    assert_drafter_samples_the_target(small, eagle, 99, temperature, top_p, top_k, block_size=4)


def context_of(model, drafter):
    """(the target, PROMPT as tokens, a function giving a drafter cache that has committed all
    of PROMPT but its last token, the anchor)."""
    target = Target(model)
    tokens = mx.array([PROMPT], dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)

    def fresh():
        cache = drafter.make_cache()
        drafter.commit(feats[:, :-1], cache, tokens[:, :-1])
        return cache

    return target, tokens, fresh


def test_a_tree_of_width_one_is_the_chain(model, drafter):
    """EAGLE-2's dynamic tree with one node a level walks the same path as the greedy chain."""
    target, tokens, fresh = context_of(model, drafter)

    K = drafter.max_drafts  # a SpecForge config names no block: ours, 8
    chain = drafter.propose(target, tokens[0, -1:], fresh(), K + 1, K, SamplingParams()).drafts
    cache = fresh()
    nodes, parents, _ = drafter.grow_tree(target, tokens[0, -1:], cache, K + 1, beam=1)
    assert nodes.tolist() == chain.tolist() and parents.tolist() == list(range(-1, K - 1))
    assert cache[0].offset == len(PROMPT) - 2  # the tree's keys left the cache


def test_every_tree_node_scores_its_own_path(model, drafter):
    """With several nodes a level, each node's path probability equals the chain run along its
    path alone: a node sees the context and its ancestors, not its cousins, at its depth."""
    target, tokens, fresh = context_of(model, drafter)

    anchor = tokens[0, -1:]
    nodes, parents, scores = drafter.grow_tree(target, anchor, fresh(), 5, beam=3)
    nodes, parents, scores = nodes.tolist(), parents.tolist(), scores.tolist()
    index = {t: i for i, t in enumerate(drafter.vocab_ids.tolist())}
    for i in range(0, len(nodes), 2):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j])
            j = parents[j]
        cache = fresh()
        out, _ = drafter.first_pass(target, anchor, cache)
        logp = 0.0
        for t in path:
            logits = drafter.logits(target, out[:, -1])[0].astype(mx.float32)
            logp += (logits - mx.logsumexp(logits)).tolist()[index[t]]
            out = drafter.step(target, mx.array([[t]], dtype=mx.uint32), out, cache[0])
        assert abs(logp - scores[i]) < 1e-3, (i, path)


@pytest.mark.parametrize("tree", [3, 8, "auto"])
def test_tree_drafts_are_the_targets_own(model, drafter, tree, monkeypatch):
    """Trees of drafts from the EAGLE-3 drafter (side branches taken), greedy and sampled
    batches: the target's own greedy output."""
    from test_tree import record_side_branches

    branches = record_side_branches(monkeypatch)
    want = reference(model, PROMPT, 30)[0]
    got = []
    for r in stream_generate(model, drafter, make_tokenizer(128), PROMPT, max_tokens=30,
                             tree=tree, copy_drafts=False):
        got += r.tokens
    assert got == want and r.stats.tree_cycles > 0
    if tree == 8:
        assert any(branches)
    batch = [r.tokens for r in batch_generate(model, drafter, make_tokenizer(128),
                                              [PROMPT, [7, 8, 9]], max_tokens=12, tree=tree)]
    assert batch == [reference(model, p, 12)[0] for p in (PROMPT, [7, 8, 9])]


def test_tree_sampling_follows_the_target():
    small = make_target("qwen3", vocab_size=V, hidden_size=32, num_layers=2, scale=1.5)
    eagle = make_eagle3(small, vocab_ids=list(range(6)), block_size=4, layer_ids=(0, 1, 1),
                        seed=7)
    assert_drafter_samples_the_target(small, eagle, 21, 1.0, tree=4)


def test_the_batch_engine_and_a_prefix_cache_decode_as_one(model, drafter):
    from mlx_dflash.decode import stream_generate_cached
    from mlx_dflash.prefix_cache import PrefixCache

    prompts = [PROMPT, [7, 8, 9], [40, 41, 40, 41, 40, 41, 42]]
    got = [r.tokens for r in batch_generate(model, drafter, make_tokenizer(128), prompts,
                                            max_tokens=16, max_batch=2)]
    assert got == [reference(model, p, 16)[0] for p in prompts]
    store = PrefixCache(1 << 30)
    tok = make_tokenizer(128)
    for prompt in (PROMPT, PROMPT + [30, 31]):  # the second continues from the first's cache
        out = []
        for r in stream_generate_cached(store, model, drafter, tok, prompt, max_tokens=12,
                                        generate=stream_generate):
            out += r.tokens
        assert out == reference(model, prompt, 12)[0]


def test_the_scheduler_times_a_chain_by_its_length(model, drafter):
    """A chain drafter's pass costs more with each draft: the costs say how much, and the
    block scheduler weighs K drafts at that price (a block drafter's pass costs the same)."""
    from mlx_dflash.schedule import measure_costs

    costs = measure_costs(Target(model), drafter, 6, reps=2)
    assert costs.draft_step_s > 0 and costs.draft(5) > costs.draft(1) == costs.draft_s
    block = measure_costs(Target(model), make_drafter(model, block_size=6), 6, reps=1)
    assert block.draft_step_s == 0 and block.draft(5) == block.draft_s


def test_specforge_norm_output_false_reads_the_head_without_the_norm(model, tmp_path):
    made = make_eagle3(model)
    config = specforge_config(made)
    config["norm_output"] = False
    loaded = load_drafter(write_specforge(made, model, tmp_path / "ckpt", config), model=model)
    out = mx.random.normal((1, model.args.hidden_size))
    assert not loaded.args.head_norm
    assert mx.allclose(loaded.logits(Target(model), out), loaded.lm_head(out))
    got = []
    for r in stream_generate(model, loaded, make_tokenizer(128), PROMPT, max_tokens=20,
                             copy_drafts=False):
        got += r.tokens
    assert got == reference(model, PROMPT, 20)[0]


def test_default_taps_come_from_the_target(model, tmp_path):
    made = make_eagle3(make_target("qwen3", seed=2, num_layers=8), layer_ids=(1, 3, 4))
    config = specforge_config(made)
    del config["eagle_config"]
    path = write_specforge(made, model, tmp_path / "ckpt", config)
    with pytest.raises(ValueError, match="names no target layers"):
        load_drafter(path)
    eight = make_target("qwen3", seed=2, num_layers=8)
    assert load_drafter(path, model=eight).target_layer_ids == [1, 3, 4]  # 1, N/2-1, N-4


def test_malformed_checkpoints_are_refused_by_name(model, drafter, tmp_path):
    made = make_eagle3(model, vocab_ids=list(range(0, 128, 2)))
    bad_maps = write_specforge(made, model, tmp_path / "maps",
                               extra={"t2d": mx.zeros((128,), dtype=mx.bool_)})
    with pytest.raises(ValueError, match="d2t and t2d do not describe"):
        load_drafter(bad_maps, model=model)
    no_head = write_specforge(made, model, tmp_path / "head", drop=["lm_head.weight"])
    with pytest.raises(ValueError, match="lacks weights: lm_head.weight"):
        load_drafter(no_head, model=model)
    config = specforge_config(made)
    config["num_hidden_layers"] = 2
    two = write_specforge(made, model, tmp_path / "two", config)
    with pytest.raises(NotImplementedError, match="of 2 layers"):
        load_drafter(two, model=model)
    wide = make_target("qwen3", seed=2, hidden_size=96)
    with pytest.raises(DrafterMismatchError, match="hidden_size 64"):
        load_drafter(write_specforge(made, model, tmp_path / "ok"), model=wide)
    assert np.all(np.array(drafter.vocab_ids) % 2 == 0)


# -- training: the training-time test ------------------------------------------------------------
def test_training_logits_are_the_chain_drafted_along_the_true_tokens(model, drafter):
    """Each block's teacher-forced training logits equal drafting's: the chain run from the
    block's anchor, fed the true tokens (so training optimises what decoding runs)."""
    from mlx_dflash.train.recipe import block_inputs

    target = Target(model)
    seq = PROMPT + [40, 41, 42, 43, 44, 45]
    tokens = mx.array([seq], dtype=mx.uint32)
    _, feats = target.hidden_states(tokens, target.make_cache(), drafter.target_layer_ids)
    anchors = np.array([3, 6, 10])
    n = 4
    blocks, labels, _ = block_inputs(np.array(seq), anchors, n + 1, 2)
    prev = np.concatenate([np.array(seq)[anchors][:, None], labels[:, :-1]], axis=1)
    got, _ = drafter.train_logits(target, feats[:, :-1], mx.array(blocks), mx.array(anchors),
                                  mx.array(prev), tokens)
    for b, a in enumerate(anchors.tolist()):
        cache = drafter.make_cache()
        drafter.commit(feats[:, :a], cache, tokens[:, :a])
        out, _ = drafter.first_pass(target, tokens[0, a : a + 1], cache)
        for j in range(n):
            want = drafter.logits(target, out[:, -1])[0]
            assert mx.allclose(got[b, j], want, atol=1e-4), (a, j)
            out = drafter.step(target, tokens[:, a + 1 + j : a + 2 + j], out, cache[0])


def test_an_eagle3_drafter_trains_on_the_feature_store(tmp_path):
    from test_train import _tiny_store

    from mlx_dflash.train.loop import TrainConfig, train

    model, _, _ = _tiny_store(tmp_path)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         family="eagle3", block_size=4, num_layers=1, mask_token_id=2,
                         draft_vocab_size=40, learning_rate=3e-3, epochs=8, grad_accum=2,
                         val_fraction=0.1)
    train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert len(log[0]["acc"]) == 3  # three drafts a chain
    first = np.mean([r["loss"] for r in log[:4]])
    assert np.mean([r["loss"] for r in log[-4:]]) < 0.8 * first
    loaded = load_drafter(tmp_path / "run" / "checkpoint", model=model)
    assert isinstance(loaded, Eagle3DraftModel) and loaded.args.draft_vocab_size == 40
    got = []
    for r in stream_generate(model, loaded, make_tokenizer(64, eos_id=64), [5, 8, 10],
                             max_tokens=16, copy_drafts=False):
        got += r.tokens
    assert got == reference(model, [5, 8, 10], 16, stop_ids=(64,))[0]
