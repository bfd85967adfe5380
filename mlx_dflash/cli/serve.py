"""`mlx-dflash serve`: an OpenAI- and Anthropic-compatible HTTP server (chat and text completions,
Responses, Messages; streaming), for one or several models, with prefix caches in memory and on
disk."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any, List, Optional

import typer

from ..policy import COPY_DRAFTS
from .app import app, fail
from .common import (
    DRAFT_WINDOW_HELP,
    KV_BITS_HELP,
    SPLIT_HELP,
    TREE_HELP,
    load_pair,
    parse_size,
    parse_split,
    parse_tree,
)


def _size(option: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        fail(f"{option}: {e}")


def _json_object(option: str, value: str | None) -> dict[str, Any]:
    try:
        parsed = json.loads(value) if value else {}
    except ValueError as e:
        fail(f"{option}: not valid JSON ({e})")
    if not isinstance(parsed, dict):
        fail(f"{option}: expected a JSON object, got {value!r}")
    return parsed


def _entries(models: list[str], drafters: list[str], names: list[str],
             config: str | None, model_dir: Path | None = None) -> list:
    """What to serve: the config file's models, every model in --model-dir, or
    --model/--drafter/--model-name in order."""
    from ..server.models import ModelEntry, read_models_config

    if model_dir is not None:
        if models or drafters or names or config:
            fail("--model-dir replaces --model, --drafter, --model-name and --models-config")
        if not model_dir.is_dir():
            fail(f"--model-dir: {model_dir} is not a directory")
        found = sorted(p for p in model_dir.iterdir() if _is_target(p))
        if not found:
            fail(f"--model-dir: no mlx-lm model (config.json + *.safetensors) in {model_dir}")
        return [ModelEntry(p.name, str(p), None) for p in found]  # drafters: auto
    if config is not None:
        if models or drafters or names:
            fail("--models-config replaces --model, --drafter and --model-name")
        try:
            return read_models_config(config)
        except (OSError, ValueError) as e:
            fail(str(e))
    models = models or [None]  # the default pair
    if drafters and len(drafters) != len(models):
        fail("give one --drafter per --model (in the same order), or none")
    if names and len(names) != len(models):
        fail("give one --model-name per --model (in the same order)")
    drafters, names = drafters or [None] * len(models), names or [None] * len(models)
    return [ModelEntry(n, m, d) for n, m, d in zip(names, models, drafters)]


@app.command()
def serve(
    model: List[str] = typer.Option(
        [], "--model", "-m", help="mlx-lm target (dir or hub id); repeatable, to serve several "
        "models by name. Default: the built-in pair."),
    drafter: List[str] = typer.Option(
        [], "--drafter", "-d", help="Drafter dir or hub id ('none': target alone; 'mtp': the "
        "target's MTP head); one per --model, in order."),
    model_name: List[str] = typer.Option(
        [], "--model-name", help="Name clients send as 'model' (default: --model); one per "
        "--model."),
    models_config: Optional[str] = typer.Option(
        None, "--models-config", help="JSON file: [{\"name\", \"model\", \"drafter\", "
        "\"block_size\"}, ...] (instead of --model/--drafter/--model-name)."),
    model_memory: Optional[str] = typer.Option(
        None, "--model-memory", help="Most bytes of weights kept loaded (e.g. 12GB); the least "
        "recently used models are unloaded beyond it. Default: no limit."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", "-p", min=0, max=65535),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="MLX_DFLASH_API_KEY",
        help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* (env "
        "MLX_DFLASH_API_KEY)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", "-b", min=1,
                                             help="Block size (default: the drafter's)."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", min=2, help="Context size (default: the target's config)."),
    cache_memory: str = typer.Option(
        "2GB", "--cache-memory", help="Prefix caches kept in memory, per loaded model (least "
        "recently used out first); 0: none."),
    cache_dir: Optional[str] = typer.Option(
        None, "--cache-dir", help="Also keep prefix caches on disk here (they survive "
        "restarts)."),
    cache_disk: Optional[str] = typer.Option(
        None, "--cache-disk", help="Most bytes of prefix caches on disk, per model (oldest use "
        "out first). Default: no limit."),
    chat_template_kwargs: Optional[str] = typer.Option(
        None, "--chat-template-kwargs", help="JSON object passed to every chat template, e.g. "
        "'{\"enable_thinking\": false}' (a request's own chat_template_kwargs win)."),
    temp: Optional[float] = typer.Option(
        None, "--temp", min=0.0, max=2.0, help="Sampling temperature for requests that name "
        "none (agents send none). Default: each API's own, 1.0."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1, help="No reply longer than this many tokens, whatever a "
        "request asks (agents ask for 32000). Default: until the context ends."),
    max_batch: int = typer.Option(
        8, "--max-batch", min=1, help="Requests decoded together (continuous batching, one "
        "verify pass for all); more wait their turn. 1: one at a time."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or "
                                  "error (the package's log lines and uvicorn's)."),
    log_file: Optional[Path] = typer.Option(
        None, "--log-file", help="Also write the package's log lines (one per request, model "
        "loads, warnings) to this file (rotated at 10 MB, 5 kept)."),
    allowed_origins: List[str] = typer.Option(
        [], "--allowed-origins", help="A web origin (e.g. http://localhost:3000) whose pages "
        "may call the API from a browser (CORS); repeatable; '*' for any. Default: none. "
        "The API key is still required of their requests."),
    copy: bool = typer.Option(COPY_DRAFTS, "--copy/--no-copy",
                              help="Copy drafts: verify what followed an earlier occurrence of "
                              "the last tokens when there is one."),
    tree: Optional[str] = typer.Option(None, "--tree", help=TREE_HELP + " Models whose pair "
                                       "takes no trees are served with chains."),
    split: str = typer.Option("auto", "--split", help=SPLIT_HELP),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", min=0,
                                               help=DRAFT_WINDOW_HELP),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
    model_dir: Optional[Path] = typer.Option(
        None, "--model-dir", help="Serve every mlx-lm model in this directory (each "
        "sub-directory with config.json and weights, named by it), each with --drafter auto."),
    preload: bool = typer.Option(
        False, "--preload", help="Load every model at start (default: on its first request "
        "or POST /v1/models/NAME/load)."),
    ttl: Optional[float] = typer.Option(
        None, "--ttl", min=0.0, help="Unload a model idle this many seconds (pinned ones "
        "stay). Default: never."),
) -> None:
    """Serve models over OpenAI- and Anthropic-compatible APIs (/v1/chat/completions,
    /v1/completions, /v1/responses, /v1/messages, /v1/models)."""
    try:
        import uvicorn

        from ..server import create_app
        from ..server.models import CacheSettings, lazy_model
    except ModuleNotFoundError as e:
        fail(f"{e.name} is needed for serving: pip install fastapi uvicorn")
    from .. import distributed
    from ..default_pair import DEFAULT_TARGET_NAME

    tree_size, split = parse_tree(tree), parse_split(split)
    if log_level.upper() not in LOG_LEVELS:
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    budget = _size("--model-memory", model_memory)
    cache = CacheSettings(_size("--cache-memory", cache_memory), cache_dir,
                          _size("--cache-disk", cache_disk))
    entries = _entries(model, drafter, model_name, models_config, model_dir)
    template_kwargs = _json_object("--chat-template-kwargs", chat_template_kwargs)
    if distributed.init() is not None:
        _across_machines(budget, cache)
        preload = True  # every rank holds its part from the start
    served = []
    for entry in entries:
        name = entry.name or entry.model or DEFAULT_TARGET_NAME
        load = functools.partial(load_pair, entry.model, entry.drafter, split=split,
                                 draft_window=draft_window, kv_bits=kv_bits)
        try:  # without --preload only the tokenizer and config are read now
            path = None if preload else _target_dir(entry.model)
            served.append(lazy_model(name, load, block_size=entry.block_size or block_size,
                                     max_context=max_context, path=path,
                                     template_kwargs={**template_kwargs,
                                                      **(entry.chat_template_kwargs or {})}))
        except (OSError, ValueError) as e:
            fail(f"model '{name}': {e}")
        if budget is not None and len(served) > 1 and sum(s.nbytes for s in served) > budget:
            served[-1].model = served[-1].drafter = None  # loaded again on first use
    try:
        server_app = create_app(models=served, model_memory=budget, cache=cache,
                                api_key=api_key, copy_drafts=copy, max_batch=max_batch,
                                tree=tree_size, max_tokens_cap=max_tokens,
                                default_temperature=temp, allowed_origins=allowed_origins,
                                ttl=ttl)
    except ValueError as e:
        fail(str(e))
    if not distributed.is_root():  # rank 0 serves; this rank runs its engine steps
        _follow(server_app.state.worker)
        return
    _configure_logs(log_level, log_file)
    names = ", ".join(f"'{s.name}'" for s in served)
    typer.secho(f"Serving {names} at http://{host}:{port}/v1"
                + (" (API key required)" if api_key else ""), fg=typer.colors.CYAN, err=True)
    typer.secho(f"Dashboard: http://{host}:{port}/dashboard", fg=typer.colors.CYAN, err=True)
    # A bounded graceful shutdown: on Ctrl-C, open streams get 5 s, then they are cancelled.
    uvicorn.run(server_app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _is_target(path: Path) -> bool:
    """An mlx-lm model directory (config.json and weights) that is not a drafter's."""
    from ..drafters import speculators
    from ..drafters.registry import ARCHITECTURES, NOT_YET

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    arch = (config.get("architectures") or [""])[0]
    return (any(path.glob("*.safetensors")) and arch not in ARCHITECTURES
            and arch not in NOT_YET and not speculators.is_speculators(config))


def _target_dir(model: str | None) -> Path:
    """The target's local directory (the default target's, converted once; a hub id's,
    downloaded once), whose tokenizer and config a lazily loaded model reads at start."""
    if model is None:
        from ..default_pair import ensure_default_target

        return ensure_default_target()
    from mlx_lm.utils import _download

    return Path(_download(model))


def _configure_logs(level: str, log_file: Path | None) -> None:
    """The package's own log lines (one per request, model loads and unloads, fallbacks)
    beside uvicorn's on stderr, and with ``log_file`` in a rotated file too."""
    from logging.handlers import RotatingFileHandler

    logger = logging.getLogger("mlx_dflash")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    if log_file is not None:
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            to_file = RotatingFileHandler(log_file, maxBytes=10 << 20, backupCount=5)
        except OSError as e:
            fail(f"--log-file {log_file}: {e.strerror or e}")
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
        logger.addHandler(to_file)


def _across_machines(budget: int | None, cache: Any) -> None:
    """Under mlx.launch: refuse what does not run across machines yet, and make the ranks
    sample alike."""
    import mlx.core as mx

    from .. import distributed

    if budget is not None:  # which model to unload would be decided by each rank's own bytes
        fail("--model-memory does not run across machines (under mlx.launch): every model "
             "stays loaded")
    if cache.directory is not None:
        fail("--cache-dir does not run across machines (under mlx.launch): every rank holds "
             "a part of each cache")
    mx.random.seed(distributed.common_seed(None))  # requests without a seed draw alike


def _follow(worker: Any) -> None:
    """A rank other than 0: run the engine steps rank 0 runs, until it stops serving."""
    import signal

    from .. import distributed
    from ..server.ranks import follow

    # Ctrl-C reaches every rank started from one terminal; this one stops when rank 0 says so
    # (interrupted between rank 0's two messages, it would leave rank 0 waiting on a dead link).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        follow(worker)
    except Exception as e:  # noqa: BLE001 (any failure ends this rank, saying why)
        fail(f"rank {distributed.rank()}: the run across machines broke off: {e}")
