"""One device (and each pod worker's share): one engine, one run session."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.engine import Display, Engine, EngineSpec, StopSignals, Topology, worker_topology
from tpugen.engine.session import RunSession
from tpugen.outputs.report import RunReport, TimedPhase, persistent_cache_summary, write_report
from tpugen.outputs.run_dir import check_run_dir_free
from tpugen.plan import plan_run


@dataclass(frozen=True)
class Calibration:
    """What `tpugen calibrate` measured: MagCache's ratios for the model, from one call of the config's first
    batch, and what that call was (the ratios are the model's and the schedule's, not the prompt's)."""

    model: str
    steps: int
    height: int
    width: int
    scheduler: str
    mag_ratios: list[float]
    seconds: float


def calibrate(run: ResolvedRun, *, display: Display | None = None) -> Calibration:
    """`tpugen calibrate`: the config's first batch once, under diffusers' MagCache calibration."""
    display = display or Display()
    engine = Engine.open(EngineSpec.of(run), display=display)
    try:
        batch = plan_run(run).batches[0]
        if batch.hires is not None:  # the ratios are the first pass's steps: its img2img pass is not calibrated
            items = tuple(replace(item, hires=None) for item in batch.items)
            batch = replace(batch, shape=replace(batch.shape, hires=""), items=items)
        display.phase(f"calibrating MagCache: {batch.steps} steps of {batch.shape}")
        start = time.perf_counter()
        ratios = engine.calibrate_mag_ratios(batch, display)
        seconds = time.perf_counter() - start
        shape = batch.shape
        return Calibration(
            run.config.model.id, batch.steps, shape.height, shape.width, engine.scheduler_name, ratios, seconds
        )
    finally:
        engine.close()


def host_index_for(run: ResolvedRun):
    """How a pod worker without TPU_WORKER_ID finds its index: torch_xla's host index, on xla only."""
    if run.config.execution.backend != "xla":
        return None
    from tpugen.backends.xla.devices import host_index

    return host_index


def _engine_for(run: ResolvedRun, engine: Engine | None, display: Display) -> Engine:
    """The engine `run` uses: a new one, or the one given with the run's LoRAs fused (a switch compiles nothing)."""
    if engine is None:
        return Engine.open(EngineSpec.of(run), display=display)
    if engine.use_loras(run.loras)["tensors"]:
        display.phase(f"LoRAs switched: {', '.join(lora.name for lora in run.loras) or 'none'}")
    return engine


def run_single(
    run: ResolvedRun,
    *,
    display: Display | None = None,
    skip_warmup: bool = False,
    resume_dir: Path | None = None,
    engine: Engine | None = None,
    topology: Topology | None = None,
    stop: StopSignals | None = None,
    run_id: str | None = None,
) -> RunReport:
    """`tpugen generate` on one device: returns the report, also written to the run directory.

    The run directory is created only once the model has loaded, so a bad model id leaves nothing behind;
    from then on a failure or a signal still leaves every finished image, the manifest and a report marked
    incomplete. With `resume_dir`, images already finished there are kept and only the rest are made. With
    `engine` (already open for this run's model and way of running), nothing is loaded and shape keys it
    has compiled are not compiled again. `stop.request(signum)` from another thread stops the run after the
    batch in flight, as a signal does. `run_id` names a new run's directory (None: output.run_id, else
    a timestamp and the config hash).
    """
    display = display or Display()
    # On a pod, this worker takes the images whose index % workers == its index.
    topology = topology or worker_topology(run.config.execution.pod, os.environ, host_index_for(run))
    session = None
    if resume_dir is not None:
        session = RunSession.resume(run, resume_dir)
        for problem in session.problems:
            display.warning(problem)
        full_plan, plan = session.share(topology.parts, topology.part)
        done = session.already_complete(len(full_plan.items))
        if done is not None:
            return done
    elif run_id or run.config.output.run_id:  # refused now, not after the model has loaded (minutes on a TPU)
        check_run_dir_free(run.config.output.dir, run_id or run.config.output.run_id)

    def stopping(signum: int) -> None:
        display.phase(f"{signal.Signals(signum).name}: stopping after the batch in flight (again: stop now)")

    # A caller that owns the signals (a server running this run in a thread) passes its own StopSignals.
    with stop or StopSignals(on_signal=stopping) as stop:
        engine = _engine_for(run, engine, display)
        if session is None:
            session = RunSession.create(run, run_id)
            full_plan, plan = session.share(topology.parts, topology.part)
        else:
            display.phase(f"resuming {session.run_dir}: {len(session.finished)} of {len(full_plan.items)} images done")
        warmup: list[dict] = []
        phase = TimedPhase()
        writer = session.writer(engine)

        def report(error: str | None = None) -> RunReport:
            return session.report(engine, full_plan, warmup, phase, topology, error)

        try:
            if not skip_warmup:
                warmup.extend(engine.warmup(plan, display, stop.check))
            engine.run(
                plan,
                writer,
                display=display,
                checkpoint=stop.check,
                strict_shapes=run.config.execution.strict_shapes,
                phase=phase,
                loras=run.loras,
            )
            stop.check()
        except BaseException as exc:
            writer.close()
            session.fail(exc, len(phase.written), lambda error: write_report(session.run_dir, report(error)), stop)
        writer.close()
        return session.finish(report())


def warm_up(run: ResolvedRun, *, display: Display | None = None, engine: Engine | None = None) -> dict:
    """`tpugen warmup`: compile every planned shape key once; writes no run directory."""
    display = display or Display()
    engine = _engine_for(run, engine, display)
    results = engine.warmup(plan_run(run), display)
    return {
        "device": engine.describe(),
        "model_load_seconds": engine.load_seconds,
        "warmup": results,
        "persistent_cache": persistent_cache_summary(engine.backend.cache, results),
    }
