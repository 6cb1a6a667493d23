"""The built-in tiny models on disk: each built once by its family's builder, atomically, into tpugen's cache."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tpugen.families import BUILTINS, CONTROLNETS
from tpugen.settings import cache_root


def _builtin(name: str):
    return (BUILTINS.get(name) or CONTROLNETS[name])[0]


def _target(name: str) -> Path:
    return cache_root() / "models" / f"{name}-v{_builtin(name).build_version}"


def is_built(name: str) -> bool:
    """Whether the built-in is on disk already (builtin_path then builds nothing): a pipeline's model_index.json,
    a ControlNet's config.json."""
    return (_target(name) / ("config.json" if name in CONTROLNETS else "model_index.json")).is_file()


def builtin_path(name: str) -> Path:
    """The saved directory of a built-in (a pipeline, or a ControlNet), building it on first use (atomically)."""
    target = _target(name)
    if is_built(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted build never looks finished.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        _without_progress_bars()  # save_pretrained's "Writing model shards" bar is not tpugen's output
        _builtin(name).build(staging / "pipeline")
        try:
            (staging / "pipeline").rename(target)
        except OSError:
            if not is_built(name):  # lost a race to another builder: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _without_progress_bars() -> None:
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()
