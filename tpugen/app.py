"""What each command does, above the modes: which mode runs, and the backend's environment for every command."""

from __future__ import annotations

import os
from pathlib import Path

from tpugen.backends import backend_environment
from tpugen.config import ResolvedRun
from tpugen.engine import Display
from tpugen.errors import InputError
from tpugen.memory import config_fit, how_it_runs, memory_plan_for
from tpugen.plan import RunPlan, plan_run


def prepare_environment(run: ResolvedRun) -> None:
    """Variables a backend reads when torch is imported (TORCH_TPU_DEFER_AND_FUSE), set before anything in
    this process imports torch: every command that runs a model calls this first, and the report records it."""
    os.environ.update(backend_environment(run.config.execution))


def generate(
    run: ResolvedRun, *, display: Display | None = None, skip_warmup: bool = False, resume_dir: Path | None = None
) -> dict:
    """`tpugen generate`: the config's way of running: one chip, all chips of the VM, or a Ray cluster."""
    if run.config.execution.mode == "ray":
        from tpugen.modes.cluster import run_cluster

        prepare_environment(run)
        return run_cluster(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)
    if run.config.output.dir.startswith("gs://"):
        raise InputError(
            "output.dir: gs:// destinations are written by tpugen pod-run's workers; give a local directory"
        )
    prepare_environment(run)
    if run.config.execution.mode == "multi":
        from tpugen.modes.multi import run_multi

        return run_multi(run, display=display, resume_dir=resume_dir)
    from tpugen.modes.single import run_single

    return run_single(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)


def resume(run_dir: Path, *, display: Display | None = None) -> dict:
    """`tpugen resume RUN_DIR`: the run's own config and prompts, its finished images kept."""
    from tpugen.engine.session import load_run

    return generate(load_run(run_dir), display=display, resume_dir=run_dir)


def warmup(run: ResolvedRun, *, display: Display | None = None) -> dict:
    """`tpugen warmup`: every shape key compiled once, no run directory."""
    prepare_environment(run)
    from tpugen.modes.single import warm_up

    return warm_up(run, display=display)


def plan(run: ResolvedRun) -> tuple[RunPlan, object, str, str | None]:
    """`tpugen plan`: (the run as batches, the memory plan or None, how the config runs, whether that fits).
    Loads no weights and starts no device."""
    execution = run.config.execution
    memory = memory_plan_for(
        run.model_source, run.config.model, execution.chip, execution.chip_memory_gb, device_free=True
    )
    fit = config_fit(memory, execution, run.config.model.id) if memory else None
    return plan_run(run), memory, how_it_runs(execution), fit


def cluster_plan(run: ResolvedRun) -> list[str]:
    """`tpugen plan` of a ray run: the workers and resources it would ask the cluster for (connects to nothing)."""
    if run.config.execution.mode != "ray":
        return []
    from tpugen.modes.cluster import plan_lines

    return plan_lines(run)


def pod_run(run: ResolvedRun, pod, **options) -> dict | None:
    """`tpugen pod-run`: every worker of a pod slice through gcloud, gathered and merged."""
    from tpugen.modes.pod import run_pod

    return run_pod(run, pod, **options)
