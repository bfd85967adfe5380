"""Speculative decoding with the target split across two ranks (mx.distributed, ring backend on
this machine, launched with mlx.launch; tensor parallel for qwen3 and llama, pipeline parallel
for qwen2 and the hybrid qwen3_next, and for llama, gemma3_text and gpt_oss, which mlx-lm does
not pipeline; qwen3_next with its own MTP head too): greedy output equals the single-process
plain output, seeded sampled output equals the single-process speculative output with that
seed, and a rank that dies ends the run on the other with a clear error instead of a hang."""

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from distributed_run import BATCH_PROMPTS, FAMILIES, MTP_FAMILIES, tokens
from test_lossless_greedy import reference
from test_mtp import make_mtp
from tiny import make_drafter, make_target, make_tokenizer

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.skipif(not mx.distributed.is_available(),
                                reason="this MLX build has no distributed backend")


# mlx.launch (its console script may not be on PATH where the tests run)
MLX_LAUNCH = [sys.executable, "-c",
              "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
              "--backend", "ring", "-n", "2"]


def run_launched(cmd, timeout=300, input=None, **kw):
    """subprocess.run in a process group of its own: on a timeout the ranks go too (killing the
    launcher alone would leave them waiting on each other)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(input, timeout=timeout)
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
    assert len(plain) >= 8, "the tiny target stops at once: the comparisons would be empty"
    assert got["plain"] == plain
    assert got["greedy"] == plain and got["auto"] == plain and got["tree"] == plain
    assert got["chunked"] == plain
    mx.random.seed(7)
    assert got["sampled"] == tokens(model, drafter, max_tokens=24, block_size=4,
                                    temperature=1.0)
    if family in MTP_FAMILIES:
        mtp = make_mtp(model)
        assert got["mtp"] == plain
        mx.random.seed(7)
        assert got["mtp_sampled"] == tokens(model, mtp, max_tokens=24, block_size=3,
                                            temperature=1.0)
    for p, batched, with_trees in zip(BATCH_PROMPTS, got["batch"], got["batch_trees"]):
        want = reference(model, p, 16)[0]
        assert batched == want and with_trees == want


def test_the_server_across_two_ranks_answers_as_one_process(tmp_path):
    """Rank 0 serves, rank 1 follows (tensor and pipeline splits; the batch engine and the
    one-at-a-time one): concurrent greedy requests
    get the target's own greedy text, a stop string and a client hanging up end their request
    alone, and repeats continue from the prefix cache with the same text."""
    from distributed_serve import MAX_TOKENS, PROMPTS, SERVED, V

    from mlx_dflash import generate

    out = tmp_path / "serve.json"
    run = run_launched([*MLX_LAUNCH, sys.executable, os.path.join(HERE, "distributed_serve.py"),
                        str(out)], timeout=300)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == set(SERVED)
    for name, texts in got.items():
        family = SERVED[name][0]
        model, tokenizer = make_target(family, vocab_size=V), make_tokenizer(V)
        want = [generate(model, None, tokenizer, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
        assert texts[:4] == want
        assert generate(model, None, tokenizer, "w7 w8", max_tokens=400).startswith(texts[4])
        stop = want[1].split()[2]
        assert texts[5] == want[1][:want[1].index(stop)]
        assert isinstance(texts[6], str)  # sampled (seeded equality: the generate tests)
        assert texts[7:] == want[:2]


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


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A tiny target (with a chat template) and drafter saved as the CLI loads them."""
    from test_chat_cli import TEMPLATE
    from tiny import save_target

    from mlx_dflash import save_drafter

    root = tmp_path_factory.mktemp("cli")
    model = make_target("qwen3", vocab_size=96)
    save_target(model, make_tokenizer(96), root / "target", TEMPLATE)
    save_drafter(make_drafter(model, block_size=4), root / "drafter")
    return ["--model", str(root / "target"), "--drafter", str(root / "drafter")]


def cli(*args):
    return [sys.executable, "-m", "mlx_dflash.cli", *args]


def test_mlx_launch_runs_generate_with_rank_0_speaking(saved_pair):
    """``mlx.launch --backend ring -n 2 mlx-dflash generate ...`` (README): rank 0 prints,
    once, the single-process text; a prompt on stdin is refused instead of waited for
    (mlx.launch passes stdin's lines on, never its end)."""
    args = ["generate", "w5 w6 w7", *saved_pair, "--max-tokens", "12"]
    alone = subprocess.run(cli(*args), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    split = run_launched([*MLX_LAUNCH, *cli(*args)])
    assert split.returncode == 0, split.stderr[-3000:]
    assert split.stdout == alone.stdout
    assert "split across 2 ranks (tensor parallel)" in split.stderr
    args[1] = "-"
    refused = run_launched([*MLX_LAUNCH, *cli(*args)], stdin=subprocess.DEVNULL)
    assert "pass the prompt as an argument" in refused.stderr


def test_mlx_launch_runs_chat_with_rank_0_reading(saved_pair):
    """Rank 0 reads the lines typed and sends them on; the conversation (a reset between two
    turns, then /exit) prints what one process prints."""
    typed = "w5 w6\n/reset\nw9 w9\nw10\n/exit\n"
    args = ["chat", *saved_pair, "--max-tokens", "8"]
    alone = subprocess.run(cli(*args), input=typed, capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 0, alone.stderr
    split = run_launched([*MLX_LAUNCH, *cli(*args)], stdin=subprocess.PIPE, input=typed)
    assert split.returncode == 0, split.stderr[-3000:]
    assert split.stdout == alone.stdout and alone.stdout.count(">> ") == 5


def test_mlx_launch_runs_serve_with_rank_0_answering(saved_pair, tmp_path):
    """``mlx.launch ... mlx-dflash serve`` with two models: rank 0 answers over HTTP what one
    process answers, switching models as requests ask, and Ctrl-C stops every rank; what does
    not run across machines is refused."""
    import socket

    import httpx

    from mlx_dflash import generate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = [*saved_pair, *saved_pair, "--model-name", "a", "--model-name", "b"]  # two models
    proc = subprocess.Popen([*MLX_LAUNCH, *cli("serve", *two, "--port", str(port))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.25)
        body = {"prompt": "w5 w6 w7", "max_tokens": 12, "temperature": 0}
        got = [httpx.post(f"{url}/v1/completions", json={**body, "model": name},
                          timeout=120).json() for name in ("a", "a", "b", "a")]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    model = make_target("qwen3", vocab_size=96)
    want = generate(model, None, make_tokenizer(96), "w5 w6 w7", max_tokens=12)
    assert all("choices" in g for g in got), (got, err[-3000:])
    assert [g["choices"][0]["text"] for g in got] == [want] * 4
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache
    assert "split across 2 ranks" in err
    assert "exited with code" not in err and "was killed" not in err, err[-3000:]  # all stopped
    for refused, said in [([*saved_pair, "--model-memory", "1GB"], "--model-memory does not"),
                          ([*saved_pair, "--cache-dir", str(tmp_path)], "--cache-dir does not")]:
        run = run_launched([*MLX_LAUNCH, *cli("serve", *refused)])
        assert said in run.stderr, run.stderr[-2000:]
