"""What a pod run's --resume is checked against before gcloud runs: its RUN_ID, its config, whether images are left."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tpugen.errors import InputError
from tpugen.modes.pod.names import STAGING


def is_pod_run(folder: Path) -> bool:
    """Whether pod-run made this folder: it holds worker-N copies, a pod report or the staging folder."""
    if not folder.is_dir():
        return False
    names = {path.name for path in folder.iterdir()}
    if STAGING in names or any(re.fullmatch(r"worker-\d+", name) for name in names):
        return True
    try:
        return "tpugen_pod_report" in json.loads((folder / "report.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def resume_run_id(value: str, output_dir: str) -> str:
    """--resume's RUN_ID, checked like output.run_id since it names a folder here and on every worker; the
    path of a pod run directly under output.dir also names it. Anything else is refused before gcloud runs."""
    from tpugen.config.schema import RUN_ID_RULE, is_safe_run_id

    local = not output_dir.startswith("gs://")
    if is_safe_run_id(value):
        run_id = value
    elif local and Path(value).is_dir():
        folder = Path(value).resolve()
        if folder.parent != Path(output_dir).resolve() or not is_safe_run_id(folder.name) or not is_pod_run(folder):
            raise InputError(
                f"--resume: {value} is not a pod run directly under output.dir ({output_dir}); give its RUN_ID"
            )
        run_id = folder.name
    else:
        raise InputError(f"--resume: {value!r} is not a run id: {RUN_ID_RULE}")
    existing = Path(output_dir) / run_id
    empty = existing.is_dir() and not any(existing.iterdir())
    # pod-run writes worker-N folders, a manifest and a report into it: never into another kind of run.
    if local and existing.exists() and not empty and not is_pod_run(existing):
        raise InputError(f"--resume: {existing} is not a pod run directory (no pod report.json or worker-N folders)")
    return run_id


def check_pod_resumable(run, local_run: Path) -> None:
    """Refuse, before any gcloud call, a --resume whose config would make other images than the pod run's: a
    worker with its run folder refuses it itself, but one that lost its disk would start afresh with it."""
    from tpugen.outputs.report import read_report
    from tpugen.outputs.run_record import differences, read_run_record

    if not local_run.is_dir():
        return
    record = read_run_record(local_run)
    if record is not None:
        differing = differences(run, record["config"], record["prompts"])
        if differing:
            raise InputError(
                f"--resume: the config differs from the pod run in {local_run} in keys that change images: "
                + ", ".join(differing)
            )
        return
    made_by = (read_report(local_run) or {}).get("config_hash")  # a pod run from before run.json
    if made_by and made_by != run.config_hash:
        raise InputError(
            f"--resume: the pod run in {local_run} was made by config hash {made_by}, and this config resolves to "
            f"{run.config_hash} (was the config or the prompts file edited?)"
        )


def _gathered_image(local_run: Path, name) -> bool:
    """Whether a pod manifest's file (worker-i/run/NAME) is inside the pod run and a whole PNG."""
    from tpugen.outputs.png import is_valid_png

    path = (local_run / str(name)).resolve()
    return path.is_relative_to(local_run.resolve()) and is_valid_png(path)


def _already_complete(run, local_run: Path) -> dict | None:
    """A pod run whose gathered report is complete and whose manifest holds every planned image: nothing to
    resume, so no worker is called and nothing is rewritten."""
    from tpugen.outputs.manifest import read_manifest
    from tpugen.outputs.report import RunReport, read_report
    from tpugen.plan import plan_run

    report = read_report(local_run)
    manifest = local_run / "manifest.jsonl"
    if not report or not report.get("complete") or not manifest.exists():
        return None
    planned = len(plan_run(run).items)
    on_disk = {r["index"] for r in read_manifest(manifest) if _gathered_image(local_run, r.get("file"))}
    if len(on_disk) < planned:
        return None
    return RunReport.from_json(report).but(run_dir=str(local_run), already_complete=True, images_planned=planned)
