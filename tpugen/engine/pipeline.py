"""A diffusers pipeline loaded onto a backend and called the XLA-friendly way, its patches as named hooks."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import os
import threading
from pathlib import Path

from tpugen.backends.base import Counters
from tpugen.config.request import MAX_STEPS, strength_to_run
from tpugen.engine.controls import combined, install_scale_as_data
from tpugen.engine.hooks import Hooks
from tpugen.engine.step_cache import install_step_cache, prepare_call, reset_step_cache, traceable_step_cache
from tpugen.engine.step_clock import StepClock, StepTiming
from tpugen.engine.tiling import circular_padding
from tpugen.errors import RunError
from tpugen.families import Family
from tpugen.families.base import TIMESTEPS_ON_HOST, timesteps_set_on_host
from tpugen.memory import is_out_of_memory
from tpugen.models import hub_failure
from tpugen.plan import Batch
from tpugen.schedulers import display_name, find_scheduler


def quiet_libraries() -> None:
    """Hide the libraries' own progress bars and chatter; tpugen reports progress itself."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def multi_control_images(per_row: list[list], layout: str) -> list:
    """Each row's control images (one per ControlNet, PIL) as a multi-ControlNet pipeline of `layout` takes them
    (ControlNets.multi_layout): the rows' lists; a list per ControlNet; or a batch tensor per ControlNet, its
    pixels in [0, 1] as diffusers' control image processor makes of a PIL image."""
    if layout == "rows":
        return per_row
    columns = [list(column) for column in zip(*per_row, strict=True)]
    if layout == "controlnets":
        return columns
    import numpy as np
    import torch

    return [
        torch.from_numpy(np.stack([np.asarray(image.convert("RGB")) for image in column])).permute(0, 3, 1, 2) / 255.0
        for column in columns
    ]


class LoadedPipeline:
    """A pipeline on its device, patched for XLA: a sync per step, CPU noise, one host read per batch.

    Graphs per shape key: text encoding (everything before the denoising loop), one denoising step
    (replayed for every step, the first included), and decoding with the conversion to pixels. Every patch is
    a named hook in `hooks`; removing them all leaves the pipeline as it was loaded.
    """

    def __init__(
        self, pipe, backend, family: Family, model_label: str, scheduler_name: str, controlnets: list | None = None
    ) -> None:
        self.pipe = pipe
        # model.controlnets on the device: the controlled pipelines (task_pipe) are made from the loaded
        # components with them, so they run inside the step graph beside the denoiser.
        self.controlnets = list(controlnets or [])
        self._residual_weights: list = []  # per ControlNet, what a call weighs its residuals by (controlnet_hooks)
        self.annotators: str | None = None  # model.annotators_dir: the weights of the control modules that need them
        self.backend = backend
        self.family = family
        self.model_label = model_label
        self.scheduler_name = scheduler_name
        self.hooks = Hooks()
        self._census: list[tuple[str, Counters]] | None = None
        self.phase_memory: dict[str, dict | None] = {}  # device memory after each phase of the last census
        self.running = "text encoders"  # what runs on the device now, for an out-of-memory message
        self.out_of_memory_advice = "`tpugen plan CONFIG` shows each component's size against the chip"
        self._loop_started = False
        self._pass = ""  # "hires " while a hires fix's second pass runs: its phases are counted apart
        self._steps_before = 0  # steps of the batch's passes before this one (on_step counts on through them)
        self.on_step = None  # called with each denoising step's number (1..steps) as it is handed to the device
        # Engines beside this one in the process, running at the same time (Engine.open's `neighbours`): the
        # backend's counters count their executions too, so the device's time per step is not read from them.
        self.neighbours = 0
        self._clock: StepClock | None = None  # the running call's
        self.step_timing: StepTiming | None = None  # the last call's host and device time per denoising step
        self.step_cache = None  # compile.step_cache once use_step_cache installed it
        # Why the last batch's loop ran a step at a time on a backend that runs whole loops (None: it ran whole),
        # and how many calls ran each way ("one call", or the reason), for the report.
        self.step_by_step: str | None = None
        self.loop_calls: dict[str, int] = {}
        # tpugen decodes the latents itself, so decoding and the conversion to pixels are one graph. A
        # safety checker or a watermark runs on the host, so pipelines with one keep their own path.
        host_steps = getattr(pipe, "safety_checker", None) is not None or getattr(pipe, "watermark", None) is not None
        self.decodes_itself = not host_steps
        self._schedulers = {scheduler_name: pipe.scheduler}
        self._max_steps: dict[str, int] = {}  # by scheduler name: max_steps's answers
        self._task_pipes: dict = {}  # img2img, inpaint and controlled pipelines made from pipe's components (task_pipe)
        self.default_scheduler = scheduler_name  # the one the model was loaded with (or the config named)
        self._sync_at_loop_start()
        family.install_hooks(pipe, backend.device, self.hooks)
        self._scheduler_hooks()

    # ---------------------------------------------------------------- the XLA patch layer

    def _sync_at_loop_start(self) -> None:
        """Cut the graph where the denoising loop starts.

        Everything before the loop (text encoding, time ids, guidance embeddings, latent set-up) becomes a
        graph of its own. Without the cut it would join the first denoising step, making that step a
        second, different denoiser graph to compile. diffusers' loops all begin by reading
        `self.interrupt`, so a per-instance subclass whose property syncs on the first read is the hook.
        """
        base = type(self.pipe)
        if self._patch_loop_start(self.pipe):

            def restore() -> None:
                self.pipe.__class__ = base

            self.hooks.add("graph cut at the loop start", restore)

    def _patch_loop_start(self, pipe) -> bool:
        """The loop-start cut on `pipe` (the loaded pipeline, or one made from its components for img2img):
        False where its class has no `interrupt` property to hook."""
        loaded = self
        base = type(pipe)
        if not isinstance(getattr(base, "interrupt", None), property):
            return False  # a pipeline without the hook: text encoding then joins the first step's graph

        def interrupt(pipe) -> bool:
            if not loaded._loop_started:
                loaded._loop_started = True
                loaded.backend.sync()
                loaded.running = loaded.family.denoiser
                loaded._mark(loaded._pass + "text encoding")
                if loaded._clock is not None:
                    loaded._clock.loop_started()
            return base.interrupt.fget(pipe)

        patches = {"interrupt": property(interrupt)}
        if getattr(self.backend, "assignment", None):
            # Components sit on several devices; the pipeline's own tensors belong on the denoiser's, not on
            # the first component's (which is what diffusers would pick).
            device = self.backend.device
            patches["_execution_device"] = property(lambda pipe: device)
        pipe.__class__ = type(base.__name__, (base,), patches)
        return True

    def task_pipe(self, task: str, controlled: bool = False):
        """The pipeline for a batch's task: the loaded one for txt2img; for img2img and inpaint diffusers' own
        pipeline of the family made from the same components (`AutoPipelineFor*.from_pipe`: no second load, the
        same fused LoRAs and hooks), patched the same way, with the scheduler in use now; `controlled`: diffusers'
        ControlNet pipeline of the task, made so with the ControlNets loaded. An edit by reference is the loaded
        pipeline's own call, given the references as its `image` list."""
        if task in ("txt2img", "edit") and not controlled:
            return self.pipe
        if (task, controlled) not in self._task_pipes:
            import diffusers

            auto = {
                "txt2img": diffusers.AutoPipelineForText2Image,
                "img2img": diffusers.AutoPipelineForImage2Image,
                "inpaint": diffusers.AutoPipelineForInpainting,
            }[task]
            extra = {"controlnet": combined(self.controlnets, self.family)} if controlled else {}
            kind = f"ControlNet {task}" if controlled else task
            if controlled and task in self.family.controlnet.pipelines:  # one AutoPipeline does not make
                auto = getattr(diffusers, self.family.controlnet.pipelines[task])
            try:
                made = auto.from_pipe(self.pipe, **extra)
            except (ValueError, KeyError) as exc:
                raise RunError(
                    f"{task}: diffusers 0.42 has no {kind} pipeline for {type(self.pipe).__name__} ({exc})"
                ) from None
            made.set_progress_bar_config(disable=True)
            self._patch_loop_start(made)
            # The family's patches on a pipeline object (its components' it shares): on a Hooks of its own.
            self.family.pipeline_hooks(made, Hooks())
            self._task_pipes[task, controlled] = made
        made = self._task_pipes[task, controlled]
        made.scheduler = self.pipe.scheduler
        return made

    def controlnet_hooks(self) -> None:
        """The ControlNets' patches, once the backend's are on (prepare_on_device): each traced once as the
        denoiser is, then its conditioning scale handed to it as data (outside the trace, which takes tensors)."""
        for n, controlnet in enumerate(self.controlnets):
            label = f"controlnet {n}" if len(self.controlnets) > 1 else "controlnet"
            self.family.controlnet_hooks(controlnet, self.backend.device, self.hooks, label)
            self.backend.trace_beside(controlnet, label, self.hooks, self.family.controlnet.traced_method)
        on_xla = str(self.backend.device).startswith("xla")
        parts = self.family.controlnet  # None: a family without ControlNets (then there are none to weigh)
        weighs = on_xla and parts is not None and parts.residual_weights_refusal is None
        self._residual_weights = install_scale_as_data(self.controlnets, self.hooks, weigh_always=weighs)

    def _scheduler_hooks(self) -> None:
        """The scheduler's patches: the family's, and a loop that starts at step 0, so the scheduler never
        searches its timesteps for the current one (`(timesteps == t).nonzero()`, a read back to the host
        inside the loop), as the PyTorch/XLA guide's scheduler fix does by passing the step index."""
        scheduler = self.pipe.scheduler
        self.family.scheduler_hooks(scheduler, self.hooks)
        on_xla = str(self.backend.device).startswith("xla")
        if self.controlnets and on_xla and TIMESTEPS_ON_HOST not in self.hooks.names():
            # diffusers' SD pipelines keep their timesteps on the host under XLA, as the UNet's step graph needs;
            # its ControlNet img2img and inpaint pipelines ask for them on the device, where the scheduler's
            # step reads one back (DDIM's `prev_timestep >= 0`) and bakes it into a graph per step.
            self.hooks.wrap(scheduler, "set_timesteps", TIMESTEPS_ON_HOST, timesteps_set_on_host)
        if hasattr(scheduler, "set_begin_index"):
            self.hooks.wrap(scheduler, "set_timesteps", FROM_STEP_ZERO, _from_step_zero(scheduler))
        if hasattr(scheduler, "sigmas") and hasattr(scheduler, "add_noise"):
            self.hooks.wrap(scheduler, "add_noise", NOISE_LEVEL_AS_DATA, _noise_level_as_data(scheduler))
        elif hasattr(scheduler, "sigmas") and hasattr(scheduler, "scale_noise"):  # flow matching: Flux and its kin
            self.hooks.wrap(scheduler, "scale_noise", NOISE_LEVEL_AS_DATA, _noise_level_as_data(scheduler, flow=True))
        elif isinstance(getattr(scheduler, "alphas_cumprod", None), torch_tensor_type()):
            self.hooks.wrap(scheduler, "add_noise", TABLES_ON_HOST, _tables_on_host(scheduler))

    def use_step_cache(self, config) -> None:
        """compile.step_cache's hooks on the denoiser (tpugen.engine.step_cache); each call sets its steps."""
        install_step_cache(self.pipe, self.family, config, self.hooks)
        trace = self.backend.trace_once
        if trace is not None and trace.on:  # the denoiser traced by dynamo: its cache's hooks with it
            traceable_step_cache(self.pipe, self.family, config, self.hooks)
        self.step_cache = config

    def use_scheduler(self, name: str | None) -> None:
        """Switch to the scheduler a user names (None: the one loaded), its hooks moved with it; the graphs
        of the denoiser stay the same, though a scheduler may compile its own step graph once."""
        choice = find_scheduler(name) if name else None
        wanted = choice.name if choice else next(iter(self._schedulers))
        if wanted == self.scheduler_name:
            return
        for hook in (FROM_STEP_ZERO, TIMESTEPS_ON_HOST, TABLES_ON_HOST, NOISE_LEVEL_AS_DATA):
            if hook in self.hooks.names():
                self.hooks.remove(hook)
        if wanted not in self._schedulers:
            import diffusers

            base = next(iter(self._schedulers.values()))
            scheduler_class = getattr(diffusers, choice.class_name)
            self._schedulers[wanted] = scheduler_class.from_config(base.config, **choice.options)
        self.pipe.scheduler = self._schedulers[wanted]
        self.scheduler_name = wanted
        self._scheduler_hooks()

    def max_steps(self, name: str | None) -> int:
        """The most steps, up to MAX_STEPS, that the scheduler a user names (None: the one loaded) runs on this
        model: each timestep it sets must index the model's noise tables (DDIM's 1000 steps of 1000, offset by 1,
        ask for timestep 1000: an IndexError in its step). Found once per scheduler, on the host, on a copy of it
        (the loaded one may be mid-call on a device thread)."""
        choice = find_scheduler(name) if name else None
        wanted = choice.name if choice else next(iter(self._schedulers))
        if wanted not in self._max_steps:
            import diffusers

            base = next(iter(self._schedulers.values()))
            scheduler_class = getattr(diffusers, choice.class_name) if choice else type(base)
            options = choice.options if choice else {}
            self._max_steps[wanted] = _most_steps(lambda: scheduler_class.from_config(base.config, **options))
        return self._max_steps[wanted]

    def _mark(self, phase: str) -> None:
        if self._census is not None:
            self._census.append((phase, self.backend.counters()))
            # With offload only this phase's component is on the device, so this is its footprint.
            self.phase_memory[phase] = self.backend.memory()

    def _step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        # Cut the lazy graph once per denoising step, so XLA compiles one step and replays it, even in
        # pipelines whose loop lacks diffusers' own mark_step.
        self.backend.sync()
        if self._clock is not None:
            self._clock.step_handed_off()
        if step == 0:
            self._mark(self._pass + "first denoising step")
        if self.on_step is not None:
            # The step is handed to the device here, not finished: nothing is read back to know that.
            self.on_step(self._steps_before + step + 1)
        return {}

    # ---------------------------------------------------------------- noise, call, decode

    def _initial_noise(self, batch: Batch, draw: bool = True):
        """Noise drawn on the CPU from one generator per image (seeded by the image's seed).

        The same seed gives the same noise on every backend and at every batch size; the generators
        are returned too, so schedulers that draw noise per step draw it per image as well. `draw` False:
        the generators only (None for the noise), for a pipeline that draws from them first.
        """
        import torch

        generators = [torch.Generator("cpu").manual_seed(row.seed) for row in batch.rows]
        if not draw:
            return None, generators
        noise = self.family.noise(self.pipe, generators, batch.shape.height, batch.shape.width)
        dtype = getattr(self.pipe, self.family.denoiser).dtype
        return self.backend.split_batch(torch.cat(noise).to(self.backend.device, dtype=dtype)), generators

    def _text_arguments(self, pipe, batch: Batch) -> dict:
        """The batch's prompts as `pipe` takes them: the family's reading (Family.text_arguments), in the batch's
        chunk count (tpugen.plan.WorkItem.chunks)."""
        shape = batch.shape
        syntax = batch.work.prompt_syntax
        return self.family.text_arguments(
            pipe, batch.rows, chunks=shape.chunks, syntax=syntax, cfg=shape.cfg, clip_skip=shape.clip_skip
        )

    def _call_arguments(self, batch: Batch, latents, generators) -> dict:
        rows = batch.rows
        arguments = {
            **self._text_arguments(self.pipe, batch),
            "height": batch.shape.height,
            "width": batch.shape.width,
            "num_inference_steps": batch.steps,
            "guidance_scale": batch.guidance_scale,
            "latents": latents,
            "generator": generators,
            "output_type": "latent" if self.decodes_itself else "pt",
            "callback_on_step_end": self._step_end,
        }
        arguments.update(self.family.call_arguments(self.pipe, rows, batch.guidance_scale))
        for name in self.family.arguments_not_taken:
            arguments.pop(name, None)
        return arguments

    def _image_arguments(self, batch: Batch, pipe) -> dict:
        """An img2img or inpaint call's arguments: each row's images read and fitted to the batch's size on the
        host (img2img_arguments does the rest)."""
        from tpugen.engine import images

        shape = batch.shape
        sources = [row.source for row in batch.rows]
        fitted = [images.load(s.init_image, shape.width, shape.height, s.resize_mode) for s in sources]
        extra = {}
        if shape.task == "inpaint":
            extra["mask_image"] = [
                images.load(
                    s.mask_image,
                    shape.width,
                    shape.height,
                    s.resize_mode,
                    mask=True,
                    image_size=images.size_of(s.init_image),
                )
                for s in sources
            ]
        extra.update(self._control_arguments(batch, "control_image"))
        return self._img2img_arguments(
            pipe, batch, fitted, batch.strength, shape.height, shape.width, batch.steps, extra
        )

    def _control_arguments(self, batch: Batch, image_key: str | None = None) -> dict:
        """A controlled batch's ControlNet arguments (none for another): each row's control images made on the
        host (fitted to the batch's size, then preprocessed), under `image_key` (img2img and inpainting pipelines
        take them as control_image; None: the family's txt2img pipeline's argument); the units' scale, start and
        end, one per call (tpugen.plan.plan_batches)."""
        if not batch.shape.controls:
            return {}
        image_key = image_key or self.family.controlnet.image_argument
        from tpugen.engine.controls import control_image

        shape, units = batch.shape, batch.work.controls.units
        # Per row, each unit's image, laid out as the family's multi-ControlNet pipeline of the task takes them
        # (ControlNets.multi_layout, and multi_layout_from_image for img2img and inpainting).
        made: dict = {}  # each distinct unit's control made once (padding rows repeat the last item's units)

        def control(unit):
            if unit not in made:
                made[unit] = control_image(unit, shape.width, shape.height, self.annotators)
            return made[unit]

        per_row = [[control(unit) for unit in row.controls.units] for row in batch.rows]
        for weighs, unit in zip(self._residual_weights, units, strict=False):
            weighs.unit, weighs.rows = unit, len(batch.rows)
        # Per-residual weights stand in for the scale (tpugen.config.controls.residual_factors).
        scales = [1.0 if unit.layer_weights is not None else unit.scale for unit in units]
        single = len(units) == 1
        if single:
            images = [row[0] for row in per_row]
        else:
            family = self.family
            parts = family.controlnet
            layout = parts.multi_layout if shape.task == "txt2img" else parts.multi_layout_from_image
            images = multi_control_images(per_row, layout)
        arguments = {
            image_key: images,
            "controlnet_conditioning_scale": scales[0] if single else scales,
            "control_guidance_start": units[0].start if single else [u.start for u in units],
            "control_guidance_end": units[0].end if single else [u.end for u in units],
        }
        if self.family.controlnet.window_refusal:  # its pipelines take no window (units run 0 to 1: the door's)
            del arguments["control_guidance_start"], arguments["control_guidance_end"]
        if not single and shape.task != "txt2img":
            # Flux.1's ControlNet img2img and inpaint pipelines zip the ControlNets with their modes (a Union one's
            # control type; Union ones are refused at the door): without a list of one per ControlNet none runs.
            # Pipelines without the argument drop it.
            arguments["control_mode"] = [None] * len(units)
        return arguments

    def _references(self, batch: Batch) -> list:
        """An edit's references (every row's: a batch has one set), read and fitted to the batch's size on the
        host, as PIL images the pipeline encodes once before its loop."""
        from tpugen.engine import images

        references, shape = batch.work.references, batch.shape
        return [
            images.load(image.path, shape.width, shape.height, references.resize_mode) for image in references.images
        ]

    def _img2img_arguments(self, pipe, batch: Batch, image, strength, height, width, steps, extra=None) -> dict:
        """The call of an img2img or inpaint pipeline (`pipe`) from `image`, for a batch's rows: no latents:
        diffusers noises the encoded image itself, drawing the noise from each image's CPU generator (as it would
        on the CPU), and runs `strength` of the `steps`; only the arguments its pipeline takes."""
        import torch

        rows = batch.rows
        arguments = {
            **self._text_arguments(pipe, batch),
            "image": image,
            "strength": strength_to_run(steps, strength),
            "height": height,
            "width": width,
            "num_inference_steps": steps,
            "guidance_scale": batch.guidance_scale,
            "generator": [torch.Generator("cpu").manual_seed(row.seed) for row in rows],
            "output_type": "latent" if self.decodes_itself else "pt",
            "callback_on_step_end": self._step_end,
            **(extra or {}),
        }
        arguments.update(self.family.call_arguments(pipe, rows, batch.guidance_scale))
        accepted = inspect.signature(type(pipe).__call__).parameters
        return {key: value for key, value in arguments.items() if key in accepted}

    def _decode(self, latents, height: int, width: int):
        """Latents to pixels in [0, 1], as each family's pipeline would, as one graph (a backend with a decoder of
        its own runs the family's decode there)."""
        decode = getattr(self.backend, "decode", None)
        if decode is not None:
            method = "decode_loop_latents" if self.step_by_step is None else "decode"
            return decode(self.family, self.pipe, latents, height, width, method)
        return self.family.decode(self.pipe, latents, height, width, self.backend.device_for("vae"))

    def _count_loop(self, how: str) -> None:
        self.loop_calls[how] = self.loop_calls.get(how, 0) + 1

    def _step_by_step(self, pipe, arguments: dict):
        """diffusers' own loop, its denoiser called a step at a time."""
        output = pipe(**arguments).images
        self._clock.loop_ended()
        self._mark("later denoising steps")
        return output

    def _denoise(self, pipe, arguments: dict, *, task: str, steps: int, phase: str = "denoising loop"):
        """The pipeline's call (of `task`, `steps` denoising steps) up to its final latents: diffusers' own loop, a
        step at a time; or, on a backend that runs whole loops, the pipeline stopped at its first denoiser call
        and the rest of the loop handed to the device as one call (tpugen.engine.whole_loop), its phase counted
        as `phase`."""
        if not getattr(self.backend, "whole_loop", False):
            return self._step_by_step(pipe, arguments)
        import time

        from tpugen.engine.whole_loop import FirstCall, NoWholeLoop, loop_work, no_whole_loop, stopped_at_first_call

        self.step_by_step = no_whole_loop(self.family)
        if self.step_by_step is not None:
            self._no_step_cache_step_by_step(self.step_by_step)
            self._count_loop(self.step_by_step)
            return self._step_by_step(pipe, arguments)
        try:
            with stopped_at_first_call(pipe, getattr(self.pipe, self.family.denoiser)), self.backend.shapes_beside():
                pipe(**arguments)
            raise RunError(f"{type(pipe).__name__} returned without calling its {self.family.denoiser}")
        except FirstCall as call:
            first = call
        start = time.perf_counter()  # the loop's host work from here: read the call, draw noise, hand it over
        try:
            work = loop_work(self.family, first, task, self.backend.noise_bucket)
        except NoWholeLoop as exc:
            self._no_step_cache_step_by_step(str(exc))
            self.step_by_step = str(exc)
            self._count_loop(self.step_by_step)
            # The pipeline encodes its prompts again, then runs its own loop: its phases are counted from the start.
            self._loop_started = False
            if self._census is not None:
                self._census = self._census[:1]
            return self._step_by_step(pipe, arguments)
        self.step_by_step = None
        self._count_loop(ONE_CALL)
        self.running = self.family.denoiser
        latents = self.backend.run_loop(work)
        handed_off = time.perf_counter()
        self.backend.wait()
        self._clock.whole_loop(steps, handed_off - start, time.perf_counter() - handed_off)
        self._mark(phase)
        if self.on_step is not None:
            self.on_step(self._steps_before + steps)
        return latents

    def _no_step_cache_step_by_step(self, why: str) -> None:
        """A step cache runs inside the whole loop only (its hooks decide as the loop is traced call by call): a
        loop that must run a step at a time, where a jitted denoiser would keep its first trace's decision for
        every step, is refused naming why."""
        if self.step_cache is not None and self.step_cache.method != "none":
            raise RunError(
                f"compile.step_cache: {self.step_cache.method} on a backend that runs whole loops needs the loop as "
                f"one call, and this batch's runs a step at a time: {why}"
            )

    def _hires_pass(self, batch: Batch, latents) -> tuple:
        """Hires fix's second pass on the first pass's `latents`: scaled up (latent: bilinearly, on the device;
        lanczos: decoded, read back, resized by PIL on the host), then diffusers' img2img of the family at the
        larger size for the hires steps at its strength, each image's noise from a generator of its seed.
        Returns its output, its size (height, width) and whether the output is pixels already; its phases are
        counted as "hires ..." ones. At denoising strength 0 there is no second pass, as in the web UI: the
        output is the upscale alone (latent: the scaled latents decoded; lanczos: the resized pixels)."""
        from tpugen.engine import images

        hires, shape = batch.hires, batch.shape
        height, width = hires.size(shape.height, shape.width, self.family.size_multiple)
        whole_loop = getattr(self.backend, "whole_loop", False)
        if hires.upscaler == "latent":
            if whole_loop:  # the first loop's latents are on its device: read back, as the pipeline returns them
                latents = self.backend.read_latents(latents)
            image = self.family.upscale_latents(self.pipe, latents, shape.height, shape.width, height, width)
            if hires.strength == 0:
                self.running = "vae"
                return (
                    self.family.decode_upscaled(self.pipe, image, height, width, self.backend.device_for("vae")),
                    height,
                    width,
                    True,
                )
        else:
            self.running = "vae"
            pixels = self._decode(latents, shape.height, shape.width).to("cpu").float()
            self._mark("first-pass decoding")
            image = [images.upscale(picture, width, height) for picture in pixels]
            if hires.strength == 0:
                return images.as_tensor(image), height, width, True
        pipe = self.task_pipe("img2img")
        arguments = self._img2img_arguments(pipe, batch, image, hires.strength, height, width, hires.schedule_steps)
        self._loop_started, self._pass, self._steps_before = False, "hires ", batch.steps
        self.running = "text encoders"
        if whole_loop:  # the second pass's loop one call too
            output = self._denoise(pipe, arguments, task="img2img", steps=hires.steps, phase="hires denoising loop")
            return output, height, width, False
        output = pipe(**arguments).images
        self._clock.loop_ended()
        self._mark("hires later denoising steps")
        return output, height, width, False

    def generate(self, batch: Batch, census: bool = False):
        """Run one batch; returns uint8 HxWx3 arrays for its real (unpadded) rows.

        With `census`, also returns {"graphs": graphs compiled per phase, "compile_seconds": their compile
        seconds per phase, "graphs_run": lazy graphs looked up in the compile cache per phase, compiled or found}
        (None where nothing counts compiles; compile seconds and lookups are XLA's only).
        """
        import numpy as np
        import torch

        start = self.backend.counters() if census else None
        self._census = [("start", start)] if start is not None else None
        self.phase_memory = {}
        self._loop_started, self._pass, self._steps_before = False, "", 0
        self.running = "text encoders"
        self._clock, self.step_timing = StepClock(self.backend, device_measured=not self.neighbours), None
        try:
            pipe = self.task_pipe(batch.shape.task, controlled=bool(batch.shape.controls))
            if batch.shape.task in ("txt2img", "edit"):
                # Flux.1's ControlNet pipeline samples the control's latents from the generators, then the noise.
                drawn_by_pipeline = bool(batch.shape.controls) and self.family.controlnet.samples_control_first
                latents, generators = self._initial_noise(batch, draw=not drawn_by_pipeline)
                arguments = self._call_arguments(batch, latents, generators)
                if batch.shape.task == "edit":
                    arguments["image"] = self._references(batch)
                arguments.update(self._control_arguments(batch))
            else:
                arguments = self._image_arguments(batch, pipe)
            if batch.hires is not None:
                arguments["output_type"] = "latent"  # the second pass starts from them, or from their pixels
            reset_step_cache(self.pipe, self.family)  # a call that failed halfway left its step cache's state
            if self.step_cache is not None:
                prepare_call(pipe, self.family, self.step_cache, batch.steps, task=batch.shape.task)
            height, width = batch.shape.height, batch.shape.width
            with torch.no_grad(), self._padding(batch):  # inference_mode tensors break torch_xla (version counters)
                output = self._denoise(pipe, arguments, task=batch.shape.task, steps=batch.steps)
                ready = False  # pixels already: a hires fix's upscale alone (denoising strength 0)
                if batch.hires is not None:
                    output, height, width, ready = self._hires_pass(batch, output)
                self.running = "vae"
                images = self._decode(output, height, width) if self.decodes_itself and not ready else output
                # The one read back to the host for the whole batch. Padding rows are dropped on the host:
                # slicing on the device would be a new graph for every count of real rows.
                host = images.to("cpu").float()[: len(batch.items)]
                self._mark("decoding")
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            raise RunError(
                f"out of memory on the device while the {self.running} ran ({batch.shape}): {self.out_of_memory_advice}"
            ) from exc
        finally:
            self.step_timing, self._clock = self._clock.timing(), None
        pixels = (host.permute(0, 2, 3, 1).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
        counted = self._per_phase()
        self._census = None
        return (list(pixels), counted) if census else list(pixels)

    def _padding(self, batch: Batch):
        """The batch's convolution padding: a tiled batch's denoiser and VAE pad circularly for this call (both
        passes of a hires fix, an img2img call's image encoding too), and as loaded again after it."""
        if not batch.shape.tiling:
            return contextlib.nullcontext()
        components = (getattr(self.pipe, name, None) for name in (self.family.denoiser, "vae"))
        return circular_padding(component for component in components if component is not None)

    def _per_phase(self) -> dict | None:
        if self._census is None:
            return None
        marks = zip(self._census, self._census[1:], strict=False)
        deltas = {phase: after - before for (_, before), (phase, after) in marks}

        def per_phase(field: str) -> dict | None:
            values = {phase: getattr(delta, field) for phase, delta in deltas.items()}
            return values if all(v is not None for v in values.values()) else None

        return {
            "graphs": per_phase("compiles"),
            "compile_seconds": per_phase("compile_seconds"),
            "graphs_run": per_phase("graph_lookups"),
        }


def _most_steps(make) -> int:
    """The most steps, up to MAX_STEPS, for which a fresh scheduler from `make()` sets timesteps that index its
    noise tables (alphas_cumprod; a scheduler without them takes any)."""

    def runs(steps: int) -> bool:
        scheduler = make()
        tables = getattr(scheduler, "alphas_cumprod", None)
        try:
            scheduler.set_timesteps(steps)
        except (ValueError, IndexError, TypeError):
            return False
        timesteps = scheduler.timesteps
        if len(timesteps) == 0:
            return False
        return tables is None or 0 <= float(timesteps.min()) and float(timesteps.max()) < len(tables)

    if runs(MAX_STEPS) or not runs(1):  # not even one step: it needs its pipeline's own arguments (Flux's mu)
        return MAX_STEPS
    runs_at, fails_at = 1, MAX_STEPS
    while runs_at + 1 < fails_at:
        middle = (runs_at + fails_at) // 2
        runs_at, fails_at = (middle, fails_at) if runs(middle) else (runs_at, middle)
    return runs_at


FROM_STEP_ZERO = "scheduler starts at step 0"
ONE_CALL = "one call"  # a batch's denoising loop ran as one call (LoadedPipeline.loop_calls)
TABLES_ON_HOST = "scheduler tables stay on the host"
NOISE_LEVEL_AS_DATA = "noise level handed in as data"


def _noise_level_as_data(scheduler, *, flow: bool = False):
    """img2img's noising (and inpainting's, every step) by a sigma scheduler (Euler, DPM++, UniPC, ...): its
    add_noise looks the noise level up by its begin or step index, a host number torch_xla bakes into the graph,
    so each strength, step count and step compiled anew. Every add_noise is a*x + s*noise for the level's a and s:
    computed by the scheduler's own add_noise on the host (from ones and zeros) and handed to the device as data,
    one graph for any of them. Without a begin index it looks the timestep up instead; that call is left alone."""

    def make(add_noise):
        def levels(sample, noise_like):
            import torch

            shape = (sample.shape[0],) + (1,) * (sample.ndim - 1)
            ones, zeros = torch.ones(shape, dtype=sample.dtype), torch.zeros(shape, dtype=sample.dtype)
            steps = torch.zeros(shape[0])  # unread: with a begin index the scheduler counts steps itself
            if flow:  # scale_noise(sample, timestep, noise)
                return add_noise(ones, steps, zeros), add_noise(zeros, steps, ones)
            return add_noise(ones, zeros, steps), add_noise(zeros, ones, steps)

        @functools.wraps(add_noise)
        def add_noise_as_data(*args, **kwargs):
            sample = args[0] if args else kwargs.get("original_samples", kwargs.get("sample"))
            if getattr(scheduler, "begin_index", None) is None or sample.device.type == "cpu":
                return add_noise(*args, **kwargs)
            if flow:
                noise = args[2] if len(args) > 2 else kwargs["noise"]
            else:
                noise = args[1] if len(args) > 1 else kwargs["noise"]
            scale, level = (value.to(sample.device) for value in levels(sample, noise))
            return sample * scale + noise * level

        return add_noise_as_data

    return make


def torch_tensor_type():
    import torch

    return torch.Tensor


def _tables_on_host(scheduler):
    """img2img's add_noise (DDIM, DDPM, PNDM) moves the scheduler's alphas_cumprod onto the device for good; each
    step then indexes it by the step's timestep, which torch_xla bakes in as a constant: a new step graph every
    step. Put back where it was (the host, as txt2img keeps it), the step indexes it as it does in txt2img."""

    def make(add_noise):
        @functools.wraps(add_noise)
        def add_noise_keeping_tables(*args, **kwargs):
            table = scheduler.alphas_cumprod
            try:
                return add_noise(*args, **kwargs)
            finally:
                scheduler.alphas_cumprod = table

        return add_noise_keeping_tables

    return make


def _from_step_zero(scheduler):
    def make(set_timesteps):
        @functools.wraps(set_timesteps)
        def set_timesteps_from_zero(*args, **kwargs):
            result = set_timesteps(*args, **kwargs)
            scheduler.set_begin_index(0)
            return result

        return set_timesteps_from_zero

    return make


# ---------------------------------------------------------------- reading a model from disk


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# Ranks that are threads of one process (torch_xla.launch on CPU) share one copy read from disk; this is
# state of the process, not of any rank, and the lock also keeps diffusers' loaders (from_pretrained, and
# the LoRA loaders through peft, which patch torch.nn process-wide while they run) from ever running in two
# threads at once.
_HOST_COPIES: dict[tuple, tuple] = {}
LOADER_LOCK = threading.Lock()


def read_from_disk(model, source, family: Family) -> tuple:
    """(pipeline on the host CPU, model label, scheduler name) for the config's model section."""
    quiet_libraries()
    from diffusers import DiffusionPipeline

    if source.kind == "builtin":
        from tpugen.tiny import builtin_path

        location, label = str(builtin_path(source.ref)), source.ref
    else:
        location = source.ref
        label = Path(source.ref).name if source.kind == "local" else source.ref

    options = {"dtype": torch_dtype(model.dtype), "trust_remote_code": model.allow_remote_code}
    if model.revision:
        options["revision"] = model.revision
    if model.variant:
        options["variant"] = model.variant
    if model.custom_pipeline:
        options["custom_pipeline"] = model.custom_pipeline
    options.update(family.load_options(model))
    try:
        # Some components print to stdout while loading; keep the CLI's output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            pipe = DiffusionPipeline.from_pretrained(location, **options)
    except Exception as exc:  # any loader failure becomes one line naming the model
        why = hub_failure(exc, from_hub=source.kind == "hub")
        raise RunError(f"model.id: cannot load {model.id!r}: {why}") from exc

    if model.scheduler:
        import diffusers

        choice = find_scheduler(model.scheduler)
        scheduler_class = getattr(diffusers, choice.class_name)
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config, **choice.options)
        scheduler_name = choice.name
    else:
        scheduler_name = display_name(type(pipe.scheduler).__name__, dict(pipe.scheduler.config))
    return pipe, label, scheduler_name


def read_shared(model, source, family: Family, *, ranks_in_process: int = 1) -> tuple:
    """read_from_disk, once per process when several ranks share it (each rank gets its own deep copy)."""
    with LOADER_LOCK:
        if ranks_in_process <= 1:
            return read_from_disk(model, source, family)
        key = (model.model_dump_json(), source)
        if key not in _HOST_COPIES:
            _HOST_COPIES[key] = read_from_disk(model, source, family)
        shared, label, scheduler_name = _HOST_COPIES[key]
        return copy.deepcopy(shared), label, scheduler_name
