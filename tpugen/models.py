"""What tpugen knows about models without loading any: families and their defaults, built-ins, known hub ids,
and where an id points."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    build_version: int  # bumped whenever the builder changes, so stale caches are rebuilt


BUILTINS = {
    "tiny-sd": BuiltinModel(
        "tiny-sd",
        "SD 1.x architecture with tiny random weights, built offline; its images are noise",
        build_version=1,
    ),
    "tiny-sdxl": BuiltinModel(
        "tiny-sdxl",
        "SDXL architecture (two CLIP encoders, text-time embeddings) with tiny random weights; noise",
        build_version=1,
    ),
    "tiny-sd3": BuiltinModel(
        "tiny-sd3",
        "SD 3 architecture (MMDiT, two CLIP encoders and T5) with tiny random weights; noise",
        build_version=1,
    ),
    "tiny-flux": BuiltinModel(
        "tiny-flux",
        "Flux.1-schnell architecture (double and single stream blocks, CLIP and T5) with tiny random weights; noise",
        build_version=1,
    ),
    "tiny-flux-deep": BuiltinModel(
        "tiny-flux-deep",
        "Flux.1's real depth (19 double + 38 single blocks) at a tiny width, for compile-time work; noise",
        build_version=1,
    ),
}

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a hub repository's id, org/name."""
    return _HUB_ID.fullmatch(text) is not None


def cache_root() -> Path:
    """tpugen's cache directory: TPUGEN_CACHE, else ~/.cache/tpugen."""
    return Path(os.environ.get("TPUGEN_CACHE") or Path.home() / ".cache" / "tpugen").expanduser()


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "builtin" | "local" | "hub"
    ref: str  # built-in name, absolute directory, or hub id


def classify_model_id(model_id: str, base_dir: Path | None = None) -> ModelSource | str:
    """Where `model_id` points, or a one-line reason it points nowhere. Touches only the filesystem."""
    if model_id in BUILTINS:
        return ModelSource("builtin", model_id)
    candidate = Path(model_id).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        candidate = base_dir / candidate
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1 or candidate.exists():
        if not candidate.is_dir():
            return f"model directory {str(candidate)!r} does not exist"
        if not (candidate / "model_index.json").is_file():
            return f"{str(candidate)!r} has no model_index.json (not a diffusers pipeline directory)"
        return ModelSource("local", str(candidate.resolve()))
    if is_hub_id(model_id):
        return ModelSource("hub", model_id)
    return (
        f"{model_id!r} is not a built-in ({', '.join(BUILTINS)}), an existing directory, "
        "or a hub id of the form org/name"
    )


# ---------------------------------------------------------------- families and their defaults


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_class: str  # the diffusers class in model_index.json
    title: str
    size: int  # default height and width
    steps: int
    guidance_scale: float
    cfg: bool  # classifier-free guidance above guidance 1 (it doubles the denoiser's batch: another shape)
    negative_prompt: bool
    flow_matching: bool  # keeps its own flow-matching scheduler
    max_sequence_length: int | None = None  # T5 tokens, for families with a T5 encoder
    # Height and width must be multiples of this: the VAE's 8, times the 2x2 patches of SD3's and Flux's
    # transformers (diffusers refuses SD3's otherwise; Flux's pipeline quietly rounds down).
    size_multiple: int = 8


FAMILIES = {
    f.name: f
    for f in (
        Family("sd", "StableDiffusionPipeline", "Stable Diffusion 1.x/2.x", 512, 30, 7.5, True, True, False),
        Family("sdxl", "StableDiffusionXLPipeline", "Stable Diffusion XL", 1024, 30, 5.0, True, True, False),
        Family("sd3", "StableDiffusion3Pipeline", "Stable Diffusion 3 / 3.5", 1024, 28, 7.0, True, True, True, 256, 16),
        # Flux.1 has no classifier-free guidance: schnell ignores guidance_scale, dev embeds it as a number.
        Family("flux", "FluxPipeline", "Flux.1 (schnell, dev)", 1024, 4, 0.0, False, False, True, 512, 16),
    )
}
_BY_CLASS = {f.pipeline_class: f for f in FAMILIES.values()}


@dataclass(frozen=True)
class KnownModel:
    family: str
    steps: int | None = None  # when the model differs from its family's default
    guidance_scale: float | None = None
    size: int | None = None
    note: str = ""


KNOWN_MODELS = {
    "tiny-sd": KnownModel("sd", size=64),
    "tiny-sdxl": KnownModel("sdxl", size=64),
    "tiny-sd3": KnownModel("sd3", size=64),
    "tiny-flux": KnownModel("flux", size=64),
    "tiny-flux-deep": KnownModel("flux", size=64),
    "stable-diffusion-v1-5/stable-diffusion-v1-5": KnownModel("sd", note="fits one v5e chip"),
    "stabilityai/stable-diffusion-2-1": KnownModel("sd", size=768, note="fits one v5e chip"),
    "stabilityai/stable-diffusion-xl-base-1.0": KnownModel("sdxl", note="fits one v5e chip in bfloat16"),
    "stabilityai/stable-diffusion-3.5-medium": KnownModel(
        "sd3", steps=40, guidance_scale=4.5, note="fits one v6e chip"
    ),
    "stabilityai/stable-diffusion-3.5-large": KnownModel(
        "sd3",
        steps=28,
        guidance_scale=3.5,
        note="~27 GB in bfloat16 with T5: more than one v6e chip once activations count",
    ),
    "black-forest-labs/FLUX.1-schnell": KnownModel(
        "flux", note="not gated; ~34 GB in bfloat16 with T5: more than one v5e or v6e chip"
    ),
    "black-forest-labs/FLUX.1-dev": KnownModel(
        "flux", steps=28, guidance_scale=3.5, note="gated (HF_TOKEN); ~34 GB in bfloat16 with T5: more than one chip"
    ),
}


def family_of(model_id: str, kind: str, ref: str) -> Family:
    """The family of a model: from the table of known ids, else its model_index.json, else SD-like."""
    known = KNOWN_MODELS.get(model_id)
    if known:
        return FAMILIES[known.family]
    if kind == "local":
        try:
            class_name = json.loads((Path(ref) / "model_index.json").read_text()).get("_class_name", "")
        except (OSError, ValueError):
            class_name = ""
        if class_name in _BY_CLASS:
            return _BY_CLASS[class_name]
    return FAMILIES["sd"]


def model_defaults(model_id: str, family: Family) -> dict:
    """height, width, steps and guidance_scale for a config that leaves them out."""
    known = KNOWN_MODELS.get(model_id) or KnownModel(family.name)
    size = known.size or family.size
    return {
        "height": size,
        "width": size,
        "steps": known.steps or family.steps,
        "guidance_scale": known.guidance_scale if known.guidance_scale is not None else family.guidance_scale,
    }
