"""`mlx-dflash launch claude | codex | opencode`: run a coding agent against this package's
server, starting one (or using one already running) and pointing the agent at it through
environment variables, `-c` overrides or a config of our own in a temporary directory; the
user's own config files are never edited. What it started stops when the agent exits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

import typer

from .app import app, fail

AGENTS = {  # name -> (command, how to install it)
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
    "codex": ("codex", "npm install -g @openai/codex"),
    "opencode": ("opencode", "npm install -g opencode-ai"),
}
CODEX_SUBCOMMANDS = {"exec", "e", "resume", "review"}  # take the model flags after them
START_TIMEOUT_S = 600.0  # a first start converts the default model and times its passes


def agent_command(agent: str, url: str, model: str, context: int | None, api_key: str,
                  args: list[str], config_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The agent's command line and the environment variables that point it at ``url``
    (``context``: the model's context size, for the agents that plan compaction by it)."""
    exe = shutil.which(AGENTS[agent][0]) or AGENTS[agent][0]
    if agent == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": api_key,
               "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
               "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
               "CLAUDE_CODE_SUBAGENT_MODEL": model,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        return [exe, *args], env
    if agent == "codex":
        flags = ["-c", "model_provider=mlx-dflash",
                 "-c", 'model_providers.mlx-dflash.name="mlx-dflash"',
                 "-c", f'model_providers.mlx-dflash.base_url="{url}/v1"',
                 "-c", 'model_providers.mlx-dflash.wire_api="responses"',
                 "-c", 'model_providers.mlx-dflash.env_key="MLX_DFLASH_API_KEY"',
                 "-m", model]
        if context:
            flags += ["-c", f"model_context_window={context}"]
        if args and args[0] in CODEX_SUBCOMMANDS:
            return [exe, args[0], *flags, *args[1:]], {"MLX_DFLASH_API_KEY": api_key}
        return [exe, *flags, *args], {"MLX_DFLASH_API_KEY": api_key}
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"mlx-dflash": {
                  "npm": "@ai-sdk/openai-compatible", "name": "mlx-dflash",
                  "options": {"baseURL": f"{url}/v1", "apiKey": api_key},
                  "models": {model: {"name": model} | (
                      {"limit": {"context": context, "output": context // 4}} if context
                      else {})}}},
              "model": f"mlx-dflash/{model}"}
    path = config_dir / "opencode.json"
    path.write_text(json.dumps(config, indent=2))
    return [exe, *args], {"OPENCODE_CONFIG": str(path)}


def _get(url: str, api_key: str | None = None, timeout: float = 2.0) -> dict | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"}
                                     if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _served_models(url: str, api_key: str | None) -> list[tuple[str, int | None]]:
    """(name, context size) of each model the server lists."""
    listing = _get(f"{url}/v1/models", api_key)
    return [(m["id"], m.get("context_length")) for m in (listing or {}).get("data", [])]


def _start_server(port: int, serve_args: list[str], log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(port),
               *serve_args]
    typer.secho(f"Starting the server: {' '.join(command[1:])} (log: {log_path})",
                fg=typer.colors.CYAN, err=True)
    log = open(log_path, "ab")  # noqa: SIM115 (the child writes to it until it stops)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(url: str, server: subprocess.Popen, log_path: Path) -> None:
    """Wait until the server started as ``server`` answers /health (its log, ``log_path``,
    is shown if it exits first)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _get(f"{url}/health") is not None:
            return
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            fail(f"the server exited before it was ready (code {server.returncode}):\n{tail}")
        time.sleep(0.5)
    server.terminate()
    fail(f"the server was not ready after {START_TIMEOUT_S:.0f} s (log: {log_path})")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    agent: str = typer.Argument(..., help="claude, codex or opencode."),
    model: Optional[List[str]] = typer.Option(
        None, "--model", "-m", help="Target to serve (default: the built-in pair)."),
    drafter: Optional[List[str]] = typer.Option(None, "--drafter", "-d",
                                                help="Drafter for --model (see serve)."),
    port: int = typer.Option(8080, "--port", "-p", min=1, max=65535),
    url: Optional[str] = typer.Option(
        None, "--url", help="Use the server at this URL instead of starting one."),
    max_context: Optional[int] = typer.Option(
        32768, "--max-context", min=2, help="The started server's context size (agents send "
        "10-30k tokens of prompt)."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1, help="The started server's longest reply."),
    temp: Optional[float] = typer.Option(
        None, "--temp", min=0.0, max=2.0, help="The started server's temperature for "
        "requests that name none (agents send none)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLX_DFLASH_API_KEY"),
) -> None:
    """Run a coding agent (Claude Code, Codex, opencode) against the server: arguments after
    `--` go to the agent, e.g. `mlx-dflash launch claude -- -p "Fix the tests"`."""
    if agent not in AGENTS:
        fail(f"unknown agent '{agent}': choose one of {', '.join(AGENTS)}")
    command, install = AGENTS[agent]
    if shutil.which(command) is None:
        fail(f"'{command}' is not installed (or not on PATH); install it with: {install}")
    base = (url or f"http://127.0.0.1:{port}").rstrip("/")
    key = api_key or "mlx-dflash"  # agents insist on some key; the server checks only its own
    server = None
    if _get(f"{base}/health") is None:
        if url is not None:
            fail(f"no server answers at {url}")
        serve_args = [a for m in model or [] for a in ("--model", m)]
        serve_args += [a for d in drafter or [] for a in ("--drafter", d)]
        serve_args += ["--max-context", str(max_context)] if max_context else []
        serve_args += ["--max-tokens", str(max_tokens)] if max_tokens else []
        serve_args += ["--temp", str(temp)] if temp is not None else []
        serve_args += ["--api-key", api_key] if api_key else []
        log_path = Path(tempfile.gettempdir()) / f"mlx-dflash-serve-{port}.log"
        server = _start_server(port, serve_args, log_path)
        wait_ready(base, server, log_path)
    else:
        typer.secho(f"Using the server already running at {base}", fg=typer.colors.CYAN,
                    err=True)
    try:
        names = _served_models(base, key)
        if not names:
            fail(f"the server at {base} lists no models (is --api-key right?)")
        with tempfile.TemporaryDirectory(prefix=f"mlx-dflash-{agent}-") as config_dir:
            argv, env = agent_command(agent, base, *names[0], key, list(ctx.args),
                                      Path(config_dir))
            code = subprocess.call(argv, env={**os.environ, **env})
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
    raise typer.Exit(code)
