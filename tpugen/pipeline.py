"""Loading a diffusers pipeline onto a backend and calling it the XLA-friendly way."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from tpugen.backends import Backend
from tpugen.config import ResolvedRun
from tpugen.errors import RunError
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
    logging.getLogger("root").setLevel(logging.ERROR)


class LoadedPipeline:
    """A pipeline on its device, patched for XLA: a sync per step, CPU noise, one host read per batch."""

    def __init__(self, pipe, backend: Backend, model_label: str, scheduler_name: str) -> None:
        self.pipe = pipe
        self.backend = backend
        self.model_label = model_label
        self.scheduler_name = scheduler_name

    def _step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        # Cut the lazy graph once per denoising step, so XLA compiles one step and replays it, even in
        # pipelines whose loop lacks diffusers' own mark_step.
        self.backend.sync()
        return {}

    def _initial_noise(self, batch: Batch):
        """Noise drawn on the CPU from one generator per image (seeded by the image's seed).

        The same seed gives the same noise on every backend and at every batch size; the generators
        are returned too, so schedulers that draw noise per step draw it per image as well.
        """
        import torch

        pipe = self.pipe
        channels = pipe.unet.config.in_channels
        scale = pipe.vae_scale_factor
        shape = (1, channels, batch.shape.height // scale, batch.shape.width // scale)
        generators = [torch.Generator("cpu").manual_seed(row.seed) for row in batch.rows]
        noise = torch.cat([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])
        return noise.to(self.backend.device, dtype=pipe.unet.dtype), generators

    def generate(self, batch: Batch):
        """Run one batch; returns uint8 HxWx3 arrays for its real (unpadded) rows."""
        import numpy as np
        import torch

        latents, generators = self._initial_noise(batch)
        rows = batch.rows
        with torch.no_grad():  # inference_mode tensors break torch_xla (version counters)
            images = self.pipe(
                prompt=[row.prompt for row in rows],
                negative_prompt=[row.negative_prompt for row in rows],
                height=batch.shape.height,
                width=batch.shape.width,
                num_inference_steps=batch.steps,
                guidance_scale=batch.guidance_scale,
                latents=latents,
                generator=generators,
                output_type="pt",
                callback_on_step_end=self._step_end,
            ).images
            # The one read back to the host for the whole batch. Padding rows are dropped on the host:
            # slicing on the device would be a new graph for every count of real rows.
            host = images.to("cpu").float()[: len(batch.items)]
        pixels = (host.permute(0, 2, 3, 1).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
        return list(pixels)


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_pipeline(run: ResolvedRun, backend: Backend) -> LoadedPipeline:
    """Load the configured model through from_pretrained (built-ins too), set its scheduler, move it."""
    quiet_libraries()
    from diffusers import DiffusionPipeline

    model = run.config.model
    source = run.model_source
    if source.kind == "builtin":
        from tpugen.tiny import builtin_path

        location = str(builtin_path(source.ref))
        label = source.ref
    else:
        location = source.ref
        label = Path(source.ref).name if source.kind == "local" else source.ref

    options = {"dtype": _torch_dtype(model.dtype)}
    if model.revision:
        options["revision"] = model.revision
    if model.variant:
        options["variant"] = model.variant
    try:
        # Some components print to stdout while loading; keep the CLI's output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            pipe = DiffusionPipeline.from_pretrained(location, **options)
    except Exception as exc:  # any loader failure becomes one line naming the model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = ""
        if source.kind == "hub":
            hint = " (is the hub reachable? gated models need HF_TOKEN)"
        raise RunError(f"model.id: cannot load {model.id!r}: {first}{hint}") from exc

    if model.scheduler:
        import diffusers

        choice = find_scheduler(model.scheduler)
        scheduler_class = getattr(diffusers, choice.class_name)
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config, **choice.options)
        scheduler_name = choice.name
    else:
        scheduler_name = display_name(type(pipe.scheduler).__name__, dict(pipe.scheduler.config))

    pipe.set_progress_bar_config(disable=True)
    pipe.to(backend.device)
    return LoadedPipeline(pipe, backend, label, scheduler_name)
