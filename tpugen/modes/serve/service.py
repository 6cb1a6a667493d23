"""What the server does behind its HTTP routes: warm engines, one device loop per engine, runs on them."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tpugen.config import ResolvedRun, resolve, run_sizes
from tpugen.config.hires import HiresFix
from tpugen.config.images import ImageSource, image_problem
from tpugen.config.loras import Lora, is_hub_lora, loras_key, resolve_lora
from tpugen.config.prompts import planned_images
from tpugen.config.request import ImageRequest, RequestLimits
from tpugen.config.schema import (
    LORA_SCALE_MAX,
    LoraConfig,
    StepCacheConfig,
    is_safe_run_id,
    step_cache_options_text,
)
from tpugen.engine import Display, Engine, StopSignals, Topology
from tpugen.engine.session import RUN_RECORD, read_run_record, recorded_prompts, run_id_for
from tpugen.engine.step_cache import warm_steps
from tpugen.errors import InputError, Interrupted, RunError, TpugenError, one_line
from tpugen.families import FAMILIES
from tpugen.logs import logger
from tpugen.modes.serve.metrics import Metrics
from tpugen.modes.serve.progress import Jobs
from tpugen.modes.serve.queue import BatchKey, BatchQueue, ImageJob, Request
from tpugen.modes.serve.request_ids import TASK_ID, current_caller
from tpugen.outputs.files import atomic_write_bytes
from tpugen.plan import Batch, RunPlan, ShapeKey, WorkItem, hires_fix, image_count, plan_run
from tpugen.schedulers import find_scheduler

log = logger("serve")

COMPILED_MAX_SIDE = 2048  # serve.max_side's default under new_shapes: compile
LORA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._ -]{0,127}")  # a file stem in serve.lora_dir, no path


class NotReady(TpugenError):
    """The server is warming up or shutting down (503)."""


class NotWarm(InputError):
    """A request for a shape or scheduler the server has not compiled, under serve.new_shapes: reject (422)."""


class TimedOut(TpugenError):
    """A request that waited longer than serve.request_timeout_s (504)."""


class Conflict(InputError):
    """A run id that is taken (409)."""


class TooManyRuns(TpugenError):
    """serve.max_runs runs are queued or running already (429)."""


@dataclass(frozen=True)
class ImageSpec(ImageRequest):
    """One image a request asks for, in tpugen's words: what ImageRequest's rules check, and how it is made."""

    scheduler: str | None = None  # a name find_scheduler knows; None: the model's own
    loras: tuple = ()  # tpugen.config.loras.Lora, fused for this image (a request's <lora:NAME:SCALE>)
    source: ImageSource | None = None  # img2img and inpainting: the images it starts from
    hires: HiresFix | None = None  # hires fix (the web UI's enable_hr): a second pass at a larger size

    @property
    def steps_in_all(self) -> int:
        """The steps its batch runs: with a hires fix, its second pass's too."""
        return self.steps + (self.hires.steps if self.hires else 0)


@dataclass
class RunHandle:
    """A run sent to the server (POST /v1/runs): it runs on the warm engine in a thread of its own."""

    id: str
    run: ResolvedRun | None  # None: an ended run read back from its run directory (run_on_disk)
    run_dir: Path
    planned: int
    stop: StopSignals = field(default_factory=StopSignals)
    state: str = "queued"  # queued, running, complete, stopped, failed
    error: list[str] | None = None
    report: dict | None = None
    thread: threading.Thread | None = None
    engine: int = 0  # which of the server's engines runs it
    created: float = field(default_factory=time.time)


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
        self.engines = engines
        self._open_engines = open_engines
        self.display = display
        self.output_root = output_root
        self.family = FAMILIES[run.family]
        self.batch_size = config.batch_size
        self.serve = config.serve
        self.sizes = [tuple(s) for s in self.serve.sizes] if self.serve.sizes else list(run_sizes(config))
        self.cfg = self.family.uses_cfg(config.guidance_scale)
        self.schedulers = [None, *(find_scheduler(name).name for name in self.serve.schedulers)]
        # Under new_shapes: reject the warm sizes bound a request already (a 422 naming them).
        default_side = COMPILED_MAX_SIDE if self.serve.new_shapes == "compile" else None
        self.max_side = self.serve.max_side or default_side
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
        # Each (shape key, scheduler) warmup compiles, one at a time so /readyz can count them.
        plan = self.warm_plan()
        self._warm_keys = [(batch, scheduler) for scheduler in self.schedulers for batch in plan.batches]
        self.runs: dict[str, RunHandle] = {}  # queued or running only: an ended run is read from its directory
        self._ended_unwritten: OrderedDict[str, RunHandle] = OrderedDict()  # ended before their directory existed
        self._runs_lock = threading.Lock()
        self._batches = 0
        self._failed_in_a_row: dict[int, int] = {}  # id(engine) -> batches failed since its last good one
        self._count_lock = threading.Lock()
        self._loops: list[threading.Thread] = []
        self._starter: threading.Thread | None = None

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
            self._warm()
        except BaseException as exc:
            what = "warmup" if self.engines else "loading the model"
            self.break_down(f"{what} failed: {one_line(exc)}", exc)
            return
        if self.state != "compiling":  # a signal came during warmup, or it failed: nothing to serve
            return
        for number, engine in enumerate(self.engines):
            # Daemon threads: a second signal ends the process under a batch in flight (stop() joins them).
            loop = threading.Thread(
                target=self._device_loop, args=(engine,), name=f"tpugen-device-{number}", daemon=True
            )
            loop.start()
            self._loops.append(loop)
        self._advance("ready")
        log.info(f"ready, {len(self.engines)} device loop(s), warm: {self.warm_summary()}")

    def _advance(self, state: str) -> None:
        """loading -> compiling -> ready; never over draining or failed."""
        with self._count_lock:
            if self.state in ("loading", "compiling"):
                self.state = state

    def _warm(self) -> None:
        # One engine at a time: the first compiles, the others find its graphs in the process's cache.
        for engine in self.engines:
            engine.backend.bind_thread()
            # A flash attention fallback (once per engine) forgets every key warmed before it: a second
            # pass compiles those again without the kernel.
            for _ in range(2):
                for batch, scheduler in self._warm_keys:
                    if self.state != "compiling":
                        return
                    if not engine.is_warm(batch.shape, scheduler, batch.steps):
                        engine.warmup(RunPlan(batch.items, (batch,)), self.display, scheduler=scheduler)
                if all(engine.is_warm(batch.shape, scheduler, batch.steps) for batch, scheduler in self._warm_keys):
                    break

    def warm_plan(self) -> RunPlan:
        """One batch per warm size, at the config's guidance and steps, or under a step cache at the steps
        that compile every kind of step a request of any step count runs (`warm_steps`)."""
        config = self.run.config
        steps = warm_steps(config.compile.step_cache, config.steps)
        batches = []
        kinds = [(task, None) for task in self.serve.tasks]
        if config.hires is not None and "txt2img" in self.serve.tasks:  # the config's hires fix, for enable_hr
            kinds.append(("txt2img", hires_fix(config.hires, steps)))
        for task, hires in kinds:
            source = self._warm_source(task)
            for height, width in self.sizes:
                item = WorkItem(
                    0,
                    0,
                    "warmup",
                    "",
                    0,
                    steps,
                    config.guidance_scale,
                    height,
                    width,
                    self.cfg,
                    source=source,
                    hires=hires,
                )
                shape = ShapeKey(height, width, self.batch_size, self.cfg, task, hires.shape_label if hires else "")
                batches.append(Batch(len(batches), shape, (item,), self.batch_size - 1))
        return RunPlan(tuple(b.items[0] for b in batches), tuple(batches))

    def _warm_source(self, task: str) -> ImageSource | None:
        """The input images an img2img or inpaint warmup call starts from: mid grey, the mask's right half white
        (the graphs depend on the sizes alone, and each call fits its images to its size)."""
        if task == "txt2img":
            return None
        import io

        from PIL import Image

        def png(image) -> bytes:
            out = io.BytesIO()
            image.save(out, format="PNG")
            return out.getvalue()

        init = self.input_image(png(Image.new("RGB", (64, 64), (128, 128, 128))), "warmup")
        mask = None
        if task == "inpaint":
            half = Image.new("L", (64, 64), 0)
            half.paste(255, (32, 0, 64, 64))
            mask = self.input_image(png(half), "warmup")
        return ImageSource(init[0], init[1], 0.75, 0, *(mask or (None, None)))

    def _hires_warm(self, hires: HiresFix) -> bool:
        """Whether the server's config warms hires fix at this scale and upscaler (its steps are data)."""
        own = self.run.config.hires
        return own is not None and hires_fix(own, 1).shape_label == hires.shape_label

    def _hires_summary(self) -> str:
        own = self.run.config.hires
        if own is None:
            return "the server's config has no hires section"
        return f"the server's config warms hires x{own.scale:g} {own.upscaler}"

    def warm_summary(self) -> str:
        sizes = ", ".join(f"{w}x{h}" for h, w in self.sizes)
        names = ", ".join(s or self.engines[0].loaded.default_scheduler for s in self.schedulers)
        summary = f"sizes {sizes} (width x height; {'cfg' if self.cfg else 'no cfg'}, batch {self.batch_size}); samplers {names}"
        if self.serve.tasks != ["txt2img"]:
            summary += f"; tasks {', '.join(self.serve.tasks)}"
        if self.run.config.hires is not None and "txt2img" in self.serve.tasks:
            summary += f"; hires fix x{self.run.config.hires.scale:g} {self.run.config.hires.upscaler}"
        cache = self.run.config.compile.step_cache
        if cache.method != "none":
            # One per server: the hooks are on the loaded denoiser, so no request or run can switch it.
            options = step_cache_options_text(cache.options())
            summary += f"; step cache {cache.method} ({options}), the server's only one, warm for any steps"
        return summary

    def warm_progress(self) -> tuple[int, int]:
        """(shape keys x schedulers x engines compiled so far, how many there are to compile)."""
        engines = list(self.engines)
        done = sum(engine.is_warm(batch.shape, s, batch.steps) for engine in engines for batch, s in self._warm_keys)
        return done, len(self._warm_keys) * max(len(engines), 1)

    def readiness(self) -> dict:
        """What /readyz says: the state; while not ready, what the server is doing; once failed, why."""
        body: dict = {"status": self.state}
        engines = len(self.engines)
        if self.state == "loading":
            multi = self.run.config.execution.mode == "multi"
            body["detail"] = f"loading {self.run.config.model.id}" + (" (an engine per device)" if multi else "")
        elif self.state == "compiling":
            done, total = self.warm_progress()
            keys = f"{_count(len(self.sizes), 'size')} x {_count(len(self.schedulers), 'sampler')}"
            if len(self.serve.tasks) > 1:
                keys += f" x {_count(len(self.serve.tasks), 'task')}"
            body["detail"] = (
                f"compiling {min(done + 1, total)} of {total} shape keys ({keys} x {_count(engines, 'engine')})"
            )
        elif self.state == "draining":
            with self._runs_lock:
                runs = len(self.runs)
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
        with self._count_lock:
            if self.state != "failed":
                self.state = "draining"
        with self._runs_lock:
            for handle in self.runs.values():
                handle.stop.request(signal.SIGTERM)

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
        with self._runs_lock:
            threads = [handle.thread for handle in self.runs.values() if handle.thread is not None]
        for thread in threads:
            thread.join()
        self.queue.close()
        for loop in self._loops:
            loop.join()

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
        with self._count_lock:
            if self.state == "failed":
                return
            self.state, self.failure = "failed", reason
            self.fatal = cause if cause is not None else RunError(reason)
        log.error(reason)
        self._answer_waiting(NotReady(reason))
        with self._runs_lock:
            for handle in self.runs.values():
                handle.stop.request(signal.SIGTERM)
        self.broken.set()

    def _answer_waiting(self, error: BaseException) -> None:
        for request in self.queue.open_requests():
            if not request.done:
                request.fail(error)

    # ---------------------------------------------------------------- images for requests

    def key_for(self, image: ImageSpec) -> BatchKey:
        cfg = self.family.uses_cfg(image.guidance_scale)
        source = image.source
        return BatchKey(
            image.height,
            image.width,
            cfg,
            image.steps,
            image.guidance_scale,
            image.scheduler,
            loras_key(image.loras),
            source.task if source else "txt2img",
            source.strength if source else None,
            image.hires,
        )

    def input_image(self, data: bytes, where: str) -> tuple[str, str]:
        """(path, sha256) of an image a request sent, written once under the output root by its content; an
        InputError naming `where` if it is no image tpugen can use."""
        problem = image_problem(data)
        if problem:
            raise InputError(f"{where}: {problem}" if not problem.startswith("not") else f"{where}: is {problem}")
        digest = hashlib.sha256(data).hexdigest()
        path = self.output_root / ".inputs" / f"{digest}.img"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, data)
        return str(path), digest

    def image_specs(self, count: int, make) -> list[ImageSpec]:
        """`make(i)` for each of a request's `count` images. Past serve.max_images_per_request only the first
        and last are made, and refused with the count: a request for ten billion images costs two specs."""
        if count <= self.serve.max_images_per_request:
            return [make(i) for i in range(count)]
        images = [make(0), make(count - 1)]
        self.check(images, count=count)  # refuses the count, with whatever else the two show
        return images

    def check(self, images: list[ImageSpec], *, count: int | None = None) -> None:
        """Every problem with a request's images, one line each, in tpugen's words: InputError, or NotWarm when
        the request is fine but asks for what is not warm (both 422). Each request is checked on its own, so a
        bad one never fails the batch it would have shared. `count`: how many images the request asks for,
        where `images` holds only the first and last of too many."""
        problems = []
        limit = self.serve.max_images_per_request
        count = len(images) if count is None else count
        if not count:
            problems.append("the request asks for no images")
        if count > limit:
            problems.append(f"{count} images asked for; this server makes at most {limit} per request")
        if images and images[0].source is not None and self.family.img2img_refusal:
            problems.append(f"image: {self.family.title} models: {self.family.img2img_refusal}")
        if images:  # a request's images differ in their seed alone
            limits = RequestLimits.of_server(self.sizes, self.run.config.guidance_scale, self.max_side)
            problems.extend(images[0].problems(self.family, limits, seeds=(image.seed for image in images)))
        if images and not problems:
            problems.extend(self.steps_problems(images[0].steps, images[0].hires, images[0].scheduler))
        if problems:
            raise InputError(*problems)
        keys = list(dict.fromkeys(self.key_for(image) for image in images))
        if self.serve.new_shapes == "reject":
            cold = [self._not_warm(key) for key in keys]
            if any(cold):
                raise NotWarm(*(problem for problem in cold if problem))
        elif self.engines:
            cap = self.serve.max_warm_shapes
            warm = {shape for shape, _ in self.engines[0].warm}
            new = {str(key.shape(self.batch_size)) for key in keys} - warm
            if new and len(warm) + len(new) > cap:
                raise NotWarm(
                    f"{', '.join(sorted(new))} would be compiled, and this server keeps at most {cap} shapes warm "
                    f"(serve.max_warm_shapes); warm: {self.warm_summary()}"
                )

    def steps_problems(self, steps: int, hires: HiresFix | None, scheduler: str | None, where: str = "") -> list[str]:
        """What the sampler cannot run of `steps` (and a hires fix's schedule), on this model: found before any
        work, so that no request's steps fail in its batch (diffusers' DDIM raises IndexError at 1000)."""
        if not self.engines:
            return []
        loaded = self.engines[0].loaded
        name, most = scheduler or loaded.default_scheduler, loaded.max_steps(scheduler)
        problems = []
        if steps > most:
            problems.append(f"{where}steps: {steps}; sampler {name} runs at most {most} on this model")
        if hires is not None and hires.schedule_steps > most:
            problems.append(
                f"{where}hires fix: {hires.steps} steps at denoising strength {hires.strength:g} take a schedule of "
                f"{hires.schedule_steps} steps; sampler {name} runs at most {most} on this model"
            )
        return problems

    def _not_warm(self, key: BatchKey) -> str | None:
        engine = self.engines[0]
        shape = key.shape(self.batch_size)
        if engine.is_warm(shape, key.scheduler, key.steps):
            return None
        scheduler = key.scheduler or engine.loaded.default_scheduler
        if (key.height, key.width) not in self.sizes:
            what = f"size {key.width}x{key.height} is not warm"
        elif key.hires is not None and not self._hires_warm(key.hires):
            what = f"hires fix {key.hires.shape_label.removeprefix('hires ')} is not warm ({self._hires_summary()})"
        elif key.task not in self.serve.tasks:
            what = f"{key.task} is not warm (serve.tasks: {', '.join(self.serve.tasks)})"
        elif key.cfg != self.cfg:
            what = f"{'CFG on' if key.cfg else 'CFG off (guidance 1 or less)'} at {key.width}x{key.height} is not warm"
        elif engine.is_warm(shape, key.scheduler):
            warmed = engine.warm_steps(shape, key.scheduler)
            what = f"{key.steps} steps need step graphs (compile.step_cache) not compiled at {warmed} steps"
        else:
            what = f"sampler {scheduler!r} is not warm"
        return f"{what} (serve.new_shapes: reject); warm: {self.warm_summary()}"

    def generate(
        self, images: list[ImageSpec], *, interruptible: bool = False, task: str | None = None
    ) -> list[tuple[int, object]]:
        """(position, pixels) of each image made, in order, once the device loops have made them (uint8 HxWx3);
        blocks the caller. All of them, unless the request is `interruptible` (the web UI's) and a client
        interrupts it: then the ones made by then. The request waits its client's turn in the queue (the
        caller of this context, tpugen.modes.serve.request_ids); its progress is the job `task` (the web UI's
        force_task_id), or else the request's id, in self.progress.

        Raises NotReady (503), QueueFull (503), NotWarm or InputError (422), TimedOut (504), or what the
        device raised (500)."""
        if self.state != "ready":
            raise NotReady(self.failure or f"the server is {self.state}; try again shortly")
        if task is not None and not TASK_ID.fullmatch(task):
            raise InputError("force_task_id: up to 128 letters, digits and . _ : - ( ), such as task(abc123)")
        self.check(images)
        caller = current_caller()
        job = self.progress.open(
            "request", task or caller.request_id, images_planned=len(images), steps=images[0].steps_in_all
        )
        request = Request(len(images), interruptible, client=caller.client, job=job)
        request.on_start = lambda: self.progress.start(job)
        jobs = [
            ImageJob(
                request,
                i,
                image.prompt,
                image.negative_prompt,
                image.seed,
                self.key_for(image),
                image.loras,
                image.source,
            )
            for i, image in enumerate(images)
        ]
        outcome, error = "failed", None
        try:
            self.queue.submit(request, jobs)
            if not request.wait(self.serve.request_timeout_s):
                limit = f"{self.serve.request_timeout_s:g} s (serve.request_timeout_s)"
                made = len(request.pixels)
                raise TimedOut(
                    f"the request waited {limit} for a device"
                    if not made
                    else f"the request was not done within {limit}: {made} of {request.images} images were made"
                )
            if request.error is not None:
                raise request.error
            made = sorted(request.pixels.items(), key=lambda made: made[0])
            outcome = "complete" if len(made) == len(images) else "interrupted"
            return made
        except BaseException as exc:
            error = one_line(exc)
            raise
        finally:
            self.queue.settle(request)
            self.progress.end(job, outcome, error=error)

    def interrupt(self) -> int:
        """The web UI's interrupt: its open requests stop waiting for images not yet started and return the
        ones they have (OpenAI's and runs are not touched). Returns how many requests were interrupted."""
        return self.queue.interrupt()

    def _device_loop(self, engine: Engine) -> None:
        try:
            engine.backend.bind_thread()
            while True:
                taken = self.queue.take(timeout=0.25)
                if taken is None:
                    if self.queue.closed:
                        return
                    continue
                key, jobs = taken
                self._run_batch(engine, key, [job for job in jobs if not job.request.done])
        except BaseException as exc:  # the loop is gone, and no other thread makes this engine's batches
            self.metrics.device_failures.inc()
            self.break_down(f"device loop {self._number(engine)} died: {one_line(exc)}")

    def _number(self, engine: Engine) -> int:
        return next((i for i, e in enumerate(self.engines) if e is engine), 0)

    def _batch_failed(self, engine: Engine, exc: Exception) -> None:
        """A batch that failed through no fault of its requests: counted, and serve.max_failed_batches of them
        in a row on one engine mean its device is broken."""
        self.metrics.device_failures.inc()
        with self._count_lock:
            failed = self._failed_in_a_row.get(id(engine), 0) + 1
            self._failed_in_a_row[id(engine)] = failed
        limit = self.serve.max_failed_batches
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

    def _run_batch(self, engine: Engine, key: BatchKey, jobs: list[ImageJob]) -> None:
        if not jobs:
            return
        with self._count_lock:
            number = self._batches
            self._batches += 1
        items = tuple(
            WorkItem(
                i,
                0,
                job.prompt,
                job.negative_prompt,
                job.seed,
                key.steps,
                key.guidance_scale,
                key.height,
                key.width,
                key.cfg,
                source=job.source,
                hires=key.hires,
            )
            for i, job in enumerate(jobs)
        )
        shape = key.shape(self.batch_size)
        batch = Batch(number, shape, items, self.batch_size - len(items))
        cold = False
        try:
            # Every graph compiled here is one after warmup: a new shape (serve.new_shapes: compile; reject
            # refused it at the door) or, if a count shows up for a warm one, a shape planning missed.
            before = engine.backend.counters()
            cold = not engine.is_warm(batch.shape, key.scheduler, key.steps)
            if cold:
                log.info(f"compiling {batch.shape} for a request (serve.new_shapes: compile)")
                compile_start = time.perf_counter()
                # Under a step cache, at the steps that compile its every kind of step: compiled once for
                # requests of any steps, not again for each step count that brings a new kind.
                steps = warm_steps(self.run.config.compile.step_cache, key.steps)
                warm_items = tuple(replace(item, steps=steps) for item in items)
                engine.warmup(RunPlan(warm_items, (replace(batch, items=warm_items),)), scheduler=key.scheduler)
                log.info(f"compiled {batch.shape} in {time.perf_counter() - compile_start:.1f} s")
            start = time.perf_counter()
            pixels = engine.generate(
                batch, scheduler=key.scheduler, loras=jobs[0].loras, on_step=self._step_reporter(jobs)
            )
            seconds = time.perf_counter() - start
            after = engine.backend.counters()
        except BaseException as exc:  # a request's failure never stops the loop
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
        if before is not None and after is not None and after.compiles > before.compiles:
            self.metrics.compiles_after_warmup.inc(after.compiles - before.compiles)
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

    # ---------------------------------------------------------------- runs

    def start_run(self, data: dict) -> RunHandle:
        """A run config sent by a client, checked, then run in a thread on the engine with the fewest runs;
        TooManyRuns past serve.max_runs queued or running."""
        if self.state != "ready":
            raise NotReady(self.failure or f"the server is {self.state}; try again shortly")
        run = self.resolve_run(data)
        count, limit = image_count(run), self.serve.max_images_per_run
        if count > limit:
            raise InputError(
                f"the run plans {count} images; this server runs at most {limit} per run (serve.max_images_per_run)"
            )
        plan = plan_run(run)
        for batch in plan.batches:  # the checks a request's images meet, for each batch of the run (whose
            # model section is the server's: its scheduler is the one the engine loaded)
            if problems := self.steps_problems(batch.steps, batch.hires, None, f"batch {batch.number}: "):
                raise InputError(*problems)
        if self.serve.new_shapes == "reject":
            engine = self.engines[0]
            most_steps: dict = {}
            for batch in plan.batches:
                most_steps[batch.shape] = max(most_steps.get(batch.shape, 0), batch.steps)
            cold = [str(shape) for shape, steps in most_steps.items() if not engine.is_warm(shape, None, steps)]
            if cold:
                raise NotWarm(
                    f"the run needs {', '.join(cold)}, not warm (serve.new_shapes: reject); warm: {self.warm_summary()}"
                )
        run_id = run_id_for(run)
        with self._runs_lock:
            if not run.config.output.run_id:  # made here (a second's time and the config's hash): made unique
                made, number = run_id, 1
                while self._taken(run_id):
                    number += 1
                    run_id = f"{made}-{number}"
            run_dir = self.output_root / run_id
            if self._taken(run_id):
                raise Conflict(f"output.run_id: {run_id} exists on this server; choose another run_id")
            limit = self.serve.max_runs
            if len(self.runs) >= limit:
                raise TooManyRuns(
                    f"{len(self.runs)} runs are queued or running (serve.max_runs: {limit}); send it again when "
                    "one ends"
                )
            engine = idlest([sum(h.engine == i for h in self.runs.values()) for i in range(len(self.engines))])
            handle = RunHandle(run_id, run, run_dir, len(plan.items), engine=engine)
            # A daemon thread: a second signal ends the process under its batch in flight (stop() joins it).
            handle.thread = threading.Thread(
                target=self._execute_run, args=(handle,), name=f"tpugen-run-{run_id}", daemon=True
            )
            self.runs[run_id] = handle
        handle.thread.start()
        log.info(f"run {run_id}: {handle.planned} images on engine {engine} of {len(self.engines)}")
        return handle

    def _taken(self, run_id: str) -> bool:
        """Whether a run of the server has `run_id` (queued, running, or on disk); under _runs_lock."""
        run_dir = self.output_root / run_id
        return run_id in self.runs or run_id in self._ended_unwritten or (run_dir.exists() and any(run_dir.iterdir()))

    def find_run(self, run_id: str) -> RunHandle | None:
        """A run of this server: queued or running, else ended, read back from its run directory. None for an id
        no run can have (too long for a folder name, a path)."""
        if not is_safe_run_id(run_id):
            return None
        with self._runs_lock:
            handle = self.runs.get(run_id)
            unwritten = self._ended_unwritten.get(run_id)
        return handle or run_on_disk(self.output_root, run_id) or unwritten

    def list_runs(self, limit: int, after: str | None = None) -> tuple[list[RunHandle], str | None]:
        """(a page of `limit` of this server's runs, newest first, the id to ask for the next page after; None
        on the last page). The runs queued or running, and those in its output directory (by when each
        started: run.json's time). `after`: the last id of the page before."""
        with self._runs_lock:
            live = {handle.id: handle.created for handle in self.runs.values()}
        started = {**live, **runs_on_disk(self.output_root)}
        order = sorted(started, key=lambda run_id: (-started[run_id], run_id))
        if after is not None:
            if after not in started:
                raise InputError(f"after: no run {after!r} on this server")
            order = order[order.index(after) + 1 :]
        page = order[:limit]
        handles = [handle for handle in map(self.find_run, page) if handle is not None]
        return handles, page[-1] if len(order) > limit else None

    def resolve_run(self, data: dict) -> ResolvedRun:
        """A client's run config under the server's model and way of running (absent or equal is fine)."""
        if not isinstance(data, dict):
            raise InputError("the run config must be a mapping of keys")
        served = self.run.config
        problems = []
        for section in ("model", "execution", "compile", "cache"):
            given = data.get(section)
            if given is None:
                continue
            ours = getattr(served, section).model_dump()
            if not isinstance(given, dict):
                problems.append(f"{section}: must be a mapping, or left out (the server's is used)")
                continue
            for key, value in sorted(given.items()):
                if section == "model" and key == "loras":
                    continue  # allowed: LoRAs are switched on the warm engine (names in serve.lora_dir)
                if section == "model" and key == "allow_remote_code" and value:
                    problems.append("model.allow_remote_code: a run sent to the server cannot run a model's code")
                elif section == "compile" and key == "step_cache":
                    problems.extend(self._step_cache_problem(value))
                elif key not in ours or ours[key] != value:
                    problems.append(
                        f"{section}.{key}: the server runs {section}.{key}: {ours.get(key)!r}; leave it out or equal"
                    )
        if data.get("prompts_file") is not None:
            problems.append("prompts_file: send the prompts themselves (prompts: [...]); the server reads no files")
        if not isinstance(data.get("output") or {}, dict):
            problems.append("output: must be a mapping (the server reads output.run_id from it), or left out")
        prompts = self._run_prompts(data.get("prompts"), problems)
        if problems:
            raise InputError(*problems)
        merged = {key: value for key, value in data.items() if key not in ("output", "serve")}
        if prompts is not None:
            merged["prompts"] = prompts
        merged.setdefault("batch_size", served.batch_size)  # the batch the server's graphs were compiled for
        for section in ("model", "execution", "compile", "cache"):
            merged[section] = getattr(served, section).model_dump()
        merged["model"]["loras"] = self._run_loras((data.get("model") or {}).get("loras") or [])
        # A client's output.dir means nothing here: the server writes under its own root, by run id.
        merged["output"] = {"dir": str(self.output_root), "run_id": (data.get("output") or {}).get("run_id")}
        return resolve(merged, base_dir=Path(self.serve.lora_dir or self.output_root))

    def _run_prompts(self, prompts, problems: list[str]) -> list | None:
        """A run's prompts with each input image sent (a base64 data: URI) stored by its content under the
        output root and named by that path; a path is refused, since the server reads none a client names.
        None: no list of prompts (resolve says what is wrong with it)."""
        if not isinstance(prompts, list):
            return None
        stored = []
        for number, entry in enumerate(prompts):
            if isinstance(entry, dict):
                entry = dict(entry)
                for key in ("init_image", "mask_image"):
                    if key in entry:
                        where = f"prompts[{number}].{key}"
                        try:
                            entry[key] = self.input_image(data_uri_bytes(entry[key], where), where)[0]
                        except InputError as exc:
                            problems.extend(exc.lines)
            stored.append(entry)
        return stored

    def _step_cache_problem(self, given) -> list[str]:
        """A run's compile.step_cache against the server's: equal once its defaults are filled in, or refused,
        since the server's one cache is on its loaded denoiser, warm for every request and run."""
        from pydantic import ValidationError

        ours = self.run.config.compile.step_cache
        try:
            if isinstance(given, dict) and StepCacheConfig(**given) == ours:
                return []
        except ValidationError:
            pass
        runs = "no step cache" if ours.method == "none" else f"step cache {ours.method} with {ours.options()}"
        return [f"compile.step_cache: the server runs {runs} for all its requests and runs; leave it out or equal"]

    def _run_loras(self, loras) -> list:
        """model.loras of a run sent here: each id a LoRA's name in serve.lora_dir, or a hub repo (org/name)."""
        if not isinstance(loras, list):
            raise InputError("model.loras: must be a list of {id, scale}")
        converted, problems = [], []
        for number, lora in enumerate(loras):
            where = f"model.loras[{number}].id"
            lora_id = lora.get("id") if isinstance(lora, dict) else None
            if not isinstance(lora_id, str):
                problems.append(f"{where}: a LoRA's name in serve.lora_dir, or a hub repo org/name")
            elif is_hub_lora(lora_id):
                if not self.serve.hub_loras:
                    problems.append(
                        f"{where}: {lora_id!r} is a hub repo; this server takes the LoRAs of serve.lora_dir only "
                        "(serve.hub_loras: true lets runs download hub LoRAs with the server's token)"
                    )
                elif problem := weight_name_problem(lora.get("weight_name")):
                    problems.append(f"model.loras[{number}].weight_name: {problem}")
                else:
                    converted.append(lora)
            elif not LORA_NAME.fullmatch(lora_id.removesuffix(".safetensors")):
                problems.append(
                    f"{where}: {lora_id!r}: a run sent to the server names a LoRA of serve.lora_dir by its file stem"
                )
            elif self.serve.lora_dir is None:
                problems.append(f"{where}: {lora_id!r} needs serve.lora_dir, which this server has not set")
            elif not (Path(self.serve.lora_dir) / (lora_id.removesuffix(".safetensors") + ".safetensors")).is_file():
                # Named, not shown as the path under serve.lora_dir it would be (a reply never shows that folder).
                known = ", ".join(p.stem for p in self.lora_files()) or "none"
                problems.append(
                    f"{where}: no LoRA {lora_id.removesuffix('.safetensors')!r} in serve.lora_dir (it has: {known})"
                )
            else:
                # A file of serve.lora_dir: its name, scale and pin only (a weight_name picks in a folder or repo).
                # The id stays its name (relative to serve.lora_dir): the run's records and files name it so.
                stem = lora_id.removesuffix(".safetensors")
                kept = {key: lora[key] for key in ("scale", "sha256") if key in lora}
                converted.append({**kept, "id": stem + ".safetensors"})
        if problems:
            raise InputError(*problems)
        return converted

    def lora_named(self, name: str, scale: float, where: str = "prompt") -> Lora:
        """The LoRA a request names (<lora:NAME:SCALE>): NAME.safetensors in serve.lora_dir, checked for this
        model's family; InputError (422) in one line otherwise."""
        from pydantic import ValidationError

        if self.serve.lora_dir is None:
            raise InputError(f"{where}: <lora:{name}> needs serve.lora_dir, which this server has not set")
        folder = Path(self.serve.lora_dir)
        path = folder / f"{name}.safetensors"
        if not LORA_NAME.fullmatch(name) or not path.is_file():
            known = ", ".join(p.stem for p in self.lora_files()) or "none"
            raise InputError(f"{where}: no LoRA {name!r} in serve.lora_dir (it has: {known})")
        try:
            config = LoraConfig(id=path.name, scale=scale)  # by its name in serve.lora_dir: what replies show
        except ValidationError:
            raise InputError(
                f"{where}: <lora:{name}:{scale:g}>: the scale must be from 0 to {LORA_SCALE_MAX:g}"
            ) from None
        return resolve_lora(config, folder, family=self.run.family, model=self.run.config.model.id, where=where)

    def lora_files(self) -> list[Path]:
        if self.serve.lora_dir is None:
            return []
        return sorted(Path(self.serve.lora_dir).glob("*.safetensors"))

    def _execute_run(self, handle: RunHandle) -> None:
        from tpugen.modes.single import run_single

        engine = self.engines[handle.engine]
        handle.state = "running"
        try:
            engine.backend.bind_thread()
            handle.report = run_single(
                handle.run,
                engine=engine,
                topology=Topology(),
                stop=handle.stop,
                display=self.display,
                run_id=handle.id,
            )
            handle.state = "complete"
        except Interrupted as exc:
            handle.state, handle.error = "stopped", exc.lines
        except TpugenError as exc:
            handle.state, handle.error = "failed", exc.lines
        except BaseException as exc:
            handle.state, handle.error = "failed", [one_line(exc)]
        finally:
            self._forget(handle)
        log.info(f"run {handle.id} {handle.state}")

    def _forget(self, handle: RunHandle) -> None:
        """An ended run leaves memory: its run directory answers for it. One that ended before it had one (it
        failed as it started) is kept, the last few of them, to say why."""
        with self._runs_lock:
            self.runs.pop(handle.id, None)
            if not (handle.run_dir / RUN_RECORD).is_file():
                self._ended_unwritten[handle.id] = handle
                while len(self._ended_unwritten) > 16:
                    self._ended_unwritten.popitem(last=False)

    def stop_run(self, run_id: str) -> RunHandle | None:
        """Stop a queued or running run after its batch in flight (resumable); None if none is."""
        with self._runs_lock:
            handle = self.runs.get(run_id)
        if handle is not None:
            handle.stop.request(signal.SIGTERM)
        return handle


def data_uri_bytes(value, where: str) -> bytes:
    """The bytes of a run's image sent as a base64 data: URI (data:[TYPE];base64,DATA); InputError naming `where`
    for anything else, a path above all."""
    import base64
    import binascii

    header, comma, payload = value.partition(",") if isinstance(value, str) else ("", "", "")
    if not (header.startswith("data:") and header.endswith(";base64") and comma):
        raise InputError(f"{where}: send the image itself (a base64 data: URI); the server reads no paths")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: the data: URI's base64 does not decode") from None


def weight_name_problem(name) -> str | None:
    """Why a hub LoRA's weight_name cannot be a file of its repo (a path that leaves it), or None."""
    if name is None:
        return None
    if not isinstance(name, str) or not name.strip():
        return "a file name in the LoRA's repo"
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\", "~")) or ":" in name or ".." in parts:
        return f"{name[:100]!r}: a file of the LoRA's repo, not a path out of it"
    return None


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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


def idlest(runs_per_engine: list[int]) -> int:
    """The engine a new run goes to: the one with the fewest runs, the first of those tied."""
    return min(range(len(runs_per_engine)), key=lambda i: (runs_per_engine[i], i))


def runs_on_disk(root: Path) -> dict[str, float]:
    """The run directories under `root` (each holds run.json), by id: when each started (run.json's time)."""
    found: dict[str, float] = {}
    try:
        paths = list(root.iterdir())
    except OSError:  # no run yet: the directory is made by the first
        return found
    for path in paths:
        if path.name.startswith("."):
            continue
        try:
            found[path.name] = (path / RUN_RECORD).stat().st_mtime
        except OSError:  # not a run directory
            continue
    return found


def run_on_disk(root: Path, run_id: str) -> RunHandle | None:
    """An ended run read back from its run directory under `root`; None if there is none. Its state is its
    report.json's: none means the server stopped under it (a second signal, a crash); `tpugen resume` goes on."""
    if run_id.startswith(".") or Path(run_id).name != run_id:
        return None
    run_dir = root / run_id
    if not (run_dir / RUN_RECORD).is_file():
        return None
    try:
        record = read_run_record(run_dir)
        planned = planned_images(recorded_prompts(record), record["config"]["images_per_prompt"])
    except (InputError, KeyError, TypeError, ValueError) as exc:
        return RunHandle(run_id, None, run_dir, 0, state="failed", error=[one_line(exc)])
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict):
        resume = f"resume with: tpugen resume {run_dir}"
        lines = ["the server stopped before the run ended (it has no report.json)", resume]
        return RunHandle(run_id, None, run_dir, planned, state="stopped", error=lines)
    error = report.get("error")
    if report.get("complete"):
        state = "complete"
    else:
        state = "stopped" if str(error or "").startswith("interrupted") else "failed"
    planned = report.get("images_planned") or planned
    return RunHandle(run_id, None, run_dir, planned, state=state, error=[error] if error else None, report=report)
