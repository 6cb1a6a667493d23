"""A run session: one run directory's whole life, from creation (or a checked resume) to its final report."""

from __future__ import annotations

import json
import shutil
import signal
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from PIL import Image

from tpugen import __version__
from tpugen.backends import versions
from tpugen.config import ModelConfig, PromptSpec, ResolvedRun, RunConfig, dump_config, load_config
from tpugen.config.controls import Controls, annotator_weights, controlnet_identity, recorded_name
from tpugen.config.images import ImageSource, References, sha256_of
from tpugen.config.loras import loras_by_content
from tpugen.config.prompts import planned_images, resolve_prompts
from tpugen.errors import InputError, Interrupted, RunError, TpugenError, one_line
from tpugen.families import FAMILIES
from tpugen.files import atomic_write_text, inside, write_json
from tpugen.lines import text_lines
from tpugen.outputs.grid import write_grid
from tpugen.outputs.manifest import Manifest, read_manifest, read_text_lenient, rewrite_manifest
from tpugen.outputs.png import image_filename, is_valid_png, save_png
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
from tpugen.plan import ImageWork, RunPlan, plan_run, plan_share

# How a resume treats a key (tpugen/config/schema.py) whose value differs from the run's. Any key not named below
# is refused: it can change an image (the model, its revision, variant, dtype, scheduler, LoRAs, watermark and
# remote code; the prompts, sizes, steps, guidance, seed, batch_size (padding and graphs) and images_per_prompt;
# the backend, whose noise and kernels differ; the pod share, which changes the batches).
# Keys that never change pixels: where files go, the compile cache, the recompile guard, the server's settings,
# where a ray run's workers are (so a killed driver's run can be resumed from another address), and the chip the
# memory plan is made for (unless execution.placement decides from it where components go).
_NOT_IMAGE_KEYS = {
    "output",
    "cache",
    "execution.strict_shapes",
    "prompts_file",
    "serve",
    "execution.ray",
    "execution.chip",
    "execution.chip_memory_gb",
}
_CHIP_KEYS = {"execution.chip", "execution.chip_memory_gb"}
# Keys that run the same computation on other devices or as other graphs: the pixels move by rounding only
# (multi equals single within 1/255, as scanned blocks, SPMD and placed components do; tests/conftest.py), so a
# resume goes on with a warning.
_ROUNDING_KEYS = {
    "execution.mode",
    "execution.cores",
    "execution.offload",
    "execution.sharding",
    "execution.mesh",
    "execution.placement",
    "execution.torch_tpu",
    "compile.torch_compile",
    "compile.scan_blocks",
    "compile.flash_attention",
    "compile.trace_once",
}
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


def image_record(
    run: ResolvedRun,
    work: ImageWork,
    *,
    scheduler: str,
    model_label: str,
    loras=(),
    index: int | None = None,
    file: str | None = None,
    batch: int | None = None,
) -> dict:
    """What made an image; stored in its PNG, so it holds nothing that varies between identical runs or
    depends on how the run was executed (no rank, no worker, no timing). `work`: a run's image's or a server's
    request's (tpugen.plan.ImageWork); `loras`: the ones fused for it. A run's image (its `index`, `file` and
    `batch` given) records its index, file, batch and the run's config hash too; a server's reply has no run file
    or batch."""
    model = run.config.model
    in_run = file is not None
    # LoRAs change the images, so they are part of what made one; a run without them keeps the record it had.
    fused = {"loras": [lora.record() for lora in loras]} if loras else {}
    cache = run.config.compile.step_cache.record()  # cached images are not the uncached ones
    step_cache = {"step_cache": cache} if cache else {}
    source = work.source.record() if work.source else {}  # by content: the path is where it was, not what it was
    source = {**source, **work.references.record()} if work.references else source
    if work.controls:  # each unit's control image by content, and how it steered
        controlnets = [recorded_name(c.id) for c in model.controlnets]
        units = zip(controlnets, work.controls.units, strict=True)
        source = {**source, "controlnet_units": [{"controlnet": name, **unit.record()} for name, unit in units]}
    multiple = FAMILIES[run.family].size_multiple
    hires = {"hires": work.hires.record(work.height, work.width, multiple)} if work.hires else {}
    tiling = {"tiling": True} if work.tiling else {}  # an untiled image keeps the record it had
    clip_skip = (
        {"clip_skip": work.clip_skip} if work.clip_skip > 1 else {}
    )  # the last layer's records stay as they were
    return {
        **({"index": index, "file": file} if in_run else {}),
        "prompt": work.prompt,
        "negative_prompt": work.negative_prompt,
        "seed": work.seed,
        "steps": work.steps,
        "guidance_scale": work.guidance_scale,
        "height": work.height,
        "width": work.width,
        "scheduler": scheduler,
        "model": model_label,
        "model_id": model.id,
        "dtype": model.dtype,
        **source,
        **hires,
        **tiling,
        **clip_skip,
        **fused,
        **step_cache,
        **({"batch": batch, "config_hash": run.config_hash} if in_run else {}),
        "tpugen_version": __version__,
    }


class ImageWriter:
    """Writes each batch's images (atomically) and returns their manifest records, appending them nowhere: a
    ray worker's side of a run, whose driver appends the records once it has them."""

    def __init__(self, session: RunSession, scheduler: str, model_label: str, extra: dict) -> None:
        self.session = session
        self.scheduler = scheduler
        self.model_label = model_label
        self.extra = extra  # manifest-only fields (the rank), never in the PNG

    def write(self, batch, pixels: list, seconds: float) -> list[dict]:
        session, run_dir = self.session, self.session.run_dir
        share = seconds / len(batch.items)
        records = []
        for item, image in zip(batch.items, pixels, strict=True):
            if item.index in session.finished:  # resumed: this image is already on disk
                continue
            name = image_filename(item.index, item.seed, item.prompt)
            record = image_record(
                session.run,
                item,
                scheduler=self.scheduler,
                model_label=self.model_label,
                loras=session.run.loras,
                index=item.index,
                file=name,
                batch=batch.number,
            )
            save_png(inside(run_dir, name), Image.fromarray(image), record)
            records.append({**record, "latency_seconds": share, **self.extra})
        return records


class BatchWriter(ImageWriter):
    """Writes each batch's images (atomically) and appends their manifest lines (fsynced) as they land."""

    def __init__(self, session: RunSession, scheduler: str, model_label: str, manifest: str, extra: dict) -> None:
        super().__init__(session, scheduler, model_label, extra)
        self.manifest = Manifest(session.run_dir / manifest)

    def __call__(self, batch, pixels: list, seconds: float) -> list[str]:
        records = self.write(batch, pixels, seconds)
        self.manifest.append(records)
        return [r["file"] for r in records]

    def close(self) -> None:
        self.manifest.close()


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


# ---------------------------------------------------------------- what made a run, and resuming it


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
    """The config as a run record holds it: a local ControlNet and the annotator weights the prompts read by
    content, as the config hash counts them (a resume then refuses weights changed in place, and takes a folder
    moved)."""
    data = _plain(run.config.model_dump())
    model = data["model"]
    model["controlnets"] = [controlnet_identity(controlnet) for controlnet in model["controlnets"]]
    if model.get("annotators_dir") is not None:
        model["annotators_dir"] = annotator_weights(model["annotators_dir"], run.prompts) or None
    return data


def _prompts_data(prompts: list[PromptSpec]) -> list[dict]:
    """The prompts as a run record holds them; a prompt without references or control images as before prompts
    could have them."""
    data = [asdict(p) for p in prompts]
    return _plain([{k: v for k, v in p.items() if k not in ("references", "controls") or v is not None} for p in data])


def write_run_record(run_dir: Path, run: ResolvedRun, run_id: str, *, exclusive: bool = False) -> None:
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
        exclusive=exclusive,
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
    return [
        PromptSpec(
            **{
                **p,
                "sizes": tuple(tuple(s) for s in p["sizes"]),
                "source": ImageSource(**p["source"]) if p.get("source") else None,
                "references": References.from_record(p["references"]) if p.get("references") else None,
                "controls": Controls.from_record(p["controls"]) if p.get("controls") else None,
            }
        )
        for p in record["prompts"]
    ]


def load_run(run_dir: Path) -> ResolvedRun:
    """`tpugen resume RUN_DIR`: the run's own config.yaml, with the prompts the run started with (a prompts
    file edited since is not read again)."""
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}: not a tpugen run directory (no config.yaml)")
    record = read_run_record(run_dir)
    if record is None:
        return load_config(run_dir / "config.yaml")
    prompts = recorded_prompts(record)
    changed = [
        f"{run_dir}: prompt {number}'s {key} {path} changed since the run started (or is gone); put it back as it "
        "was, or start a new run"
        for number, prompt in enumerate(prompts)
        for key, path, sha256 in prompt.files()
        if sha256_of(path) != sha256
    ]
    if changed:
        raise InputError(*changed)
    return load_config(run_dir / "config.yaml", prompts=prompts)


def _under(key: str, sections: set[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in sections)


def changed_keys(old_config: dict, new_config: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for each key whose value differs between two configs. A key one side
    lacks (a run recorded before tpugen had it) counts as that key's default."""
    defaults = _flatten(_plain(RunConfig(model=ModelConfig(id="-")).model_dump()))
    a, b = _flatten(_loras_by_content(old_config)), _flatten(_loras_by_content(new_config))

    def value(flat: dict, key: str):
        # A run made before model.loras existed has no such key: it had no LoRAs, as [] says.
        found = flat.get(key, defaults.get(key))
        return None if found == [] else found

    return [(key, value(a, key), value(b, key)) for key in sorted(set(a) | set(b)) if value(a, key) != value(b, key)]


def _loras_by_content(config: dict) -> dict:
    """The config with model.loras as what names the images: each file's sha256 and scale, in no order (an id is
    where the file was found, which a moved project or an older run recorded otherwise)."""
    loras = (config.get("model") or {}).get("loras")
    if not loras:
        return config
    return {**config, "model": {**config["model"], "loras": loras_by_content(loras)}}


def _image_effect(key: str, old_config: dict, new_config: dict) -> str:
    """What a change of `key` does to the images: "none", "rounding" or "changes"."""
    placed = any(config.get("execution", {}).get("placement", "none") != "none" for config in (old_config, new_config))
    if key in _CHIP_KEYS and placed:
        return "rounding"  # placement: auto decides from the chip's memory where each component goes
    if _under(key, _NOT_IMAGE_KEYS):
        return "none"
    return "rounding" if _under(key, _ROUNDING_KEYS) else "changes"


def image_changing_differences(old_config: dict, new_config: dict) -> list[str]:
    """The dotted keys whose values differ between two configs in a way that changes images (more than by
    rounding)."""
    return [
        key
        for key, _, _ in changed_keys(old_config, new_config)
        if _image_effect(key, old_config, new_config) == "changes"
    ]


def rounding_differences(old_config: dict, new_config: dict) -> list[str]:
    """`key (old -> new)` for each key that differs in a way that changes pixels by rounding only (another device
    count, graph or placement of the same computation)."""
    return [
        f"{key} ({old} -> {new})"
        for key, old, new in changed_keys(old_config, new_config)
        if _image_effect(key, old_config, new_config) == "rounding"
    ]


def differences(run: ResolvedRun, old_config: dict, old_prompts: list[dict]) -> list[str]:
    """The keys in which `run` would make other images than the recorded config and prompts made."""
    differing = image_changing_differences(old_config, _config_data(run))
    # Prompts count by their content, wherever they came from (an inline list or a file).
    if old_prompts != _prompts_data(run.prompts) and "prompts" not in differing:
        differing.append("prompts" if run.config.prompts is not None else "prompts_file (its prompts)")
    return differing


def check_resumable(run: ResolvedRun, run_dir: Path) -> str | None:
    """Refuse, naming what changed, a resume whose work would differ from what made the run's images; the
    warning for one whose images would differ by rounding only, or None."""
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
    differing = differences(run, old_config, old_prompts)
    if differing:
        raise InputError(
            f"--resume: the config differs from the run in {run_dir} in keys that change images: "
            + ", ".join(differing)
        )
    if record is None:
        path = run_dir / MANIFEST
        made_by = {r.get("config_hash") for r in (read_manifest(path) if path.exists() else [])}
        made_by -= {None, run.config_hash, previous.config_hash}
        if made_by:
            raise InputError(
                f"--resume: the images in {run_dir} were made by config hash {', '.join(sorted(made_by))}, and "
                f"this config resolves to {run.config_hash} (was config.yaml or the prompts file edited?)"
            )
    rounding = rounding_differences(old_config, _config_data(run))
    if rounding:
        return (
            f"--resume: the config differs from the run in {run_dir} in {', '.join(rounding)}: the images made now "
            "may differ from those already made by rounding (about 1/255)"
        )
    return None


def as_recorded(run: ResolvedRun, run_dir: Path) -> ResolvedRun:
    """`run` with the config hash of the run in `run_dir` (run.json's), so that the images a resume makes carry
    the hash the run's first images carry, whatever key that changes no image (execution.chip, say) differs."""
    try:
        record = read_run_record(run_dir)
    except InputError:  # the owner of the session checked it; a rank elsewhere may not read it
        record = None
    if record is None or record["config_hash"] == run.config_hash:
        return run
    return replace(run, config_hash=record["config_hash"])


def prompts_file_edited(run: ResolvedRun, run_dir: Path) -> str | None:
    """The warning for a resume whose prompts file no longer holds the prompts the run goes on with (those it
    started with, from run.json), or None."""
    if run.config.prompts_file is None:
        return None
    problems: list[str] = []
    now = resolve_prompts(run.config.model_copy(deep=True), run_dir, None, problems)
    if not problems and _prompts_data(now) == _prompts_data(run.prompts):
        return None
    file = Path(run.config.prompts_file).expanduser()
    file = file if file.is_absolute() else run_dir / file
    what = (
        "changed since the run started; its edits are not used" if file.is_file() else "is gone since the run started"
    )
    return (
        f"prompts_file: {file} {what}: the run goes on with the {len(run.prompts)} prompts it started with (kept "
        f"in {RUN_RECORD})"
    )


def _manifest_paths(run_dir: Path) -> list[Path]:
    return [p for p in [run_dir / MANIFEST, *sorted(run_dir.glob("manifest.rank*.jsonl"))] if p.exists()]


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
