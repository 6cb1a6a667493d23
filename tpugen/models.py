"""What tpugen knows about models without loading any: built-ins, their defaults, and where an id points."""

from __future__ import annotations

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

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


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
    if _HUB_ID.match(model_id):
        return ModelSource("hub", model_id)
    return (
        f"{model_id!r} is not a built-in ({', '.join(BUILTINS)}), an existing directory, "
        "or a hub id of the form org/name"
    )
