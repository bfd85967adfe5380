"""`mlx-dflash chat` driven through a pseudo-terminal on a tiny saved pair with a chat template."""

from __future__ import annotations

import re
import sys

import pytest
from tiny import make_drafter, make_target, make_tokenizer, save_target

import mlx_dflash

pexpect = pytest.importorskip("pexpect")

# Roles become words of the tiny word-level vocabulary, so every rendered token is a real id.
TEMPLATE = (
    "{% for m in messages %}"
    "{{ {'system': 'w20', 'user': 'w21', 'assistant': 'w22'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w22{% endif %}"
)
STATS = re.compile(
    r"\[[\d.]+ tok/s \| mean acceptance length [\d.]+ \(block 4\) \| est\. speedup [\d.]+x"
    r" \| prefilled (\d+) of (\d+) prompt tokens\]"
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_chat_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = make_target("qwen3", vocab_size=96)
    target_dir = save_target(model, make_tokenizer(96), root / "target", TEMPLATE)
    drafter_dir = root / "drafter"
    mlx_dflash.save_drafter(make_drafter(model, block_size=4), drafter_dir)
    return target_dir, drafter_dir


def expected_reply(target, drafter, tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mlx_dflash.generate(target, drafter, tokenizer, prompt, max_tokens=MAX_TOKENS)


def spawn_chat(target_dir, drafter_dir, *options):
    """`mlx-dflash chat` on the tiny pair in a pseudo-terminal, MAX_TOKENS a reply."""
    return pexpect.spawn(
        sys.executable,
        ["-m", "mlx_dflash.cli", "chat", "--model", str(target_dir), "--drafter",
         str(drafter_dir), "--max-tokens", str(MAX_TOKENS), *options],
        encoding="utf-8", timeout=30, dimensions=(24, 200),
    )


def quit_chat(child):
    child.expect_exact(">> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def say(child, text):
    """Send one user turn; return (reply, (prefilled, prompt tokens)) as shown on the terminal."""
    child.expect_exact(">> ")
    child.sendline(text)
    child.expect_exact(text)  # the terminal's echo of the input line
    child.expect(STATS)
    reply = ANSI.sub("", child.before).replace("\r\n", "\n").strip("\n")
    return reply, (int(child.match.group(1)), int(child.match.group(2)))


def test_chat_two_turns_reset_exit(tiny_chat_pair):
    from mlx_lm import load

    target_dir, drafter_dir = tiny_chat_pair
    child = spawn_chat(target_dir, drafter_dir, "--system-prompt", "w8")
    try:
        child.expect("Loading")  # progress while the model loads
        child.expect(r"target 1-token pass [\d.]+ ms, 4-token pass [\d.]+ ms")  # costs timed
        child.expect(r"Ready in [\d.]+ s")

        target, tokenizer = load(str(target_dir))
        drafter = mlx_dflash.load_drafter(drafter_dir)
        history = [{"role": "system", "content": "w8"}, {"role": "user", "content": "w5 w6 w7"}]

        reply1, _ = say(child, "w5 w6 w7")
        assert reply1 == expected_reply(target, drafter, tokenizer, history)
        assert reply1  # the tiny model says something

        # Turn two sees the whole conversation, re-rendered through the template.
        history += [{"role": "assistant", "content": reply1},
                    {"role": "user", "content": "w30 w31"}]
        reply2, _ = say(child, "w30 w31")
        assert reply2 == expected_reply(target, drafter, tokenizer, history)

        child.expect_exact(">> ")
        child.sendline("/reset")
        child.expect_exact("[conversation cleared]")
        # After /reset only the system prompt is left: turn two's message alone.
        reply3, _ = say(child, "w30 w31")
        assert reply3 == expected_reply(target, drafter, tokenizer,
                                        [history[0], {"role": "user", "content": "w30 w31"}])
        assert reply3 != reply2  # the history did shape turn two

        quit_chat(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_prefills_only_the_new_turn(tiny_chat_pair):
    """Turn 3 prefills only turn 3's tokens: the caches of turns 1 and 2 are kept."""
    from mlx_lm import load

    target_dir, drafter_dir = tiny_chat_pair
    child = spawn_chat(target_dir, drafter_dir, "--system", "w8 w9 w10")
    try:
        target, tokenizer = load(str(target_dir))
        drafter = mlx_dflash.load_drafter(drafter_dir)
        history = [{"role": "system", "content": "w8 w9 w10"}]
        for turn, text in enumerate(["w5 w6 w7", "w30 w31", "w40 w41 w42"], 1):
            before = tokenizer.apply_chat_template(history) if turn > 1 else []
            history.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            reply, (prefilled, total) = say(child, text)
            assert reply == expected_reply(target, drafter, tokenizer, history)
            assert total == len(prompt)
            assert prompt[: len(before)] == before
            if turn == 1:
                assert prefilled == total
            else:  # only what the new turn added to the template's text
                assert prefilled == len(prompt) - len(before), (turn, prefilled, total)
            history.append({"role": "assistant", "content": reply})
        quit_chat(child)
    finally:
        child.close(force=True)


def test_chat_max_kv_size_drops_the_oldest_exchanges(tiny_chat_pair):
    from typer.testing import CliRunner

    from mlx_dflash.cli import app

    target_dir, drafter_dir = tiny_chat_pair
    args = ["chat", "--model", str(target_dir), "--drafter", str(drafter_dir), "-n", "4",
            "--system", "w8", "--max-kv-size", "16"]
    result = CliRunner().invoke(app, args, input="w5 w6 w7\nw30 w31\nw40 w41\n")
    assert result.exit_code == 0, result.output
    assert "[dropped the 2 oldest messages to stay within --max-kv-size]" in result.output
    assert len(STATS.findall(result.output)) == 3


def test_chat_help_explains_the_estimate():
    from typer.testing import CliRunner

    from mlx_dflash.cli import app

    result = CliRunner().invoke(app, ["chat", "--help"], terminal_width=400)
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    for phrase in ("/reset", "/exit", "--system-prompt", "--system", "--max-kv-size",
                   "--block-size", "est. speedup", "committed tokens x t(1-token pass)"):
        assert phrase in text, phrase


def test_chat_piped_and_without_template(tiny_chat_pair, tmp_path):
    """Piped stdin works too (EOF quits); a tokenizer without a chat template is refused."""
    from typer.testing import CliRunner

    from mlx_dflash.cli import app

    target_dir, drafter_dir = tiny_chat_pair
    args = ["chat", "--model", str(target_dir), "--drafter", str(drafter_dir), "-n", "4"]
    result = CliRunner().invoke(app, args, input="w5 w6 w7\n/help\n")
    assert result.exit_code == 0, result.output
    assert STATS.search(result.output) and "/reset clears" in result.output

    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors"):
        (plain / name).symlink_to(target_dir / name)
    make_tokenizer(96)._tokenizer.save_pretrained(str(plain))
    result = CliRunner().invoke(app, ["chat", "--model", str(plain), "--drafter", "none"])
    assert result.exit_code == 2 and "has no chat template" in result.output


def test_chat_with_tree_drafts(tiny_chat_pair):
    """--tree: two turns (the second continues the first's caches), replies as the target's."""
    from mlx_lm import load

    target_dir, drafter_dir = tiny_chat_pair
    child = spawn_chat(target_dir, drafter_dir, "--tree", "5")
    try:
        child.expect(r"Ready in [\d.]+ s")
        target, tokenizer = load(str(target_dir))
        drafter = mlx_dflash.load_drafter(drafter_dir)
        history = [{"role": "user", "content": "w5 w6 w7"}]
        reply1, _ = say(child, "w5 w6 w7")
        assert reply1 == expected_reply(target, drafter, tokenizer, history)
        history += [{"role": "assistant", "content": reply1},
                    {"role": "user", "content": "w30 w31"}]
        reply2, (prefilled, total) = say(child, "w30 w31")
        assert reply2 == expected_reply(target, drafter, tokenizer, history)
        assert prefilled < total
        quit_chat(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
