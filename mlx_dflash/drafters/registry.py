"""The drafter families: one ``register`` line each, with the config.json ``architectures`` names
it loads. Loading, training (``--family``) and the CLI all read these tables."""

from __future__ import annotations

from .dflash import DFlashDraftModel
from .dflash2 import DFlash2DraftModel
from .dspark import DSparkDraftModel
from .eagle3 import Eagle3DraftModel

FAMILIES: dict[str, type[DFlashDraftModel]] = {}  # family name (cls.family) -> class
ARCHITECTURES: dict[str, type[DFlashDraftModel]] = {}  # config.json architectures[0] -> class
NOT_YET = {"Gemma4DSparkModel": "Gemma 4 DSpark"}  # known, refused with a clear error


def register(cls: type[DFlashDraftModel], *architectures: str) -> None:
    """Add a family under its ``family`` name; it loads every name in ``architectures``, one of
    which must be the name its args write (``args_class.architecture``)."""
    if cls.args_class.architecture not in architectures:
        raise ValueError(f"{cls.__name__} writes {cls.args_class.architecture}, which it does "
                         "not register")
    FAMILIES[cls.family] = cls
    ARCHITECTURES.update(dict.fromkeys(architectures, cls))


register(DFlashDraftModel, "DFlashDraftModel")
register(DFlash2DraftModel, "DFlash2DraftModel")
# DeepSpec writes Qwen3DSparkModel (fields at the top level); SpecForge-style exports write
# DSparkDraftModel with the fields in dflash_config. DSparkArgs.from_config reads both.
register(DSparkDraftModel, "Qwen3DSparkModel", "DSparkDraftModel")
# SpecForge's EAGLE-3 (SGLang loads the same name); the speculators layout converts to it.
register(Eagle3DraftModel, "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def drafter_family(name: str) -> type[DFlashDraftModel]:
    """The family registered as ``name``."""
    if name not in FAMILIES:
        raise ValueError(f"unknown drafter family '{name}' ({', '.join(FAMILIES)})")
    return FAMILIES[name]
