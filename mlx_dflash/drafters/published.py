"""``--drafter auto``: the drafter a target gets when none is named.

In order: the target's own MTP head when its checkpoint kept one (``mtp.safetensors``); else a
published drafter from the table in ``assets/published/drafters.json``, matched by the
target's hub id or, for a converted or quantized copy, by its shape (model type, hidden size,
layer count, vocabulary); else lookup drafts only (blocks copied from the context and
verified; no drafter). Each step says what it chose and why (``Choice.reason``): never a
silent fallback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from huggingface_hub import is_offline_mode

from .shipped import drafter_dir

TABLE = Path(__file__).resolve().parent.parent / "assets" / "published" / "drafters.json"
FAMILY_ORDER = ("dspark", "dflash2", "dflash", "eagle3")  # the better drafters first
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
AUTO, LOOKUP, MTP, NONE = "auto", "lookup", "mtp", "none"  # --drafter's special values
SHIPPED = "shipped:"


@dataclass(frozen=True)
class Published:
    """One published drafter for one published target."""

    target: str  # the target's hub id
    shape: tuple | None  # SHAPE_KEYS' values of the target's config (None: not known)
    drafter: str  # a hub id, or "shipped:NAME"
    family: str
    source: str
    layout: dict | None  # the drafter config's block_size, target_layer_ids, vocab_size

    @property
    def location(self) -> str:
        """What load_drafter reads: a shipped drafter's directory, else the hub id."""
        if self.drafter.startswith(SHIPPED):
            return str(drafter_dir(self.drafter.removeprefix(SHIPPED)))
        return self.drafter

    @property
    def cached(self) -> bool:
        """On this machine already (shipped, or in the Hugging Face cache)."""
        if self.drafter.startswith(SHIPPED) or Path(self.drafter).is_dir():  # (a local one)
            return Path(self.location, "config.json").exists()
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(self.drafter, "config.json"), str)

    @property
    def fetch_command(self) -> str:
        return f"hf download {self.drafter}"


@lru_cache(maxsize=1)
def published() -> tuple[Published, ...]:
    """Every (target, drafter) pair of the table, each target's best family first."""
    data = json.loads(TABLE.read_text())
    out = []
    for t in data["targets"]:
        shape = tuple(t["shape"][k] for k in SHAPE_KEYS) if t.get("shape") else None
        for d in sorted(t["drafters"], key=lambda d: FAMILY_ORDER.index(d["family"])):
            out.append(Published(t["target"], shape, d["drafter"], d["family"], d["source"],
                                 d.get("layout")))
    return tuple(out)


def target_shape(config: dict[str, Any]) -> tuple:
    """A target config's SHAPE_KEYS values (a multimodal config's text part where it has one)."""
    text = config.get("text_config") or {}
    return tuple(config.get(k, text.get(k)) for k in SHAPE_KEYS)


def matches(model: str, config: dict[str, Any]) -> tuple[list[Published], str]:
    """The table's drafters for a target named ``model`` with ``config``, best first, and how
    they matched ("hub id" or "shape"); [] when none does."""
    by_id = [p for p in published() if p.target.lower() == model.lower()]
    if by_id:
        return by_id, "hub id"
    shape = target_shape(config)
    return [p for p in published() if p.shape == shape], "shape"


@dataclass
class Choice:
    """What ``auto`` picked: ``drafter`` is MTP, LOOKUP or a published drafter's location;
    ``reason`` says why, in a sentence for the user."""

    drafter: str
    reason: str
    entry: Published | None = None

    @property
    def label(self) -> str:
        """Short, for /v1/models and the stats line."""
        if self.entry is not None:
            return f"{self.entry.drafter} ({self.entry.family})"
        return {MTP: "the target's MTP head", LOOKUP: "lookup drafts only"}[self.drafter]


def has_mtp_head(model_dir: Path, config: dict[str, Any]) -> bool:
    from .mtp import FAMILIES, SIDECAR

    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    return (model_dir / SIDECAR).exists() and model_type in FAMILIES


def candidates(model: str, model_dir: Path) -> tuple[list[Published], str, dict[str, Any]]:
    """(the published drafters that fit, how they matched, the target's config)."""
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the target's config {config_file}: {e}") from e
    found, how = matches(model, config)
    return found, how, config


def choose(model: str, model_dir: str | Path, target: Any) -> tuple[Any, Choice]:
    """``auto``'s drafter for ``target`` (loaded from ``model_dir``, named ``model``) and why:
    its MTP head, else each published drafter that fits in turn (one not cached while
    offline, not fetchable, or not fitting is passed over, and said), else lookups only."""
    from . import load_drafter
    from .base import LookupDrafts

    model_dir = Path(model_dir)
    found, how, config = candidates(model, model_dir)
    if has_mtp_head(model_dir, config):
        from .mtp import load_mtp_drafter

        return load_mtp_drafter(model_dir, target), Choice(
            MTP, "its checkpoint keeps a multi-token-prediction head (mtp.safetensors)")
    missed = []
    for entry in found:
        if not entry.cached and is_offline_mode():
            missed.append(f"{entry.drafter} is not cached and the hub is offline (fetch it "
                          f"with `{entry.fetch_command}`)")
            continue
        try:
            drafter = load_drafter(entry.location, model=target)
        except FileNotFoundError as e:
            missed.append(f"{entry.drafter} could not be fetched ({e}; fetch it with "
                          f"`{entry.fetch_command}`)")
            continue
        except (ValueError, NotImplementedError) as e:  # it does not fit this copy
            missed.append(f"{entry.drafter} does not fit: {e}")
            continue
        return drafter, Choice(entry.location, f"published for {entry.target}, matched by "
                               f"{how}" + (f" ({'; '.join(missed)})" if missed else ""), entry)
    if found:
        reason = "no published drafter could be used: " + "; ".join(missed)
    else:
        shape = ", ".join(f"{k}={v}" for k, v in zip(SHAPE_KEYS, target_shape(config)))
        reason = (f"no published drafter is known for this target ({shape}; see `mlx-dflash "
                  "models`)")
    return LookupDrafts(), Choice(LOOKUP, reason + "; decoding with lookup drafts only")


def describe(drafter: Any) -> str:
    """What drafts for a model, for people: its family and where it came from."""
    from .base import LookupDrafts

    if drafter is None:
        return "none (the target alone)"
    if isinstance(drafter, LookupDrafts):
        return "lookup drafts only"
    path = drafter.source_path
    name = type(drafter).__name__
    if path is None:
        return name
    hub = [p for p in Path(path).parts if p.startswith("models--")]  # the hub's cache layout
    where = hub[-1].removeprefix("models--").replace("--", "/") if hub else Path(path).name
    return f"{name} ({where})"


def table_rows() -> list[dict[str, Any]]:
    """The table as `mlx-dflash models` prints it."""
    return [{"target": p.target, "drafter": p.drafter, "family": p.family, "source": p.source,
             "cached": p.cached, "fetch": p.fetch_command} for p in published()]
