"""A request's images at the door: checked (each request on its own), queued under their batch keys, and waited
for until the device loops have made them."""

from __future__ import annotations

from dataclasses import replace

from tpugen.config.controls import controlled_problems
from tpugen.config.request import RequestLimits
from tpugen.config.rules import CLIP_SKIP_NEEDS_WEBUI, jax_image_problems
from tpugen.errors import InputError, one_line
from tpugen.modes.serve.progress import Jobs
from tpugen.modes.serve.queue import BatchQueue, ImageJob, Request
from tpugen.modes.serve.refusals import NotWarm, TimedOut
from tpugen.modes.serve.request_ids import TASK_ID, current_caller
from tpugen.modes.serve.warm import WarmEngines
from tpugen.plan import ImageWork

COMPILED_MAX_SIDE = 2048  # serve.max_side's default under new_shapes: compile


# What each reason a controlled image cannot run is about, in a request's words (controlled_problems' kinds).
CONTROLLED_WHAT = {
    "image": "ControlNet units with an image",
    "strength": "denoising_strength with ControlNet units",
    "window": "ControlNet units' guidance_start and guidance_end",
    "weights": "ControlNet units' control_mode and advanced_weighting",
}


class Admission:
    """What a request's images meet before a device loop takes them: the server's rules, its warm shapes and
    samplers, its bounds; then the one queue, where the request waits its client's turn."""

    def __init__(self, warm: WarmEngines, queue: BatchQueue, progress: Jobs) -> None:
        self.warm = warm
        self.queue = queue
        self.progress = progress  # every request's and run's progress (tpugen.modes.serve.progress)
        serve = warm.serve
        # Under new_shapes: reject the warm sizes bound a request already (a 422 naming them).
        default_side = COMPILED_MAX_SIDE if serve.new_shapes == "compile" else None
        self.max_side = serve.max_side or default_side

    def work_for(self, image: ImageWork) -> ImageWork:
        """A request's image as this server's model reads it: its guidance's CFG, its prompts' chunks, the server's
        prompt syntax (the fields a request's builder leaves at their defaults). Called once its rules passed."""
        cfg = self.warm.family.uses_cfg(image.guidance_scale)
        reader = self.warm.reader
        chunks = reader.chunks(image.prompt, image.negative_prompt, cfg=cfg)
        return replace(image, cfg=cfg, chunks=chunks, prompt_syntax=reader.syntax)

    def image_works(self, count: int, make) -> list[ImageWork]:
        """`make(i)` for each of a request's `count` images. Past serve.max_images_per_request only the first
        and last are made, and refused with the count: a request for ten billion images costs two specs."""
        if count <= self.warm.serve.max_images_per_request:
            return [make(i) for i in range(count)]
        images = [make(0), make(count - 1)]
        self.check(images, count=count)  # refuses the count, with whatever else the two show
        return images

    def check(self, images: list[ImageWork], *, count: int | None = None) -> None:
        """Every problem with a request's images, one line each, in tpugen's words: InputError, or NotWarm when
        the request is fine but asks for what is not warm (both 422). Each request is checked on its own, so a
        bad one never fails the batch it would have shared. `count`: how many images the request asks for,
        where `images` holds only the first and last of too many."""
        warm, serve, family = self.warm, self.warm.serve, self.warm.family
        problems = []
        limit = serve.max_images_per_request
        count = len(images) if count is None else count
        if not count:
            problems.append("the request asks for no images")
        if count > limit:
            problems.append(f"{count} images asked for; this server makes at most {limit} per request")
        if images and warm.run.config.execution.backend == "jax":
            image = images[0]
            problems.extend(
                jax_image_problems(
                    family,
                    references=bool(image.references),
                    tiling=image.tiling,
                    weighed=bool(image.controls) and image.controls.weighed,
                )
            )
        # The family's refusals (its hires fix's are the request's hires field's: a1111.hires_for).
        refused = images[0].refusals(family) if images else {}
        if "image" in refused:
            problems.append(f"image: {refused['image']}")
        if images and images[0].controls:
            found = controlled_problems(family, images[0].controls, images[0].source, warm.controlnet_configs())
            problems.extend(f"{CONTROLLED_WHAT[kind]}: {why}" for kind, why in found.items())
        if "txt2img" in refused:
            problems.append(f"image: {refused['txt2img']}; send one or more images to edit")
        if "tiling" in refused:
            problems.append(f"tiling: {refused['tiling']}")
        if "clip_skip" in refused:
            problems.append(f"clip skip {images[0].clip_skip}: {refused['clip_skip']}")
        elif images and images[0].clip_skip > 1 and warm.run.config.prompt_syntax != "webui":
            problems.append(f"clip skip {images[0].clip_skip}: {CLIP_SKIP_NEEDS_WEBUI}")
        elif images and images[0].clip_skip > (layers := warm.text_layers()):
            problems.append(f"clip skip {images[0].clip_skip}: the text encoder has {layers} layers; at most {layers}")
        if images:  # a request's images differ in their seed alone
            limits = RequestLimits.of_server(warm.sizes, warm.run.config.guidance_scale, self.max_side)
            problems.extend(images[0].problems(family, limits, seeds=(image.seed for image in images)))
        if images and not problems:
            problems.extend(warm.steps_problems(images[0].steps, images[0].hires, images[0].scheduler))
        if problems:
            raise InputError(*problems)
        works = list({work.call_key: work for work in map(self.work_for, images)}.values())
        if serve.new_shapes == "reject":
            cold = [self._not_warm(work) for work in works]
            if any(cold):
                raise NotWarm(*(problem for problem in cold if problem))
        elif warm.engines:
            cap = serve.max_warm_shapes
            engine = warm.engines[0]
            warmed = engine.warm_programs()  # under a step cache on jax, each shape key at each step count
            new = {engine.program_key(work.shape(warm.batch_size), work.steps) for work in works} - warmed
            if new and len(warmed) + len(new) > cap:
                raise NotWarm(
                    f"{', '.join(sorted(new))} would be compiled, and this server keeps at most {cap} shapes warm "
                    f"(serve.max_warm_shapes); warm: {warm.summary()}"
                )

    def _not_warm(self, work: ImageWork) -> str | None:
        warm = self.warm
        engine = warm.engines[0]
        shape = work.shape(warm.batch_size)
        if engine.is_warm(shape, work.scheduler, work.steps):
            return None
        scheduler = work.scheduler or engine.loaded.default_scheduler
        if (work.height, work.width) not in warm.sizes:
            what = f"size {work.width}x{work.height} is not warm"
        elif work.hires is not None and not warm.hires_warm(work.hires):
            what = f"hires fix {work.hires.shape_label.removeprefix('hires ')} is not warm ({warm.hires_summary()})"
        elif work.task not in warm.serve.tasks:
            what = f"{work.task} is not warm (serve.tasks: {', '.join(warm.serve.tasks)})"
        elif shape.controls and not warm.controlnets:
            what = "ControlNet units are not warm (the server's model.controlnets is empty)"
        elif shape.controls and work.task not in warm.controlled_tasks:
            what = f"ControlNet units on {work.task} are not warm (warm with them: {', '.join(warm.controlled_tasks)})"
        elif shape.references and shape.references not in warm.reference_counts:
            counts = ", ".join(map(str, warm.reference_counts))
            count = shape.references
            what = f"edit with {count} reference{'s' if count > 1 else ''} is not warm"
            what += f" (serve.reference_counts: {counts})"
        elif work.chunks not in warm.chunk_counts:
            counts = ", ".join(map(str, warm.chunk_counts))
            what = f"a prompt of {work.chunks} chunks of 75 tokens is not warm (serve.prompt_chunks: {counts})"
        elif work.cfg != warm.cfg:
            what = (
                f"{'CFG on' if work.cfg else 'CFG off (guidance 1 or less)'} at {work.width}x{work.height} is not warm"
            )
        elif work.tiling and not warm.serve.tiling:
            what = "tiling is not warm (serve.tiling: false)"
        elif work.clip_skip != warm.run.config.clip_skip:
            what = f"clip skip {work.clip_skip} is not warm (clip_skip: {warm.run.config.clip_skip})"
        elif engine.is_warm(shape, work.scheduler) and engine.per_step_count:
            counts = engine.warm_counts(shape, work.scheduler)
            what = (
                f"{work.steps} steps are not warm (under compile.step_cache each step count is a loop program of its "
                f"own on backend jax; warm at {', '.join(map(str, counts))} steps)"
            )
        elif engine.is_warm(shape, work.scheduler):
            warmed = engine.warm_steps(shape, work.scheduler)
            what = f"{work.steps} steps need step graphs (compile.step_cache) not compiled at {warmed} steps"
        else:
            what = f"sampler {scheduler!r} is not warm"
        return f"{what} (serve.new_shapes: reject); warm: {warm.summary()}"

    def generate(
        self, images: list[ImageWork], *, interruptible: bool = False, task: str | None = None
    ) -> list[tuple[int, object]]:
        """(position, pixels) of each image made, in order, once the device loops have made them (uint8 HxWx3);
        blocks the caller. All of them, unless the request is `interruptible` (the web UI's) and a client
        interrupts it: then the ones made by then. The request waits its client's turn in the queue (the
        caller of this context, tpugen.modes.serve.request_ids); its progress is the job `task` (the web UI's
        force_task_id), or else the request's id, in self.progress.

        Raises QueueFull (503), NotWarm or InputError (422), TimedOut (504), or what the device raised (500)."""
        if task is not None and not TASK_ID.fullmatch(task):
            raise InputError("force_task_id: up to 128 letters, digits and . _ : - ( ), such as task(abc123)")
        self.check(images)
        caller = current_caller()
        job = self.progress.open(
            "request", task or caller.request_id, images_planned=len(images), steps=images[0].steps_in_all
        )
        request = Request(len(images), interruptible, client=caller.client, job=job)
        request.on_start = lambda: self.progress.start(job)
        jobs = [ImageJob(request, i, self.work_for(image)) for i, image in enumerate(images)]
        outcome, error = "failed", None
        timeout = self.warm.serve.request_timeout_s
        try:
            self.queue.submit(request, jobs)
            if not request.wait(timeout):
                limit = f"{timeout:g} s (serve.request_timeout_s)"
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
