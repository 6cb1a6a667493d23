"""What the server does behind its HTTP routes: warm engines, one device loop per engine, runs on them. The
Service is the one object the routes call; it starts, warms, drains and stops the server, and hands requests to
its admission (admission.py), batches to its device loops (device_loops.py) and runs to its runs (runs.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.config.loras import Lora
from tpugen.engine import Display, Engine
from tpugen.errors import InputError, RunError, one_line
from tpugen.families import FAMILIES
from tpugen.logs import logger
from tpugen.modes.serve.admission import Admission
from tpugen.modes.serve.device_loops import DeviceLoops
from tpugen.modes.serve.input_images import MIB, InputImages
from tpugen.modes.serve.lora_dir import lora_files, lora_named
from tpugen.modes.serve.metrics import Metrics
from tpugen.modes.serve.progress import Jobs
from tpugen.modes.serve.queue import BatchQueue
from tpugen.modes.serve.refusals import Conflict, NotReady, NotWarm, TimedOut, TooManyRuns
from tpugen.modes.serve.run_handles import RunHandle
from tpugen.modes.serve.runs import SentRuns
from tpugen.modes.serve.warm import WarmEngines
from tpugen.plan import ImageWork

# The facade the routes use: the service, and what its methods refuse work with (tpugen.modes.serve.refusals).
__all__ = ["Conflict", "NotReady", "NotWarm", "Service", "TimedOut", "TooManyRuns"]

log = logger("serve")


class Service:
    """Engines opened from the server's config (one per device under execution.mode: multi), warmed for
    serve.sizes x serve.schedulers, each fed batches from the one queue by a device loop of its own."""

    def __init__(
        self,
        run: ResolvedRun,
        engines: list[Engine],
        *,
        output_root: Path,
        display: Display,
        open_engines: Callable[[], list[Engine]] | None = None,
    ) -> None:
        """`engines` open already, or none and `open_engines`, which start() calls in its thread: the server
        answers HTTP while the model loads."""
        config = run.config
        self.run = run
        self._open_engines = open_engines
        self.display = display
        self.output_root = output_root
        self.family = FAMILIES[run.family]
        self.batch_size = config.batch_size
        self.serve = config.serve
        # The engines and what they keep warm; the sizes, CFG and samplers are the warm set's (the routes read them).
        # The images requests and runs send, kept while a run or a request may read them.
        self.inputs = InputImages(
            output_root,
            max_bytes=self.serve.max_input_mb * MIB,
            keep_s=self.serve.request_timeout_s + 60,
            held=lambda: self.sent_runs.input_paths(),
        )
        self.warm = WarmEngines(run, engines, inputs=self.inputs)
        self.sizes, self.cfg, self.schedulers = self.warm.sizes, self.warm.cfg, self.warm.schedulers
        self.queue = BatchQueue(self.batch_size, self.serve.batch_window_ms / 1000, self.serve.max_queue)
        self.metrics = Metrics()
        self.progress = Jobs()  # every request's and run's progress (tpugen.modes.serve.progress)
        # Read when /metrics is, so they are never a step behind the queue.
        self.metrics.queue_depth.set_function(self.queue.depth)
        self.metrics.requests_open.set_function(self.queue.open_count)
        self.state = "loading"  # loading, compiling, ready, draining, failed
        self.failure: str | None = None  # what /readyz says broke, once failed
        self.fatal: BaseException | None = None  # what tpugen serve exits with, once failed
        self.broken = threading.Event()  # set on failing: tpugen serve then exits 1 (server.py)
        self.abandoned = False  # a second signal: the process exits under the batches in flight
        self._state_lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self.admission = Admission(self.warm, self.queue, self.progress)
        self.device_loops = DeviceLoops(
            self.queue,
            self.metrics,
            self.progress,
            batch_size=self.batch_size,
            step_cache=config.compile.step_cache,
            max_failed_batches=self.serve.max_failed_batches,
            break_down=self.break_down,
        )
        self.sent_runs = SentRuns(self.warm, output_root=output_root, display=display, inputs=self.inputs)

    @property
    def engines(self) -> list[Engine]:
        """The server's engines: none until they are opened (start())."""
        return self.warm.engines

    @engines.setter
    def engines(self, engines: list[Engine]) -> None:
        self.warm.engines = engines

    @property
    def runs(self) -> dict[str, RunHandle]:
        """The runs queued or running, by id: an ended run is read from its directory."""
        return self.sent_runs.live

    # ---------------------------------------------------------------- start and stop

    def start(self) -> None:
        """In a thread: open the engines (unless they were given), warm every shape key and scheduler (the
        server answers meanwhile, /readyz 503 saying which), then start the device loops."""
        self._starter = threading.Thread(target=self._load_then_serve, name="tpugen-warmup", daemon=True)
        self._starter.start()

    def starting(self) -> bool:
        """Whether the engines are still loading or warming up (a signal then stops it between shape keys)."""
        return self._starter is not None and self._starter.is_alive()

    def _load_then_serve(self) -> None:
        try:
            if self._open_engines is not None:
                self.engines = self._open_engines()
            self._advance("compiling")
            self.warm.warm_up(self.display, lambda: self.state == "compiling")
        except BaseException as exc:
            what = "warmup" if self.engines else "loading the model"
            self.break_down(f"{what} failed: {one_line(exc)}", exc)
            return
        if self.state != "compiling":  # a signal came during warmup, or it failed: nothing to serve
            return
        self.device_loops.start(self.engines)
        self._advance("ready")
        devices = sum(engine.backend.device_count for engine in self.engines)
        log.info(f"ready, {len(self.engines)} device loop(s) on {devices} device(s), warm: {self.warm_summary()}")

    def _advance(self, state: str) -> None:
        """loading -> compiling -> ready; never over draining or failed."""
        with self._state_lock:
            if self.state in ("loading", "compiling"):
                self.state = state

    def warm_summary(self) -> str:
        return self.warm.summary()

    def readiness(self) -> dict:
        """What /readyz says: the state; while not ready, what the server is doing; once failed, why."""
        body: dict = {"status": self.state}
        engines = len(self.engines)
        if self.state == "loading":
            execution = self.run.config.execution
            per_device = execution.mode == "multi" and execution.backend == "xla"
            body["detail"] = f"loading {self.run.config.model.id}" + (" (an engine per device)" if per_device else "")
        elif self.state == "compiling":
            done, total = self.warm.progress()
            keys = f"{_count(len(self.sizes), 'size')} x {_count(len(self.schedulers), 'sampler')}"
            if len(self.serve.tasks) > 1:
                keys += f" x {_count(len(self.serve.tasks), 'task')}"
            body["detail"] = (
                f"compiling {min(done + 1, total)} of {total} shape keys ({keys} x {_count(engines, 'engine')})"
            )
        elif self.state == "draining":
            runs = self.sent_runs.open_count()
            requests = len(self.queue.open_requests())
            body["detail"] = f"draining: {_count(requests, 'request')} and {_count(runs, 'run')} in flight"
        if engines:
            body["warm"] = self.warm_summary()
        if self.failure:
            body["error"] = self.failure
        return body

    def begin_drain(self) -> None:
        """SIGTERM/SIGINT: refuse new work, stop runs after their batch in flight (resumable); requests in
        flight still get their images."""
        with self._state_lock:
            if self.state != "failed":
                self.state = "draining"
        self.sent_runs.stop_all()

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Until no request waits for images and no run is queued or running (each is bounded: a request by
        its timeout, a run by its batch in flight), or `timeout` seconds; whether it drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.queue.open_requests() or self.runs:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """After the last request: wait for the runs, then stop the device loops after their batch."""
        if self.abandoned:  # a second signal: the process exits under them
            return
        self.begin_drain()
        for thread in self.sent_runs.threads():
            thread.join()
        self.queue.close()
        self.device_loops.join()

    def abandon(self) -> None:
        """A second signal: stop at once. Requests still waiting are answered 503; batches in flight are
        abandoned with the process, and runs stay resumable (their manifests hold whole lines only)."""
        self.abandoned = True
        self.begin_drain()
        self._answer_waiting(NotReady("the server is stopping at once (a second signal)"))
        self.queue.close()

    def break_down(self, reason: str, cause: BaseException | None = None) -> None:
        """The server cannot serve (its model did not load or warm up, or its device is broken): /readyz 503
        with `reason`, the requests waiting answered 503 at once, runs stopped after their batch. `broken` is
        set: tpugen serve exits 1 once those are answered (server.py), raising `cause` (default: a RunError
        of `reason`)."""
        with self._state_lock:
            if self.state == "failed":
                return
            self.state, self.failure = "failed", reason
            self.fatal = cause if cause is not None else RunError(reason)
        log.error(reason)
        self._answer_waiting(NotReady(reason))
        self.sent_runs.stop_all()
        self.broken.set()

    def _answer_waiting(self, error: BaseException) -> None:
        for request in self.queue.open_requests():
            if not request.done:
                request.fail(error)

    def _refuse_unless_ready(self) -> None:
        """NotReady (503) unless the server is ready: warming up, draining or failed, it takes no new work."""
        if self.state != "ready":
            raise NotReady(self.failure or f"the server is {self.state}; try again shortly")

    # ---------------------------------------------------------------- images for requests

    def input_image(self, data: bytes, where: str) -> tuple[str, str]:
        """(path, sha256) of an image a request sent, written once under the output root by its content; an
        InputError naming `where` if it is no image tpugen can use."""
        return self.inputs.store(data, where)

    def references(self, sent: list[bytes], where: str, problems: list[str], *, mask: bool, resize_mode: int = 1):
        """A request's reference images (FLUX.2 edits by them), in the order sent, each stored by its content for
        the engine to fit to the size (`resize_mode`); None with every problem noted in `problems`: none sent, more
        than the model takes, a part that is no image, a mask (`mask`: one was sent), each named after `where`."""
        from tpugen.config.images import InputImage, References
        from tpugen.config.request import no_mask_for_references, too_many_references

        family = self.family
        if mask:
            problems.append(f"mask: {no_mask_for_references(family)}")
        if not sent:
            problems.append(f"{where}: give 1 to {family.max_references} images (PNG or JPEG), the references")
            return None
        if why := too_many_references(family, len(sent)):
            problems.append(f"{where}: {why}")
            return None
        names = [where] if len(sent) == 1 else [f"{where}[{n}]" for n in range(len(sent))]
        stored = []
        for data, name in zip(sent, names, strict=True):
            try:
                stored.append(InputImage(*self.input_image(data, name)))
            except InputError as exc:
                problems.extend(exc.lines)
        if problems:
            return None
        return References(tuple(stored), resize_mode)

    def image_works(self, count: int, make) -> list[ImageWork]:
        """`make(i)` for each of a request's `count` images, bounded by serve.max_images_per_request
        (Admission.image_works)."""
        return self.admission.image_works(count, make)

    def check(self, images: list[ImageWork], *, count: int | None = None) -> None:
        """Every problem with a request's images, one line each (Admission.check): InputError, or NotWarm."""
        self.admission.check(images, count=count)

    def generate(
        self, images: list[ImageWork], *, interruptible: bool = False, task: str | None = None
    ) -> list[tuple[int, object]]:
        """The images made for a request, once the server is ready (Admission.generate, which says the rest);
        NotReady (503) while it is not."""
        self._refuse_unless_ready()
        return self.admission.generate(images, interruptible=interruptible, task=task)

    def interrupt(self) -> int:
        """The web UI's interrupt: its open requests stop waiting for images not yet started and return the
        ones they have (OpenAI's and runs are not touched). Returns how many requests were interrupted."""
        return self.queue.interrupt()

    def lora_named(self, name: str, scale: float, where: str = "prompt") -> Lora:
        """The LoRA a request names (<lora:NAME:SCALE>): NAME.safetensors in serve.lora_dir, checked for this
        model's family; InputError (422) in one line otherwise."""
        return lora_named(
            self.serve.lora_dir, name, scale, family=self.run.family, model=self.run.config.model.id, where=where
        )

    def lora_files(self) -> list[Path]:
        return lora_files(self.serve.lora_dir)

    def embeddings(self) -> tuple[tuple, tuple]:
        """(the textual-inversion embeddings loaded, the files of serve.embeddings_dir skipped): none of either
        until the model has loaded."""
        if not self.engines:
            return (), ()
        return self.warm.embeddings(), self.warm.skipped_embeddings()

    # ---------------------------------------------------------------- runs

    def start_run(self, data: dict) -> RunHandle:
        """A run config sent by a client, checked, then run in a thread on the engine with the fewest runs;
        TooManyRuns past serve.max_runs queued or running."""
        self._refuse_unless_ready()
        return self.sent_runs.start(data)

    def find_run(self, run_id: str) -> RunHandle | None:
        """A run of this server: queued or running, else ended, read back from its run directory. None for an id
        no run can have (too long for a folder name, a path)."""
        return self.sent_runs.find(run_id)

    def list_runs(self, limit: int, after: str | None = None) -> tuple[list[RunHandle], str | None]:
        """(a page of `limit` of this server's runs, newest first, the id to ask for the next page after; None
        on the last page). `after`: the last id of the page before."""
        return self.sent_runs.page(limit, after)

    def stop_run(self, run_id: str) -> RunHandle | None:
        """Stop a queued or running run after its batch in flight (resumable); None if none is."""
        return self.sent_runs.stop(run_id)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
