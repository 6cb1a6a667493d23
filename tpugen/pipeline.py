"""Loading a diffusers pipeline onto a backend and calling it the XLA-friendly way."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import threading
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
    """A pipeline on its device, patched for XLA: a sync per step, CPU noise, one host read per batch.

    Graphs per shape key, for SD 1.x/2.x: text encoding, one denoising step (replayed for every step,
    the first included), and decoding with the conversion to pixels.
    """

    def __init__(self, pipe, backend: Backend, model_label: str, scheduler_name: str) -> None:
        self.pipe = pipe
        self.backend = backend
        self.model_label = model_label
        self.scheduler_name = scheduler_name
        self._census: list[tuple[str, int]] | None = None
        # SD pipelines without a safety checker are decoded by tpugen, so decoding and the conversion to
        # pixels are one graph; a safety checker runs on the host, so such pipelines keep their own path.
        self.decodes_itself = type(pipe).__name__ == "StableDiffusionPipeline" and pipe.safety_checker is None
        self._sync_after_prepare_latents()

    def _sync_after_prepare_latents(self) -> None:
        original = self.pipe.prepare_latents

        def prepare_then_sync(*args, **kwargs):
            result = original(*args, **kwargs)
            # Text encoding and the latent set-up become a graph of their own here. Without this cut they
            # would join the first denoising step, making it a second, different UNet graph to compile.
            self.backend.sync()
            self._mark("text encoding")
            return result

        self.pipe.prepare_latents = prepare_then_sync

    def _mark(self, phase: str) -> None:
        if self._census is not None:
            self._census.append((phase, self.backend.counters().compiles))

    def _step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        # Cut the lazy graph once per denoising step, so XLA compiles one step and replays it, even in
        # pipelines whose loop lacks diffusers' own mark_step.
        self.backend.sync()
        if step == 0:
            self._mark("first denoising step")
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

    def generate(self, batch: Batch, census: bool = False):
        """Run one batch; returns uint8 HxWx3 arrays for its real (unpadded) rows.

        With `census`, also returns how many graphs each phase compiled (XLA only; None elsewhere).
        """
        import numpy as np
        import torch

        counting = census and self.backend.counters() is not None
        self._census = [("start", self.backend.counters().compiles)] if counting else None
        latents, generators = self._initial_noise(batch)
        rows = batch.rows
        with torch.no_grad():  # inference_mode tensors break torch_xla (version counters)
            output = self.pipe(
                prompt=[row.prompt for row in rows],
                negative_prompt=[row.negative_prompt for row in rows],
                height=batch.shape.height,
                width=batch.shape.width,
                num_inference_steps=batch.steps,
                guidance_scale=batch.guidance_scale,
                latents=latents,
                generator=generators,
                output_type="latent" if self.decodes_itself else "pt",
                callback_on_step_end=self._step_end,
            ).images
            self._mark("later denoising steps")
            images = self._decode(output) if self.decodes_itself else output
            # The one read back to the host for the whole batch. Padding rows are dropped on the host:
            # slicing on the device would be a new graph for every count of real rows.
            host = images.to("cpu").float()[: len(batch.items)]
            self._mark("decoding")
        pixels = (host.permute(0, 2, 3, 1).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
        graphs = self._graphs_per_phase()
        self._census = None
        return (list(pixels), graphs) if census else list(pixels)

    def _decode(self, latents):
        vae = self.pipe.vae
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def _graphs_per_phase(self) -> dict | None:
        if self._census is None:
            return None
        return {
            phase: count - previous
            for (_, previous), (phase, count) in zip(self._census, self._census[1:], strict=False)
        }


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# Ranks that are threads of one process (torch_xla.launch on CPU) share one copy read from disk; this is
# state of the process, not of any rank, and the lock also keeps diffusers' loader (which patches
# torch.nn process-wide while it runs) from ever running in two threads at once.
_HOST_COPIES: dict[tuple, tuple] = {}
_HOST_LOCK = threading.Lock()


def _read_from_disk(run: ResolvedRun) -> tuple:
    """(pipeline on the host CPU, model label, scheduler name) as the config asks for it."""
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
    options["trust_remote_code"] = model.allow_remote_code
    if model.custom_pipeline:
        options["custom_pipeline"] = model.custom_pipeline
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
    return pipe, label, scheduler_name


def load_pipeline(run: ResolvedRun, backend: Backend, *, ranks_in_process: int = 1) -> LoadedPipeline:
    """Load the configured model through from_pretrained (built-ins too), set its scheduler, move it.

    With several ranks in this process, the weights are read from disk once and each rank gets a copy.
    """
    with _HOST_LOCK:
        if ranks_in_process > 1:
            key = (run.config.model.model_dump_json(), run.model_source)
            if key not in _HOST_COPIES:
                _HOST_COPIES[key] = _read_from_disk(run)
            shared, label, scheduler_name = _HOST_COPIES[key]
            pipe = copy.deepcopy(shared)
        else:
            pipe, label, scheduler_name = _read_from_disk(run)

    pipe.set_progress_bar_config(disable=True)
    pipe.to(backend.device)
    return LoadedPipeline(pipe, backend, label, scheduler_name)
