"""Ways of running: each only arranges engines and run sessions. `generate`'s ways (execution.mode) are one
interface, Mode, chosen from MODES; pod-run and the server are commands of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tpugen.errors import InputError
from tpugen.outputs.report import RunReport


class Mode(Protocol):
    """One way of making a run's images; `run` returns the run's report, also written to its run directory."""

    name: str  # execution.mode's value
    writes_gs: bool  # it writes a gs:// output.dir itself (else that is refused before it starts)

    def run(self, run, *, display, skip_warmup: bool, resume_dir: Path | None) -> RunReport: ...

    def plan_lines(self, run) -> list[str]:
        """What `tpugen plan` adds for this way of running (connecting to nothing)."""
        ...


class _OnThisMachine:
    """A way of running on this VM's own chips: nothing of its own to plan, no gs:// writer."""

    writes_gs = False

    def plan_lines(self, run) -> list[str]:
        return []


class Single(_OnThisMachine):
    """One chip (or, with SPMD or placement, one process driving every chip of the VM)."""

    name = "single"

    def run(self, run, *, display, skip_warmup: bool, resume_dir: Path | None) -> RunReport:
        from tpugen.modes.single import run_single

        return run_single(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)


class Multi(_OnThisMachine):
    """One replica per chip of the VM: torch_xla.launch on xla, torchrun on cpu, cuda and torch_tpu; on jax one
    process, one program over a data-parallel mesh of every device (each call's rows split over them)."""

    name = "multi"

    def run(self, run, *, display, skip_warmup: bool, resume_dir: Path | None) -> RunReport:
        if run.config.execution.backend == "jax":  # one process, one program over a mesh of every device
            from tpugen.modes.single import run_single

            return run_single(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)
        if skip_warmup:  # each rank compiles its own shapes before its timed phase, always
            raise InputError("--skip-warmup: execution.mode: multi warms every rank up first; leave it out")
        from tpugen.modes.multi import run_multi

        return run_multi(run, display=display, resume_dir=resume_dir)


class Ray:
    """Batches handed out over a Ray cluster's workers, each with an engine of its own."""

    name = "ray"
    writes_gs = True  # with google-cloud-storage, or refused in the driver's own words

    def plan_lines(self, run) -> list[str]:
        from tpugen.modes.ray import plan_lines

        return plan_lines(run)

    def run(self, run, *, display, skip_warmup: bool, resume_dir: Path | None) -> RunReport:
        from tpugen.modes.ray import run_cluster

        return run_cluster(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)


# execution.mode -> its way of running; a new mode is a class and a line here.
MODES: dict[str, Mode] = {mode.name: mode for mode in (Single(), Multi(), Ray())}


def mode_for(run) -> Mode:
    """The way of running the run's config names."""
    return MODES[run.config.execution.mode]
