"""`mlx-dflash generate --model DIR --drafter DIR` end to end on a tiny saved pair."""

import subprocess
import sys

import pytest
from tiny import make_drafter, make_target, make_tokenizer, save_target

from mlx_dflash import save_drafter


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    model = make_target("qwen3", vocab_size=96)
    target_dir = save_target(model, make_tokenizer(96), root / "target")
    drafter_dir = root / "drafter"
    save_drafter(make_drafter(model, block_size=4), drafter_dir)
    return target_dir, drafter_dir


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_dflash.cli", *args],
                          capture_output=True, text=True)


def test_generate_matches_mlx_lm(tiny_pair):
    target_dir, drafter_dir = tiny_pair
    out = cli("generate", "w5 w6 w7", "--model", str(target_dir), "--drafter", str(drafter_dir),
              "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    from mlx_lm import generate, load

    model, tok = load(str(target_dir))
    assert out.stdout.rstrip("\n") == generate(model, tok, "w5 w6 w7", max_tokens=12)
    assert "mean acceptance length" in out.stderr


def test_generate_bad_paths_are_named(tiny_pair):
    target_dir, _ = tiny_pair
    out = cli("generate", "hi", "--model", str(target_dir), "--drafter", "/no/such/dir")
    assert out.returncode == 2 and "drafter directory not found: /no/such/dir" in out.stderr
    out = cli("generate", "--model", str(target_dir), "--drafter", "none")
    assert out.returncode == 2 and "no prompt given" in out.stderr


def test_help_and_version():
    assert "generate" in cli("--help").stdout
    assert cli("--version").stdout.startswith("mlx-dflash ")


def test_tree_option(tiny_pair):
    """--tree N gives the target's output; a bad --tree is named before anything loads."""
    target_dir, drafter_dir = tiny_pair
    pair = ["--model", str(target_dir), "--drafter", str(drafter_dir), "--max-tokens", "12"]
    plain = cli("generate", "w5 w6 w7", *pair)
    tree = cli("generate", "w5 w6 w7", *pair, "--tree", "5")
    assert tree.returncode == 0, tree.stderr
    assert tree.stdout == plain.stdout
    bad = cli("generate", "w5 w6 w7", *pair, "--tree", "0")
    assert bad.returncode != 0 and "--tree takes a number of nodes" in bad.stderr


def test_long_context_options(tiny_pair):
    """--draft-window keeps the output; --kv-bits changes the caches, not the lossless rule
    (equal to plain decoding with the same caches); values they cannot take are named."""
    target_dir, drafter_dir = tiny_pair
    pair = ["--model", str(target_dir), "--drafter", str(drafter_dir), "--max-tokens", "12"]
    plain = cli("generate", "w5 w6 w7", *pair)
    windowed = cli("generate", "w5 w6 w7", *pair, "--draft-window", "2")
    assert windowed.returncode == 0, windowed.stderr
    assert windowed.stdout == plain.stdout
    bad = cli("generate", "w5 w6 w7", *pair, "--kv-bits", "7")
    assert bad.returncode == 2 and "--kv-bits takes 2, 3, 4, 5, 6, 8, got 7" in bad.stderr
    # the tiny target's heads are 16 wide: no group size of 32 or more divides them
    small = cli("generate", "w5 w6 w7", *pair, "--kv-bits", "8")
    assert small.returncode == 2
    assert "does not divide the target's head dimension 16" in small.stderr
    no_window = cli("generate", "w5 w6 w7", "--model", str(target_dir), "--drafter", "none",
                    "--draft-window", "8")
    assert no_window.returncode == 2 and "--draft-window applies to DFlash" in no_window.stderr


def test_json_schema_option(tmp_path):
    """--json-schema FILE: the reply is what generate(..., grammar=...) writes, and valid JSON
    for the schema; a missing file, bad JSON and a schema it cannot enforce are named."""
    import json

    from test_grammar import SCHEMA, WORDS
    from tiny import make_text_tokenizer

    from mlx_dflash import Grammar, generate

    tok = make_text_tokenizer(WORDS)
    model = make_target("qwen3", vocab_size=len(tok.vocab), seed=5)
    target_dir = save_target(model, tok, tmp_path / "target")
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    save_drafter(drafter, tmp_path / "drafter")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    pair = ["--model", str(target_dir), "--drafter", str(tmp_path / "drafter")]
    out = cli("generate", "a pet", *pair, "--max-tokens", "120", "--json-schema", str(schema),
              "--no-chat-template")
    assert out.returncode == 0, out.stderr
    want = generate(model, drafter, tok, "a pet", max_tokens=120,
                    grammar=Grammar.json_schema(SCHEMA))
    assert out.stdout.rstrip("\n") == want
    json.loads(want)
    missing = cli("generate", "a pet", *pair, "--json-schema", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    schema.write_text('{"type": "object", "properties": {"a": {"type": "strng"}}}')
    bad = cli("generate", "a pet", *pair, "--json-schema", str(schema))
    assert bad.returncode == 2 and "strng" in bad.stderr
