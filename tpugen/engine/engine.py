"""The engine: a loaded, warmed pipeline on its backend, that any number of runs use."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpugen.backends import make_backend
from tpugen.config import CacheConfig, CompileConfig, ExecutionConfig, ModelConfig, ResolvedRun
from tpugen.engine.pipeline import LoadedPipeline, read_shared
from tpugen.errors import InputError, RunError
from tpugen.families import family_code
from tpugen.memory import fit_problem, is_out_of_memory, memory_plan_for, out_of_memory_advice
from tpugen.models import ModelSource
from tpugen.outputs.report import TimedPhase
from tpugen.plan import Batch, RunPlan


class Display:
    """What the engine and the modes tell the user as they go; the CLI shows it with rich, tests keep it quiet."""

    def phase(self, text: str) -> None: ...

    def batches_started(self, total: int) -> None: ...

    def batch_done(self, batch: Batch, seconds: float) -> None: ...

    def progress(self, done: int, total: int, across: str = "all ranks") -> None:
        """Images done over every part of the run (`across`: all ranks, all workers), as its parent counts them."""

    def finished(self) -> None: ...

    def warning(self, text: str) -> None:
        """Something the user should know even under --quiet (a damaged manifest line, say)."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is opened from: a config's model, execution, compile and cache sections (not its
    prompts, sizes or outputs). Two runs whose specs are equal can share one engine."""

    model: ModelConfig
    execution: ExecutionConfig
    compile: CompileConfig
    cache: CacheConfig
    source: ModelSource
    family: str
    batch_size: int  # only for the out-of-memory advice

    @classmethod
    def of(cls, run: ResolvedRun) -> EngineSpec:
        c = run.config
        return cls(c.model, c.execution, c.compile, c.cache, run.model_source, run.family, c.batch_size)

    def key(self) -> str:
        """Equal for two runs that can share this engine."""
        sections = (self.model, self.execution.model_copy(update={"strict_shapes": False}), self.compile, self.cache)
        return "|".join(s.model_dump_json() for s in sections)


Checkpoint = Callable[[], None]


def _no_checkpoint() -> None:
    """Nothing asks the work to stop."""


class Engine:
    """A pipeline loaded once onto its backend. It knows which shape keys it has compiled: `warmup` compiles
    only the ones it lacks, and `run` executes any plan's batches into a run session."""

    def __init__(self, spec: EngineSpec, backend, loaded: LoadedPipeline, load_seconds: float, memory) -> None:
        self.spec = spec
        self.backend = backend
        self.loaded = loaded
        self.load_seconds = load_seconds
        self.memory = memory  # the memory plan (tpugen.memory.MemoryPlan) where the model's size is known
        self.warm: dict[tuple[str, str], dict] = {}  # (shape key, scheduler) -> its warmup entry

    # ---------------------------------------------------------------- opening

    @classmethod
    def open(cls, spec: EngineSpec, *, display: Display | None = None, ranks_in_process: int = 1) -> Engine:
        """The backend (with its compile cache started) and the pipeline on it."""
        display = display or Display()
        execution = spec.execution
        backend = make_backend(execution, spec.compile, spec.cache)
        memory = _memory_plan(spec)
        _check_fit(spec, backend, memory)
        family = family_code(spec.family)
        if execution.placement != "none":
            _assign_components(spec, backend, memory, family.denoiser)

        display.phase(f"loading {spec.model.id} onto {backend.name}")
        start = time.perf_counter()
        pipe, label, scheduler_name = read_shared(spec.model, spec.source, family, ranks_in_process=ranks_in_process)
        pipe.set_progress_bar_config(disable=True)
        backend.prepare_on_host(pipe, family, spec.compile)
        offload = execution.offload == "model"
        advice = out_of_memory_advice(execution, spec.batch_size, spec.model.dtype)
        try:
            backend.place(pipe, offload=offload, family=family)
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            raise RunError(
                f"out of memory on the device while {backend.placing or 'the model'} moved onto it: {advice}"
            ) from exc
        loaded = LoadedPipeline(pipe, backend, family, label, scheduler_name)
        backend.prepare_on_device(pipe, family, spec.compile, loaded.hooks)
        loaded.out_of_memory_advice = advice
        backend.wait()
        return cls(spec, backend, loaded, time.perf_counter() - start, memory)

    def accepts(self, run: ResolvedRun) -> bool:
        """Whether `run` can use this engine as it is (same model, way of running, compile and cache)."""
        return EngineSpec.of(run).key() == self.spec.key()

    @property
    def scheduler_name(self) -> str:
        return self.loaded.scheduler_name

    @property
    def model_label(self) -> str:
        return self.loaded.model_label

    def describe(self) -> dict:
        return self.backend.describe()

    def close(self) -> None:
        """Take the patches off the pipeline and let it go (its device memory is freed with it)."""
        self.loaded.hooks.remove_all()
        self.loaded = None

    # ---------------------------------------------------------------- compiling

    def warmup(self, plan: RunPlan, display: Display | None = None, checkpoint: Checkpoint = _no_checkpoint):
        """One full pipeline call per shape key this engine has not compiled yet, at the plan's step count:
        its wall time is the compile time. Keys already warm are listed as such and cost nothing."""
        display = display or Display()
        first_batch: dict = {}
        for batch in plan.batches:
            first_batch.setdefault(batch.shape, batch)
        results = []
        for shape, batch in first_batch.items():
            key = (str(shape), self.scheduler_name)
            if key in self.warm:
                results.append(
                    {
                        **_shape_fields(shape),
                        "already_warm": True,
                        "seconds": 0.0,
                        "compiles": 0,
                        "compile_seconds": 0.0,
                        "graphs_per_phase": None,
                        "compile_seconds_per_phase": None,
                        "device_memory_per_phase": None,
                        "persistent_cache_hits": 0,
                        "persistent_cache_misses": 0,
                        "persistent_cache_load_failures": 0,
                    }
                )
                continue
            checkpoint()
            display.phase(f"warmup: compiling {shape} (on a TPU the first compile can take many minutes)")
            before = self.backend.counters()
            start = time.perf_counter()
            _, census = self.loaded.generate(batch, census=True)
            self.backend.wait()
            seconds = time.perf_counter() - start
            delta = _delta(self.backend, before)
            entry = {
                **_shape_fields(shape),
                "seconds": seconds,
                "compiles": delta.compiles if delta else None,
                "compile_seconds": delta.compile_seconds if delta else None,
                "graphs_per_phase": census["graphs"] if census else None,
                "compile_seconds_per_phase": census["compile_seconds"] if census else None,
                "device_memory_per_phase": dict(self.loaded.phase_memory) or None,
                "persistent_cache_hits": delta.persistent_cache_hits if delta else None,
                "persistent_cache_misses": delta.persistent_cache_misses if delta else None,
                "persistent_cache_load_failures": delta.persistent_cache_load_failures if delta else None,
            }
            self.warm[key] = entry
            results.append(entry)
        return results

    # ---------------------------------------------------------------- the timed phase

    def run(
        self,
        plan: RunPlan,
        write_batch: Callable[[Batch, list, float], list],
        *,
        display: Display | None = None,
        checkpoint: Checkpoint = _no_checkpoint,
        strict_shapes: bool = False,
        phase: TimedPhase | None = None,
    ) -> TimedPhase:
        """The timed phase: each batch generated, then handed to `write_batch(batch, pixels, seconds)`, which
        writes its images and returns their names. Strict shapes: a batch that compiles stops the run. The
        phase's figures are in `phase` whatever happens, so a report can be written after a failure."""
        display = display or Display()
        phase = phase if phase is not None else TimedPhase()
        backend = self.backend
        phase_before = backend.counters()
        phase_start = time.perf_counter()
        display.batches_started(len(plan.batches))
        try:
            for batch in plan.batches:
                checkpoint()
                before = backend.counters()
                start = time.perf_counter()
                pixels = self.loaded.generate(batch)
                backend.wait()  # the clock is read only after the device has finished
                seconds = time.perf_counter() - start
                delta = _delta(backend, before)
                phase.generate_seconds += seconds
                if delta and delta.compiles:
                    phase.recompiles.append(
                        {"batch": batch.number, "shape_key": str(batch.shape), "compiles": delta.compiles}
                    )
                    if strict_shapes:
                        raise RunError(
                            f"strict shapes: batch {batch.number} ({batch.shape}) compiled {delta.compiles} "
                            "graphs after warmup; its images were not written"
                        )
                start = time.perf_counter()
                names = write_batch(batch, pixels, seconds)
                phase.written.extend(names)
                phase.write_seconds += time.perf_counter() - start
                phase.batches.append(
                    {
                        "batch": batch.number,
                        "shape_key": str(batch.shape),
                        "images": len(names),
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
            display.finished()
            phase.wall_seconds = time.perf_counter() - phase_start
            counters = _delta(backend, phase_before)
            phase.counters = counters.as_dict() if counters else None
        return phase

    def generate(self, batch: Batch, scheduler: str | None = None) -> list:
        """One batch's pixels, outside any run (a server's requests): uint8 HxWx3 arrays of its real rows."""
        self.loaded.use_scheduler(scheduler)
        return self.loaded.generate(batch)


def _shape_fields(shape) -> dict:
    return {
        "shape_key": str(shape),
        "height": shape.height,
        "width": shape.width,
        "batch_size": shape.batch_size,
        "cfg": shape.cfg,
    }


def _delta(backend, before):
    after = backend.counters()
    return after - before if after is not None and before is not None else None


def _memory_plan(spec: EngineSpec):
    """The memory plan for the chip kind the config names; a model tpugen cannot size has none."""
    execution = spec.execution
    try:
        return memory_plan_for(spec.source, spec.model, execution.chip, execution.chip_memory_gb)
    except Exception:  # informational, and for the fit check; a model tpugen cannot size is not refused for that
        return None


def _check_fit(spec: EngineSpec, backend, memory) -> None:
    """Refuse, before any weights load, a model that cannot fit the chips the way the config runs it.

    Only where the chip is known: on a TPU, or when the config names the chip (execution.chip or
    chip_memory_gb); elsewhere (XLA:CPU, GPUs) the chip in the config is a planning assumption only.
    """
    execution = spec.execution
    named = {"chip", "chip_memory_gb"} & execution.model_fields_set
    if backend.name not in ("xla", "torch_tpu") or not (named or os.environ.get("PJRT_DEVICE", "").upper() == "TPU"):
        return
    if execution.placement != "none" or memory is None:
        return  # the placement itself is checked chip by chip
    devices = backend.device_count if execution.sharding == "spmd" else 1
    problem = fit_problem(memory, execution, devices, spec.model.id)
    if problem:
        hint = "" if named else f" (if these chips are not {execution.chip}, set execution.chip)"
        raise InputError(problem + hint)


def _assign_components(spec: EngineSpec, backend, memory, denoiser: str) -> None:
    """execution.placement, decided from the component sizes on disk before any weights load."""
    from tpugen.placement import assign_components

    execution = spec.execution
    if memory is None:
        raise InputError(
            f"execution.placement: the component sizes of {spec.model.id} are not known without its files; "
            "download it first (its safetensors headers give the sizes)"
        )
    sizes = {c.name: c.bytes for c in memory.components}
    explicit = execution.placement if isinstance(execution.placement, dict) else None
    backend.assign(assign_components(sizes, backend.capacities(memory.chip_gb * 1e9), explicit), denoiser)
