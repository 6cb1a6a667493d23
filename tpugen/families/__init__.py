"""The model families, one folder each; this registry is the only list of them.

A family's folder owns everything about its models (tpugen.families.base.Family). Adding a family is its
folder and one line in FAMILIES below."""

from __future__ import annotations

from tpugen.families.base import Builtin, Family, FlashRoute, KnownModel
from tpugen.families.flux import FAMILY as FLUX
from tpugen.families.flux2 import FLUX2, FLUX2_KLEIN
from tpugen.families.qwenimage import FAMILY as QWEN_IMAGE
from tpugen.families.sd import FAMILY as SD
from tpugen.families.sd3 import FAMILY as SD3
from tpugen.families.sdxl import FAMILY as SDXL
from tpugen.families.zimage import FAMILY as Z_IMAGE

FAMILIES: dict[str, Family] = {f.name: f for f in (SD, SDXL, SD3, FLUX, FLUX2_KLEIN, FLUX2, Z_IMAGE, QWEN_IMAGE)}

_BY_CLASS = {cls: f for f in FAMILIES.values() for cls in f.pipeline_classes}
BUILTINS: dict[str, tuple[Builtin, Family]] = {b.name: (b, f) for f in FAMILIES.values() for b in f.builtins}
KNOWN_MODELS: dict[str, tuple[KnownModel, Family]] = {m.id: (m, f) for f in FAMILIES.values() for m in f.known_models}


def family(name: str) -> Family:
    """The family of that name (a name in FAMILIES)."""
    return FAMILIES[name]


def family_for_class(class_name: str) -> Family | None:
    """The family whose pipelines have this diffusers class name, or None when no family covers it."""
    return _BY_CLASS.get(class_name)


def covered_classes() -> str:
    """The pipeline classes tpugen knows, for a message."""
    return ", ".join(f"{f.title} ({', '.join(f.pipeline_classes)})" for f in FAMILIES.values())


__all__ = [
    "BUILTINS",
    "FAMILIES",
    "KNOWN_MODELS",
    "Builtin",
    "Family",
    "FlashRoute",
    "KnownModel",
    "covered_classes",
    "family",
    "family_for_class",
]
