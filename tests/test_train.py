"""Training: the recipe's masks, a few steps on a tiny model (loss falls), checkpoint round trip."""

import json

import mlx.core as mx
import numpy as np
from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash import load_drafter
from mlx_dflash.target import Target
from mlx_dflash.train.data import iter_examples, read_prompts, regenerate
from mlx_dflash.train.loop import TrainConfig, train
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


def test_regenerate_train_and_round_trip(tmp_path):
    model = make_target("qwen3", vocab_size=64, num_layers=4)
    tok = make_tokenizer(64, eos_id=64)
    tok._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 3} w{i + 5}"})
                                 for i in range(3, 15)))
    rows = read_prompts(prompts)
    regenerate(model, tok, rows, tmp_path / "data", max_tokens=24, batch_size=8, progress=False)
    regenerate(model, tok, rows, tmp_path / "data", max_tokens=24, progress=False)  # resumes
    examples = list(iter_examples(tmp_path / "data"))
    assert len(examples) == 12 and len({e["id"] for e in examples}) == 12
    config = TrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "run"),
                         block_size=4, num_layers=1, num_taps=2, mask_token_id=2,
                         learning_rate=3e-3, epochs=8, grad_accum=2, save_every=10,
                         val_fraction=0.1)
    trained = train(model, config, progress=False)
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    first = np.mean([r["loss"] for r in log[:4]])
    last = np.mean([r["loss"] for r in log[-4:]])
    assert last < 0.8 * first, (first, last)
    drafter = load_drafter(tmp_path / "run" / "checkpoint", model=model)
    assert drafter.block_size == 4 and drafter.mask_token_id == 2
    # Training runs on standardised features; the saved fc has the scale folded in.
    assert mx.allclose(drafter.fc.weight, trained.fc.weight, atol=1e-6)
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == len(log)
    # A new run can start from a saved drafter: its first loss is the trained level.
    config2 = TrainConfig(**{**config.__dict__, "out_dir": str(tmp_path / "run2"), "epochs": 1,
                             "init_from": str(tmp_path / "run" / "checkpoint")})
    train(model, config2, progress=False)
    log3 = [json.loads(line) for line in open(tmp_path / "run2" / "train_log.jsonl")]
    assert log3[0]["loss"] < first
    # Resume: one more epoch continues from the saved step.
    config.epochs = 9
    train(model, config, progress=False)
    log2 = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert log2[len(log)]["step"] == len(log) + 1


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
