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
    height: int
    width: int
    build_version: int  # bumped whenever the builder changes, so stale caches are rebuilt


BUILTINS = {
    "tiny-sd": BuiltinModel(
        "tiny-sd",
        "SD 1.x architecture with tiny random weights, built offline; its images are noise",
        height=64,
        width=64,
        build_version=1,
    ),
}

DEFAULT_SIZE = 512  # SD 1.x's native size, used when a model has no known default

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


def default_size(model_id: str) -> tuple[int, int]:
    """(height, width) to use when the config gives none."""
    builtin = BUILTINS.get(model_id)
    if builtin:
        return builtin.height, builtin.width
    return DEFAULT_SIZE, DEFAULT_SIZE
