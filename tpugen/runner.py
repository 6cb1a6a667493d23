"""Executing a plan: load, warm up each shape key, run the timed batches, write images and the report."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from PIL import Image

from tpugen import __version__
from tpugen.backends import Backend, Counters, host_index, make_backend, versions
from tpugen.config import ResolvedRun, dump_config
from tpugen.errors import InputError, Interrupted, RunError, TpugenError
from tpugen.outputs import (
    Manifest,
    atomic_write_bytes,
    atomic_write_text,
    contact_sheet,
    image_filename,
    inside,
    read_manifest,
    save_png,
    write_json,
)
from tpugen.plan import Batch, RunPlan, ShapeKey, plan_run, plan_share
from tpugen.pod import pod_position
from tpugen.report import latency_summary, render_markdown, session_summary
from tpugen.resume import check_resumable, finished_records, rewrite_manifest, write_run_record


class RunDisplay:
    """What the runner tells the user as it goes; the CLI shows it with rich, tests keep it silent."""

    def phase(self, text: str) -> None: ...

    def batches_started(self, total: int) -> None: ...

    def batch_done(self, batch: Batch, seconds: float) -> None: ...

    def progress(self, done: int, total: int) -> None: ...

    def finished(self) -> None: ...

    def warning(self, text: str) -> None:
        """Something the user should know even under --quiet (a damaged manifest line, say)."""


class GracefulStop:
    """SIGINT/SIGTERM finish the batch in flight and then stop the run; a second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, display: RunDisplay) -> None:
        self.display = display
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # handlers can only live there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self.display.phase(f"{signal.Signals(signum).name}: stopping after the batch in flight (again: stop now)")

    def check(self) -> None:
        """Called between batches: stop here if a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum)


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


def warmup(loaded, plan: RunPlan, display: RunDisplay, checkpoint=lambda: None) -> list[dict]:
    """One full pipeline call per shape key, at the run's step count: its wall time is the compile time."""
    backend = loaded.backend
    first_batch: dict[ShapeKey, Batch] = {}
    for batch in plan.batches:
        first_batch.setdefault(batch.shape, batch)
    results = []
    for shape, batch in first_batch.items():
        checkpoint()
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
                "device_memory_per_phase": dict(loaded.phase_memory) or None,
                "persistent_cache_hits": delta.persistent_cache_hits if delta else None,
                "persistent_cache_misses": delta.persistent_cache_misses if delta else None,
                "persistent_cache_load_failures": delta.persistent_cache_load_failures if delta else None,
            }
        )
    return results


def image_record(run: ResolvedRun, loaded, item, batch: Batch, file: str) -> dict:
    """What made an image; stored in its PNG, so it holds nothing that varies between identical runs."""
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


def run_batches(
    run: ResolvedRun,
    loaded,
    plan: RunPlan,
    run_dir: Path,
    phase: TimedPhase,
    display: RunDisplay,
    *,
    finished: frozenset[int] = frozenset(),
    checkpoint=lambda: None,
    manifest_name: str = "manifest.jsonl",
    extra: dict | None = None,
) -> None:
    """The timed phase: each batch generated, then its images and manifest lines written (strict shapes: a
    batch that compiles stops the run)."""
    backend = loaded.backend
    manifest = Manifest(run_dir / manifest_name)
    phase_before = backend.counters()
    phase_start = time.perf_counter()
    display.batches_started(len(plan.batches))
    try:
        for batch in plan.batches:
            checkpoint()
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
                if item.index in finished:  # resumed: this image is already on disk
                    continue
                name = image_filename(item.index, item.seed, item.prompt)
                record = {**image_record(run, loaded, item, batch, name), **(extra or {})}
                save_png(inside(run_dir, name), Image.fromarray(image), record)
                records.append({**record, "latency_seconds": share})
                phase.written.append(run_dir / name)
            manifest.append(records)
            phase.write_seconds += time.perf_counter() - start

            phase.batches.append(
                {
                    "batch": batch.number,
                    "shape_key": str(batch.shape),
                    "images": len(records),
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
    images_reused: int = 0,
    error: str | None = None,
    pod: tuple[int, int] = (0, 1),
    earlier_sessions: list[dict] = (),
) -> dict:
    """report.json's content. `error` marks a run that stopped early; what it finished is still listed."""
    rows = phase.batches
    per_image = [row["seconds"] / row["images"] for row in rows if row["images"] for _ in range(row["images"])]
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
        "pod": {"worker_index": pod[0], "num_workers": pod[1]},
        "model": {"id": run.config.model.id, "dtype": run.config.model.dtype, "scheduler": scheduler},
        "images": images + images_reused,
        "images_this_session": images,
        "images_reused": images_reused,
        "images_planned": len(plan.items),
        "batches": len(plan.batches),
        "padding_rows": plan.padding_rows,
        "shape_keys": [str(k) for k in plan.shape_keys],
        "memory": _memory_section(run),
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
                "scope": (
                    "process-wide, read before and after each phase; one device in this process"
                    if device.get("backend") == "xla"
                    else "torch.compile graphs counted by dynamo; executions and transfers are not counted here"
                ),
                "warmup": {
                    "compiles": _total(w["compiles"] for w in warmup_results),
                    "compile_seconds": _total(w["compile_seconds"] for w in warmup_results),
                },
                "timed_phase": counters.as_dict(),
            }
            if counters
            else None
        ),
        "earlier_sessions": list(earlier_sessions),
        "files": {"manifest": "manifest.jsonl", "config": "config.yaml", "grid": "grid.png"},
    }


def _memory_section(run: ResolvedRun) -> dict | None:
    """The memory plan for the run's chip kind; a planning problem never fails a run that already ran."""
    from tpugen.memory import memory_plan_for

    execution = run.config.execution
    try:
        plan = memory_plan_for(run, execution.chip, execution.chip_memory_gb)
    except Exception as exc:  # informational only
        return {"error": f"{type(exc).__name__}: {exc}"}
    return plan.as_dict() if plan else None


def _total(values) -> float | None:
    """The sum, or None when any part was not measured."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def write_report(run_dir: Path, report: dict) -> None:
    write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))


def read_report(run_dir: Path) -> dict | None:
    """The run's report.json as an earlier session left it, or None (none yet, or unreadable)."""
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def earlier_sessions_of(run_dir: Path) -> list[dict]:
    """Every earlier session's figures, from the report the last one left: a resume never drops them."""
    previous = read_report(run_dir)
    if previous is None or "timed_phase" not in previous:
        return []
    return [*previous.get("earlier_sessions", []), session_summary(previous)]


def already_complete(run_dir: Path, images_planned: int, finished: dict[int, dict]) -> dict:
    """A resume with nothing left to make: load no model, rewrite nothing, say so.

    A run that finished every image but stopped before its final report (killed in between) gets that report
    now, from the last one it wrote."""
    report = read_report(run_dir)
    if report is None or not report.get("complete"):
        rewrite_manifest(run_dir, finished)
        write_grid(run_dir, sorted(run_dir.glob("[0-9]*.png")))
        report = {**(report or {"run_id": run_dir.name, "run_dir": str(run_dir)}), "complete": True, "error": None}
        report["images"] = len(finished)
        write_json(run_dir / "report.json", report)
        if "timed_phase" in report:
            atomic_write_text(run_dir / "report.md", render_markdown(report))
    return {
        **report,
        "run_dir": str(run_dir),
        "already_complete": True,
        "images": len(finished),
        "images_planned": images_planned,
    }


def write_grid(run_dir: Path, images: list[Path]) -> None:
    sheet = contact_sheet(images)
    if sheet is not None:
        buffer = io.BytesIO()
        sheet.save(buffer, format="PNG")
        atomic_write_bytes(run_dir / "grid.png", buffer.getvalue())


def load(run: ResolvedRun, display: RunDisplay):
    """The backend (with its compile cache started) and the pipeline on it; returns (loaded, seconds)."""
    cfg = run.config
    backend = make_backend(cfg)
    _check_fit(run, backend)
    if cfg.execution.placement != "none":
        _assign_components(run, backend)

    from tpugen.pipeline import load_pipeline

    display.phase(f"loading {cfg.model.id} onto {backend.name}")
    start = time.perf_counter()
    loaded = load_pipeline(run, backend)
    backend.wait()
    return loaded, time.perf_counter() - start


def _check_fit(run: ResolvedRun, backend) -> None:
    """Refuse, before any weights load, a model that cannot fit the chips the way the config runs it.

    Only where the chip is known: on a TPU, or when the config names the chip (execution.chip or
    chip_memory_gb); elsewhere (XLA:CPU, GPUs) the chip in the config is a planning assumption only.
    """
    from tpugen.memory import fit_problem, memory_plan_for

    execution = run.config.execution
    named = {"chip", "chip_memory_gb"} & execution.model_fields_set
    if backend.name not in ("xla", "torch_tpu") or not (named or os.environ.get("PJRT_DEVICE", "").upper() == "TPU"):
        return
    if execution.placement != "none":
        return  # the placement itself is checked chip by chip
    try:
        plan = memory_plan_for(run, execution.chip, execution.chip_memory_gb)
    except Exception:  # a model tpugen cannot size is not refused for that; its report says why
        return
    devices = backend.devices if execution.sharding == "spmd" else 1  # SpmdBackend counts its mesh's devices
    problem = plan and fit_problem(plan, execution, devices, run.config.model.id)
    if problem:
        hint = "" if named else f" (if these chips are not {execution.chip}, set execution.chip)"
        raise InputError(problem + hint)


def _assign_components(run: ResolvedRun, backend) -> None:
    """execution.placement, decided from the component sizes on disk before any weights load."""
    from tpugen.memory import memory_plan_for
    from tpugen.placement import assign_components

    execution = run.config.execution
    plan = memory_plan_for(run, execution.chip, execution.chip_memory_gb)
    if plan is None:
        raise InputError(
            f"execution.placement: the component sizes of {run.config.model.id} are not known without its files; "
            "download it first (its safetensors headers give the sizes)"
        )
    sizes = {c.name: c.bytes for c in plan.components}
    explicit = execution.placement if isinstance(execution.placement, dict) else None
    denoiser = "unet" if "unet" in sizes else "transformer"
    backend.assign(assign_components(sizes, backend.capacities(plan.chip_gb * 1e9), explicit), denoiser)


def persistent_cache_summary(cache: dict, warmup_results: list[dict]) -> dict:
    """What the persistent compile cache did, as counted; never assumed."""
    summary = dict(cache)
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
        "persistent_cache": persistent_cache_summary(loaded.backend.cache, results),
    }


def generate(
    run: ResolvedRun,
    *,
    display: RunDisplay | None = None,
    skip_warmup: bool = False,
    resume_dir: Path | None = None,
) -> dict:
    """The whole `tpugen generate`: returns the report, also written to the run directory.

    The run directory is created only once the model has loaded, so a bad model id leaves nothing behind;
    from then on a failure or a signal still leaves every finished image, the manifest and a report marked
    incomplete. With `resume_dir`, images already finished there are kept and only the rest are made.
    """
    display = display or RunDisplay()
    if run.config.execution.mode == "multi":
        from tpugen.multi import run_multi

        return run_multi(run, display=display, resume_dir=resume_dir)
    finished: dict[int, dict] = {}
    earlier: list[dict] = []
    if resume_dir is not None:
        resume_dir = Path(resume_dir).resolve()
        check_resumable(run, resume_dir)
        finished, problems = finished_records(resume_dir, run)
        for problem in problems:
            display.warning(problem)
        earlier = earlier_sessions_of(resume_dir)
    # On a pod, this worker takes the images whose index % workers == its index.
    worker, workers = pod_position(run.config.execution.pod, os.environ, host_index)
    full_plan = plan_share(run, workers, worker)
    plan = plan_share(run, workers, worker, frozenset(finished))
    if resume_dir is not None and not plan.batches:
        return already_complete(resume_dir, len(full_plan.items), finished)

    with GracefulStop(display) as stop:
        loaded, load_seconds = load(run, display)
        backend = loaded.backend
        if resume_dir is not None:
            run_id, run_dir = resume_dir.name, resume_dir
            rewrite_manifest(run_dir, finished)  # drop a torn last line before appending to it
            display.phase(f"resuming {run_dir}: {len(finished)} of {len(plan.items)} images already finished")
        else:
            run_id = run_id_for(run)
            run_dir = make_run_dir(run, run_id)
            atomic_write_text(run_dir / "config.yaml", dump_config(run.config))
            write_run_record(run_dir, run, run_id)

        warmup_results: list[dict] = []
        phase = TimedPhase()

        def report(error: str | None = None) -> dict:
            return build_report(
                run,
                run_id=run_id,
                run_dir=run_dir,
                plan=full_plan,
                device=backend.describe(),
                scheduler=loaded.scheduler_name,
                load_seconds=load_seconds,
                warmup_results=warmup_results,
                persistent_cache=persistent_cache_summary(backend.cache, warmup_results),
                phase=phase,
                images_reused=len(finished),
                error=error,
                pod=(worker, workers),
                earlier_sessions=earlier,
            )

        try:
            if not skip_warmup:
                warmup_results.extend(warmup(loaded, plan, display, stop.check))
            run_batches(run, loaded, plan, run_dir, phase, display, finished=frozenset(finished), checkpoint=stop.check)
            stop.check()
        except BaseException as exc:
            _fail(exc, stop, run_dir, phase, lambda error: write_report(run_dir, report(error)))
        # Batches may finish out of index order (and a resume appends); the final manifest is in index order.
        rewrite_manifest(run_dir, {r["index"]: r for r in read_manifest(run_dir / "manifest.jsonl")})
        write_grid(run_dir, sorted(run_dir.glob("[0-9]*.png")))
        final = report()
        write_report(run_dir, final)
        return final


def _fail(exc: BaseException, stop: GracefulStop, run_dir: Path, phase: TimedPhase, write) -> None:
    """Write the incomplete report, then re-raise as one error that says what was kept and how to go on."""
    kept = f"{len(phase.written)} new images, the manifest and report.json are in {run_dir}"
    resume = f"resume with: tpugen resume {run_dir}"
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        signum = exc.signum if isinstance(exc, Interrupted) else (stop.signum or signal.SIGINT)
        name = signal.Signals(signum).name
        when = "after the batch in flight" if isinstance(exc, Interrupted) else "at once"
        write(f"interrupted by {name}")
        raise Interrupted(signum, f"interrupted by {name}, stopped {when}; {kept}", resume) from None
    if isinstance(exc, TpugenError):
        write(exc.lines[0])
        raise type(exc)(*exc.lines, kept) from exc
    if isinstance(exc, OSError):
        where = exc.filename or run_dir
        write(f"writing {where}: {exc.strerror or exc}")
        raise RunError(f"writing {where}: {exc.strerror or exc}", kept, resume) from exc
    if not isinstance(exc, Exception):
        write(type(exc).__name__)
        raise exc
    reason = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]
    write(reason)
    raise RunError(f"the run failed: {reason}", kept, resume) from exc
