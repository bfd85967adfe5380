"""Training: the recipe's masks, a few steps on a tiny model (loss falls), checkpoint round trip."""

import json

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import load_drafter
from mlx_dflash.target import Target
from mlx_dflash.train.data import read_prompts
from mlx_dflash.train.loop import TrainConfig, train
from mlx_dflash.train.store import FeatureStore, StoreMismatchError, build_store
from mlx_dflash.train.recipe import block_inputs, build_target_layer_ids, sample_anchors


def test_layer_id_rule_matches_zlab():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]


def test_anchor_and_label_layout():
    tokens = np.arange(100, 120)
    anchors = sample_anchors(5, len(tokens), 50, np.random.default_rng(0))
    assert anchors.min() >= 5 and anchors.max() <= len(tokens) - 2
    blocks, labels, valid = block_inputs(tokens, np.array([5, 17]), 4, mask_token_id=7)
    assert blocks.tolist() == [[105, 7, 7, 7], [117, 7, 7, 7]]
    assert labels[0].tolist() == [106, 107, 108] and valid[0].all()
    assert valid[1].tolist() == [True, True, False]


def test_blocks_see_only_context_before_their_anchor():
    model = make_target("qwen3")
    target = Target(model)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 2), num_layers=2)
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    _, feats = target.hidden_states(tokens, None, drafter.target_layer_ids)
    anchors = mx.array([3, 6])
    blocks = mx.array([[8, 2, 2, 2], [11, 2, 2, 2]])
    out = drafter.train_hidden(target.embed(blocks), feats, anchors)
    # Changing features at or after anchor 3 must not change block 0.
    changed = mx.concatenate([feats[:, :3], feats[:, 3:] * -2.0], axis=1)
    out2 = drafter.train_hidden(target.embed(blocks), changed, anchors)
    assert mx.allclose(out[0], out2[0], atol=1e-5) and not mx.allclose(out[1], out2[1])
    # Training a block equals drafting it at inference with the same context.
    cache = drafter.make_cache()
    drafter.commit(feats[:, :6], cache)
    infer = drafter(target.embed(blocks[1:2]), cache)
    assert mx.allclose(infer[0], out[1], atol=1e-4)


def _tiny_store(tmp_path, n=12, **kw):
    model = make_target("qwen3", vocab_size=64, num_layers=4)
    tok = make_tokenizer(64, eos_id=64)
    tok._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 3} w{i + 5}"})
                                 for i in range(3, 3 + n)))
    rows = read_prompts(prompts)
    build_store(model, tok, rows, tmp_path / "store", [0, 2], max_tokens=24, batch_size=5,
                top_k=4, progress=False, **kw)
    return model, tok, rows


def test_feature_store_round_trips(tmp_path):
    from test_lossless_greedy import reference

    model, tok, rows = _tiny_store(tmp_path)
    store = FeatureStore(tmp_path / "store")
    assert len(store) == 12 and store.layer_ids == [0, 2] and store.top_k == 4
    target = Target(model)
    store.check(target, [0, 2])
    for seq in store:
        prompt = seq.tokens[: seq.prompt_len].tolist()
        want, _ = reference(model, prompt, 24, stop_ids=())
        assert seq.tokens[seq.prompt_len:].tolist() == want  # the target's own greedy reply
        _, feats = target.hidden_states(mx.array(seq.tokens)[None], None, [0, 2])
        assert seq.features.shape == (len(seq.tokens) - 1, 128)
        assert np.allclose(seq.features, np.array(feats[0, :-1]), atol=2e-2, rtol=1e-2)
        logits = target.forward(mx.array(seq.tokens)[None], None)[0][0, seq.prompt_len - 1:-1]
        probs = np.array(mx.softmax(logits, axis=-1))
        got = np.take_along_axis(probs, np.asarray(seq.topk_ids), axis=-1)
        assert np.allclose(seq.topk_probs, got, atol=1e-3)
        assert np.allclose(np.sort(probs, axis=-1)[:, -4:].sum(-1),
                           np.asarray(seq.topk_probs, np.float32).sum(-1), atol=1e-3)


def test_feature_store_refuses_another_target_or_taps(tmp_path):
    _tiny_store(tmp_path, n=3)
    store = FeatureStore(tmp_path / "store")
    other = Target(make_target("qwen3", vocab_size=64, num_layers=4, seed=5))
    with pytest.raises(StoreMismatchError, match="another target.*weights_sha256"):
        store.check(other)
    with pytest.raises(StoreMismatchError, match="tap layers \\[0, 2\\].*\\[1, 3\\]"):
        store.check(Target(make_target("qwen3", vocab_size=64, num_layers=4)), [1, 3])
    with pytest.raises(FileNotFoundError, match="no feature store"):
        FeatureStore(tmp_path / "nothing")


def test_feature_store_resumes(tmp_path):
    model, tok, rows = _tiny_store(tmp_path, n=6)
    store_dir = tmp_path / "store"
    first = sorted(p.name for p in store_dir.glob("shard_*"))
    # A shard being written when the run was killed is a .tmp folder: ignored, then redone.
    (store_dir / "shard_dead.tmp").mkdir()
    more = rows + read_prompts_from(tmp_path, range(20, 24))
    build_store(model, tok, more, store_dir, [0, 2], max_tokens=24, batch_size=5, top_k=4,
                progress=False)
    store = FeatureStore(store_dir)
    assert len(store) == 10 and len(store.ids()) == 10
    assert set(first) <= {p.name for p in store_dir.glob("shard_*")}  # old shards untouched


def read_prompts_from(tmp_path, ids):
    f = tmp_path / "more.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"}) for i in ids))
    return read_prompts(f)


def test_train_on_store_and_round_trip(tmp_path):
    model, _, _ = _tiny_store(tmp_path)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, mask_token_id=2, draft_vocab_size=40,
                         tv_weight=0.5, learning_rate=3e-3, epochs=8, grad_accum=2,
                         save_every_s=0.5, val_fraction=0.1)
    trained = train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    first = np.mean([r["loss"] for r in log[:4]])
    last = np.mean([r["loss"] for r in log[-4:]])
    assert last < 0.8 * first, (first, last)
    drafter = load_drafter(tmp_path / "run" / "checkpoint", model=model)
    assert drafter.block_size == 4 and drafter.mask_token_id == 2
    assert drafter.args.draft_vocab_size == 40
    assert drafter.vocab_ids.tolist() == trained.vocab_ids.tolist()
    # Training runs on standardised features; the saved fc has the scale folded in.
    assert mx.allclose(drafter.fc.weight, trained.fc.weight, atol=1e-6)
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == len(log) and state["train_seconds"] > 0
    assert (tmp_path / "run" / "val_log.jsonl").exists()
    # A new run can start from a saved drafter: its first loss is the trained level.
    config2 = TrainConfig(**{**config.__dict__, "out_dir": str(tmp_path / "run2"), "epochs": 1,
                             "init_from": str(tmp_path / "run" / "checkpoint")})
    train(model, config2, progress=False)
    log3 = [json.loads(line) for line in open(tmp_path / "run2" / "train_log.jsonl")]
    assert log3[0]["loss"] < first


def test_interrupted_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    import mlx_dflash.train.loop as loop

    model, _, _ = _tiny_store(tmp_path)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, mask_token_id=2, learning_rate=3e-3,
                         epochs=4, max_steps=12, grad_accum=2, save_every_s=0)
    full = train(model, config, progress=False)
    full_log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    # The same run killed in its 7th step (after the step-6 checkpoint), then started again.
    calls = {"n": 0}
    real_loss = loop.block_loss

    def dies_in_step_7(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 6:  # one loss call per step (the step's sequences are collated)
            raise KeyboardInterrupt
        return real_loss(*args, **kw)

    config.out_dir = str(tmp_path / "run_b")
    monkeypatch.setattr(loop, "block_loss", dies_in_step_7)
    with pytest.raises(KeyboardInterrupt):
        train(model, config, progress=False)
    monkeypatch.setattr(loop, "block_loss", real_loss)
    resumed = train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "run_b" / "train_log.jsonl")]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert np.allclose([r["loss"] for r in log], [r["loss"] for r in full_log], rtol=1e-3)
    assert mx.allclose(resumed.fc.weight, full.fc.weight, atol=1e-4)


def test_dspark_trains_from_a_dflash_backbone(tmp_path):
    from mlx_dflash.drafters import DSparkDraftModel

    model, _, _ = _tiny_store(tmp_path)
    base = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "dflash"),
                       block_size=4, num_layers=1, mask_token_id=2, epochs=1, grad_accum=2)
    train(model, base, progress=False)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "dspark"),
                         family="dspark", block_size=3, num_layers=1, mask_token_id=2,
                         val_fraction=0.4,
                         markov_rank=8, draft_vocab_size=40, ce_weight=0.1, tv_weight=1.8,
                         gamma=4.0, learning_rate=3e-3, epochs=8, grad_accum=2,
                         init_from=str(tmp_path / "dflash" / "checkpoint"))
    trained = train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "dspark" / "train_log.jsonl")]
    assert len(log[0]["acc"]) == 3  # g = 3 inputs label 3 tokens
    first = np.mean([r["loss"] for r in log[:4]])
    assert np.mean([r["loss"] for r in log[-4:]]) < 0.8 * first
    drafter = load_drafter(tmp_path / "dspark" / "checkpoint", model=model)
    assert isinstance(drafter, DSparkDraftModel) and drafter.args.draft_vocab_size == 40
    calibration = json.loads((tmp_path / "dspark" / "calibration.json").read_text())
    assert drafter.args.confidence_temperatures == calibration["temperatures"]
    assert len(calibration["ece_after"]) == 3
    assert "confidence_head" in drafter and mx.allclose(drafter.fc.weight, trained.fc.weight,
                                                        atol=1e-6)


def test_sequential_temperature_scaling_calibrates_the_running_product():
    from mlx_dflash.train.calibrate import sequential_temperatures

    rng = np.random.default_rng(0)
    true_logit = rng.normal(1.0, 2.0, size=(4000, 4))
    survive = rng.random((4000, 4)) < 1 / (1 + np.exp(-true_logit))
    accepted = np.cumprod(survive, axis=1).astype(float)
    temps, offsets, before, after = sequential_temperatures(true_logit * 3.0, accepted)
    assert all(a <= b + 1e-9 for a, b in zip(after, before))  # overconfident, fixed
    assert after[0] < 0.5 * before[0] and 2.0 < temps[0] < 4.5 and abs(offsets[0]) <= 0.3
    # A head off by a constant: a temperature alone cannot fix it, an offset can.
    temps, offsets, before, after = sequential_temperatures(true_logit - 1.0, accepted,
                                                            offsets=False)
    _, offsets, _, shifted = sequential_temperatures(true_logit - 1.0, accepted)
    assert shifted[0] < 0.5 * after[0] and 0.6 <= offsets[0] <= 1.4


def test_time_budget_sets_the_schedule_and_ends_the_run(tmp_path):
    model, _, _ = _tiny_store(tmp_path)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, mask_token_id=2, learning_rate=1e-3,
                         max_minutes=0.02, grad_accum=2, warmup=0.2)
    train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert log[-1]["train_seconds"] >= 1.2 and log[-2]["train_seconds"] < 1.2
    lrs = [r["lr"] for r in log]
    assert lrs[0] < 0.5e-3 and max(lrs) > 0.8e-3 and lrs[-1] < 0.3e-3
    # A larger budget resumes the same run (its clock included).
    config.max_minutes = 0.03
    train(model, config, progress=False)
    log2 = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert log2[len(log)]["step"] == len(log) + 1 and log2[-1]["train_seconds"] >= 1.8


def test_sliding_window_drafter_train_matches_inference_and_is_lossless():
    from test_lossless_greedy import reference, speculative

    model = make_target("llama")
    target = Target(model)
    drafter = make_drafter(model, block_size=4, layer_ids=(0, 2), num_layers=2,
                           layer_types=["sliding_attention", "full_attention"],
                           sliding_window=3, is_causal=False)
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    _, feats = target.hidden_states(tokens, None, drafter.target_layer_ids)
    blocks = mx.array([[11, 2, 2, 2]])
    out = drafter.train_hidden(target.embed(blocks), feats, mx.array([6]))
    cache = drafter.make_cache()
    drafter.commit(feats[:, :6], cache)
    assert mx.allclose(drafter(target.embed(blocks), cache)[0], out[0], atol=1e-4)
    # Far context still reaches the block through the full-attention layer.
    changed = mx.concatenate([feats[:, :2, ::-1], feats[:, 2:]], axis=1)
    out2 = drafter.train_hidden(target.embed(blocks), changed, mx.array([6]))
    assert not mx.allclose(out, out2)
    tok = make_tokenizer(128)
    prompt = [4, 5, 6, 7, 8, 9, 10]
    want, _ = reference(model, prompt, 20)
    got, _, _ = speculative(model, drafter, tok, prompt, 20, 4)
    assert got == want


def test_dflash2_trains_from_a_dflash_backbone(tmp_path):
    from mlx_dflash.drafters import DFlash2DraftModel

    model, _, _ = _tiny_store(tmp_path)
    base = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "dflash"),
                       block_size=4, num_layers=1, mask_token_id=2, epochs=1, grad_accum=2,
                       draft_vocab_size=40)
    dflash = train(model, base, progress=False)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "dflash2"),
                         family="dflash2", block_size=4, num_layers=1, mask_token_id=2,
                         selector_rank=8, selector_top_k=4, conv_group_size=8,
                         learning_rate=3e-3, epochs=8, grad_accum=2, val_fraction=0.2,
                         init_from=str(tmp_path / "dflash" / "checkpoint"))
    train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "dflash2" / "train_log.jsonl")]
    first = np.mean([r["loss"] for r in log[:4]])
    assert np.mean([r["loss"] for r in log[-4:]]) < 0.8 * first
    val = [json.loads(line) for line in open(tmp_path / "dflash2" / "val_log.jsonl")][-1]
    assert len(val["recall"]) == 3 and all(0 <= r <= 1 for r in val["recall"])
    drafter = load_drafter(tmp_path / "dflash2" / "checkpoint", model=model)
    assert isinstance(drafter, DFlash2DraftModel)
    assert drafter.vocab_ids.tolist() == dflash.vocab_ids.tolist()  # kept from the start
    sel = drafter.candidate_selector
    assert float(mx.abs(sel.successor_codebook).sum()) > 0  # the selector learned something


def test_held_out_sequences_stay_held_out_as_the_store_grows():
    from mlx_dflash.train.loop import held_out_split

    class Ids:
        def __init__(self, n):
            self.ids = [f"set:{i}" for i in range(n)]

        def __len__(self):
            return len(self.ids)

        def id_list(self):
            return self.ids

    small, big = Ids(2000), Ids(3000)
    big.ids = big.ids[2000:] + big.ids[:2000]  # new shards sort anywhere
    _, held_small = held_out_split(small, 0.02)
    train_big, held_big = held_out_split(big, 0.02)
    assert 20 < len(held_small) < 60
    assert {small.ids[i] for i in held_small} <= {big.ids[i] for i in held_big}
    assert not {big.ids[i] for i in held_big} & {big.ids[i] for i in train_big}


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_collated_sequences_give_each_sequence_its_own_logits(tmp_path, family):
    """Training attention over shared contexts (one matmul per sequence) and collating several
    sequences into one forward change nothing a block sees."""
    import mlx.nn as nn
    from mlx_dflash.train.loop import Batches, feature_scale, new_drafter
    from mlx_dflash.train.recipe import block_loss, collate, position_weights
    from mlx_dflash.train.softmax import softmax_logsumexp

    model, _, _ = _tiny_store(tmp_path)
    target = Target(model)
    store = FeatureStore(tmp_path / "store")
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         family=family, block_size=4, num_layers=1, mask_token_id=2,
                         markov_rank=8, num_anchors=6)
    drafter = new_drafter(target, config, store.layer_ids)
    batches = Batches(store, drafter, config,
                      feature_scale([np.asarray(s.features) for s in store]))
    # Sequences of different lengths, one with fewer anchors than the others.
    seqs = [batches(i, np.random.default_rng(i)) for i in range(3)]
    seqs.append(batches(3, np.random.default_rng(3), num_anchors=2))
    joint = collate(seqs)
    logits, _ = drafter.train_logits(target, joint.features, joint.blocks, joint.anchors,
                                     joint.prev)
    N = joint.blocks.shape[0] // len(seqs)
    for g, b in enumerate(seqs):
        own, _ = drafter.train_logits(target, b.features, b.blocks, b.anchors, b.prev)
        n = b.blocks.shape[0]
        assert mx.allclose(logits[g * N : g * N + n], own, atol=1e-4)
        assert not np.array(joint.valid[g * N + n : (g + 1) * N]).any()  # padding: no labels

    # The matmul attention equals SDPA over broadcast copies of the context.
    attn = drafter.layers[0].self_attn
    x = mx.random.normal((5, 4, 64))
    ctx = mx.random.normal((1, 9, 64))
    keys, values = attn.context_kv(ctx, 0)
    anchors = mx.array([3, 4, 6, 8, 9])
    visible = mx.arange(9)[None, None, :] < anchors[:, None, None]
    mask = mx.concatenate([mx.broadcast_to(visible, (5, 4, 9)),
                           mx.ones((5, 4, 4), mx.bool_)], axis=-1)[:, None]
    got = attn(x, keys, values, anchors, mask)
    want = [attn(x[i : i + 1], keys, values, anchors[i : i + 1], mask[i : i + 1])
            for i in range(5)]
    assert mx.allclose(got, mx.concatenate(want), atol=1e-5)

    # One-pass softmax + logsumexp: values and gradients as MLX's own.
    z = mx.random.normal((3, 7, 50)) * 5
    lab = mx.random.randint(0, 50, (3, 7))

    def ours(z):
        q, lse = softmax_logsumexp(z)
        return (q * q).sum() + (lse - mx.take_along_axis(z, lab[..., None], -1)[..., 0]).sum()

    def mlx_own(z):
        q = mx.softmax(z, axis=-1)
        return (q * q).sum() + nn.losses.cross_entropy(z, lab, reduction="none").sum()

    (a, ga), (b_, gb) = mx.value_and_grad(ours)(z), mx.value_and_grad(mlx_own)(z)
    assert abs(a.item() - b_.item()) < 1e-3 and mx.allclose(ga, gb, atol=1e-5)
    weights = position_weights(batches.n_labels + 1, 4.0)
    loss, _ = block_loss(drafter, target, joint, weights, 0.1, 1.0,
                         1.0 if family == "dspark" else 0.0)
    assert np.isfinite(loss.item())


def test_a_run_takes_sequences_that_arrive_in_its_store(tmp_path, monkeypatch, capsys):
    import mlx_dflash.train.loop as loop

    model, tok, _ = _tiny_store(tmp_path, n=12)
    more = tmp_path / "more.jsonl"
    more.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"})
                              for i in range(40, 52)))
    real_validate, calls, scored = loop.validate, {"n": 0}, []

    def grow_then_validate(*args, **kw):
        calls["n"] += 1
        scored.append(list(args[3]))
        if calls["n"] == 1:  # generation adds shards while the run trains
            build_store(model, tok, read_prompts(more), tmp_path / "store", [0, 2],
                        max_tokens=24, batch_size=5, top_k=4, progress=False)
        return real_validate(*args, **kw)

    monkeypatch.setattr(loop, "validate", grow_then_validate)
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, mask_token_id=2, max_steps=6,
                         epochs=4, grad_accum=2, save_every_s=0)
    train(model, config, progress=False)
    assert "feature store grew: 12 -> 24 sequences" in capsys.readouterr().out
    # Validation topped its set up with held-out sequences that arrived (it held fewer than
    # val_sequences) and scores only sequences held out now.
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    grown = FeatureStore(tmp_path / "store")
    held = {grown.id_list()[i] for i in loop.held_out_split(grown, config.val_fraction,
                                                             config.seed)[1]}
    assert scored[0] and len(held) < config.val_sequences
    assert set(state["val_ids"]) == held == {grown.id_list()[i] for i in scored[-1]}


def test_step_gradients_per_sequence_equal_the_collated_step(tmp_path, monkeypatch):
    """Large blocks go one sequence a forward, weighted by valid positions: with equal valid
    counts that is the collated step's loss and gradients."""
    import mlx.nn as nn
    import mlx_dflash.train.recipe as recipe
    from mlx.utils import tree_flatten
    from mlx_dflash.train.loop import Batches, feature_scale, new_drafter

    model, _, _ = _tiny_store(tmp_path)
    target = Target(model)
    store = FeatureStore(tmp_path / "store")
    config = TrainConfig(store_dir=str(tmp_path / "store"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, mask_token_id=2, num_anchors=3)
    drafter = new_drafter(target, config, store.layer_ids)
    batches = Batches(store, drafter, config,
                      feature_scale([np.asarray(s.features) for s in store]))
    seqs = [batches(i, np.random.default_rng(i)) for i in range(4)]
    assert len({int(b.valid.sum()) for b in seqs}) == 1  # every block fully labelled
    w = recipe.position_weights(batches.n_labels + 1, 7.0)
    fn = nn.value_and_grad(drafter, lambda b: recipe.block_loss(drafter, target, b, w, 1.0, 0.5))
    (loss, _), grads = recipe.step_gradients(fn, seqs)  # 12 rows a sequence: collated
    monkeypatch.setattr(recipe, "COLLATE_MAX_ROWS", 4)
    (loss_1, _), grads_1 = recipe.step_gradients(fn, seqs)
    assert abs(loss.item() - loss_1.item()) < 1e-5
    for (_, g), (_, g1) in zip(tree_flatten(grads), tree_flatten(grads_1)):
        assert mx.allclose(g, g1, atol=1e-5)


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_grown_drafter_computes_what_it_did(family):
    from test_dflash2 import make_dflash2
    from test_dspark import make_dspark

    from mlx_dflash.train.recipe import grow_layers

    model = make_target("qwen3", vocab_size=64, num_layers=4)
    make = {"dflash": make_drafter, "dspark": make_dspark, "dflash2": make_dflash2}[family]
    drafter = make(model, num_layers=1)
    target = Target(model)
    features = mx.random.normal((1, 9, 2 * model.args.hidden_size))

    def block_hidden():
        cache = drafter.make_cache()
        drafter.commit(features, cache)
        return drafter.block_hidden(target, mx.array([5]), cache, drafter.args.block_size)

    before = block_hidden()
    assert grow_layers(drafter, 3) == 2
    assert len(drafter.layers) == drafter.args.num_hidden_layers == 3
    assert len(drafter.args.layer_types) == 3
    assert mx.allclose(block_hidden(), before, atol=1e-5)
    with pytest.raises(ValueError, match="cannot shrink"):
        grow_layers(drafter, 2)


def test_a_run_grows_the_drafter_it_starts_from(tmp_path):
    model, _, _ = _tiny_store(tmp_path)
    common = dict(store_dir=str(tmp_path / "store"), block_size=4, mask_token_id=2,
                  learning_rate=3e-3, grad_accum=2)
    train(model, TrainConfig(out_dir=str(tmp_path / "one"), num_layers=1, epochs=2, **common),
          progress=False)
    start = str(tmp_path / "one" / "checkpoint")
    kept = train(model, TrainConfig(out_dir=str(tmp_path / "kept"), init_from=start, max_steps=1,
                                    **common), progress=False)
    assert len(kept.layers) == 1  # no --layers: the starting drafter's own count
    train(model, TrainConfig(out_dir=str(tmp_path / "two"), num_layers=2, init_from=start,
                             epochs=2, **common), progress=False)
    log = [json.loads(line) for line in open(tmp_path / "two" / "train_log.jsonl")]
    first = json.loads(open(tmp_path / "one" / "train_log.jsonl").readlines()[-1])
    assert log[0]["loss"] < 1.5 * first["loss"]  # where the 1-layer run ended (fresh: ~7)
    grown = load_drafter(tmp_path / "two" / "checkpoint", model=model)
    assert len(grown.layers) == grown.args.num_hidden_layers == 2
