"""`mlx-dflash launch`: an agent pointed at a running server, its arguments passed through, a
clear error when it is not installed. Stand-in agents (shell scripts on PATH) print what they
were given; the real agents run in scripts/agents_e2e.py."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from test_server_agents import NAME, pair  # noqa: F401 (the tiny pair, a fixture)
from typer.testing import CliRunner

from mlx_dflash.cli import app
from mlx_dflash.server import BackgroundServer, create_app

STAND_IN = """#!/bin/sh
{python} - "$@" <<'EOF'
import json, os, sys
keys = ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL", "MLX_DFLASH_API_KEY",
        "OPENCODE_CONFIG")
config = os.environ.get("OPENCODE_CONFIG")
seen = {{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}},
        "config": json.load(open(config)) if config else None}}
open(os.environ["SEEN"], "w").write(json.dumps(seen))
EOF
exit 3
"""


@pytest.fixture()
def agents_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SEEN", str(tmp_path / "seen.json"))
    for name in ("claude", "codex", "opencode"):
        path = tmp_path / name
        path.write_text(STAND_IN.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def run(args):
    """The command's result and what the stand-in agent saw."""
    seen = os.environ.get("SEEN")
    if seen and os.path.exists(seen):
        os.remove(seen)
    result = CliRunner().invoke(app, ["launch", *args])
    return result, json.load(open(seen)) if seen and os.path.exists(seen) else None


def test_agents_are_pointed_at_the_server(pair, agents_on_path):  # noqa: F811
    with BackgroundServer(create_app(*pair, model_name=NAME, max_context=4096)) as srv:
        result, seen = run(["claude", "--url", srv.url, "--", "-p", "hi there"])
        assert result.exit_code == 3  # the agent's own exit code
        assert seen["argv"] == ["-p", "hi there"]
        assert seen["env"]["ANTHROPIC_BASE_URL"] == srv.url
        assert seen["env"]["ANTHROPIC_MODEL"] == NAME and seen["env"]["ANTHROPIC_AUTH_TOKEN"]

        _, seen = run(["codex", "--url", srv.url, "--", "exec", "--json", "hi"])
        argv = seen["argv"]
        assert argv[0] == "exec" and argv[-2:] == ["--json", "hi"]  # flags after the subcommand
        assert f'model_providers.mlx-dflash.base_url="{srv.url}/v1"' in argv
        assert 'model_providers.mlx-dflash.wire_api="responses"' in argv
        assert "model_context_window=4096" in argv and argv[argv.index("-m") + 1] == NAME

        _, seen = run(["opencode", "--url", srv.url, "--", "run", "hi"])
        provider = seen["config"]["provider"]["mlx-dflash"]
        assert provider["options"]["baseURL"] == f"{srv.url}/v1"
        assert seen["config"]["model"] == f"mlx-dflash/{NAME}"
        assert provider["models"][NAME]["limit"]["context"] == 4096
    assert not os.path.exists(seen["env"]["OPENCODE_CONFIG"])  # a temporary config, gone


def test_missing_agent_and_missing_server(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result, _ = run(["codex"])
    assert result.exit_code == 2 and "npm install -g @openai/codex" in result.output
    result, _ = run(["gemini"])
    assert result.exit_code == 2 and "claude, codex, opencode" in result.output


def test_no_server_at_the_url(agents_on_path):
    result, _ = run(["claude", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "no server answers at http://127.0.0.1:9" in result.output
