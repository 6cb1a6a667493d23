"""What the server does behind its HTTP routes: warm engines, one device loop per engine, runs on them."""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpugen.config import ResolvedRun, resolve, run_sizes
from tpugen.config.loras import Lora, is_hub_lora, loras_key, resolve_lora
from tpugen.config.request import ImageRequest, RequestLimits
from tpugen.config.schema import LORA_SCALE_MAX, LoraConfig
from tpugen.engine import Display, Engine, StopSignals, Topology
from tpugen.engine.session import run_id_for
from tpugen.errors import InputError, Interrupted, TpugenError, one_line
from tpugen.families import FAMILIES
from tpugen.logs import logger
from tpugen.modes.serve.metrics import Metrics
from tpugen.modes.serve.progress import Jobs
from tpugen.modes.serve.queue import BatchKey, BatchQueue, ImageJob, Request
from tpugen.modes.serve.request_ids import TASK_ID, current_caller
from tpugen.plan import Batch, RunPlan, ShapeKey, WorkItem, image_count, plan_run
from tpugen.schedulers import find_scheduler

log = logger("serve")

LORA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._ -]{0,127}")  # a file stem in serve.lora_dir, no path


class NotReady(TpugenError):
    """The server is warming up or shutting down (503)."""


class NotWarm(InputError):
    """A request for a shape or scheduler the server has not compiled, under serve.new_shapes: reject (422)."""


class TimedOut(TpugenError):
    """A request that waited longer than serve.request_timeout_s (504)."""


class Conflict(InputError):
    """A run id that is taken (409)."""


@dataclass(frozen=True)
class ImageSpec(ImageRequest):
    """One image a request asks for, in tpugen's words: what ImageRequest's rules check, and how it is made."""

    scheduler: str | None = None  # a name find_scheduler knows; None: the model's own
    loras: tuple = ()  # tpugen.config.loras.Lora, fused for this image (a request's <lora:NAME:SCALE>)


@dataclass
class RunHandle:
    """A run sent to the server (POST /v1/runs): it runs on the warm engine in a thread of its own."""

    id: str
    run: ResolvedRun
    run_dir: Path
    planned: int
    stop: StopSignals = field(default_factory=StopSignals)
    state: str = "queued"  # queued, running, complete, stopped, failed
    error: list[str] | None = None
    report: dict | None = None
    thread: threading.Thread | None = None


class Service:
    """Engines opened from the server's config (one per device under execution.mode: multi), warmed for
    serve.sizes x serve.schedulers, each fed batches from the one queue by a device loop of its own."""

    def __init__(self, run: ResolvedRun, engines: list[Engine], *, output_root: Path, display: Display) -> None:
        config = run.config
        self.run = run
        self.engines = engines
        self.display = display
        self.output_root = output_root
        self.family = FAMILIES[run.family]
        self.batch_size = config.batch_size
        self.serve = config.serve
        self.sizes = [tuple(s) for s in self.serve.sizes] if self.serve.sizes else list(run_sizes(config))
        self.cfg = self.family.uses_cfg(config.guidance_scale)
        self.schedulers = [None, *(find_scheduler(name).name for name in self.serve.schedulers)]
        self.queue = BatchQueue(self.batch_size, self.serve.batch_window_ms / 1000, self.serve.max_queue)
        self.metrics = Metrics()
        self.progress = Jobs()  # every request's and run's progress (tpugen.modes.serve.progress)
        # Read when /metrics is, so they are never a step behind the queue.
        self.metrics.queue_depth.set_function(self.queue.depth)
        self.metrics.requests_open.set_function(self.queue.open_count)
        self.state = "warming"  # warming, ready, draining, failed
        self.failure: str | None = None
        self.runs: dict[str, RunHandle] = {}
        self._runs_lock = threading.Lock()
        self._batches = 0
        self._count_lock = threading.Lock()
        self._loops: list[threading.Thread] = []

    # ---------------------------------------------------------------- start and stop

    def start(self) -> None:
        """Warm every shape key and scheduler in a thread (the server answers /readyz 503 meanwhile), then
        start the device loops."""
        threading.Thread(target=self._warm_then_serve, name="tpugen-warmup", daemon=True).start()

    def _warm_then_serve(self) -> None:
        try:
            # One engine at a time: the first compiles, the others find its graphs in the process's cache.
            plan = self.warm_plan()
            for engine in self.engines:
                engine.backend.bind_thread()
                # A flash attention fallback (once per engine) forgets every key warmed before it: a second
                # pass compiles those again without the kernel.
                for _ in range(2):
                    for scheduler in self.schedulers:
                        engine.warmup(plan, self.display, scheduler=scheduler)
                    if all(engine.is_warm(b.shape, s) for b in plan.batches for s in self.schedulers):
                        break
        except BaseException as exc:  # the server stays up to say why, never ready
            self.failure = one_line(exc)
            self.state = "failed"
            log.error(f"warmup failed: {self.failure}")
            return
        for number, engine in enumerate(self.engines):
            loop = threading.Thread(target=self._device_loop, args=(engine,), name=f"tpugen-device-{number}")
            loop.start()
            self._loops.append(loop)
        if self.state == "warming":
            self.state = "ready"
        log.info(f"ready, {len(self.engines)} device loop(s), warm: {self.warm_summary()}")

    def warm_plan(self) -> RunPlan:
        """One batch per warm size, at the config's steps and guidance."""
        config = self.run.config
        batches = []
        for height, width in self.sizes:
            item = WorkItem(0, 0, "warmup", "", 0, config.steps, config.guidance_scale, height, width, self.cfg)
            shape = ShapeKey(height, width, self.batch_size, self.cfg)
            batches.append(Batch(len(batches), shape, (item,), self.batch_size - 1))
        return RunPlan(tuple(b.items[0] for b in batches), tuple(batches))

    def warm_summary(self) -> str:
        sizes = ", ".join(f"{w}x{h}" for h, w in self.sizes)
        names = ", ".join(s or self.engines[0].loaded.default_scheduler for s in self.schedulers)
        return f"sizes {sizes} (width x height; {'cfg' if self.cfg else 'no cfg'}, batch {self.batch_size}); samplers {names}"

    def begin_drain(self) -> None:
        """SIGTERM/SIGINT: refuse new work, stop runs after their batch in flight (resumable); requests in
        flight still get their images."""
        self.state = "draining"
        with self._runs_lock:
            for handle in self.runs.values():
                handle.stop.request(signal.SIGTERM)

    def wait_drained(self) -> None:
        """Until no request waits for images and no run is running (each is bounded: a request by its
        timeout, a run by its batch in flight)."""
        while self.queue.open_requests() or any(h.state in ("queued", "running") for h in list(self.runs.values())):
            time.sleep(0.05)

    def stop(self) -> None:
        """After the last request: wait for the runs, then stop the device loops after their batch."""
        self.begin_drain()
        for handle in list(self.runs.values()):
            if handle.thread is not None:
                handle.thread.join()
        self.queue.close()
        for loop in self._loops:
            loop.join()

    # ---------------------------------------------------------------- images for requests

    def key_for(self, image: ImageSpec) -> BatchKey:
        cfg = self.family.uses_cfg(image.guidance_scale)
        return BatchKey(
            image.height, image.width, cfg, image.steps, image.guidance_scale, image.scheduler, loras_key(image.loras)
        )

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
        if images:  # a request's images differ in their seed alone
            limits = RequestLimits.of_server(self.sizes, self.run.config.guidance_scale)
            problems.extend(images[0].problems(self.family, limits, seeds=(image.seed for image in images)))
        if problems:
            raise InputError(*problems)
        if self.serve.new_shapes == "reject":
            cold = [self._not_warm(key) for key in dict.fromkeys(self.key_for(image) for image in images)]
            if any(cold):
                raise NotWarm(*(problem for problem in cold if problem))

    def _not_warm(self, key: BatchKey) -> str | None:
        engine = self.engines[0]
        shape = ShapeKey(key.height, key.width, self.batch_size, key.cfg)
        if engine.is_warm(shape, key.scheduler):
            return None
        scheduler = key.scheduler or engine.loaded.default_scheduler
        if (key.height, key.width) not in self.sizes:
            what = f"size {key.width}x{key.height} is not warm"
        elif key.cfg != self.cfg:
            what = f"{'CFG on' if key.cfg else 'CFG off (guidance 1 or less)'} at {key.width}x{key.height} is not warm"
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
            "request", task or caller.request_id, images_planned=len(images), steps=images[0].steps
        )
        request = Request(len(images), interruptible, client=caller.client, job=job)
        request.on_start = lambda: self.progress.start(job)
        jobs = [
            ImageJob(request, i, image.prompt, image.negative_prompt, image.seed, self.key_for(image), image.loras)
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
        engine.backend.bind_thread()
        while True:
            taken = self.queue.take(timeout=0.25)
            if taken is None:
                if self.queue.closed:
                    return
                continue
            key, jobs = taken
            self._run_batch(engine, key, [job for job in jobs if not job.request.done])

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
            )
            for i, job in enumerate(jobs)
        )
        batch = Batch(
            number, ShapeKey(key.height, key.width, self.batch_size, key.cfg), items, self.batch_size - len(items)
        )
        try:
            # Every graph compiled here is one after warmup: a new shape (serve.new_shapes: compile; reject
            # refused it at the door) or, if a count shows up for a warm one, a shape planning missed.
            before = engine.backend.counters()
            if not engine.is_warm(batch.shape, key.scheduler):
                log.info(f"compiling {batch.shape} for a request (serve.new_shapes: compile)")
                compile_start = time.perf_counter()
                engine.warmup(RunPlan(items, (batch,)), scheduler=key.scheduler)
                log.info(f"compiled {batch.shape} in {time.perf_counter() - compile_start:.1f} s")
            start = time.perf_counter()
            pixels = engine.generate(batch, scheduler=key.scheduler, loras=jobs[0].loras)
            seconds = time.perf_counter() - start
            after = engine.backend.counters()
        except BaseException as exc:  # a request's failure never stops the loop
            log.error(f"batch {number} failed: {one_line(exc)}")
            for job in jobs:
                job.request.fail(exc)
            return
        # Counted before the images are handed over: a client that reads /metrics after its answer sees its batch.
        if before is not None and after is not None and after.compiles > before.compiles:
            self.metrics.compiles_after_warmup.inc(after.compiles - before.compiles)
        self.metrics.batch(seconds, len(jobs), batch.padding)
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
        """A run config sent by a client, checked, then run in a thread on the first engine."""
        if self.state != "ready":
            raise NotReady(self.failure or f"the server is {self.state}; try again shortly")
        run = self.resolve_run(data)
        count, limit = image_count(run), self.serve.max_images_per_run
        if count > limit:
            raise InputError(
                f"the run plans {count} images; this server runs at most {limit} per run (serve.max_images_per_run)"
            )
        plan = plan_run(run)
        if self.serve.new_shapes == "reject":
            engine = self.engines[0]
            cold = [str(shape) for shape in plan.shape_keys if not engine.is_warm(shape)]
            if cold:
                raise NotWarm(
                    f"the run needs {', '.join(cold)}, not warm (serve.new_shapes: reject); warm: {self.warm_summary()}"
                )
        run_id = run_id_for(run)
        run_dir = self.output_root / run_id
        with self._runs_lock:
            if run_id in self.runs or (run_dir.exists() and any(run_dir.iterdir())):
                raise Conflict(f"output.run_id: {run_id} exists on this server; choose another run_id")
            handle = RunHandle(run_id, run, run_dir, len(plan.items))
            handle.thread = threading.Thread(target=self._execute_run, args=(handle,), name=f"tpugen-run-{run_id}")
            self.runs[run_id] = handle
        handle.thread.start()
        return handle

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
                elif key not in ours or ours[key] != value:
                    problems.append(
                        f"{section}.{key}: the server runs {section}.{key}: {ours.get(key)!r}; leave it out or equal"
                    )
        if data.get("prompts_file") is not None:
            problems.append("prompts_file: send the prompts themselves (prompts: [...]); the server reads no files")
        if not isinstance(data.get("output") or {}, dict):
            problems.append("output: must be a mapping (the server reads output.run_id from it), or left out")
        if problems:
            raise InputError(*problems)
        merged = {key: value for key, value in data.items() if key not in ("output", "serve")}
        merged.setdefault("batch_size", served.batch_size)  # the batch the server's graphs were compiled for
        for section in ("model", "execution", "compile", "cache"):
            merged[section] = getattr(served, section).model_dump()
        merged["model"]["loras"] = self._run_loras((data.get("model") or {}).get("loras") or [])
        # A client's output.dir means nothing here: the server writes under its own root, by run id.
        merged["output"] = {"dir": str(self.output_root), "run_id": (data.get("output") or {}).get("run_id")}
        return resolve(merged, base_dir=Path(self.serve.lora_dir or self.output_root))

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

        handle.state = "running"
        self.engines[0].backend.bind_thread()
        try:
            handle.report = run_single(
                handle.run,
                engine=self.engines[0],
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
        log.info(f"run {handle.id} {handle.state}")

    def stop_run(self, run_id: str) -> RunHandle:
        handle = self.runs[run_id]
        handle.stop.request(signal.SIGTERM)
        return handle
