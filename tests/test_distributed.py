"""Speculative decoding with the target split across two ranks (mx.distributed, ring backend
on this machine, launched with mlx.launch; tensor parallel for qwen3 and llama, pipeline
parallel for qwen2 and the hybrid qwen3_next): greedy output equals the single-process plain
output, seeded sampled output equals the single-process speculative output with that seed,
and a rank that dies ends the run on the other with a clear error instead of a hang."""

import json
import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from distributed_run import BATCH_PROMPTS, FAMILIES, tokens
from test_lossless_greedy import reference
from tiny import make_drafter

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.skipif(not mx.distributed.is_available(),
                                reason="this MLX build has no distributed backend")


# mlx.launch (its console script may not be on PATH where the tests run)
MLX_LAUNCH = [sys.executable, "-c",
              "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
              "--backend", "ring", "-n", "2"]


def run_launched(cmd, timeout=300, **kw):
    """subprocess.run in a process group of its own: on a timeout the ranks go too (killing the
    launcher alone would leave them waiting on each other)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(*args, timeout=300):
    """``mlx.launch --backend ring -n 2`` of distributed_run.py on this machine."""
    return run_launched([*MLX_LAUNCH, sys.executable, os.path.join(HERE, "distributed_run.py"),
                         *args], timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "out.json"
    run = launch(str(out))
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_targets_decode_as_one_process(two_ranks, family):
    model = FAMILIES[family][0]()
    drafter = make_drafter(model, block_size=4)
    got = two_ranks[family]
    plain = tokens(model, None, max_tokens=24)
    assert got["plain"] == plain
    assert got["greedy"] == plain and got["auto"] == plain and got["tree"] == plain
    assert got["chunked"] == plain
    mx.random.seed(7)
    assert got["sampled"] == tokens(model, drafter, max_tokens=24, block_size=4,
                                    temperature=1.0)
    for p, batched, with_trees in zip(BATCH_PROMPTS, got["batch"], got["batch_trees"]):
        want = reference(model, p, 16)[0]
        assert batched == want and with_trees == want


def test_a_rank_that_dies_ends_the_run_with_an_error(tmp_path):
    """Rank 1 exits mid-run: rank 0 does not hang. Its next message fails ("connection to a
    peer was lost"), or mlx.launch stops it first; either way the run ends, saying which rank
    left."""
    out = tmp_path / "out.json"
    run = launch(str(out), "die", timeout=120)  # a hang would time out
    said = run.stdout + run.stderr
    assert not out.exists()
    assert "rank 1 exited with code 3" in said
    assert "connection to a peer was lost" in said or "rank 0 exited with code -15" in said


def test_mlx_launch_runs_the_cli_with_rank_0_speaking(tmp_path):
    """``mlx.launch --backend ring -n 2 mlx-dflash generate ...`` (README): rank 0 prints,
    once, the single-process text; a prompt on stdin (which mlx.launch does not pass on) is
    refused instead of waited for."""
    from tiny import make_target, make_tokenizer, save_target

    from mlx_dflash import save_drafter

    model = make_target("qwen3", vocab_size=96)
    target_dir = save_target(model, make_tokenizer(96), tmp_path / "target")
    save_drafter(make_drafter(model, block_size=4), tmp_path / "drafter")
    args = ["generate", "w5 w6 w7", "--model", str(target_dir), "--drafter",
            str(tmp_path / "drafter"), "--max-tokens", "12"]
    alone = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", *args],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    cmd = [*MLX_LAUNCH, sys.executable, "-m", "mlx_dflash.cli", *args]
    split = run_launched(cmd)
    assert split.returncode == 0, split.stderr[-3000:]
    assert split.stdout == alone.stdout
    assert "split across 2 ranks (tensor parallel)" in split.stderr
    args[1] = "-"
    refused = run_launched([*MLX_LAUNCH, sys.executable, "-m", "mlx_dflash.cli", *args],
                           stdin=subprocess.DEVNULL)
    assert "pass the prompt as an argument" in refused.stderr
    chat = run_launched([*MLX_LAUNCH, sys.executable, "-m", "mlx_dflash.cli", "chat",
                         "--model", str(target_dir)], stdin=subprocess.DEVNULL)
    assert "chat does not run across machines" in chat.stderr
