"""The run directory: its name, making it, and reading back the manifests of the images made in it (what made
the run, run.json, is tpugen.outputs.run_record's)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.errors import InputError
from tpugen.lines import text_lines
from tpugen.outputs.manifest import read_manifest, read_text_lenient
from tpugen.outputs.png import image_filename, is_valid_png
from tpugen.plan import plan_run

RUN_RECORD = "run.json"  # what made the run: the resolved config and its prompts, as they were at the start
MANIFEST = "manifest.jsonl"


def run_id_for(run: ResolvedRun, now: datetime | None = None) -> str:
    """output.run_id, else a UTC timestamp plus the config hash: sortable, and says what made it."""
    if run.config.output.run_id:
        return run.config.output.run_id
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{run.config_hash}"


def check_run_dir_free(output_dir: str | Path, run_id: str) -> Path:
    """The run directory a new run would make, refused if it exists with anything in it."""
    run_dir = Path(output_dir) / run_id
    if run_dir.exists() and any(run_dir.iterdir()):
        raise InputError(f"output.run_id: {run_dir} already exists and is not empty; choose another run_id")
    return run_dir


def make_run_dir(output_dir: str | Path, run_id: str) -> Path:
    """A new, empty run directory; refused (nothing written) if it exists with anything in it."""
    run_dir = check_run_dir_free(output_dir, run_id)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"output.dir: cannot create {run_dir}: {exc.strerror}") from None
    return run_dir


def manifest_paths(run_dir: Path) -> list[Path]:
    return [p for p in [run_dir / MANIFEST, *sorted(run_dir.glob("manifest.rank*.jsonl"))] if p.exists()]


def all_records(run_dir: Path) -> list[dict]:
    """Every record in the run's manifest and in per-rank manifests not merged yet (multi mode)."""
    records = []
    for path in manifest_paths(run_dir):
        records.extend(read_manifest(path))
    return records


def finished_records(run_dir: Path, run: ResolvedRun) -> tuple[dict[int, dict], list[str]]:
    """(records by image index whose image is this run's and is on disk as a valid PNG, one line for each
    manifest line that is not a record of this run's plan). Lines that are not records are ignored."""
    expected = {item.index: image_filename(item.index, item.seed, item.prompt) for item in plan_run(run).items}
    finished, problems = {}, []
    for path in manifest_paths(run_dir):
        lines = text_lines(read_text_lenient(path))
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
                if is_valid_png(run_dir / expected[index]):
                    finished[index] = record
                continue
            problems.append(f"{path.name} line {number}: {why}; ignored")
    return finished, problems
