"""A run session: one run directory's whole life, from creation (or a checked resume) to its final report."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from tpugen.backends import versions
from tpugen.config import ResolvedRun, dump_config
from tpugen.config.prompts import planned_images
from tpugen.errors import InputError, Interrupted, RunError, TpugenError, one_line
from tpugen.files import atomic_write_text, write_json
from tpugen.outputs.grid import write_grid
from tpugen.outputs.manifest import Manifest, rewrite_manifest
from tpugen.outputs.report import (
    RunReport,
    TimedPhase,
    build_report,
    earlier_sessions_of,
    persistent_cache_summary,
    plan_counts,
    read_report,
    write_report,
)
from tpugen.outputs.run_dir import MANIFEST, all_records, finished_records, make_run_dir, run_id_for
from tpugen.outputs.run_record import as_recorded, check_resumable, prompts_file_edited, write_run_record
from tpugen.outputs.writers import BatchWriter, ImageWriter
from tpugen.plan import RunPlan, plan_share


class RunSession:
    """The run directory's whole life, written once for every mode: created (or resumed and checked),
    config.yaml and run.json, images and manifest lines as they land, per-rank manifests merged, the grid,
    and report.json and report.md built by the one report builder."""

    def __init__(self, run: ResolvedRun, run_dir: Path, run_id: str, *, resumed: bool) -> None:
        self.run = run
        self.run_dir = run_dir
        self.run_id = run_id
        self.resumed = resumed
        self.finished: dict[int, dict] = {}  # records of images already on disk (a resume)
        self.problems: list[str] = []  # manifest lines that were not this run's records
        self.earlier_sessions: list[dict] = []

    # ---------------------------------------------------------------- starting

    @classmethod
    def create(cls, run: ResolvedRun, run_id: str | None = None) -> RunSession:
        run_id = run_id or run_id_for(run)
        run_dir = make_run_dir(run.config.output.dir, run_id)
        # run.json first: a directory with config.yaml and no run.json reads as a run from before run.json. It is
        # created exclusively: of two runs started at once with one run_id, the second is refused here.
        try:
            write_run_record(run_dir, run, run_id, exclusive=True)
        except FileExistsError:
            raise InputError(
                f"output.run_id: {run_dir} is being used by another run that started at the same time; choose "
                "another run_id"
            ) from None
        atomic_write_text(run_dir / "config.yaml", dump_config(run.config))
        return cls(run, run_dir.resolve(), run_id, resumed=False)

    @classmethod
    def resume(cls, run: ResolvedRun, run_dir: Path) -> RunSession:
        """The run in `run_dir`, checked against `run`: refused (naming what changed) if the work would differ
        from what made its images. Its `problems` (warning lines) start with what an allowed resume should know:
        a prompts file edited since the run started, keys that change the new images by rounding only."""
        run_dir = Path(run_dir).resolve()
        rounding = check_resumable(run, run_dir)
        session = cls(as_recorded(run, run_dir), run_dir, run_dir.name, resumed=True)
        session.finished, session.problems = finished_records(run_dir, run)
        if rounding and len(session.finished) < planned_images(run.prompts, run.config.images_per_prompt):
            session.problems.insert(0, rounding)
        edited = prompts_file_edited(run, run_dir)
        if edited:
            session.problems.insert(0, edited)
        session.earlier_sessions = earlier_sessions_of(run_dir)
        return session

    @classmethod
    def attach(cls, run: ResolvedRun, run_dir: Path, finished: frozenset[int]) -> RunSession:
        """A rank's view of a session its parent process owns: it writes its share, nothing else."""
        session = cls(as_recorded(run, Path(run_dir)), Path(run_dir), Path(run_dir).name, resumed=True)
        session.finished = dict.fromkeys(finished, {})
        return session

    @classmethod
    def start(cls, run: ResolvedRun, resume_dir: Path | None = None) -> RunSession:
        return cls.resume(run, resume_dir) if resume_dir is not None else cls.create(run)

    def discard(self) -> None:
        """Remove the run directory of a run that made nothing (its model never loaded): no run to resume."""
        if not self.resumed:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---------------------------------------------------------------- the work

    def share(self, parts: int = 1, part: int = 0) -> tuple[RunPlan, RunPlan]:
        """(the whole share of this part, what is left of it): a resume leaves out finished batches."""
        return plan_share(self.run, parts, part), plan_share(self.run, parts, part, frozenset(self.finished))

    def settle(self) -> None:
        """Before a resumed run writes anything: manifest.jsonl holds exactly the records the resume checked
        (a torn last line, lines of other runs and records of images gone from disk dropped), and the per-rank
        manifests of an earlier session are merged into it and removed, so no new line is ever appended to a
        torn one. The session's owner calls this, never a rank attached to it."""
        if self.resumed:
            rewrite_manifest(self.run_dir, self.finished)
            for path in self.run_dir.glob("manifest.rank*.jsonl"):
                path.unlink()

    def writer(self, engine, manifest: str = MANIFEST, extra: dict | None = None) -> BatchWriter:
        if manifest == MANIFEST:  # the owner's own writer (a rank writes its manifest.rankN.jsonl)
            self.settle()
        return BatchWriter(self, engine.scheduler_name, engine.model_label, manifest, extra or {})

    def open_manifest(self) -> Manifest:
        """manifest.jsonl for appending records that others wrote the images of (a ray run's driver)."""
        self.settle()
        return Manifest(self.run_dir / MANIFEST)

    def image_writer(self, engine, extra: dict | None = None) -> ImageWriter:
        """Images only: the records come back to whoever owns the manifest (a ray run's driver)."""
        return ImageWriter(self, engine.scheduler_name, engine.model_label, extra or {})

    def records(self) -> dict[int, dict]:
        """Every image record in the manifest and in per-rank manifests not merged yet, by index."""
        return {r["index"]: r for r in all_records(self.run_dir)}

    def already_complete(self, images_planned: int) -> dict | None:
        """A resume with nothing left to make: load no model, rewrite nothing; the report to show, or None when
        there is work left. A run that finished every image but stopped before its final report (killed in
        between) gets that report now, from the last one it wrote."""
        if not self.resumed or len(self.finished) < images_planned:
            return None
        stored = read_report(self.run_dir)
        report = RunReport.from_json(stored or {"run_id": self.run_id})
        if stored is None or not report.complete:
            self.settle()
            write_grid(self.run_dir, sorted(self.run_dir.glob("[0-9]*.png")))
            report = report.but(complete=True, error=None, run_dir=str(self.run_dir), images=len(self.finished))
            if report.timed_phase is not None:
                write_report(self.run_dir, report)
            else:  # a report that never had figures: say it is complete, render nothing
                write_json(self.run_dir / "report.json", report.as_json())
        return report.but(
            run_dir=str(self.run_dir),
            already_complete=True,
            images=len(self.finished),
            images_planned=images_planned,
        )

    # ---------------------------------------------------------------- the end

    def report(self, engine, plan: RunPlan, warmup: list[dict], phase: TimedPhase, topology, error=None) -> RunReport:
        """The report of a session that one engine ran (single mode, one pod worker)."""
        return build_report(
            run=self.run,
            run_id=self.run_id,
            run_dir=self.run_dir,
            **plan_counts(plan),
            device=engine.describe(),
            versions=versions(),
            scheduler=engine.scheduler_name,
            load_seconds=engine.load_seconds,
            warmup=warmup,
            persistent_cache=persistent_cache_summary(engine.backend.cache, warmup),
            phase=phase,
            topology=topology.as_dict(),
            images_reused=len(self.finished),
            error=error,
            memory=engine.memory_summary(plan),
            earlier_sessions=self.earlier_sessions,
        )

    def finish(self, report: RunReport) -> RunReport:
        """The final files: the manifest in index order (per-rank manifests merged in), the grid, the report."""
        rewrite_manifest(self.run_dir, self.records())
        for path in self.run_dir.glob("manifest.rank*.jsonl"):
            path.unlink()
        write_grid(self.run_dir, sorted(self.run_dir.glob("[0-9]*.png")))
        write_report(self.run_dir, report)
        return report

    def fail(self, exc: BaseException, made: int, write_incomplete, stop=None) -> None:
        """Write the incomplete report (`write_incomplete(error)`), then raise one error that says what was
        kept and how to go on."""
        kept = f"{made} new images, the manifest and report.json are in {self.run_dir}"
        resume = f"resume with: tpugen resume {self.run_dir}"
        write_incomplete = self._never_failing(write_incomplete)
        if isinstance(exc, (Interrupted, KeyboardInterrupt)):
            signum = exc.signum if isinstance(exc, Interrupted) else ((stop and stop.signum) or signal.SIGINT)
            name = signal.Signals(signum).name
            when = "after the batch in flight" if isinstance(exc, Interrupted) else "at once"
            write_incomplete(f"interrupted by {name}")
            raise Interrupted(signum, f"interrupted by {name}, stopped {when}; {kept}", resume) from None
        if isinstance(exc, TpugenError):
            write_incomplete(exc.lines[0])
            raise type(exc)(*exc.lines, kept) from exc
        if isinstance(exc, OSError):
            where = exc.filename or self.run_dir
            write_incomplete(f"writing {where}: {exc.strerror or exc}")
            raise RunError(f"writing {where}: {exc.strerror or exc}", kept, resume) from exc
        if not isinstance(exc, Exception):
            write_incomplete(type(exc).__name__)
            raise exc
        reason = one_line(exc)
        write_incomplete(reason)
        raise RunError(f"the run failed: {reason}", kept, resume) from exc

    def _never_failing(self, write_incomplete):
        """`write_incomplete`, or where building the full report fails too (a pipeline that broke before the
        report's figures exist), a report.json that still says the run is incomplete, why, and why the full
        report could not be written."""

        def write(error: str) -> None:
            try:
                write_incomplete(error)
            except Exception as exc:
                write_json(
                    self.run_dir / "report.json",
                    {"complete": False, "error": error, "report_error": one_line(exc), "run_dir": str(self.run_dir)},
                )

        return write
