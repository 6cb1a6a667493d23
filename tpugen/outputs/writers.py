"""An image's files: the PNG with its record of what made it, and the manifest line beside it."""

from __future__ import annotations

from PIL import Image

from tpugen import __version__
from tpugen.config import ResolvedRun
from tpugen.config.controls import recorded_name
from tpugen.families import FAMILIES
from tpugen.files import inside
from tpugen.outputs.manifest import Manifest
from tpugen.outputs.png import image_filename, save_png
from tpugen.plan import ImageWork


def image_record(
    run: ResolvedRun,
    work: ImageWork,
    *,
    scheduler: str,
    model_label: str,
    loras=(),
    index: int | None = None,
    file: str | None = None,
    batch: int | None = None,
) -> dict:
    """What made an image; stored in its PNG, so it holds nothing that varies between identical runs or
    depends on how the run was executed (no rank, no worker, no timing). `work`: a run's image's or a server's
    request's (tpugen.plan.ImageWork); `loras`: the ones fused for it. A run's image (its `index`, `file` and
    `batch` given) records its index, file, batch and the run's config hash too; a server's reply has no run file
    or batch."""
    model = run.config.model
    in_run = file is not None
    # LoRAs change the images, so they are part of what made one; a run without them keeps the record it had.
    fused = {"loras": [lora.record() for lora in loras]} if loras else {}
    cache = run.config.compile.step_cache.record()  # cached images are not the uncached ones
    step_cache = {"step_cache": cache} if cache else {}
    source = work.source.record() if work.source else {}  # by content: the path is where it was, not what it was
    source = {**source, **work.references.record()} if work.references else source
    if work.controls:  # each unit's control image by content, and how it steered
        controlnets = [recorded_name(c.id) for c in model.controlnets]
        units = zip(controlnets, work.controls.units, strict=True)
        source = {**source, "controlnet_units": [{"controlnet": name, **unit.record()} for name, unit in units]}
    multiple = FAMILIES[run.family].size_multiple
    hires = {"hires": work.hires.record(work.height, work.width, multiple)} if work.hires else {}
    tiling = {"tiling": True} if work.tiling else {}  # an untiled image keeps the record it had
    clip_skip = (
        {"clip_skip": work.clip_skip} if work.clip_skip > 1 else {}
    )  # the last layer's records stay as they were
    return {
        **({"index": index, "file": file} if in_run else {}),
        "prompt": work.prompt,
        "negative_prompt": work.negative_prompt,
        "seed": work.seed,
        "steps": work.steps,
        "guidance_scale": work.guidance_scale,
        "height": work.height,
        "width": work.width,
        "scheduler": scheduler,
        "model": model_label,
        "model_id": model.id,
        "dtype": model.dtype,
        **source,
        **hires,
        **tiling,
        **clip_skip,
        **fused,
        **step_cache,
        **({"batch": batch, "config_hash": run.config_hash} if in_run else {}),
        "tpugen_version": __version__,
    }


class ImageWriter:
    """Writes each batch's images (atomically) and returns their manifest records, appending them nowhere: a
    ray worker's side of a run, whose driver appends the records once it has them."""

    def __init__(self, session, scheduler: str, model_label: str, extra: dict) -> None:
        self.session = session  # its run, run_dir and finished (tpugen.engine.session.RunSession)
        self.scheduler = scheduler
        self.model_label = model_label
        self.extra = extra  # manifest-only fields (the rank), never in the PNG

    def write(self, batch, pixels: list, seconds: float) -> list[dict]:
        session, run_dir = self.session, self.session.run_dir
        share = seconds / len(batch.items)
        records = []
        for item, image in zip(batch.items, pixels, strict=True):
            if item.index in session.finished:  # resumed: this image is already on disk
                continue
            name = image_filename(item.index, item.seed, item.prompt)
            record = image_record(
                session.run,
                item,
                scheduler=self.scheduler,
                model_label=self.model_label,
                loras=session.run.loras,
                index=item.index,
                file=name,
                batch=batch.number,
            )
            save_png(inside(run_dir, name), Image.fromarray(image), record)
            records.append({**record, "latency_seconds": share, **self.extra})
        return records


class BatchWriter(ImageWriter):
    """Writes each batch's images (atomically) and appends their manifest lines (fsynced) as they land."""

    def __init__(self, session, scheduler: str, model_label: str, manifest: str, extra: dict) -> None:
        super().__init__(session, scheduler, model_label, extra)
        self.manifest = Manifest(session.run_dir / manifest)

    def __call__(self, batch, pixels: list, seconds: float) -> list[str]:
        records = self.write(batch, pixels, seconds)
        self.manifest.append(records)
        return [r["file"] for r in records]

    def close(self) -> None:
        self.manifest.close()
