"""Executing a plan: load, warm up each shape key, run the timed batches, write images and the report."""

from __future__ import annotations

import io
import time
from datetime import datetime, timezone
from pathlib import Path

from PIL import Image

from tpugen import __version__
from tpugen.backends import Backend, Counters, make_backend, versions
from tpugen.config import ResolvedRun, dump_config
from tpugen.errors import InputError, RunError
from tpugen.outputs import (
    Manifest,
    atomic_write_bytes,
    atomic_write_text,
    contact_sheet,
    image_filename,
    inside,
    save_png,
    write_json,
)
from tpugen.plan import Batch, RunPlan, ShapeKey, plan_run
from tpugen.report import latency_summary, render_markdown


class RunDisplay:
    """What the runner tells the user as it goes; the CLI shows it with rich, tests keep it silent."""

    def phase(self, text: str) -> None: ...

    def batches_started(self, total: int) -> None: ...

    def batch_done(self, batch: Batch, seconds: float) -> None: ...

    def finished(self) -> None: ...


def run_id_for(run: ResolvedRun, now: datetime | None = None) -> str:
    """output.run_id, else a UTC timestamp plus the config hash: sortable, and says what made it."""
    if run.config.output.run_id:
        return run.config.output.run_id
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%d-%H%M%S}-{run.config_hash}"


def make_run_dir(run: ResolvedRun, run_id: str) -> Path:
    run_dir = Path(run.config.output.dir) / run_id
    if run_dir.exists() and any(run_dir.iterdir()):
        raise InputError(f"output.run_id: {run_dir} already exists and is not empty; choose another run_id")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"output.dir: cannot create {run_dir}: {exc.strerror}") from None
    return run_dir


def _delta(backend: Backend, before: Counters | None) -> Counters | None:
    after = backend.counters()
    return after - before if after is not None and before is not None else None


def warmup(loaded, plan: RunPlan, display: RunDisplay) -> list[dict]:
    """One full pipeline call per shape key, at the run's step count: its wall time is the compile time."""
    backend = loaded.backend
    first_batch: dict[ShapeKey, Batch] = {}
    for batch in plan.batches:
        first_batch.setdefault(batch.shape, batch)
    results = []
    for shape, batch in first_batch.items():
        display.phase(f"warmup: compiling {shape} (on a TPU the first compile can take many minutes)")
        before = backend.counters()
        start = time.perf_counter()
        loaded.generate(batch)
        backend.wait()
        seconds = time.perf_counter() - start
        delta = _delta(backend, before)
        results.append(
            {
                "shape_key": str(shape),
                "height": shape.height,
                "width": shape.width,
                "batch_size": shape.batch_size,
                "cfg": shape.cfg,
                "seconds": seconds,
                "compiles": delta.compiles if delta else None,
                "compile_seconds": delta.compile_seconds if delta else None,
                "persistent_cache_hits": delta.persistent_cache_hits if delta else None,
                "persistent_cache_misses": delta.persistent_cache_misses if delta else None,
            }
        )
    return results


def _record(run: ResolvedRun, loaded, item, batch: Batch, file: str, latency: float) -> dict:
    model = run.config.model
    return {
        "index": item.index,
        "file": file,
        "prompt": item.prompt,
        "negative_prompt": item.negative_prompt,
        "seed": item.seed,
        "steps": item.steps,
        "guidance_scale": item.guidance_scale,
        "height": item.height,
        "width": item.width,
        "scheduler": loaded.scheduler_name,
        "model": loaded.model_label,
        "model_id": model.id,
        "dtype": model.dtype,
        "batch": batch.number,
        "latency_seconds": latency,
        "config_hash": run.config_hash,
        "tpugen_version": __version__,
    }


def generate(run: ResolvedRun, *, display: RunDisplay | None = None, skip_warmup: bool = False) -> dict:
    """The whole `tpugen generate`: returns the report (also written to the run directory)."""
    display = display or RunDisplay()
    plan = plan_run(run)
    backend = make_backend(run.config.execution.backend)

    from tpugen.pipeline import load_pipeline

    display.phase(f"loading {run.config.model.id} onto {backend.name}")
    start = time.perf_counter()
    loaded = load_pipeline(run, backend)
    backend.wait()
    load_seconds = time.perf_counter() - start

    run_id = run_id_for(run)
    run_dir = make_run_dir(run, run_id)
    atomic_write_text(run_dir / "config.yaml", dump_config(run.config))

    warmup_results = [] if skip_warmup else warmup(loaded, plan, display)

    manifest = Manifest(run_dir / "manifest.jsonl")
    batch_rows, recompiles, written = [], [], []
    timed_before = backend.counters()
    generate_seconds = write_seconds = 0.0
    display.batches_started(len(plan.batches))
    phase_start = time.perf_counter()
    try:
        for batch in plan.batches:
            before = backend.counters()
            start = time.perf_counter()
            pixels = loaded.generate(batch)
            backend.wait()
            seconds = time.perf_counter() - start
            delta = _delta(backend, before)
            generate_seconds += seconds
            if delta and delta.compiles:
                recompiles.append({"batch": batch.number, "shape_key": str(batch.shape), "compiles": delta.compiles})

            start = time.perf_counter()
            share = seconds / len(batch.items)
            records = []
            for item, image in zip(batch.items, pixels):
                name = image_filename(item.index, item.seed, item.prompt)
                record = _record(run, loaded, item, batch, name, share)
                save_png(inside(run_dir, name), Image.fromarray(image), record)
                records.append(record)
                written.append(run_dir / name)
            manifest.append(records)
            write_seconds += time.perf_counter() - start

            batch_rows.append(
                {
                    "batch": batch.number,
                    "shape_key": str(batch.shape),
                    "images": len(batch.items),
                    "padding": batch.padding,
                    "steps": batch.steps,
                    "seconds": seconds,
                    "compiles": delta.compiles if delta else None,
                    "executions": delta.executions if delta else None,
                    "transfers_to_host": delta.transfers_to_host if delta else None,
                }
            )
            display.batch_done(batch, seconds)
    except OSError as exc:
        raise RunError(f"writing {exc.filename or run_dir}: {exc.strerror or exc}") from exc
    finally:
        manifest.close()
    backend.wait()
    wall = time.perf_counter() - phase_start
    timed_delta = _delta(backend, timed_before)
    display.finished()

    sheet = contact_sheet(written)
    if sheet is not None:
        buffer = io.BytesIO()
        sheet.save(buffer, format="PNG")
        atomic_write_bytes(run_dir / "grid.png", buffer.getvalue())

    per_image = [row["seconds"] / row["images"] for row in batch_rows for _ in range(row["images"])]
    images = len(written)
    report = {
        "tpugen_report": 1,
        "complete": True,
        "run_id": run_id,
        "run_dir": str(run_dir),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "device": backend.describe(),
        "config_hash": run.config_hash,
        "model": {"id": run.config.model.id, "dtype": run.config.model.dtype, "scheduler": loaded.scheduler_name},
        "images": images,
        "batches": len(plan.batches),
        "padding_rows": plan.padding_rows,
        "shape_keys": [str(k) for k in plan.shape_keys],
        "model_load_seconds": load_seconds,
        "warmup": warmup_results,
        "warmup_seconds": sum(w["seconds"] for w in warmup_results),
        "timed_phase": {
            "wall_seconds": wall,
            "generate_seconds": generate_seconds,
            "write_seconds": write_seconds,
            "images_per_second": images / wall if wall > 0 else None,
            "per_image_seconds": latency_summary(per_image),
            "seconds_per_step": (
                sum(row["seconds"] / row["steps"] for row in batch_rows) / len(batch_rows) if batch_rows else None
            ),
            "batches": batch_rows,
        },
        "compiles_after_warmup": timed_delta.compiles if timed_delta else None,
        "recompiles": recompiles,
        "xla_counters": (
            {
                "scope": "process-wide, read before and after the phase on one device",
                "warmup": {
                    "compiles": sum(w["compiles"] for w in warmup_results),
                    "compile_seconds": sum(w["compile_seconds"] for w in warmup_results),
                },
                "timed_phase": timed_delta.as_dict(),
            }
            if timed_delta
            else None
        ),
        "files": {"manifest": "manifest.jsonl", "config": "config.yaml", "grid": "grid.png" if sheet else None},
    }
    write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))
    return report
