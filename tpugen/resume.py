"""Continuing a run: which images are already finished, and whether a config may resume a run directory."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tpugen.config import ResolvedRun, load_config
from tpugen.errors import InputError
from tpugen.outputs import atomic_write_text, read_manifest

# Keys that never change pixels: where files go, the compile cache, and the recompile guard.
_NOT_IMAGE_KEYS = {"output", "cache", "execution.strict_shapes", "prompts_file"}


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def image_changing_differences(old: ResolvedRun, new: ResolvedRun) -> list[str]:
    """The dotted keys whose values differ between two runs in a way that changes images."""
    a, b = _flatten(old.config.model_dump()), _flatten(new.config.model_dump())
    differing = [
        key
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key) and not any(key == k or key.startswith(k + ".") for k in _NOT_IMAGE_KEYS)
    ]
    # Prompts count by their content, wherever they came from (an inline list or a file).
    if old.prompts != new.prompts and "prompts" not in differing:
        differing.append("prompts" if new.config.prompts is not None else "prompts_file (its prompts)")
    return differing


def check_resumable(run: ResolvedRun, run_dir: Path) -> None:
    """Refuse, naming the keys, a resume whose config would not reproduce the run's images."""
    if not run_dir.is_dir():
        raise InputError(f"--resume: {run_dir} is not a run directory")
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"--resume: {run_dir} has no config.yaml, so it is not a tpugen run directory")
    previous = load_config(run_dir / "config.yaml")
    differing = image_changing_differences(previous, run)
    if differing:
        raise InputError(
            f"--resume: the config differs from the run in {run_dir} in keys that change images: "
            + ", ".join(differing)
        )


def _valid_png(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except Exception:  # any unreadable file is simply made again
        return False


def all_records(run_dir: Path) -> list[dict]:
    """Every record in the run's manifest and in per-rank manifests not merged yet (multi mode)."""
    records = []
    for path in [run_dir / "manifest.jsonl", *sorted(run_dir.glob("manifest.rank*.jsonl"))]:
        if path.exists():
            records.extend(read_manifest(path))
    return records


def finished_records(run_dir: Path) -> dict[int, dict]:
    """Manifest records, by image index, whose image file is present and a valid PNG."""
    finished = {}
    for record in all_records(run_dir):
        name = record.get("file")
        if isinstance(name, str) and "/" not in name and _valid_png(run_dir / name):
            finished[record["index"]] = record
    return finished


def rewrite_manifest(run_dir: Path, records: dict[int, dict]) -> None:
    """Replace the manifest with these records in index order (drops torn lines and missing images)."""
    lines = "".join(json.dumps(records[i], ensure_ascii=False) + "\n" for i in sorted(records))
    atomic_write_text(run_dir / "manifest.jsonl", lines)
