"""What the server keeps warm: its engines, once opened, and the shape keys x samplers they compile before the
first request (serve.sizes x serve.schedulers x serve.tasks, and the config's hires fix)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tpugen.config import ResolvedRun, run_sizes
from tpugen.config.controls import Controls, ControlUnit, control_name
from tpugen.config.hires import HiresFix
from tpugen.config.images import ImageSource, InputImage, References
from tpugen.config.schema import step_cache_options_text
from tpugen.engine import Display, Engine
from tpugen.engine.step_cache import warm_steps
from tpugen.families import FAMILIES
from tpugen.modes.serve.input_images import InputImages
from tpugen.plan import Batch, RunPlan, WorkItem, hires_fix
from tpugen.prompt_reading import PromptReader
from tpugen.schedulers import find_scheduler


class WarmEngines:
    """The server's engines (one per device under execution.mode: multi; none until they are opened) and what
    they keep warm: serve.sizes x serve.schedulers, at the config's batch size, guidance and steps."""

    def __init__(self, run: ResolvedRun, engines: list[Engine], *, inputs: InputImages) -> None:
        config = run.config
        self.run = run
        self.engines = engines
        self.inputs = inputs  # where the warmup's input images are stored
        self.family = FAMILIES[run.family]
        self.batch_size = config.batch_size
        self.serve = config.serve
        self.sizes = [tuple(s) for s in self.serve.sizes] if self.serve.sizes else list(run_sizes(config))
        self.cfg = self.family.uses_cfg(config.guidance_scale)
        self.schedulers = [None, *(find_scheduler(name).name for name in self.serve.schedulers)]
        # The prompt chunk counts warmed (serve.prompt_chunks), where prompts are read in chunks at all.
        self.chunk_counts = list(self.serve.prompt_chunks) if self.reader.chunked else [1]
        # The reference counts an edit is warm for (serve.reference_counts), where edits are warmed at all.
        self.reference_counts = list(self.serve.reference_counts) if "edit" in self.serve.tasks else []
        # The server's ControlNets (model.controlnets): txt2img is warm with all of them as well, and img2img and
        # inpaint where the family's ControlNets take an image.
        self.controlnets = [c.id for c in config.model.controlnets]
        known = self.controlnet_configs()
        parts = self.family.controlnet
        controlled = ["txt2img", *(t for t in ("img2img", "inpaint") if parts and not parts.refusal(t, known))]
        self.controlled_tasks = [task for task in self.serve.tasks if task in controlled] if self.controlnets else []
        # Each (shape key, scheduler) warmup compiles, one at a time so /readyz can count them.
        plan = self.plan()
        self.keys = [(batch, scheduler) for scheduler in self.schedulers for batch in plan.batches]

    def controlnet_configs(self) -> list[dict]:
        """The configs of the ControlNets the engines loaded (none until they are open)."""
        loaded = getattr(self.engines[0].loaded, "controlnets", []) if self.engines else []
        return [dict(controlnet.config) for controlnet in loaded]

    @property
    def reader(self) -> PromptReader:
        """How the server reads prompts: with the textual-inversion embeddings its engines hold (`embeddings`)."""
        return PromptReader.of(self.run, self.embeddings())

    def text_layers(self) -> int:
        """The layers of the first text encoder (a clip skip's bound; 12 until the engines are open)."""
        pipe = getattr(self.engines[0].loaded, "pipe", None) if self.engines else None
        config = getattr(getattr(pipe, "text_encoder", None), "config", None)
        return getattr(config, "num_hidden_layers", 12)

    def embeddings(self) -> tuple:
        """The embeddings the engines loaded (model.embeddings and serve.embeddings_dir's); model.embeddings until
        they are open."""
        return self.engines[0].embeddings if self.engines else self.run.embeddings

    def skipped_embeddings(self) -> tuple:
        """The files of serve.embeddings_dir that did not load (none until the engines are open)."""
        return self.engines[0].skipped_embeddings if self.engines else ()

    def warm_up(self, display: Display, warming: Callable[[], bool]) -> None:
        """Warm every engine for every key, while `warming()` says the server still is (a signal stops it between
        shape keys)."""
        # One engine at a time: the first compiles, the others find its graphs in the process's cache.
        for engine in self.engines:
            engine.backend.bind_thread()
            # A flash attention fallback (once per engine) forgets every key warmed before it: a second
            # pass compiles those again without the kernel.
            for _ in range(2):
                for batch, scheduler in self.keys:
                    if not warming():
                        return
                    if not engine.is_warm(batch.shape, scheduler, batch.steps):
                        engine.warmup(RunPlan(batch.items, (batch,)), display, scheduler=scheduler)
                if all(engine.is_warm(batch.shape, scheduler, batch.steps) for batch, scheduler in self.keys):
                    break

    def plan(self) -> RunPlan:
        """One batch per warm size (with serve.tiling each once more, tiled; an edit once per reference count), at
        the config's guidance and steps, or under a step cache at the steps that compile every kind of step a
        request of any step count runs (`warm_steps`)."""
        config = self.run.config
        # backend jax traces a cached loop call by call: a program per step count, warmed at the config's.
        steps = warm_steps(config.compile.step_cache, config.steps, per_count=config.execution.backend == "jax")
        batches = []
        kinds = [(task, None, 0, False) for task in self.serve.tasks if task != "edit"]
        kinds += [("edit", None, count, False) for count in self.reference_counts]
        if config.hires is not None and "txt2img" in self.serve.tasks:  # the config's hires fix, for enable_hr
            kinds.append(("txt2img", hires_fix(config.hires, steps), 0, False))
        # The web UI's ControlNet units, on txt2img (and img2img and inpaint where the family's ControlNets take them).
        kinds += [(task, None, 0, True) for task in self.controlled_tasks]
        shapes = [(*kind, chunks) for kind in kinds for chunks in self.chunk_counts]
        tilings = (False, True) if self.serve.tiling else (False,)  # serve.tiling: every warm shape tiled too
        for tiling, (task, hires, refs, controlled, chunks) in itertools.product(tilings, shapes):
            source, references = self._source(task, controlled), self._references(refs)
            controls = self._controls() if controlled else None
            for height, width in self.sizes:
                item = WorkItem(
                    index=0,
                    prompt="warmup",
                    negative_prompt="",
                    seed=0,
                    steps=steps,
                    guidance_scale=config.guidance_scale,
                    height=height,
                    width=width,
                    cfg=self.cfg,
                    source=source,
                    hires=hires,
                    chunks=chunks,
                    prompt_syntax=config.prompt_syntax,
                    tiling=tiling,
                    clip_skip=config.clip_skip,
                    references=references,
                    controls=controls,
                )
                shape = item.shape(self.batch_size)
                batches.append(Batch(number=len(batches), shape=shape, items=(item,), padding=self.batch_size - 1))
        return RunPlan(tuple(b.items[0] for b in batches), tuple(batches))

    def _source(self, task: str, controlled: bool = False) -> ImageSource | None:
        """The input images an img2img or inpaint warmup call starts from: mid grey, the mask's right half white
        (the graphs depend on the sizes alone, and each call fits its images to its size); at strength 1 where the
        family's ControlNet inpaints only so (`controlled`)."""
        if task not in ("img2img", "inpaint"):
            return None
        from PIL import Image

        init = self._grey()
        mask = None
        if task == "inpaint":
            half = Image.new("L", (64, 64), 0)
            half.paste(255, (32, 0, 64, 64))
            mask = self.inputs.store(_png(half), "warmup")
        full = controlled and task == "inpaint" and self.family.controlnet.inpaint_strength_refusal
        return ImageSource(init[0], init[1], 1.0 if full else 0.75, 0, *(mask or (None, None)))

    def _references(self, count: int) -> References | None:
        """The references an edit warmup call of `count` references gives: mid grey each (the graphs depend on
        their count and the size alone: each is fitted to the call's size)."""
        if not count:
            return None
        return References((InputImage(*self._grey()),) * count)

    def _controls(self) -> Controls:
        """The units a controlled warmup call gives: mid grey for each ControlNet (the graphs depend on their count
        and the size alone; a unit's scale, start and end are data)."""
        grey = InputImage(*self._grey())
        return Controls(tuple(ControlUnit(grey) for _ in self.controlnets))

    def _grey(self) -> tuple[str, str]:
        """(path, sha256) of a mid-grey image stored for warmup calls to start or edit from."""
        from PIL import Image

        return self.inputs.store(_png(Image.new("RGB", (64, 64), (128, 128, 128))), "warmup")

    def hires_warm(self, hires: HiresFix) -> bool:
        """Whether the server's config warms hires fix at this scale and upscaler (its steps are data)."""
        own = self.run.config.hires
        return own is not None and hires_fix(own, 1).shape_label == hires.shape_label

    def hires_summary(self) -> str:
        own = self.run.config.hires
        if own is None:
            return "the server's config has no hires section"
        return f"the server's config warms hires x{own.scale:g} {own.upscaler}"

    def summary(self) -> str:
        sizes = ", ".join(f"{w}x{h}" for h, w in self.sizes)
        names = ", ".join(s or self.engines[0].loaded.default_scheduler for s in self.schedulers)
        summary = f"sizes {sizes} (width x height; {'cfg' if self.cfg else 'no cfg'}, batch {self.batch_size}); samplers {names}"
        if self.serve.tasks != ["txt2img"]:
            summary += f"; tasks {', '.join(self.serve.tasks)}"
        if self.reference_counts:
            counts = ", ".join(map(str, self.reference_counts))
            summary += f"; edits with {counts} reference{'s' if self.reference_counts != [1] else ''}"
        if self.chunk_counts != [1]:
            summary += f"; prompt chunks {', '.join(map(str, self.chunk_counts))}"
        if self.serve.tiling:
            summary += "; tiled and untiled"
        if self.controlnets:
            summary += f"; ControlNet units for {', '.join(control_name(c) for c in self.controlnets)}"
        if self.run.config.hires is not None and "txt2img" in self.serve.tasks:
            summary += f"; hires fix x{self.run.config.hires.scale:g} {self.run.config.hires.upscaler}"
        cache = self.run.config.compile.step_cache
        if cache.method != "none":
            # One per server: the hooks are on the loaded denoiser, so no request or run can switch it.
            options = step_cache_options_text(cache.options())
            summary += f"; step cache {cache.method} ({options}), the server's only one, warm for any steps"
        return summary

    def progress(self) -> tuple[int, int]:
        """(shape keys x schedulers x engines compiled so far, how many there are to compile)."""
        engines = list(self.engines)
        done = sum(engine.is_warm(batch.shape, s, batch.steps) for engine in engines for batch, s in self.keys)
        return done, len(self.keys) * max(len(engines), 1)

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


def _png(image) -> bytes:
    """A PIL image as PNG bytes."""
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
