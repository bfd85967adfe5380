"""`mlx-dflash train`: the target's responses + features into a feature store, then a drafter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ..drafters.registry import FAMILIES
from .app import app, fail


@app.command()
def train(
    out: Path = typer.Option(..., "--out", "-o", help="Run directory (store/, checkpoint/)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target (default pair)."),
    prompts: List[Path] = typer.Option([], "--prompts", help="Training prompt file(s); "
                                       "repeatable. Omit to train on the existing store."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Prompts per file."),
    code_prompts: int = typer.Option(0, "--code-prompts", min=0,
                                     help="Add N prompts built from stdlib docstrings."),
    store: Optional[Path] = typer.Option(None, "--store", help="Feature store folder "
                                         "(default OUT/store; share one between runs)."),
    workers: int = typer.Option(2, "--workers", min=1, help="Generation processes."),
    gen_batch_size: int = typer.Option(64, "--gen-batch-size", min=1,
                                       help="Prompts generated together per forward."),
    generate_only: bool = typer.Option(False, "--generate-only",
                                       help="Fill the store and stop."),
    max_response_tokens: int = typer.Option(192, "--max-response-tokens", min=8),
    family: str = typer.Option("dflash", "--family", help=f"{', '.join(FAMILIES)}."),
    block_size: int = typer.Option(16, "--block-size", min=2),
    markov_rank: int = typer.Option(256, "--markov-rank", min=1, help="DSpark only."),
    markov_head: str = typer.Option("vanilla", "--markov-head",
                                    help="DSpark only: vanilla, gated or rnn."),
    aux_weight: Optional[float] = typer.Option(
        None, "--aux-weight", "--conf-weight", "--selector-weight", min=0.0,
        help="Weight of the family's own loss term (DSpark: confidence-head BCE; DFlash 2: "
        "selector CE). Default: the family's."),
    gamma: Optional[float] = typer.Option(None, "--gamma", min=0.1,
                                          help="Position decay (default: the family's)."),
    layers: Optional[int] = typer.Option(
        None, "--layers", min=1, help="Drafter layers (default 2; with --init-from, its own "
        "count, or more to grow it)."),
    taps: int = typer.Option(4, "--taps", min=1, help="Target layers tapped for features."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id",
                                                help="Default: the tokenizer's mask token, "
                                                "else 16 for SmolLM2 (<empty_output>)."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", min=0,
                                    help="Reduced draft vocabulary size (0: full head)."),
    tv_weight: float = typer.Option(0.0, "--tv-weight", min=0.0,
                                    help="Weight of the total-variation distillation term."),
    ce_weight: float = typer.Option(1.0, "--ce-weight", min=0.0),
    epochs: float = typer.Option(3.0, "--epochs", min=0.01),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1),
    minutes: Optional[float] = typer.Option(None, "--minutes", min=0.1,
                                            help="Train for this much training time (the "
                                            "schedule follows it; resumes keep the clock)."),
    learning_rate: float = typer.Option(6e-4, "--lr"),
    anchors: int = typer.Option(32, "--anchors", min=1, help="Anchors per sequence."),
    grad_accum: int = typer.Option(4, "--grad-accum", min=1),
    save_minutes: float = typer.Option(5.0, "--save-minutes", min=0.1),
    init_from: Optional[str] = typer.Option(None, "--init-from",
                                            help="Continue from a saved drafter (dir or shipped "
                                            "name) instead of a fresh one."),
    eval_prompts: Optional[Path] = typer.Option(None, "--eval-prompts",
                                                help="Held-out prompts for a final "
                                                "acceptance evaluation."),
    eval_limit: int = typer.Option(8, "--eval-limit", min=1),
) -> None:
    """Train a DFlash drafter for a target (generation and training both resume)."""
    from mlx_lm import load

    from ..drafters.shipped import resolve_drafter
    from ..target import Target
    from ..train.data import read_prompts, stdlib_code_prompts
    from ..train.loop import TrainConfig
    from ..train.loop import train as run_training
    from ..train.recipe import build_target_layer_ids
    from ..train.store import FeatureStore, StoreMismatchError, build_store_parallel

    for f in prompts + ([eval_prompts] if eval_prompts else []):
        if not f.exists():
            fail(f"prompt file not found: {f}")
    if model is None:
        from ..default_pair import ensure_default_target

        model = str(ensure_default_target())
    target, tokenizer = load(model)
    if mask_token_id is None:
        mask = getattr(tokenizer, "mask_token_id", None)
        mask_token_id = mask if mask is not None else 16
        name = tokenizer.convert_ids_to_tokens(mask_token_id)
        typer.echo(f"mask token id: {mask_token_id} ({name})")
    store_dir = store or out / "store"
    rows = []
    for f in prompts:
        rows += read_prompts(f, limit=limit)
    if code_prompts:
        rows += stdlib_code_prompts(limit=code_prompts)
    num_layers = len(Target(target, check=False).inner.layers)
    if (store_dir / "manifest.json").exists():
        layer_ids = FeatureStore(store_dir).layer_ids
    else:
        layer_ids = build_target_layer_ids(num_layers, taps)
    try:
        if rows:
            build_store_parallel(model, rows, store_dir, layer_ids, workers=workers,
                                 max_tokens=max_response_tokens, batch_size=gen_batch_size)
        elif not (store_dir / "manifest.json").exists():
            fail("no training data: pass --prompts, or point --store at a feature store")
        FeatureStore(store_dir).check(Target(target, check=False))
    except (StoreMismatchError, OSError, RuntimeError) as e:
        fail(str(e))
    if generate_only:
        typer.echo(f"feature store: {len(FeatureStore(store_dir))} sequences in {store_dir}")
        return
    if family not in FAMILIES:
        fail(f"--family must be one of {', '.join(FAMILIES)}, got '{family}'")
    try:  # the family checks its own options (e.g. DSpark's --markov-head)
        config = TrainConfig(store_dir=str(store_dir), out_dir=str(out), block_size=block_size,
                             family=family, markov_rank=markov_rank,
                             markov_head_type=markov_head, aux_weight=aux_weight, gamma=gamma,
                             num_layers=layers, mask_token_id=mask_token_id,
                             draft_vocab_size=draft_vocab or None, ce_weight=ce_weight,
                             tv_weight=tv_weight, epochs=epochs, max_steps=max_steps,
                             max_minutes=minutes,
                             learning_rate=learning_rate, num_anchors=anchors,
                             grad_accum=grad_accum, save_every_s=save_minutes * 60,
                             init_from=resolve_drafter(init_from) if init_from else None)
    except ValueError as e:
        fail(str(e))
    drafter = run_training(target, config)
    if eval_prompts:
        from ..bench import load_prompt_sets
        from ..decode import stream_generate

        texts = next(iter(load_prompt_sets([str(eval_prompts)], eval_limit).values()))
        lengths = []
        for text in texts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True)
            *_, last = stream_generate(target, drafter, tokenizer, ids, max_tokens=128)
            lengths += last.stats.acceptance_lengths
        tau = sum(lengths) / max(len(lengths), 1)
        (out / "eval.json").write_text(json.dumps({"prompts": str(eval_prompts),
                                                   "n": len(texts), "block_size": block_size,
                                                   "mean_acceptance_length": tau}, indent=2))
        typer.echo(f"held-out mean acceptance length: {tau:.2f} (block {block_size})")
