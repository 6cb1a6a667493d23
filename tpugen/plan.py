"""Turning a resolved config into work: image indices, seeds, shape keys and padded batches (pure)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from tpugen.config import ResolvedRun
from tpugen.config.controls import Controls
from tpugen.config.hires import HiresFix
from tpugen.config.images import ImageSource, References
from tpugen.config.loras import loras_key
from tpugen.config.prompts import planned_images
from tpugen.config.request import ImageRequest
from tpugen.families import FAMILIES
from tpugen.prompt_reading import PromptReader


@dataclass(frozen=True, kw_only=True)
class ImageWork(ImageRequest):
    """Everything one image asks for: a run's prompt at one size (work_items) and a server's request
    (tpugen.modes.serve) alike. Its task, the key that decides which images share a pipeline call and the shape
    it compiles to are derived here and nowhere else. A new per-image option is a field here and the places that
    act on it.

    `cfg`, `chunks` and `prompt_syntax` are how the model reads the image: whoever knows the model fills them (a
    run's plan; a server's admission, once a request's rules are checked)."""

    # Classifier-free guidance (guidance above 1, in families that have it) doubles the denoiser's batch, so it
    # is part of the compiled shape.
    cfg: bool = True
    scheduler: str | None = None  # a request's sampler (find_scheduler's name); None: the pipeline's own
    loras: tuple = ()  # a request's <lora:NAME:SCALE> (tpugen.config.loras.Lora), fused for it; a run fuses at load
    source: ImageSource | None = None  # img2img and inpainting: what the image starts from
    hires: HiresFix | None = None  # hires fix: a second, img2img pass at a larger size (steps resolved)
    # 75-token chunks the text encoders take for its prompt and negative prompt, the longer of the two
    # (tpugen.families.prompt_syntax): the denoiser's text length, so part of the compiled shape.
    chunks: int = 1
    tiling: bool = False  # seamless tiling: the convolutions pad circularly, another graph
    prompt_syntax: str = "webui"  # how its prompts are read (RunConfig.prompt_syntax): a call has one
    clip_skip: int = 1  # the text encoder layer its prompts are read from, counted from the last (RunConfig.clip_skip)
    references: References | None = None  # an edit by reference: the images it edits from
    controls: Controls | None = None  # its control images, one per ControlNet

    @property
    def task(self) -> str:
        """txt2img, img2img (from an init image), inpaint (an init image and a mask) or edit (by reference)."""
        if self.references is not None:
            return "edit"
        return self.source.task if self.source else "txt2img"

    @property
    def strength(self) -> float | None:
        return self.source.strength if self.source else None

    @property
    def steps_in_all(self) -> int:
        """The steps its call runs: with a hires fix, its second pass's too."""
        return self.steps + (self.hires.steps if self.hires else 0)

    def refusals(self, family) -> dict[str, str]:
        """What `family` (tpugen.families.Family) cannot do of this work, by part (Family.refusals)."""
        return family.refusals(
            image=self.source is not None,
            edit=self.references is not None,
            tiling=self.tiling,
            clip_skip=self.clip_skip,
            hires_upscaler=self.hires.upscaler if self.hires else None,
        )

    def shape(self, batch_size: int) -> ShapeKey:
        """The compiled shape a call of `batch_size` rows like this one runs at."""
        return ShapeKey(
            height=self.height,
            width=self.width,
            batch_size=batch_size,
            cfg=self.cfg,
            task=self.task,
            hires=self.hires.shape_label if self.hires else "",
            chunks=self.chunks,
            tiling=self.tiling,
            clip_skip=self.clip_skip,
            references=self.references.count if self.references else 0,
            controls=self.controls.count if self.controls else 0,
        )

    @cached_property
    def call_key(self) -> tuple:
        """Equal for images that can share a pipeline call: one shape, and what diffusers takes once per call
        (steps, guidance, img2img's strength, the hires pass, an edit's references, which the pipeline gives every
        row, each ControlNet's scale, start and end), the sampler and the LoRAs fused. What stays each image's
        own: its prompts, seed, input images and control images."""
        controls = self.controls.call_key if self.controls else None
        shared = (self.steps, self.guidance_scale, self.strength, self.prompt_syntax, self.hires, self.references)
        return (self.shape(1), *shared, controls, self.scheduler, loras_key(self.loras))


@dataclass(frozen=True, kw_only=True)
class WorkItem(ImageWork):
    """One image's work at its place in a run (or, for a server's request, in its batch). Its index, seed and file
    name never depend on batching or on the device."""

    index: int
    prompt_index: int = 0

    @classmethod
    def at(cls, work: ImageWork, *, index: int, prompt_index: int = 0) -> WorkItem:
        """`work` as image `index`."""
        return cls(index=index, prompt_index=prompt_index, **{f.name: getattr(work, f.name) for f in fields(work)})


@dataclass(frozen=True, order=True, kw_only=True)
class ShapeKey:
    """What a compiled graph depends on (ImageWork.shape): a new value of any field means a new XLA compile."""

    height: int
    width: int
    batch_size: int
    cfg: bool
    # img2img and inpaint encode their images before the loop: a graph of their own (ImageWork.task).
    task: str = "txt2img"
    # Hires fix's second pass (HiresFix.shape_label: its scale and upscaler), "" for none: the larger size's
    # graphs, and the upscale's, are this key's too.
    hires: str = ""
    chunks: int = 1  # 75-token prompt chunks (ImageWork.chunks)
    tiling: bool = False  # seamless tiling (ImageWork.tiling)
    clip_skip: int = 1  # the text encoder's layer (ImageWork.clip_skip): another text-encoding graph
    # An edit's reference images, each fitted to the key's size: their tokens join the latent's at every step.
    references: int = 0
    # ControlNets that run beside the denoiser at each step (0: none): their residuals join the step's graph.
    controls: int = 0

    def __str__(self) -> str:
        text = f"{self.height}x{self.width} b{self.batch_size} {'cfg' if self.cfg else 'nocfg'}"
        text = text if self.task == "txt2img" else f"{text} {self.task}"
        text = f"{text} {self.chunks} chunks" if self.chunks > 1 else text
        text = f"{text} tiled" if self.tiling else text
        text = f"{text} clip skip {self.clip_skip}" if self.clip_skip > 1 else text
        text = f"{text} {self.references} ref{'s' if self.references > 1 else ''}" if self.references else text
        text = f"{text} {self.controls} controlnet{'s' if self.controls > 1 else ''}" if self.controls else text
        return f"{text} {self.hires}" if self.hires else text


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One pipeline call: real items first, then `padding` copies of the last one (never written)."""

    number: int
    shape: ShapeKey
    items: tuple[WorkItem, ...]
    padding: int

    @property
    def work(self) -> WorkItem:
        """What the whole call shares (ImageWork.call_key): its first image's."""
        return self.items[0]

    @property
    def rows(self) -> tuple[WorkItem, ...]:
        return self.items + (self.items[-1],) * self.padding

    @property
    def steps(self) -> int:
        return self.work.steps

    @property
    def guidance_scale(self) -> float:
        return self.work.guidance_scale

    @property
    def strength(self) -> float | None:
        return self.work.strength

    @property
    def hires(self) -> HiresFix | None:
        return self.work.hires


@dataclass(frozen=True)
class RunPlan:
    items: tuple[WorkItem, ...]
    batches: tuple[Batch, ...]

    @property
    def shape_keys(self) -> list[ShapeKey]:
        """The distinct shapes in the order the run first needs them."""
        return list(dict.fromkeys(b.shape for b in self.batches))

    @property
    def padding_rows(self) -> int:
        return sum(b.padding for b in self.batches)


def image_count(run: ResolvedRun) -> int:
    """How many images the run makes (len(work_items(run))), counted without listing them."""
    return planned_images(run.prompts, run.config.images_per_prompt)


def work_items(run: ResolvedRun) -> list[WorkItem]:
    """Every image of the run in index order: prompt by prompt, size by size, then images_per_prompt.

    A prompt's k-th image (counted over its sizes) has seed `prompt seed + k` when the prompt has its
    own seed, else `seed + index`.
    """
    cfg = run.config
    family = FAMILIES[run.family]
    hires = cfg.hires
    reader = PromptReader.of(run)
    items: list[WorkItem] = []
    for p, spec in enumerate(run.prompts):
        chunks = reader.chunks(spec.prompt, spec.negative_prompt, cfg=family.uses_cfg(spec.guidance_scale))
        k = 0
        for height, width in spec.sizes:
            for _ in range(cfg.images_per_prompt):
                index = len(items)
                seed = spec.seed + k if spec.seed is not None else cfg.seed + index
                item = WorkItem(
                    index=index,
                    prompt_index=p,
                    prompt=spec.prompt,
                    negative_prompt=spec.negative_prompt,
                    seed=seed,
                    steps=spec.steps,
                    guidance_scale=spec.guidance_scale,
                    height=height,
                    width=width,
                    cfg=family.uses_cfg(spec.guidance_scale),
                    source=spec.source,
                    # A hires fix is txt2img's: a prompt with an init image is its own img2img pass, one with
                    # references an edit.
                    hires=hires_fix(hires, spec.steps) if spec.source is None and not spec.references else None,
                    chunks=chunks,
                    prompt_syntax=cfg.prompt_syntax,
                    tiling=cfg.tiling,
                    clip_skip=cfg.clip_skip,
                    references=spec.references,
                    controls=spec.controls,
                )
                items.append(item)
                k += 1
    return items


def hires_fix(config, steps: int) -> HiresFix | None:
    """The run config's hires section (tpugen.config.schema.HiresConfig, or None) for an image of `steps` first
    steps: its second pass's steps filled in (0: as many as the first pass)."""
    if config is None:
        return None
    return HiresFix(config.scale, config.steps or steps, config.strength, config.upscaler)


def plan_batches(items: list[WorkItem], batch_size: int) -> list[Batch]:
    """Group items into full batches of one shape; a pipeline call also needs one step count and guidance (and
    for img2img one strength: the steps it runs; for hires fix one second pass; for an edit one set of
    references, which the pipeline gives every row; for ControlNets one scale and start and end each, which
    diffusers takes per call).

    Items keep index order inside each group; groups come in the order of their first item. The last
    batch of a group is padded to `batch_size`, so every call has a planned shape and nothing recompiles.
    """
    groups: dict[tuple, list[WorkItem]] = {}
    for item in items:
        groups.setdefault(item.call_key, []).append(item)
    batches = []
    for members in groups.values():
        shape = members[0].shape(batch_size)
        for start in range(0, len(members), batch_size):
            chunk = tuple(members[start : start + batch_size])
            batches.append(Batch(number=len(batches), shape=shape, items=chunk, padding=batch_size - len(chunk)))
    return batches


def plan_run(run: ResolvedRun) -> RunPlan:
    """The whole run as data: what each pipeline call makes, at which shape."""
    items = work_items(run)
    return RunPlan(tuple(items), tuple(plan_batches(items, run.config.batch_size)))


def shard(items: list[WorkItem] | tuple[WorkItem, ...], parts: int, part: int) -> list[WorkItem]:
    """Round-robin by global image index: part p of n takes the images whose index % n == p."""
    return [item for item in items if item.index % parts == part]


def plan_share(run: ResolvedRun, parts: int = 1, part: int = 0, finished: frozenset[int] = frozenset()) -> RunPlan:
    """One worker's or rank's share, batched and padded on its own. Batches whose images are all finished
    (a resume) are left out; the others keep every row, so an image is computed as it first would have been."""
    mine = shard(plan_run(run).items, parts, part)
    batches = plan_batches(mine, run.config.batch_size)
    return RunPlan(tuple(mine), tuple(b for b in batches if any(i.index not in finished for i in b.items)))
