"""Loading a diffusers pipeline onto a backend and calling it the XLA-friendly way."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tpugen.backends import Backend
from tpugen.config import ResolvedRun
from tpugen.errors import RunError
from tpugen.families import FAMILIES
from tpugen.memory import is_out_of_memory, out_of_memory_advice
from tpugen.plan import Batch
from tpugen.schedulers import display_name, find_scheduler


@dataclass(frozen=True)
class CompileSpec:
    """One torch.compile call on the denoiser, as data: the same code serves cpu, cuda and TorchTPU."""

    component: str  # "unet" or "transformer"
    method: str  # "compile", or "compile_repeated_blocks" under CPU offload (its hooks cannot be traced)
    backend: str  # torch.compile backend: "tpu" (TorchTPU) or "inductor"

    def arguments(self) -> dict:
        # Static shapes: a new size compiles once; a new step count does not compile (the diffusers guide).
        return {"backend": self.backend, "fullgraph": True, "dynamic": False}


def compile_spec(
    backend: str, *, torch_compile: bool, tpu_mode: str, offload: bool, component: str
) -> CompileSpec | None:
    """What to compile for a run, or None for eager."""
    if backend == "torch_tpu":
        if tpu_mode != "compile":
            return None
        compiler = "tpu"
    elif backend in ("cpu", "cuda") and torch_compile:
        compiler = "inductor"
    else:
        return None
    return CompileSpec(component, "compile_repeated_blocks" if offload else "compile", compiler)


def apply_compile(pipe, spec: CompileSpec | None) -> None:
    if spec is not None:
        getattr(getattr(pipe, spec.component), spec.method)(**spec.arguments())


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

    Graphs per shape key: text encoding (everything before the denoising loop), one denoising step
    (replayed for every step, the first included), and decoding with the conversion to pixels.
    """

    def __init__(self, pipe, backend: Backend, model_label: str, scheduler_name: str, family: str) -> None:
        self.pipe = pipe
        self.backend = backend
        self.model_label = model_label
        self.scheduler_name = scheduler_name
        self.family = FAMILIES[family]
        self._census: list[tuple[str, int]] | None = None
        self.phase_memory: dict[str, dict | None] = {}  # device memory after each phase of the last census
        self.denoiser_name = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
        self.running = "text encoders"  # what runs on the device now, for an out-of-memory message
        self.out_of_memory_advice = "`tpugen plan CONFIG` shows each component's size against the chip"
        self._loop_started = False
        # tpugen decodes the latents itself, so decoding and the conversion to pixels are one graph. A
        # safety checker or a watermark runs on the host, so pipelines with one keep their own path.
        host_steps = getattr(pipe, "safety_checker", None) is not None or getattr(pipe, "watermark", None) is not None
        self.decodes_itself = not host_steps
        self._sync_at_loop_start()
        self._timesteps_to_device()
        self._step_index_from_zero()

    # ---------------------------------------------------------------- the XLA patch layer

    def _sync_at_loop_start(self) -> None:
        """Cut the graph where the denoising loop starts.

        Everything before the loop (text encoding, time ids, guidance embeddings, latent set-up) becomes a
        graph of its own. Without the cut it would join the first denoising step, making that step a
        second, different denoiser graph to compile. diffusers' loops all begin by reading
        `self.interrupt`, so a per-instance subclass whose property syncs on the first read is the hook.
        """
        loaded = self
        base = type(self.pipe)
        if not isinstance(getattr(base, "interrupt", None), property):
            return  # a pipeline without the hook: text encoding then joins the first step's graph

        def interrupt(pipe) -> bool:
            if not loaded._loop_started:
                loaded._loop_started = True
                loaded.backend.sync()
                loaded.running = loaded.denoiser_name
                loaded._mark("text encoding")
            return base.interrupt.fget(pipe)

        patches = {"interrupt": property(interrupt)}
        if getattr(self.backend, "assignment", None):
            # Components sit on several devices; the pipeline's own tensors belong on the denoiser's, not on
            # the first component's (which is what diffusers would pick).
            device = self.backend.device
            patches["_execution_device"] = property(lambda pipe: device)
        self.pipe.__class__ = type(base.__name__, (base,), patches)

    def _timesteps_to_device(self) -> None:
        """Keep timesteps on the host and hand them to the denoiser as data.

        SD3 in diffusers 0.42 keeps timesteps on the CPU under XLA and passes them to the transformer as
        they are, which fails ("Expected XLA tensor"); Flux keeps them on the device, so each step's value is
        baked into its graph and every step compiles anew. Timesteps computed on the CPU and moved to the
        device at the transformer's door fix both: one step graph, replayed.
        """
        denoiser = getattr(self.pipe, "transformer", None)
        if denoiser is None:
            return
        device = self.backend.device

        def to_device(module, args, kwargs):
            for key in ("timestep", "guidance"):
                value = kwargs.get(key)
                if value is not None and str(value.device) != str(device):
                    kwargs[key] = value.to(device)
            return args, kwargs

        denoiser.register_forward_pre_hook(to_device, with_kwargs=True)
        scheduler = self.pipe.scheduler
        set_timesteps = scheduler.set_timesteps

        @functools.wraps(set_timesteps)  # diffusers inspects its signature (sigmas, mu)
        def set_timesteps_on_host(*args, **kwargs):
            kwargs["device"] = "cpu"
            return set_timesteps(*args, **kwargs)

        scheduler.set_timesteps = set_timesteps_on_host

    def _step_index_from_zero(self) -> None:
        """Tell the scheduler its loop starts at step 0, so it never searches its timesteps for the current
        one (`(timesteps == t).nonzero()`, a read back to the host inside the loop), as the PyTorch/XLA
        guide's scheduler fix does by passing the step index."""
        scheduler = self.pipe.scheduler
        if not hasattr(scheduler, "set_begin_index"):
            return
        set_timesteps = scheduler.set_timesteps

        @functools.wraps(set_timesteps)
        def set_timesteps_from_zero(*args, **kwargs):
            result = set_timesteps(*args, **kwargs)
            scheduler.set_begin_index(0)
            return result

        scheduler.set_timesteps = set_timesteps_from_zero

    def _mark(self, phase: str) -> None:
        if self._census is not None:
            self._census.append((phase, self.backend.counters().compiles))
            # With offload only this phase's component is on the device, so this is its footprint.
            self.phase_memory[phase] = self.backend.memory()

    def _step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        # Cut the lazy graph once per denoising step, so XLA compiles one step and replays it, even in
        # pipelines whose loop lacks diffusers' own mark_step.
        self.backend.sync()
        if step == 0:
            self._mark("first denoising step")
        return {}

    # ---------------------------------------------------------------- noise, call, decode

    def _initial_noise(self, batch: Batch):
        """Noise drawn on the CPU from one generator per image (seeded by the image's seed).

        The same seed gives the same noise on every backend and at every batch size; the generators
        are returned too, so schedulers that draw noise per step draw it per image as well.
        """
        import torch

        pipe = self.pipe
        scale = pipe.vae_scale_factor
        height, width = batch.shape.height, batch.shape.width
        generators = [torch.Generator("cpu").manual_seed(row.seed) for row in batch.rows]
        if self.family.name == "flux":
            channels = pipe.transformer.config.in_channels // 4
            h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
            noise = [torch.randn((1, channels, h, w), generator=g, dtype=torch.float32) for g in generators]
            noise = [pipe._pack_latents(n, 1, channels, h, w) for n in noise]
        else:
            denoiser = getattr(pipe, "unet", None) or pipe.transformer
            shape = (1, denoiser.config.in_channels, height // scale, width // scale)
            noise = [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
        dtype = (getattr(pipe, "unet", None) or pipe.transformer).dtype
        return self.backend.split_batch(torch.cat(noise).to(self.backend.device, dtype=dtype)), generators

    def _call_arguments(self, batch: Batch, latents, generators) -> dict:
        rows = batch.rows
        arguments = {
            "prompt": [row.prompt for row in rows],
            "height": batch.shape.height,
            "width": batch.shape.width,
            "num_inference_steps": batch.steps,
            "guidance_scale": batch.guidance_scale,
            "latents": latents,
            "generator": generators,
            "output_type": "latent" if self.decodes_itself else "pt",
            "callback_on_step_end": self._step_end,
        }
        if self.family.negative_prompt:
            arguments["negative_prompt"] = [row.negative_prompt for row in rows]
        if self.family.max_sequence_length:
            arguments["max_sequence_length"] = self.max_sequence_length()
        return arguments

    def max_sequence_length(self) -> int:
        """T5 tokens: the family's default, capped by what the tokenizer takes."""
        tokenizer = getattr(self.pipe, "tokenizer_3", None) or getattr(self.pipe, "tokenizer_2", None)
        limit = getattr(tokenizer, "model_max_length", None) or self.family.max_sequence_length
        return min(self.family.max_sequence_length, limit)

    def _decode(self, latents, batch: Batch):
        """Latents to pixels in [0, 1], as each family's pipeline would, as one graph."""
        import torch

        vae = self.pipe.vae
        config = vae.config
        if self.family.name == "flux":
            latents = self.pipe._unpack_latents(
                latents, batch.shape.height, batch.shape.width, self.pipe.vae_scale_factor
            )
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / config.scaling_factor + mean
        else:
            latents = latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)
        image = vae.decode(latents.to(device=self.backend.device_for("vae"), dtype=vae.dtype), return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def generate(self, batch: Batch, census: bool = False):
        """Run one batch; returns uint8 HxWx3 arrays for its real (unpadded) rows.

        With `census`, also returns how many graphs each phase compiled (XLA only; None elsewhere).
        """
        import numpy as np
        import torch

        counting = census and self.backend.counters() is not None
        self._census = [("start", self.backend.counters().compiles)] if counting else None
        self.phase_memory = {}
        self._loop_started = False
        self.running = "text encoders"
        try:
            latents, generators = self._initial_noise(batch)
            with torch.no_grad():  # inference_mode tensors break torch_xla (version counters)
                output = self.pipe(**self._call_arguments(batch, latents, generators)).images
                self._mark("later denoising steps")
                self.running = "vae"
                images = self._decode(output, batch) if self.decodes_itself else output
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
        pixels = (host.permute(0, 2, 3, 1).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
        graphs = self._graphs_per_phase()
        self._census = None
        return (list(pixels), graphs) if census else list(pixels)

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
    if run.family == "sdxl":
        # The invisible watermark runs on the host and is not saved in model_index.json: off unless asked.
        options["add_watermarker"] = model.watermark
    if model.custom_pipeline:
        options["custom_pipeline"] = model.custom_pipeline
    try:
        # Some components print to stdout while loading; keep the CLI's output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            pipe = DiffusionPipeline.from_pretrained(location, **options)
    except Exception as exc:  # any loader failure becomes one line naming the model
        raise RunError(f"model.id: cannot load {model.id!r}: {_load_failure(exc)}") from exc

    if model.scheduler:
        import diffusers

        choice = find_scheduler(model.scheduler)
        scheduler_class = getattr(diffusers, choice.class_name)
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config, **choice.options)
        scheduler_name = choice.name
    else:
        scheduler_name = display_name(type(pipe.scheduler).__name__, dict(pipe.scheduler.config))
    return pipe, label, scheduler_name


def _load_failure(exc: BaseException) -> str:
    """Why a model did not load, in the words a user can act on: offline, gated, missing, or as raised."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    names = {type(e).__name__ for e in chain}
    if "GatedRepoError" in names:
        if not os.environ.get("HF_TOKEN"):
            return "gated on the hub and HF_TOKEN is not set (accept the licence, then set HF_TOKEN)"
        return "gated on the hub and HF_TOKEN's account has no access (accept the licence on the model page)"
    if "RepositoryNotFoundError" in names:
        return "no such model on the hub (or it is private: set HF_TOKEN)"
    offline = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectionError", "ConnectError"}
    if names & offline or os.environ.get("HF_HUB_OFFLINE") == "1":
        return "offline: the hub cannot be reached and the model is not in the local cache (HF_HOME)"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


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
    if run.config.compile.scan_blocks:
        from tpugen.backends import scan_repeated_blocks

        # Weights are stacked on the host, before they move to the device.
        scan_repeated_blocks(pipe.transformer)
    execution = run.config.execution
    offload = execution.offload == "model"
    advice = out_of_memory_advice(execution, run.config.batch_size, run.config.model.dtype)
    try:
        backend.place(pipe, offload=offload)
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise RunError(
            f"out of memory on the device while {backend.placing or 'the model'} moved onto it: {advice}"
        ) from exc
    component = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    spec = compile_spec(
        backend.name,
        torch_compile=run.config.compile.torch_compile,
        tpu_mode=execution.torch_tpu.mode,
        offload=offload,
        component=component,
    )
    apply_compile(pipe, spec)
    loaded = LoadedPipeline(pipe, backend, label, scheduler_name, run.family)
    loaded.out_of_memory_advice = advice
    return loaded
