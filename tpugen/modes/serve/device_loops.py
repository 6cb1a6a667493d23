"""One device loop per engine: each takes batches from the one queue and makes them on its engine; a batch's
failure fails its requests, never the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from tpugen.config.schema import StepCacheConfig
from tpugen.engine import Engine
from tpugen.engine.step_cache import warm_steps
from tpugen.errors import InputError, RunError, one_line
from tpugen.logs import logger
from tpugen.modes.serve.metrics import Metrics
from tpugen.modes.serve.progress import Jobs
from tpugen.modes.serve.queue import BatchQueue, ImageJob
from tpugen.plan import Batch, RunPlan

log = logger("serve")


class DeviceLoops:
    """The threads that feed the server's engines, one each, and what they count: batch numbers, and the batches
    failed in a row on each engine (serve.max_failed_batches of them mean its device is broken: `break_down`)."""

    def __init__(
        self,
        queue: BatchQueue,
        metrics: Metrics,
        progress: Jobs,
        *,
        batch_size: int,
        step_cache: StepCacheConfig,
        max_failed_batches: int,
        break_down: Callable[[str], None],
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        self.progress = progress
        self.batch_size = batch_size
        self.step_cache = step_cache
        self.max_failed_batches = max_failed_batches
        self.break_down = break_down  # the server cannot serve: tpugen.modes.serve.service.Service.break_down
        self._engines: list[Engine] = []
        self._threads: list[threading.Thread] = []
        self._batches = 0
        self._failed_in_a_row: dict[int, int] = {}  # id(engine) -> batches failed since its last good one
        self._count_lock = threading.Lock()
        self.compiles = CompileLedger()

    def start(self, engines: list[Engine]) -> None:
        """A device loop for each of `engines`, started."""
        self._engines = list(engines)
        if len(self._engines) > 1:
            # Engines in one process (mode multi): the device's time per step is not measured (StepClock), and
            # /metrics says so.
            self.metrics.device_ms_per_step.set(float("nan"))
        for number, engine in enumerate(self._engines):
            # Daemon threads: a second signal ends the process under a batch in flight (stop() joins them).
            loop = threading.Thread(target=self._loop, args=(engine,), name=f"tpugen-device-{number}", daemon=True)
            loop.start()
            self._threads.append(loop)

    def join(self) -> None:
        """Until every loop has returned (the queue is closed: each returns after its batch)."""
        for loop in self._threads:
            loop.join()

    def _loop(self, engine: Engine) -> None:
        try:
            engine.backend.bind_thread()
            while True:
                taken = self.queue.take(timeout=0.25)
                if taken is None:
                    if self.queue.closed:
                        return
                    continue
                _, jobs = taken
                self.run_batch(engine, [job for job in jobs if not job.request.done])
        except BaseException as exc:  # the loop is gone, and no other thread makes this engine's batches
            self.metrics.device_failures.inc()
            self.break_down(f"device loop {self._number(engine)} died: {one_line(exc)}")

    def _number(self, engine: Engine) -> int:
        return next((i for i, e in enumerate(self._engines) if e is engine), 0)

    def _batch_failed(self, engine: Engine, exc: Exception) -> None:
        """A batch that failed through no fault of its requests: counted, and serve.max_failed_batches of them
        in a row on one engine mean its device is broken."""
        self.metrics.device_failures.inc()
        with self._count_lock:
            failed = self._failed_in_a_row.get(id(engine), 0) + 1
            self._failed_in_a_row[id(engine)] = failed
        limit = self.max_failed_batches
        if failed >= limit:
            self.break_down(
                f"{failed} batches in a row failed on engine {self._number(engine)} (serve.max_failed_batches: "
                f"{limit}); the last: {one_line(exc)}"
            )

    def _step_reporter(self, jobs: list[ImageJob]):
        """What tells each request of a batch which step its images are at."""
        requests: dict[int, list] = {}
        for job in jobs:
            requests.setdefault(id(job.request), [job.request, 0])[1] += 1

        def stepped(step: int) -> None:
            for request, count in requests.values():
                if request.job is not None:
                    self.progress.stepped(request.job, step, count)

        return stepped

    def run_batch(self, engine: Engine, jobs: list[ImageJob]) -> None:
        """One batch of jobs of one key made on `engine`: each image delivered to its request, or the batch's
        failure."""
        if not jobs:
            return
        work = jobs[0].work  # what the call shares (ImageWork.call_key)
        with self._count_lock:
            number = self._batches
            self._batches += 1
        items = tuple(job.work_item(i) for i, job in enumerate(jobs))
        shape = work.shape(self.batch_size)
        batch = Batch(number=number, shape=shape, items=items, padding=self.batch_size - len(items))
        cold, window = False, None
        try:
            # Every graph compiled here is one after warmup: a new shape (serve.new_shapes: compile; reject
            # refused it at the door) or, if a count shows up for a warm one, a shape planning missed.
            window = self.compiles.open(engine.backend)
            cold = not engine.is_warm(batch.shape, work.scheduler, work.steps)
            if cold:
                log.info(f"compiling {batch.shape} for a request (serve.new_shapes: compile)")
                compile_start = time.perf_counter()
                # Under a step cache, at the steps that compile its every kind of step: compiled once for
                # requests of any steps, not again for each step count that brings a new kind.
                steps = warm_steps(self.step_cache, work.steps, per_count=engine.per_step_count)
                warm_items = tuple(replace(item, steps=steps) for item in items)
                engine.warmup(RunPlan(warm_items, (replace(batch, items=warm_items),)), scheduler=work.scheduler)
                log.info(f"compiled {batch.shape} in {time.perf_counter() - compile_start:.1f} s")
            start = time.perf_counter()
            pixels = engine.generate(
                batch, scheduler=work.scheduler, loras=work.loras, on_step=self._step_reporter(jobs)
            )
            seconds = time.perf_counter() - start
            window, new = None, self.compiles.close(window, engine.backend)
        except BaseException as exc:  # a request's failure never stops the loop
            self.compiles.close(window)
            log.error(f"batch {number} failed: {one_line(exc)}")
            for job in jobs:
                job.request.fail(exc)
            if not isinstance(exc, Exception):
                raise  # SystemExit and the like end the loop, which the watchdog hears of
            if counts_against_the_device(exc, cold_shape=cold):
                self._batch_failed(engine, exc)
            return
        self._failed_in_a_row[id(engine)] = 0
        # Counted before the images are handed over: a client that reads /metrics after its answer sees its batch.
        if new:
            self.metrics.compiles_after_warmup.inc(new)
        self.metrics.batch(seconds, len(jobs), batch.padding, engine.step_timing)
        # Counted before the images are handed over too: a request's progress says done by the time it answers.
        made: dict[int, list] = {}
        for job in jobs:
            made.setdefault(id(job.request), [job.request, 0])[1] += 1
        for request, count in made.values():
            if request.job is not None:
                self.progress.advance(request.job, count)
        for job, image in zip(jobs, pixels, strict=True):
            job.request.deliver(job.position, image)
        names = ", ".join(request.job.name if request.job is not None else "-" for request, _ in made.values())
        log.info(
            f"batch {number}: {batch.shape}, {len(jobs)} images (+{batch.padding} padding), "
            f"{seconds:.2f} s, {self.queue.depth()} images waiting; requests {names}"
        )


class CompileLedger:
    """The compiles the server's batches saw, each counted once. A batch reads the backend's compile count as it
    starts and ends (a window); where a server runs an engine per device in one process (mode multi), torch_xla
    keeps one count for the process, the engines' windows overlap, and a compile falls in each window open at
    the time: only the part of a closing window no other window counted yet is new. With one engine the windows
    never overlap, and a window's new compiles are its end's count less its start's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}  # the windows of batches in flight: their number -> the count at the start
        self._counted: list[tuple[int, int]] = []  # spans of the count already counted, disjoint, in order
        self._windows = 0

    def open(self, backend) -> int | None:
        """A batch starts on `backend`: its window (None where the backend counts no compiles). The count is read
        under the lock, so that no window closes between the reading and the opening."""
        with self._lock:
            counters = backend.counters()
            if counters is None:
                return None
            self._windows += 1
            self._open[self._windows] = counters.compiles
            return self._windows

    def close(self, window: int | None, backend=None) -> int:
        """The batch of `window` ended on `backend` (None: it failed, and adds nothing itself): the compiles in
        its window that no other window counted."""
        if window is None:
            return 0
        with self._lock:
            start = self._open.pop(window, None)  # first: a reading that raises leaves no window open
            if start is None:  # closed already (its reading raised, and the batch failed)
                return 0
            counters = backend.counters() if backend is not None else None
            count = counters.compiles if counters is not None else None
            if count is None or count <= start:
                new = 0
            else:
                new = count - start - sum(max(0, min(end, count) - max(begin, start)) for begin, end in self._counted)
                self._counted = _merged([*self._counted, (start, count)])
            # A window opens at the count of its time or later: spans below every open window's start are done.
            floor = min(self._open.values(), default=None)
            self._counted = [] if floor is None else [span for span in self._counted if span[1] > floor]
            return new


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def counts_against_the_device(exc: BaseException, *, cold_shape: bool) -> bool:
    """Whether a failed batch says the device or its runtime is broken, which a restart may cure: what the
    runtime raises (RuntimeError: XLA's INTERNAL or UNAVAILABLE, out of memory) or tpugen's RunError, for a
    shape that warmed up fine. Not a request's own doing, which a restart would meet again: its bad input found
    only in its batch (InputError); a shape compiled for it (serve.new_shapes: compile), since a size that does
    not fit must fail its own requests, not the server; a Python error of the pipeline's code for its values
    (diffusers' DDIM at 1000 steps raises IndexError)."""
    if cold_shape or isinstance(exc, InputError):
        return False
    return isinstance(exc, (RuntimeError, RunError, MemoryError))
