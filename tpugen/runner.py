"""Executing a plan: load, warm up each shape key, run the timed batches, write images and the report."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from PIL import Image

from tpugen import __version__
from tpugen.backends import Backend, Counters, make_backend, versions
from tpugen.config import ResolvedRun, dump_config
from tpugen.errors import InputError, RunError, TpugenError
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
        _, graphs = loaded.generate(batch, census=True)
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
                "graphs_per_phase": graphs,
                "persistent_cache_hits": delta.persistent_cache_hits if delta else None,
                "persistent_cache_misses": delta.persistent_cache_misses if delta else None,
                "persistent_cache_load_failures": delta.persistent_cache_load_failures if delta else None,
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


@dataclass
class TimedPhase:
    """What the timed phase has done so far; enough to write a report at any point, even after a failure."""

    batches: list[dict] = field(default_factory=list)
    recompiles: list[dict] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    generate_seconds: float = 0.0
    write_seconds: float = 0.0
    wall_seconds: float = 0.0
    counters: Counters | None = None


def run_batches(run: ResolvedRun, loaded, plan: RunPlan, run_dir: Path, phase: TimedPhase, display: RunDisplay) -> None:
    """The timed phase: each batch generated, then its images and manifest lines written (strict shapes: a
    batch that compiles stops the run)."""
    backend = loaded.backend
    manifest = Manifest(run_dir / "manifest.jsonl")
    phase_before = backend.counters()
    phase_start = time.perf_counter()
    display.batches_started(len(plan.batches))
    try:
        for batch in plan.batches:
            before = backend.counters()
            start = time.perf_counter()
            pixels = loaded.generate(batch)
            backend.wait()  # the clock is read only after the device has finished
            seconds = time.perf_counter() - start
            delta = _delta(backend, before)
            phase.generate_seconds += seconds
            if delta and delta.compiles:
                phase.recompiles.append(
                    {"batch": batch.number, "shape_key": str(batch.shape), "compiles": delta.compiles}
                )
                if run.config.execution.strict_shapes:
                    raise RunError(
                        f"strict shapes: batch {batch.number} ({batch.shape}) compiled {delta.compiles} "
                        "graphs after warmup; its images were not written"
                    )

            start = time.perf_counter()
            share = seconds / len(batch.items)
            records = []
            for item, image in zip(batch.items, pixels, strict=True):
                name = image_filename(item.index, item.seed, item.prompt)
                record = _record(run, loaded, item, batch, name, share)
                save_png(inside(run_dir, name), Image.fromarray(image), record)
                records.append(record)
                phase.written.append(run_dir / name)
            manifest.append(records)
            phase.write_seconds += time.perf_counter() - start

            phase.batches.append(
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
    finally:
        manifest.close()
        display.finished()
        phase.wall_seconds = time.perf_counter() - phase_start
        phase.counters = _delta(backend, phase_before)


def build_report(
    run: ResolvedRun,
    *,
    run_id: str,
    run_dir: Path,
    plan: RunPlan,
    device: dict,
    scheduler: str,
    load_seconds: float,
    warmup_results: list[dict],
    persistent_cache: dict,
    phase: TimedPhase,
    error: str | None = None,
) -> dict:
    """report.json's content. `error` marks a run that stopped early; what it finished is still listed."""
    rows = phase.batches
    per_image = [row["seconds"] / row["images"] for row in rows for _ in range(row["images"])]
    images = len(phase.written)
    wall = phase.wall_seconds
    counters = phase.counters
    return {
        "tpugen_report": 1,
        "complete": error is None,
        "error": error,
        "run_id": run_id,
        "run_dir": str(run_dir),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "device": device,
        "config_hash": run.config_hash,
        "model": {"id": run.config.model.id, "dtype": run.config.model.dtype, "scheduler": scheduler},
        "images": images,
        "images_planned": len(plan.items),
        "batches": len(plan.batches),
        "padding_rows": plan.padding_rows,
        "shape_keys": [str(k) for k in plan.shape_keys],
        "model_load_seconds": load_seconds,
        "warmup": warmup_results,
        "warmup_seconds": sum(w["seconds"] for w in warmup_results),
        "persistent_cache": persistent_cache,
        "timed_phase": {
            "wall_seconds": wall,
            "generate_seconds": phase.generate_seconds,
            "write_seconds": phase.write_seconds,
            "images_per_second": images / wall if wall > 0 and images else None,
            "per_image_seconds": latency_summary(per_image),
            "seconds_per_step": sum(r["seconds"] / r["steps"] for r in rows) / len(rows) if rows else None,
            "batches": rows,
        },
        "compiles_after_warmup": counters.compiles if counters else None,
        "recompiles": phase.recompiles,
        "xla_counters": (
            {
                "scope": "process-wide, read before and after each phase; one device in this process",
                "warmup": {
                    "compiles": sum(w["compiles"] for w in warmup_results),
                    "compile_seconds": sum(w["compile_seconds"] for w in warmup_results),
                },
                "timed_phase": counters.as_dict(),
            }
            if counters
            else None
        ),
        "files": {"manifest": "manifest.jsonl", "config": "config.yaml", "grid": "grid.png"},
    }


def write_report(run_dir: Path, report: dict) -> None:
    write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))


def write_grid(run_dir: Path, images: list[Path]) -> None:
    sheet = contact_sheet(images)
    if sheet is not None:
        buffer = io.BytesIO()
        sheet.save(buffer, format="PNG")
        atomic_write_bytes(run_dir / "grid.png", buffer.getvalue())


def load(run: ResolvedRun, display: RunDisplay):
    """The backend (with its compile cache started) and the pipeline on it; returns (loaded, seconds)."""
    cfg = run.config
    backend = make_backend(cfg.execution.backend, cfg.cache.enabled, cfg.cache.dir)

    from tpugen.pipeline import load_pipeline

    display.phase(f"loading {cfg.model.id} onto {backend.name}")
    start = time.perf_counter()
    loaded = load_pipeline(run, backend)
    backend.wait()
    return loaded, time.perf_counter() - start


def persistent_cache_summary(backend: Backend, warmup_results: list[dict]) -> dict:
    """What the persistent compile cache did, as counted; never assumed."""
    summary = dict(backend.cache)
    for key in ("hits", "misses", "load_failures"):
        counts = [w[f"persistent_cache_{key}"] for w in warmup_results if w[f"persistent_cache_{key}"] is not None]
        summary[key] = sum(counts) if counts else None
    return summary


def warmup_only(run: ResolvedRun, *, display: RunDisplay | None = None) -> dict:
    """`tpugen warmup`: compile every planned shape key once; writes no run directory."""
    display = display or RunDisplay()
    plan = plan_run(run)
    loaded, load_seconds = load(run, display)
    results = warmup(loaded, plan, display)
    return {
        "device": loaded.backend.describe(),
        "model_load_seconds": load_seconds,
        "warmup": results,
        "persistent_cache": persistent_cache_summary(loaded.backend, results),
    }


def generate(run: ResolvedRun, *, display: RunDisplay | None = None, skip_warmup: bool = False) -> dict:
    """The whole `tpugen generate`: returns the report, also written to the run directory.

    The run directory is created only once the model has loaded, so a bad model id leaves nothing behind;
    from then on a failure still leaves every finished image, the manifest and a report marked incomplete.
    """
    display = display or RunDisplay()
    plan = plan_run(run)
    loaded, load_seconds = load(run, display)
    backend = loaded.backend

    run_id = run_id_for(run)
    run_dir = make_run_dir(run, run_id)
    atomic_write_text(run_dir / "config.yaml", dump_config(run.config))

    warmup_results: list[dict] = []
    phase = TimedPhase()

    def report(error: str | None = None) -> dict:
        return build_report(
            run,
            run_id=run_id,
            run_dir=run_dir,
            plan=plan,
            device=backend.describe(),
            scheduler=loaded.scheduler_name,
            load_seconds=load_seconds,
            warmup_results=warmup_results,
            persistent_cache=persistent_cache_summary(backend, warmup_results),
            phase=phase,
            error=error,
        )

    try:
        if not skip_warmup:
            warmup_results.extend(warmup(loaded, plan, display))
        run_batches(run, loaded, plan, run_dir, phase, display)
        write_grid(run_dir, phase.written)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            reason = "interrupted"
        elif isinstance(exc, TpugenError):
            reason = exc.lines[0]
        else:
            reason = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]
        write_report(run_dir, report(error=reason))
        if not isinstance(exc, Exception):
            raise
        kept = f"{len(phase.written)} finished images, the manifest and report.json are in {run_dir}"
        if isinstance(exc, TpugenError):
            raise type(exc)(*exc.lines, kept) from exc
        if isinstance(exc, OSError):
            raise RunError(f"writing {exc.filename or run_dir}: {exc.strerror or exc}", kept) from exc
        raise RunError(f"the run failed: {reason}", kept) from exc
    final = report()
    write_report(run_dir, final)
    return final
