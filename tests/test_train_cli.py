"""`mlx-dflash train` end to end on a tiny target directory: two generation workers fill the
feature store, a drafter is trained from it; errors name the problem."""

import json

from test_convert_cli import run
from tiny import make_target, make_tokenizer, save_target

from mlx_dflash import load_drafter
from mlx_dflash.train.store import FeatureStore


def target_dir(path, seed=0):
    model = make_target("qwen3", vocab_size=96, num_layers=8, seed=seed)
    return save_target(model, make_tokenizer(96), path,
                       chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


def test_train_command_end_to_end(tmp_path):
    target = target_dir(tmp_path / "target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"w{i} w{i + 7} w{i + 2}"})
                                 for i in range(3, 23)))
    args = ("train", "--out", tmp_path / "run", "--model", target, "--prompts", prompts,
            "--workers", 2, "--gen-batch-size", 6, "--max-response-tokens", 12,
            "--block-size", 4, "--layers", 1, "--taps", 2, "--draft-vocab", 30,
            "--tv-weight", 0.5, "--mask-token-id", 2, "--epochs", 2, "--grad-accum", 2)
    result = run(*args, "--generate-only")
    assert result.exit_code == 0, result.output
    store = FeatureStore(tmp_path / "run" / "store")
    assert len(store) == 20 and len(list(store.path.glob("shard_*"))) == 4
    assert store.layer_ids == [1, 5]  # z-lab's rule for 8 layers, 2 taps
    result = run(*args)  # generation resumes (nothing left), then training
    assert result.exit_code == 0, result.output
    drafter = load_drafter(tmp_path / "run" / "checkpoint")
    assert drafter.args.draft_vocab_size == 30 and drafter.target_layer_ids == [1, 5]

    # Another target's store is refused with a message that says so.
    other = target_dir(tmp_path / "other", seed=4)
    result = run("train", "--out", tmp_path / "run", "--model", other, "--epochs", 1)
    assert result.exit_code == 2 and "made for another target" in result.output
    result = run("train", "--out", tmp_path / "new", "--model", target, "--prompts",
                 tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and "prompt file not found" in result.output
