"""Continuing a run: what made the run, which images are already finished, and whether a config may resume it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from PIL import Image

from tpugen.config import PromptSpec, ResolvedRun, load_config
from tpugen.errors import InputError
from tpugen.lines import text_lines
from tpugen.outputs import atomic_write_text, image_filename, read_manifest, write_json
from tpugen.plan import plan_run

# Keys that never change pixels: where files go, the compile cache, and the recompile guard.
_NOT_IMAGE_KEYS = {"output", "cache", "execution.strict_shapes", "prompts_file"}
RUN_RECORD = "run.json"  # what made the run: the resolved config and its prompts, as they were at the start


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(value):
    """JSON-shaped (tuples as lists), so a stored record and a fresh one compare equal."""
    return json.loads(json.dumps(value))


def _config_data(run: ResolvedRun) -> dict:
    return _plain(run.config.model_dump())


def _prompts_data(prompts: list[PromptSpec]) -> list[dict]:
    return _plain([asdict(p) for p in prompts])


def write_run_record(run_dir: Path, run: ResolvedRun, run_id: str) -> None:
    """run.json: the config and the prompts a run starts with, so a resume can tell what made its images even
    after config.yaml or the prompts file has been edited."""
    write_json(
        run_dir / RUN_RECORD,
        {
            "tpugen_run": 1,
            "run_id": run_id,
            "config_hash": run.config_hash,
            "config": _config_data(run),
            "prompts": _prompts_data(run.prompts),
        },
    )


def read_run_record(run_dir: Path) -> dict | None:
    """The run's run.json, or None for a run made before tpugen wrote one."""
    path = run_dir / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError(f"{path}: unreadable (not the JSON tpugen wrote); the run cannot be checked") from None
    if not isinstance(record, dict) or not {"config", "prompts", "config_hash"} <= set(record):
        raise InputError(f"{path}: not a tpugen run record; the run cannot be checked")
    return record


def recorded_prompts(record: dict) -> list[PromptSpec]:
    return [PromptSpec(**{**p, "sizes": tuple(tuple(s) for s in p["sizes"])}) for p in record["prompts"]]


def load_run(run_dir: Path) -> ResolvedRun:
    """`tpugen resume RUN_DIR`: the run's own config.yaml, with the prompts the run started with (a prompts
    file edited since is not read again)."""
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}: not a tpugen run directory (no config.yaml)")
    record = read_run_record(run_dir)
    if record is None:
        return load_config(run_dir / "config.yaml")
    return load_config(run_dir / "config.yaml", prompts=recorded_prompts(record))


def image_changing_differences(old_config: dict, new_config: dict) -> list[str]:
    """The dotted keys whose values differ between two configs in a way that changes images."""
    a, b = _flatten(old_config), _flatten(new_config)
    return [
        key
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key) and not any(key == k or key.startswith(k + ".") for k in _NOT_IMAGE_KEYS)
    ]


def check_resumable(run: ResolvedRun, run_dir: Path) -> None:
    """Refuse, naming what changed, a resume whose work would differ from what made the run's images."""
    if not run_dir.is_dir():
        raise InputError(f"--resume: {run_dir} is not a run directory")
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"--resume: {run_dir} has no config.yaml, so it is not a tpugen run directory")
    record = read_run_record(run_dir)
    if record is not None:
        old_config, old_prompts = record["config"], record["prompts"]
    else:  # a run from before run.json: its config.yaml is all there is
        previous = load_config(run_dir / "config.yaml")
        old_config, old_prompts = _config_data(previous), _prompts_data(previous.prompts)
    differing = image_changing_differences(old_config, _config_data(run))
    # Prompts count by their content, wherever they came from (an inline list or a file).
    if old_prompts != _prompts_data(run.prompts) and "prompts" not in differing:
        differing.append("prompts" if run.config.prompts is not None else "prompts_file (its prompts)")
    if differing:
        raise InputError(
            f"--resume: the config differs from the run in {run_dir} in keys that change images: "
            + ", ".join(differing)
        )
    if record is None:
        made_by = {r.get("config_hash") for r in read_manifest_path(run_dir)} - {None, run.config_hash}
        if made_by:
            raise InputError(
                f"--resume: the images in {run_dir} were made by config hash {', '.join(sorted(made_by))}, and "
                f"this config resolves to {run.config_hash} (was config.yaml or the prompts file edited?)"
            )


def read_manifest_path(run_dir: Path) -> list[dict]:
    path = run_dir / "manifest.jsonl"
    return read_manifest(path) if path.exists() else []


def _valid_png(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except Exception:  # any unreadable file is simply made again
        return False


def _manifest_paths(run_dir: Path) -> list[Path]:
    return [p for p in [run_dir / "manifest.jsonl", *sorted(run_dir.glob("manifest.rank*.jsonl"))] if p.exists()]


def all_records(run_dir: Path) -> list[dict]:
    """Every record in the run's manifest and in per-rank manifests not merged yet (multi mode)."""
    records = []
    for path in _manifest_paths(run_dir):
        records.extend(read_manifest(path))
    return records


def finished_records(run_dir: Path, run: ResolvedRun) -> tuple[dict[int, dict], list[str]]:
    """(records by image index whose image is this run's and is on disk as a valid PNG, one line for each
    manifest line that is not a record of this run's plan). Lines that are not records are ignored."""
    expected = {item.index: image_filename(item.index, item.seed, item.prompt) for item in plan_run(run).items}
    finished, problems = {}, []
    for path in _manifest_paths(run_dir):
        lines = text_lines(path.read_text(encoding="utf-8"))
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number < len(lines):  # a torn last line is what a crash leaves; anything else is damage
                    problems.append(f"{path.name} line {number}: not JSON; ignored")
                continue
            index = record.get("index") if isinstance(record, dict) else None
            if not isinstance(record, dict):
                why = f"not an image record ({line[:40]})"
            elif type(index) is not int:
                why = "no image index"
            elif index not in expected:
                why = f"image {index} is not in this run's plan ({len(expected)} images)"
            elif record.get("file") != expected[index]:
                why = f"image {index} is not {expected[index]}"
            else:
                if _valid_png(run_dir / expected[index]):
                    finished[index] = record
                continue
            problems.append(f"{path.name} line {number}: {why}; ignored")
    return finished, problems


def rewrite_manifest(run_dir: Path, records: dict[int, dict]) -> None:
    """Replace the manifest with these records in index order (drops torn lines and missing images)."""
    lines = "".join(json.dumps(records[i], ensure_ascii=False) + "\n" for i in sorted(records))
    atomic_write_text(run_dir / "manifest.jsonl", lines)
