"""One host of a ray run: its engine opened and warmed once per process, then batches made into the shared run
directory, their manifest records handed back (plain Python; tpugen.modes.ray.worker makes it a Ray actor)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from tpugen.backends import backend_environment
from tpugen.config import ResolvedRun
from tpugen.engine import Engine, EngineSpec, RunSession
from tpugen.outputs.report import TimedPhase
from tpugen.plan import Batch, RunPlan


class NotStarted(RuntimeError):
    """A batch reached a process whose engine is not open: Ray restarted this worker without the driver seeing it
    die (it died between batches), so it has to be started again before it takes work."""


def warmup_plan(plan: RunPlan) -> RunPlan:
    """The first batch of each shape key: all a worker needs to warm up for any batch of `plan`."""
    first: dict = {}
    for batch in plan.batches:
        first.setdefault(batch.shape, batch)
    return RunPlan((), tuple(first.values()))


class HostWorker:
    """The state a Ray actor keeps: the run, and once `start` has run, an engine warm for every shape key.

    Ray calls __init__ again in a restarted process (same arguments), which is why the engine is opened in
    `start`, which the driver calls on every process it meets: the driver times it, sees its errors as a
    worker that failed to start, and tells a restarted process from the old one by `incarnation`.
    """

    def __init__(self, run: ResolvedRun, index: int, warm: RunPlan | None) -> None:
        self.run = run
        self.index = index
        self.warm = warm  # None: --skip-warmup
        self.incarnation = uuid.uuid4().hex[:12]  # this process, among the restarts of this worker
        self.engine: Engine | None = None
        self.started: dict | None = None

    def hello(self) -> dict:
        """Where this worker runs, answered at once (before the engine opens), so workers.json has its pid."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "incarnation": self.incarnation}

    def start(self) -> dict:
        """Open the engine and warm every shape key the run needs; a second call in the same process costs
        nothing (`fresh` says which)."""
        if self.started is not None:
            return {**self.started, "fresh": False}
        from tpugen.backends import versions

        os.environ.update(backend_environment(self.run.config.execution, self.run.config.cache))  # before torch
        begin = time.perf_counter()
        engine = Engine.open(EngineSpec.of(self.run))
        warmup = engine.warmup(self.warm) if self.warm is not None else []
        self.engine = engine
        self.started = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "load_seconds": engine.load_seconds,
            "warmup": warmup,
            "start_seconds": time.perf_counter() - begin,
            "device": engine.describe(),
            "scheduler": engine.scheduler_name,
            "cache": engine.backend.cache,
            "memory": engine.memory.as_dict() if engine.memory else None,
            "versions": versions(),
        }
        return {**self.started, "fresh": True}

    def run_batch(self, batch: Batch, run_dir: str, done: frozenset[int]) -> dict:
        """Make one batch, write its images (atomically) into the run directory, and return their records for
        the driver's manifest. Images in `done` are on disk already (a resume) and are not written again."""
        if self.engine is None:
            raise NotStarted(f"worker {self.index} (pid {os.getpid()}) has no engine open")
        writer = RunSession.attach(self.run, Path(run_dir), done).image_writer(self.engine)
        records: list[dict] = []

        def write(b: Batch, pixels: list, seconds: float) -> list[str]:
            made = writer.write(b, pixels, seconds)
            records.extend(made)
            return [r["file"] for r in made]

        phase = TimedPhase()
        self.engine.run(
            RunPlan(batch.items, (batch,)), write, strict_shapes=self.run.config.execution.strict_shapes, phase=phase
        )
        return {
            "batch": batch.number,
            "incarnation": self.incarnation,
            "records": records,
            "row": phase.batches[0],
            "recompiles": phase.recompiles,
            "counters": phase.counters,
            "generate_seconds": phase.generate_seconds,
            "write_seconds": phase.write_seconds,
            "wall_seconds": phase.wall_seconds,
        }
