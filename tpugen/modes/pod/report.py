"""The pod report: the gathered worker-i folders merged (manifest, a row per worker) into one report like any run's."""

from __future__ import annotations

import json
from pathlib import Path

from tpugen.lines import text_lines
from tpugen.modes.pod.names import WORKER_LOG, WORKER_RUN, WORKER_STATUS, Pod


def _tail(path: Path, lines: int = 5) -> list[str]:
    if not path.exists():
        return []
    return [line for line in text_lines(path.read_text(errors="replace")) if line.strip()][-lines:]


def merge_workers(local_run: Path, workers: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(pod manifest records, per-worker rows, the workers' own reports) from the gathered worker-i folders."""
    from tpugen.outputs.manifest import read_manifest

    records, rows, reports = [], [], []
    for i in range(workers):
        folder = local_run / f"worker-{i}"
        status_text = (folder / WORKER_STATUS).read_text().strip() if (folder / WORKER_STATUS).exists() else ""
        status = int(status_text) if status_text.lstrip("-").isdigit() else None
        report_path = folder / WORKER_RUN / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        if report and "timed_phase" in report:
            reports.append({**report, "worker": i})
        manifest = folder / WORKER_RUN / "manifest.jsonl"
        mine = read_manifest(manifest) if manifest.exists() else []
        for record in mine:
            records.append({**record, "file": f"worker-{i}/{WORKER_RUN}/{record['file']}", "worker": i})
        timed = (report or {}).get("timed_phase") or {}
        rows.append(
            {
                "worker": i,
                "gathered": folder.exists(),
                "exit_status": status,
                "complete": bool(report and report.get("complete")) and status == 0,
                "images": len(mine),
                "warmup_seconds": (report or {}).get("warmup_seconds"),
                "timed_wall_seconds": timed.get("wall_seconds"),
                "images_per_second": timed.get("images_per_second"),
                "compiles_after_warmup": (report or {}).get("compiles_after_warmup"),
                "last_lines": _tail(folder / WORKER_LOG) if status != 0 else [],
            }
        )
    return sorted(records, key=lambda r: r["index"]), rows, reports


def pod_report(
    *,
    run,
    run_id: str,
    run_dir,
    pod: Pod,
    records: list[dict],
    rows: list[dict],
    reports: list[dict],
    ssh_exit_status: int | None = None,
    gather_failed_workers: list[int] = (),
):
    """The pod's report, built like every run's (tpugen.outputs.report) from its workers' reports: throughput
    is all images over the slowest worker's timed phase; a table per worker."""
    from tpugen.backends import Counters, versions
    from tpugen.outputs.report import build_report, merge_phases, persistent_cache_summary
    from tpugen.outputs.sections import PodSection
    from tpugen.plan import plan_run

    plan = plan_run(run)
    for report in reports:
        report["written"] = [r["file"] for r in records if r["worker"] == report["worker"]]
    phase = merge_phases(reports, "worker")
    counted = [(r.get("xla_counters") or {}).get("timed_phase") for r in reports]
    if counted and all(counted):
        phase.counters = sum((Counters(**c) for c in counted[1:]), Counters(**counted[0])).as_dict()
    warmup = [{**w, "worker": r["worker"]} for r in reports for w in r["warmup"]]
    first = reports[0] if reports else {}
    failed = [r["worker"] for r in rows if not r["complete"]]
    complete = not failed and len(records) == len(plan.items)
    topology = dict(first.get("topology") or {"rank": 0, "ranks_per_worker": 1})
    ranks = topology.get("ranks_per_worker", 1)
    topology.update(worker_index=0, num_workers=len(rows), world_size=len(rows) * ranks)
    report = build_report(
        run=run,
        run_id=run_id,
        run_dir=run_dir,
        images_planned=len(plan.items),
        batches_planned=sum(r["batches"] for r in reports),
        padding_rows=sum(r["padding_rows"] for r in reports),
        shape_keys=list(dict.fromkeys(k for r in reports for k in r["shape_keys"])),
        device=first.get("device", {"backend": run.config.execution.backend, "device_kind": "unknown"}),
        versions=first.get("versions") or versions(),
        scheduler=(first.get("model") or {}).get("scheduler", "unknown"),
        load_seconds=max((r["model_load_seconds"] or 0.0 for r in reports), default=None),
        warmup=warmup,
        persistent_cache=persistent_cache_summary(
            first.get("persistent_cache") or {"enabled": False, "note": "no worker reported"}, warmup
        ),
        phase=phase,
        topology=topology,
        images_reused=sum(r.get("images_reused", 0) for r in reports),
        error=None if complete else f"failed workers: {failed}" if failed else "images are missing",
        memory=first.get("memory"),
        counters_scope="each worker's own process, summed over the workers",
    )
    slowest = phase.wall_seconds or None
    return report.but(
        images=len(records),
        section=PodSection(
            tpu=pod.tpu,
            zone=pod.zone,
            workers=len(rows),
            failed_workers=failed,
            per_worker=rows,
            slowest_worker_wall_seconds=slowest,
            pod_images_per_second=len(records) / slowest if slowest else None,
            gather_failed_workers=list(gather_failed_workers),
            ssh_exit_status=ssh_exit_status,
        ),
    )
