"""A run sent to the server as its routes see it (RunHandle): queued or running in memory, or ended and read back
from its run directory."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.config.prompts import planned_images
from tpugen.engine import StopSignals
from tpugen.errors import InputError, one_line
from tpugen.outputs.run_dir import RUN_RECORD
from tpugen.outputs.run_record import read_run_record, recorded_prompts


@dataclass
class RunHandle:
    """A run sent to the server (POST /v1/runs): it runs on the warm engine in a thread of its own."""

    id: str
    run: ResolvedRun | None  # None: an ended run read back from its run directory (run_on_disk)
    run_dir: Path
    planned: int
    stop: StopSignals = field(default_factory=StopSignals)
    state: str = "queued"  # queued, running, complete, stopped, failed
    error: list[str] | None = None
    report: dict | None = None
    thread: threading.Thread | None = None
    engine: int = 0  # which of the server's engines runs it
    created: float = field(default_factory=time.time)


def runs_on_disk(root: Path) -> dict[str, float]:
    """The run directories under `root` (each holds run.json), by id: when each started (run.json's time)."""
    found: dict[str, float] = {}
    try:
        paths = list(root.iterdir())
    except OSError:  # no run yet: the directory is made by the first
        return found
    for path in paths:
        if path.name.startswith("."):
            continue
        try:
            found[path.name] = (path / RUN_RECORD).stat().st_mtime
        except OSError:  # not a run directory
            continue
    return found


def run_on_disk(root: Path, run_id: str) -> RunHandle | None:
    """An ended run read back from its run directory under `root`; None if there is none. Its state is its
    report.json's: none means the server stopped under it (a second signal, a crash); `tpugen resume` goes on."""
    if run_id.startswith(".") or Path(run_id).name != run_id:
        return None
    run_dir = root / run_id
    if not (run_dir / RUN_RECORD).is_file():
        return None
    try:
        record = read_run_record(run_dir)
        planned = planned_images(recorded_prompts(record), record["config"]["images_per_prompt"])
    except (InputError, KeyError, TypeError, ValueError) as exc:
        return RunHandle(run_id, None, run_dir, 0, state="failed", error=[one_line(exc)])
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict):
        resume = f"resume with: tpugen resume {run_dir}"
        lines = ["the server stopped before the run ended (it has no report.json)", resume]
        return RunHandle(run_id, None, run_dir, planned, state="stopped", error=lines)
    error = report.get("error")
    if report.get("complete"):
        state = "complete"
    else:
        state = "stopped" if str(error or "").startswith("interrupted") else "failed"
    planned = report.get("images_planned") or planned
    return RunHandle(run_id, None, run_dir, planned, state=state, error=[error] if error else None, report=report)
