"""The model families, one folder each; this registry is the only list of them.

A family's folder owns everything about its models (tpugen.families.base.Family). Adding a family is its
folder and one line in FAMILIES below."""

from __future__ import annotations

from tpugen.families.base import Builtin, Family, FlashRoute, KnownModel
from tpugen.families.flux import FAMILY as FLUX
from tpugen.families.flux2 import FLUX2, FLUX2_KLEIN, FLUX2_KLEIN_DISTILLED, FLUX2_KLEIN_KV
from tpugen.families.qwenimage import FAMILY as QWEN_IMAGE
from tpugen.families.qwenimage_edit import FAMILY as QWEN_IMAGE_EDIT_PLUS
from tpugen.families.qwenimage_edit import SINGLE as QWEN_IMAGE_EDIT
from tpugen.families.sd import FAMILY as SD
from tpugen.families.sd3 import FAMILY as SD3
from tpugen.families.sdxl import FAMILY as SDXL
from tpugen.families.zimage import FAMILY as Z_IMAGE

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        SD,
        SDXL,
        SD3,
        FLUX,
        FLUX2_KLEIN,
        FLUX2_KLEIN_DISTILLED,
        FLUX2_KLEIN_KV,
        FLUX2,
        Z_IMAGE,
        QWEN_IMAGE,
        QWEN_IMAGE_EDIT_PLUS,
        QWEN_IMAGE_EDIT,
    )
}

_BY_CLASS: dict[str, list[Family]] = {}
for _family in FAMILIES.values():
    for _cls in _family.pipeline_classes:
        _BY_CLASS.setdefault(_cls, []).append(_family)
BUILTINS: dict[str, tuple[Builtin, Family]] = {b.name: (b, f) for f in FAMILIES.values() for b in f.builtins}
CONTROLNETS: dict[str, tuple[Builtin, Family]] = {
    b.name: (b, f) for f in FAMILIES.values() if f.controlnet for b in f.controlnet.builtins
}
KNOWN_MODELS: dict[str, tuple[KnownModel, Family]] = {m.id: (m, f) for f in FAMILIES.values() for m in f.known_models}


def family(name: str) -> Family:
    """The family of that name (a name in FAMILIES)."""
    return FAMILIES[name]


def family_for_class(class_name: str, index: dict | None = None) -> Family | None:
    """The family whose pipelines have this diffusers class name (and, where two share it, whose `covers` takes
    the pipeline's model_index.json), or None when no family covers it."""
    return next((f for f in _BY_CLASS.get(class_name, ()) if f.covers(index or {})), None)


def covered_classes() -> str:
    """The pipeline classes tpugen knows, for a message."""
    seen: set[str] = set()
    named = []
    for f in FAMILIES.values():
        if not set(f.pipeline_classes) <= seen:  # FLUX.2 [klein]'s base and distilled share a class
            named.append(f"{f.title} ({', '.join(f.pipeline_classes)})")
            seen |= set(f.pipeline_classes)
    return ", ".join(named)


__all__ = [
    "BUILTINS",
    "CONTROLNETS",
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
