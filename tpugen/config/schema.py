"""The run config's schema: every key, its type, its default and its own checks (pydantic)."""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tpugen.config.hires import DEFAULT_HIRES_STRENGTH, MAX_HIRES_SCALE
from tpugen.config.request import (
    MAX_REFERENCES,
    MAX_SEED,
    MAX_STEPS,
    MIN_STEPS,
    SIDE_MULTIPLE,
    side_ok,
    text_problem,
)
from tpugen.schedulers import SCHEDULER_NAMES, find_scheduler


class _Section(BaseModel):
    # strict: YAML already types its values, so "20" for steps is a mistake worth naming, not coercing.
    # No infinities: guidance_scale .inf runs to all-black images, chip_memory_gb .inf plans nothing.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# How a resume treats a key whose value differs from the run's (tpugen.outputs.run_record), declared on the key with
# `json_schema_extra=RESUME_...`; on a section, for every key under it. A key declared with none can change an
# image and refuses the resume: the model, its revision, variant, dtype, scheduler, LoRAs, watermark and remote
# code; the prompts, sizes, steps, guidance, seed, batch_size (padding and graphs) and images_per_prompt; the
# backend, whose noise and kernels differ; the pod share, which changes the batches.
# Never changes pixels: where files go, the compile cache, the recompile guard, the server's settings, where a ray
# run's workers are (so a killed driver's run can be resumed from another address).
RESUME_NO_EFFECT = {"resume": "none"}
# The same computation on other devices or as other graphs: the pixels move by rounding only (multi equals single
# within 1/255, as scanned blocks, SPMD and placed components do; tests/conftest.py): a resume goes on, warned.
RESUME_ROUNDING = {"resume": "rounding"}
# The chip a memory plan is made for: no effect, unless execution.placement decides from its memory where each
# component goes (then rounding).
RESUME_PLACEMENT = {"resume": "placement"}


@functools.cache
def resume_effects(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, str]:
    """{dotted key or section: "none", "rounding" or "placement"}: every key declared with its effect on a
    resume; the keys left out change images."""
    effects = {}
    for name, field in (model or RunConfig).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "resume" in extra:
            effects[prefix + name] = extra["resume"]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            effects.update(resume_effects(field.annotation, f"{prefix}{name}."))
    return effects


# A LoRA's scale: 1.0 is the strength it was trained at and web UIs' sliders stop at 2; past 4 its change
# swamps the model's own weights (noise, not style). Negative scales invert what it learned, which LoRAs are
# not trained for: a sign typed by mistake more often than meant.
LORA_SCALE_MAX = 4.0


class LoraConfig(_Section):
    id: str = Field(
        description=(
            "A .safetensors LoRA file (relative to the config file), a folder holding one, or a hub repo id "
            "org/name. Formats: diffusers/PEFT and kohya (sd-scripts), for the UNet or transformer and the "
            "text encoders."
        )
    )
    scale: float = Field(
        default=1.0, description="How strongly it is fused into the weights, from 0 to 4 (1.0: as trained)."
    )
    weight_name: str | None = Field(
        default=None,
        description=(
            "The file inside a hub repo or a folder (default: its only .safetensors, or "
            "pytorch_lora_weights.safetensors)."
        ),
    )
    sha256: str | None = Field(
        default=None,
        description=(
            "The file's sha256, filled in when the config is resolved; set it to pin the file (any other is refused)."
        ),
    )

    @field_validator("scale")
    @classmethod
    def _sensible_scale(cls, value: float) -> float:
        if not 0 <= value <= LORA_SCALE_MAX:
            raise ValueError(
                f"must be from 0 to {LORA_SCALE_MAX:g} (1.0 is the strength it was trained at; negative scales invert "
                f"it and past {LORA_SCALE_MAX:g} it swamps the model's weights), got {value:g}"
            )
        return value

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError(f"must be the 64 lowercase hex digits of a sha256, got {value!r}")
        return value


# A ControlNet's weight: the web UI's ControlNet extension's slider stops at 2.
CONTROL_SCALE_MAX = 2.0


class ControlNetConfig(_Section):
    id: str = Field(
        description=(
            "A built-in ControlNet (tiny-shapes-controlnet, tiny-sd-controlnet, tiny-sdxl-controlnet, "
            "tiny-flux-controlnet, tiny-qwen-image-controlnet, tiny-z-image-controlnet; `tpugen models` lists "
            "them), a local diffusers ControlNet folder (ControlNetModel; FluxControlNetModel for Flux.1, "
            "QwenImageControlNetModel for Qwen-Image, ZImageControlNetModel for Z-Image; relative to the config "
            "file), or a hub id org/name."
        )
    )
    scale: float = Field(
        default=1.0,
        description=(
            "How strongly its residuals steer the denoiser, from 0 to 2 (the web UI's weight); a prompt's "
            "control_scale overrides it."
        ),
    )

    @field_validator("scale")
    @classmethod
    def _sensible_scale(cls, value: float) -> float:
        if not 0 <= value <= CONTROL_SCALE_MAX:
            raise ValueError(f"must be from 0 to {CONTROL_SCALE_MAX:g} (the web UI's weight), got {value:g}")
        return value


class ModelConfig(_Section):
    id: str = Field(
        description=(
            "A built-in (tiny-sd, ...; `tpugen models` lists them), a local diffusers folder (relative to the"
            " config file), or a hub id org/name."
        )
    )
    revision: str | None = Field(
        default=None, description="The hub revision (branch, tag or commit), passed to from_pretrained."
    )
    variant: str | None = Field(default=None, description="The weights variant (fp16, ...), passed to from_pretrained.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description=(
            "The weights' and activations' dtype: bfloat16 on a TPU (its native format, half the memory of float32)."
        ),
    )
    scheduler: str | None = Field(
        default=None,
        description=(
            "A common name (DPM++ 2M, DPM++ 2M Karras, DPM++ 2M SDE, Euler, Euler a, Heun, LMS, DDIM, PNDM, "
            "UniPC, DEIS, LCM) or a diffusers scheduler class name; unset keeps the model's own. "
            "Flow-matching families keep theirs."
        ),
    )
    allow_remote_code: bool = Field(
        default=False,
        description=(
            "Run code that ships with a model (trust_remote_code, custom_pipeline): only when the config says so."
        ),
    )
    custom_pipeline: str | None = Field(
        default=None,
        description="A diffusers community pipeline to load instead of the model's own (needs allow_remote_code).",
    )
    watermark: bool = Field(
        default=False, description="SDXL's invisible watermark (runs on the host, so off by default on TPU)."
    )
    loras: list[LoraConfig] = Field(
        default=[],
        description=(
            "LoRAs fused into the weights on the host before the model moves to the device, in this order: "
            "the compiled graphs stay the base model's (no compile per LoRA), and a warm engine can switch "
            "them without compiling."
        ),
    )
    controlnets: list[ControlNetConfig] = Field(
        default=[],
        description=(
            "ControlNets run beside the denoiser, inside its step graph, for prompts that give a control_image (one "
            "image per ControlNet, in this order); two or more run as diffusers' multi-ControlNet (Stable Diffusion "
            "1.x/2.x, SDXL, Flux.1; Qwen-Image and Z-Image one at a time). Stable Diffusion 1.x/2.x, SDXL, Flux.1, "
            "Qwen-Image and Z-Image models (a ControlNet of the model's family)."
        ),
    )
    annotators_dir: str | None = Field(
        default=None,
        description=(
            "A local folder of annotator weights, named as lllyasviel/Annotators names them (ControlNetHED.pth, "
            "table5_pidinet.pth, sk_model.pth and sk_model2.pth, dpt_hybrid-midas-501f0c75.pt, "
            "body_pose_model.pth, hand_pose_model.pth and facenet.pth, mlsd_large_512_fp32.pth; relative to the "
            "config file): the ControlNet preprocessors that need them (softedge_hed, softedge_hedsafe, scribble_hed, "
            "softedge_pidinet, softedge_pidisafe, scribble_pidinet, lineart_realistic, lineart_coarse, depth_midas, "
            "openpose, openpose_hand, openpose_face, openpose_faceonly, openpose_full, mlsd) run on the host through "
            "controlnet_aux, each whose files the folder holds."
        ),
    )
    embeddings: list[str] = Field(
        default=[],
        description=(
            "Textual-inversion embedding files (.safetensors, .pt or .bin; relative to the config file), loaded "
            "into the CLIP text encoders with diffusers' loader (SD 1.x/2.x; SDXL's hold clip_l and clip_g). A "
            "prompt names each by its file's stem, as in the web UI; one of n vectors takes n tokens."
        ),
    )

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str | None) -> str | None:
        if value is not None and find_scheduler(value) is None:
            raise ValueError(f"unknown scheduler {value!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
        return value


class PodConfig(_Section):
    worker_index: int | None = Field(
        default=None,
        ge=0,
        description=(
            "This worker's index in a pod; unset: TPU_WORKER_ID, CLOUD_TPU_TASK_ID, else torch_xla's host "
            "index (pod-run sets it for each worker)."
        ),
    )
    num_workers: int | None = Field(
        default=None,
        ge=1,
        description=(
            "The pod's worker count, set by `tpugen pod-run`; worker i makes the images whose index % num_workers == i."
        ),
    )


class TorchTpuConfig(_Section):
    mode: Literal["eager", "defer_and_fuse", "compile"] = Field(
        default="eager",
        description=(
            "eager (strict, the default), defer_and_fuse (TORCH_TPU_DEFER_AND_FUSE=1), or compile "
            '(torch.compile "tpu").'
        ),
    )


def _check_auto_or_bool(value: Any) -> Any:
    if value == "auto" or isinstance(value, bool):
        return value
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(f"must be auto, true or false, got {shown}")


# One readable error for a bad value, instead of one per member of `bool | Literal["auto"]`.
AutoOrBool = Annotated[Any, AfterValidator(_check_auto_or_bool)]


# The step caches diffusers 0.42 ships that tpugen does not run, each with why (compile.step_cache.method).
STEP_CACHE_NOT_YET = {
    "fastercache": (
        "is not run: its skip of the unconditional pass splits one CFG batch into halves, and these families "
        "have none to split (FLUX.2 [klein] and Qwen-Image run CFG as two transformer calls, guidance-distilled "
        "Flux.1 none); its attention extrapolation alone (is_guidance_distilled) is not built yet: use "
        "pyramid_attention_broadcast or taylorseer"
    ),
    "first_block_cache": (
        "cannot run as static graphs: its threshold compares each step's residual on the device, a branch on "
        "the data (a read back to the host every step); use taylorseer, or magcache (the same skip decided "
        "from ratios calibrated once)"
    ),
}
# Each method tpugen runs, with the options that are its own (named as diffusers' config class for it names them).
STEP_CACHE_OPTIONS = {
    "none": (),
    "taylorseer": (
        "cache_interval",
        "disable_cache_before_step",
        "disable_cache_after_step",
        "max_order",
        "taylor_factors_dtype",
        "skip_predict_identifiers",
        "cache_identifiers",
        "use_lite_mode",
    ),
    "magcache": ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios"),
    # No cross_attention_* or temporal_attention_*: Flux.1, FLUX.2 and Qwen-Image have neither kind (their one
    # attention per block is joint, text and image together, and no module of theirs is_cross_attention), so
    # diffusers would hook nothing with them.
    "pyramid_attention_broadcast": ("spatial_attention_block_skip_range", "spatial_attention_timestep_skip_range"),
}
STEP_CACHE_METHODS = tuple(STEP_CACHE_OPTIONS)
# diffusers' own precomputed MagCache ratios, by the name a config gives them (diffusers.hooks.mag_cache).
KNOWN_MAG_RATIOS = {"flux": "FLUX_MAG_RATIOS"}


def _check_step_cache_method(value: Any) -> Any:
    if value in STEP_CACHE_METHODS:
        return value
    if value in STEP_CACHE_NOT_YET:
        raise ValueError(f"{value} {STEP_CACHE_NOT_YET[value]}")
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(f"must be none, taylorseer, magcache or pyramid_attention_broadcast, got {shown}")


class HiresConfig(_Section):
    scale: float = Field(
        default=2.0,
        gt=1,
        le=MAX_HIRES_SCALE,
        description=(
            "The second pass's size: scale times the base size, each side floored to a multiple of 8 (16 for "
            "the Flux-like families); the web UI's hr_scale."
        ),
    )
    steps: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description=(
            "The steps the second pass runs (as the web UI, on a schedule of steps / strength); 0: the first "
            "pass's steps. The web UI's hr_second_pass_steps."
        ),
    )
    strength: float = Field(
        default=DEFAULT_HIRES_STRENGTH,
        ge=0,
        le=1,
        description=(
            "How far the upscaled first pass is noised again (the web UI's denoising_strength); 0: no second pass, "
            "the upscale alone, as in the web UI."
        ),
    )
    upscaler: Literal["latent", "lanczos"] = Field(
        default="latent",
        description=(
            "latent: the first pass's latents scaled up bilinearly on the device (the web UI's Latent); "
            "lanczos: its decoded pixels resized with PIL's Lanczos filter on the host (one more read back), "
            "then encoded at the larger size (the web UI's Lanczos)."
        ),
    )


class StepCacheConfig(_Section):
    method: Annotated[str, AfterValidator(_check_step_cache_method)] = Field(
        default="none",
        description=(
            "none; taylorseer: diffusers' TaylorSeer (diffusers.hooks.TaylorSeerCacheConfig, attached with"
            " transformer.enable_cache): between full steps, the attention outputs are predicted from a "
            "Taylor series of the last full ones; or magcache: diffusers' MagCache (MagCacheConfig): whole "
            "steps skipped, the last full step's residual reused, where the model's calibrated mag_ratios "
            "say the error stays under threshold. Each step's kind follows from the step index (and the "
            "ratios) alone; or pyramid_attention_broadcast: diffusers' PAB (PyramidAttentionBroadcastConfig): "
            "inside a range of timesteps, each attention's output is computed every "
            "spatial_attention_block_skip_range calls and reused between, decided from its call count and the "
            "timestep (on the host). So on XLA each kind of step is one graph, compiled in warmup. Images differ"
            " from uncached ones (the PNG record and parameters say so)."
        ),
    )
    # TaylorSeerCacheConfig's own options, with its names and defaults.
    cache_interval: int = Field(
        default=5,
        ge=1,
        description="Full steps come every cache_interval steps once caching has started; the others are predicted.",
    )
    disable_cache_before_step: int = Field(
        default=3,
        ge=1,
        description=(
            "Steps 0 .. this - 1 run full (they gather the Taylor factors); at least 1, so step 0 always runs full."
        ),
    )
    disable_cache_after_step: int | None = Field(
        default=None, ge=1, description="From this step on every step runs full again (none: caching to the end)."
    )
    max_order: int = Field(
        default=1,
        ge=0,
        le=4,
        description="The Taylor series' highest order (1: a straight line through the last two full steps).",
    )
    taylor_factors_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16",
        description=(
            "The factors' dtype: float32 keeps the images closest to uncached ones (diffusers' default is bfloat16)."
        ),
    )
    skip_predict_identifiers: list[str] | None = Field(
        default=None,
        description=(
            "Regexes (re.fullmatch on module names) of modules predicted as zeros; unset: TaylorSeer's own "
            "choice, the attention of every transformer block."
        ),
    )
    cache_identifiers: list[str] | None = Field(
        default=None,
        description=(
            "Regexes (re.fullmatch on module names) of modules Taylor-predicted; unset: the attention of "
            "every transformer block."
        ),
    )
    use_lite_mode: bool = Field(
        default=False,
        description=(
            "TaylorSeer lite: blocks skipped, only proj_out predicted (faster, further from the uncached image)."
        ),
    )

    # MagCacheConfig's own options, with its names and defaults. Its num_inference_steps is each call's steps
    # (tpugen sets it), and its calibrate mode is `tpugen calibrate`.
    threshold: float = Field(
        default=0.06,
        gt=0,
        description="magcache: a step is skipped while the error its ratios add up to stays at or under this.",
    )
    max_skip_steps: int = Field(
        default=3, ge=1, description="magcache: the most steps skipped in a row (K in the MagCache paper)."
    )
    retention_ratio: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="magcache: this share of the first steps always runs full (0.2 of 28 steps: the first 6).",
    )
    mag_ratios: list[float] | str | None = Field(
        default=None,
        description=(
            "magcache: the model's magnitude ratios, one per step of a calibration run (stretched to any other"
            " step count as diffusers does): a list, a .yaml/.json file that `tpugen calibrate` wrote "
            "(relative to the config), or flux for diffusers' FLUX.1 [dev] ratios. A run's config.yaml holds "
            "the list itself."
        ),
    )

    # PyramidAttentionBroadcastConfig's own options, with its names; its current_timestep_callback is tpugen's
    # (the pipeline's current timestep, a host value for these families).
    spatial_attention_block_skip_range: int = Field(
        default=2,
        ge=1,
        description=(
            "pyramid_attention_broadcast: inside the timestep range, each attention is computed on every N-th of"
            " its calls in a pipeline call (both CFG passes count) and its last output reused between (1: never "
            "reused)."
        ),
    )
    spatial_attention_timestep_skip_range: list[int] = Field(
        default=[100, 800],
        description=(
            "pyramid_attention_broadcast: [low, high]: attention is reused only at timesteps strictly between "
            "these (timesteps run from 1000 down to 0; outside, every call computes)."
        ),
    )

    @field_validator("spatial_attention_timestep_skip_range")
    @classmethod
    def _timestep_range(cls, value: list[int]) -> list[int]:
        if len(value) != 2 or value[0] >= value[1]:
            raise ValueError(f"must be [low, high] with low below high, got {value}")
        return value

    @field_validator("skip_predict_identifiers", "cache_identifiers")
    @classmethod
    def _regexes(cls, value: list[str] | None) -> list[str] | None:
        for pattern in value or ():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    @field_validator("mag_ratios")
    @classmethod
    def _ratios(cls, value: list[float] | str | None) -> list[float] | str | None:
        if isinstance(value, list) and (not value or any(not (0 < r < 10) for r in value)):
            raise ValueError("must be a non-empty list of ratios, each above 0 and below 10")
        if isinstance(value, str) and value not in KNOWN_MAG_RATIOS and not value.endswith((".yaml", ".yml", ".json")):
            raise ValueError(f"{value!r} is neither {', '.join(KNOWN_MAG_RATIOS)} nor a .yaml or .json file of ratios")
        return value

    @model_validator(mode="after")
    def _options_of_the_method(self) -> StepCacheConfig:
        # Options at their defaults pass: a resolved config (a run's config.yaml) writes every key out.
        fields = type(self).model_fields
        own = STEP_CACHE_OPTIONS[self.method]
        for method, names in STEP_CACHE_OPTIONS.items():
            given = [n for n in names if n not in own and getattr(self, n) != fields[n].default]
            if given:
                what = "no step cache" if self.method == "none" else f"method {self.method}"
                raise ValueError(
                    f"{', '.join(given)}: {method}'s option(s), not for {what}; set method: {method} or leave them out"
                )
        if self.method == "magcache" and self.mag_ratios is None:
            raise ValueError(
                "magcache needs the model's mag_ratios: measure them with `tpugen calibrate CONFIG` and set "
                "mag_ratios to the file it writes (or flux, for diffusers' FLUX.1 [dev] ratios)"
            )
        return self

    def options(self) -> dict:
        """The method's own options, as diffusers' config class names them ({} for none)."""
        return {name: getattr(self, name) for name in STEP_CACHE_OPTIONS[self.method]}

    def record(self) -> dict | None:
        """What an image record says of the cache (None: no cache, and the record stays as it was before)."""
        return None if self.method == "none" else {"method": self.method, **self.options()}


def step_cache_options_text(options: dict, *, pair: str = "{} {}", sep: str = ", ") -> str:
    """A step cache's options as a report, a PNG's parameters or the server's summary shows them: each set one
    as `pair` (key, value), a long list (MagCache's ratios, which the records hold whole) by its length."""
    shown = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, list) and len(value) > 4:
            value = f"[{len(value)} values]"
        shown.append(pair.format(key, value))
    return sep.join(shown)


class CompileConfig(_Section):
    torch_compile: bool = Field(
        default=False,
        description=(
            "torch.compile the denoiser on the cpu and cuda backends (xla compiles through torch_xla already)."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    trace_once: bool = Field(
        default=True,
        description=(
            "xla: the denoiser is traced once per shape key by dynamo (torch.compile with torch_xla's openxla "
            "backend) and every later step launches the cached graph, instead of recording the whole denoiser in "
            "Python again each step (tens of ms of host time per step for SD 1.5, more for SDXL). Where it cannot "
            "apply (a step cache, SPMD, offload, placement, scanned blocks, a denoiser dynamo cannot trace) the "
            "run falls back to lazy tracing and says why at load and in the report. false: lazy tracing."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    scan_blocks: bool = Field(
        default=False,
        description=(
            "xla, every DiT family (SD3, Flux.1, FLUX.2, Z-Image, Qwen-Image, Qwen-Image-Edit and its Plus): run "
            "each run of identical blocks through torch_xla's scan with the weights stacked once, so one block "
            "per kind is compiled."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    flash_attention: AutoOrBool = Field(
        default="auto",
        description=(
            "xla: the denoiser's attention through torch_xla's Pallas flash-attention kernel (diffusers' XLA "
            "path). auto: on a TPU only; true: try it anywhere. If it cannot run (no jax, not a TPU, a "
            "compile error), the run goes on without. jax: JAX's Pallas kernel for every attention call it takes "
            "(no mask, tokens a multiple of 128), on a TPU (auto or true); plain attention elsewhere."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    step_cache: StepCacheConfig = Field(
        default=StepCacheConfig(),
        description=(
            "Skip work between denoising steps with one of diffusers' step caches (Flux.1, FLUX.2 [klein] and "
            "Qwen-Image; see compile.step_cache.method). A server has its config's one, warm for any steps."
        ),
    )


def _check_placement(value: Any) -> Any:
    if value in ("none", "auto"):
        return value
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(k, str) for k in value)
        and all(type(v) is int and v >= 0 for v in value.values())
    ):
        return value
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(
        f"must be none, auto, or a mapping of component to chip index such as {{text_encoder: 1, unet: 0}}, got {shown}"
    )


Placement = Annotated[Any, AfterValidator(_check_placement)]


class MeshConfig(_Section):
    data: int = Field(
        default=1, ge=1, description="Devices that each take a share of the batch (batch_size must divide by it)."
    )
    model: int = Field(
        default=0, ge=0, description="Devices each weight is split over; 0 = every device the data axis leaves."
    )


# Where a ray run's driver finds its cluster: local (a throwaway cluster on this machine, for the run), auto
# (the cluster `ray start` made, or RAY_ADDRESS), ray://HOST:PORT (Ray Client) or HOST:PORT (the GCS address).
_RAY_ADDRESS = re.compile(r"(ray://)?[A-Za-z0-9][A-Za-z0-9.-]*:[0-9]{1,5}")


def is_ray_address(value: str) -> bool:
    """ray://HOST:PORT or HOST:PORT: a cluster to join (RAY_ADDRESS is checked by the same rule)."""
    return bool(_RAY_ADDRESS.fullmatch(value))


def _check_ray_address(value: str) -> str:
    if value in ("local", "auto") or _RAY_ADDRESS.fullmatch(value):
        return value
    raise ValueError(f"must be local, auto, ray://HOST:PORT or HOST:PORT, got {value!r}")


def _check_workers(value: Any) -> Any:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(f"must be a number of workers (1 or more) or auto, got {shown}")


def _check_resources(value: Any) -> Any:
    if value is None:
        return value
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(k, str) and k for k in value)
        and all(type(v) in (int, float) and 0 < v < float("inf") for v in value.values())
    ):
        return value
    shown = "{" + ", ".join(f"{k}: {v!r}" for k, v in value.items()) + "}" if isinstance(value, dict) else repr(value)
    raise ValueError(f"must be a mapping of Ray resource to a positive amount such as {{TPU: 4}}, got {shown}")


class RayConfig(_Section):
    address: Annotated[str, AfterValidator(_check_ray_address)] = Field(
        default="local",
        description=(
            "Where the driver finds its cluster: local (a throwaway cluster on this machine, for the run), "
            "auto (the cluster `ray start` made, or RAY_ADDRESS), ray://HOST:PORT (Ray Client) or HOST:PORT "
            "(the GCS address)."
        ),
    )
    workers: Annotated[Any, AfterValidator(_check_workers)] = Field(
        default="auto",
        description=(
            "A number, or auto: one per TPU host of the cluster (as many as resources_per_worker fit on its "
            "TPU nodes), else one per node."
        ),
    )
    resources_per_worker: Annotated[Any, AfterValidator(_check_resources)] = Field(
        default=None,
        description=(
            "What each worker asks Ray for; default {TPU: chips per host} on a cluster with TPUs, else {CPU: 1}."
        ),
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="How often Ray starts a lost worker again (it opens and warms its engine again each time).",
    )
    runtime_env: dict[str, Any] | None = Field(
        default=None, description="Passed to ray.init (pip, env_vars, working_dir, ...)."
    )
    connect_timeout_s: float = Field(default=30.0, gt=0, description="How long the address may take to answer.")
    batch_timeout_s: float | None = Field(
        default=600.0,
        gt=0,
        description=(
            "A batch's deadline, in seconds from when its worker could start it (its previous batch done): a "
            "worker that misses it is taken as lost (hung), its batches in flight go back to the queue and "
            "its actor is killed, so Ray restarts it while max_restarts allow. Warm batches take seconds; the"
            " warmup has no deadline, nor (with --skip-warmup) a worker's first batch of each shape key, "
            "which compiles. null: no deadline."
        ),
    )


class ExecutionConfig(_Section):
    backend: Literal["xla", "jax", "cpu", "cuda", "torch_tpu"] = Field(
        default="xla",
        description=(
            "xla (torch_xla), jax (diffusers' modules as JAX functions through torchax, the whole denoising loop "
            "as one compiled call, compiles read back by later processes), cpu (eager PyTorch, the reference), "
            "cuda (eager on an NVIDIA GPU) or torch_tpu (TorchTPU)."
        ),
    )
    mode: Literal["single", "multi", "ray"] = Field(
        default="single",
        description=(
            "single: one device; multi: one replica per device, through torch_xla.launch (xla) or torchrun, "
            "one process each (torch_tpu: process group tpu_dist, cuda: nccl, cpu: gloo, with cores "
            "processes), or on jax one process over a mesh of the devices, each call's batch_size rows split over "
            "them; ray: batches handed out to the workers of a Ray cluster (execution.ray)."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    cores: int = Field(
        default=0,
        ge=0,
        description="multi and spmd: how many devices (0 = every local device; on XLA:CPU, CPU_NUM_DEVICES or 1).",
        json_schema_extra=RESUME_ROUNDING,
    )
    strict_shapes: bool = Field(
        default=False,
        description=(
            "Any compile after warmup stops the run (exit 1), naming the batch and shape key (also generate "
            "--strict-shapes)."
        ),
        json_schema_extra=RESUME_NO_EFFECT,
    )
    pod: PodConfig = Field(default=PodConfig(), description="A worker's place in a TPU pod slice (`tpugen pod-run`).")
    offload: Literal["none", "model"] = Field(
        default="none",
        description="model: each component moves to the device only while it runs (xla, cuda, torch_tpu).",
        json_schema_extra=RESUME_ROUNDING,
    )
    sharding: Literal["none", "spmd"] = Field(
        default="none",
        description="spmd (xla, jax): one process drives every local device as a mesh; big weights are split over it.",
        json_schema_extra=RESUME_ROUNDING,
    )
    mesh: MeshConfig = Field(
        default=MeshConfig(),
        description=(
            "The SPMD mesh (execution.sharding: spmd): {data: D, model: M}, D x M = the devices (on XLA:CPU, "
            "execution.cores)."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    placement: Placement = Field(
        default="none",
        description=(
            "xla: whole components on different chips of this VM: auto (greedy by size), or {component: chip index}."
        ),
        json_schema_extra=RESUME_ROUNDING,
    )
    chip: Literal["v4", "v5e", "v5p", "v6e"] = Field(
        default="v5e",
        description="The TPU generation memory plans are made for (HBM per chip: v4 32 GB, v5e 16, v5p 95, v6e 32).",
        json_schema_extra=RESUME_PLACEMENT,
    )
    chip_memory_gb: float | None = Field(
        default=None, gt=0, description="Overrides the chip's HBM in GB.", json_schema_extra=RESUME_PLACEMENT
    )
    torch_tpu: TorchTpuConfig = Field(
        default=TorchTpuConfig(),
        description="TorchTPU's options (execution.backend: torch_tpu).",
        json_schema_extra=RESUME_ROUNDING,
    )
    ray: RayConfig = Field(
        default=RayConfig(),
        description="A run over a Ray cluster (execution.mode: ray only).",
        json_schema_extra=RESUME_NO_EFFECT,
    )


class CacheConfig(_Section):
    enabled: bool | Literal["auto"] = Field(
        default="auto",
        description="auto: on where XLA can reload compiled programs (TPU); off on XLA:CPU, which cannot.",
    )
    dir: str | None = Field(
        default=None,
        description="The cache's folder; unset: TPUGEN_CACHE/xla, one subdirectory per device kind and process.",
    )


# A run id is a folder name here and, with pod-run, in gcloud scp paths that a shell on every worker reads:
# only characters no shell splits, expands or runs.
RUN_ID_RULE = "use 1 to 128 ASCII letters, digits, '.', '_' or '-', not starting with '.' or '-'"
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def is_safe_run_id(value: str) -> bool:
    return _RUN_ID.fullmatch(value) is not None


class OutputConfig(_Section):
    dir: str = Field(
        default="outputs",
        description="Where run directories go (relative to the working directory), or gs://bucket/prefix for pod-run.",
    )
    run_id: str | None = Field(
        default=None,
        description=(
            "The run directory's name; unset: a UTC timestamp and the config hash. 1 to 128 ASCII letters, "
            "digits, '.', '_' or '-', not starting with '.' or '-'."
        ),
    )

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, value: str | None) -> str | None:
        if value is not None and not is_safe_run_id(value):
            raise ValueError(RUN_ID_RULE)
        return value


def _check_prompt(value: Any) -> Any:
    # A mapping is checked key by key when the prompts are resolved (config.prompts), like a .jsonl line.
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"a prompt is a string, or a mapping like a .jsonl line, got {value!r}")
    if not value.strip():
        raise ValueError("prompt is empty")
    if problem := text_problem(value):
        raise ValueError(problem)
    return value


# A prompt, or a mapping with the keys of a .jsonl line (prompt, negative_prompt, seed, steps, ...).
Prompt = Annotated[Any, AfterValidator(_check_prompt)]


def _check_side(value: int) -> int:
    if not side_ok(value):
        raise ValueError(
            f"must be a positive multiple of {SIDE_MULTIPLE} (the VAE downsamples by {SIDE_MULTIPLE}), got {value}"
        )
    return value


def _check_size(pair: list[int]) -> list[int]:
    if len(pair) != 2:
        raise ValueError(f"a size is a [height, width] pair, got {pair}")
    for side in pair:
        _check_side(side)
    return pair


Size = Annotated[list[int], AfterValidator(_check_size)]


class PromptStyle(_Section):
    name: str = Field(min_length=1, max_length=200, description="The style's name, as requests' `styles` name it.")
    prompt: str = Field(
        default="",
        max_length=10_000,
        description="Added to a request's prompt: `{prompt}` in it stands for the prompt, else it is appended after a comma.",
    )
    negative_prompt: str = Field(
        default="", max_length=10_000, description="Added to the negative prompt by the same rule."
    )


class ServeConfig(_Section):
    sizes: list[Size] | None = Field(
        default=None,
        description=(
            "The sizes kept warm, [height, width] pairs; unset: the config's own sizes (sizes, or height x width)."
        ),
    )
    schedulers: list[str] = Field(
        default=[], description="Schedulers kept warm besides the model's own (the names model.scheduler takes)."
    )
    tasks: list[Literal["txt2img", "img2img", "inpaint", "edit"]] = Field(
        default=["txt2img"],
        description=(
            "What the server keeps warm at each size and sampler: txt2img, img2img (/sdapi/v1/img2img) and "
            "inpaint (img2img with a mask); each is graphs of its own (the image's encoding). edit: editing by "
            "reference images (FLUX.2: /v1/images/edits, /sdapi/v1/img2img), at each of serve.reference_counts."
        ),
    )
    reference_counts: list[Annotated[int, Field(ge=1, le=MAX_REFERENCES)]] = Field(
        default=[1],
        min_length=1,
        max_length=MAX_REFERENCES,
        description=(
            "serve.tasks edit: the numbers of reference images kept warm (each its own graphs at every size: the "
            "references' tokens join the image's); up to the family's most (FLUX.2 [dev] 6, [klein] 4)."
        ),
    )
    prompt_chunks: list[Annotated[int, Field(ge=1, le=8)]] = Field(
        default=[1],
        min_length=1,
        max_length=8,
        description=(
            "prompt_syntax webui, SD and SDXL: the prompt lengths kept warm, in 75-token chunks (each count its "
            "own graphs at every size; a prompt is as long as the longer of it and its negative prompt). [1, 2] "
            "warms prompts of up to 150 tokens too."
        ),
    )
    tiling: bool = Field(
        default=False,
        description=(
            "Also keep tiled images warm (the web UI's tiling: true): every warm size, task and sampler once more "
            "with circular padding, graphs of their own. Off: under new_shapes: reject a tiled request gets 422."
        ),
    )
    new_shapes: Literal["reject", "compile"] = Field(
        default="reject",
        description=(
            "A request for a size, CFG or scheduler that is not warm: reject (422 naming what is warm), or "
            "compile it once (it then stays warm)."
        ),
    )
    batch_window_ms: int = Field(
        default=20,
        ge=0,
        le=60_000,
        description=(
            "How long the first image of a batch waits for companions with the same shape, steps and guidance."
        ),
    )
    max_queue: int = Field(
        default=64, ge=1, description="Requests waiting or running at once; one more gets 503 with Retry-After."
    )
    max_images_per_request: int = Field(
        default=16, ge=1, description="Images one request may ask for (A1111 batch_size x n_iter, OpenAI n)."
    )
    max_images_per_run: int = Field(
        default=10_000,
        ge=1,
        description="Images one run sent to /v1/runs may plan (prompts x images_per_prompt x sizes); more gets 422.",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A request still waiting after this long gets 504 and its images are dropped from the queue.",
    )
    max_input_mb: int = Field(
        default=2048,
        ge=1,
        description=(
            "The images requests and runs send, kept under the output root's .inputs folder by content, up to this "
            "many MiB: past it the least recently used go, save those a queued or running run reads and those a "
            "request used within serve.request_timeout_s."
        ),
    )
    idle_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="A kept-alive connection that sends no new request for this long is closed.",
    )
    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "A request's head must arrive within this long of its connection opening (or of its first byte after "
            "an answer), else the connection is closed; a body that stops for this long between two parts gets 408."
        ),
    )
    lora_dir: str | None = Field(
        default=None,
        description=(
            "A folder of LoRA .safetensors files that requests name by file stem (A1111's <lora:NAME:SCALE>, "
            "and model.loras of runs sent to /v1/runs); relative to the config file."
        ),
    )
    embeddings_dir: str | None = Field(
        default=None,
        description=(
            "A folder of textual-inversion embeddings (.safetensors, .pt, .bin) the server loads at start, besides "
            "model.embeddings; prompts name each by its file's stem. A file that fails is listed as skipped by "
            "/sdapi/v1/embeddings; relative to the config file."
        ),
    )
    max_runs: int = Field(
        default=2,
        ge=1,
        description=(
            "Runs sent to /v1/runs that may be queued or running at once; one more gets 429 with Retry-After."
            " Under execution.mode: multi each run goes to the engine with the fewest runs, so set it to the "
            "device count or more to keep every chip busy with runs."
        ),
    )
    max_failed_batches: int = Field(
        default=3,
        ge=1,
        description=(
            "Batches in a row that may fail on one engine (not counting a request's own bad input) before the"
            " server calls its device broken: /readyz turns 503 with the last error, and once the requests in"
            " flight are answered the process exits 1 so its supervisor (systemd, Kubernetes, Ray) restarts "
            "it."
        ),
    )
    max_side: int | None = Field(
        default=None,
        ge=64,
        description=(
            "A request's largest width or height; unset: 2048 under new_shapes: compile (each new size is a compile "
            "and graphs kept in memory), and under reject the warm sizes (a larger one is refused as not warm)."
        ),
    )
    max_warm_shapes: int = Field(
        default=64,
        ge=1,
        description=(
            "Under new_shapes: compile, the most shape keys the server keeps warm (warmup's included): a request "
            "that would compile one more gets 422."
        ),
    )
    hub_loras: bool = Field(
        default=False,
        description=(
            "Whether a run sent to /v1/runs may name a hub LoRA (org/name), which the server downloads with its own "
            "token; off: runs and requests name the LoRAs of serve.lora_dir only."
        ),
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description=(
            "Web pages (scheme://host[:port], as a browser sends Origin) that may call the server besides its own "
            "page: a request from any other origin gets 403, so a page on the web cannot drive a server on your "
            "machine."
        ),
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description=(
            "Host names a server bound to a loopback address answers besides loopback ones (localhost, 127.0.0.1, "
            "[::1]): any other Host gets 400, so a DNS name rebound to 127.0.0.1 cannot reach it."
        ),
    )

    prompt_styles: list[PromptStyle] = Field(
        default_factory=list,
        description=(
            "The web UI's saved prompt styles this server has: a request's `styles` names them (GET "
            "/sdapi/v1/prompt-styles lists them); none by default."
        ),
    )

    @field_validator("prompt_styles")
    @classmethod
    def _unique_styles(cls, value: list[PromptStyle]) -> list[PromptStyle]:
        names = [style.name for style in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"style {twice[0]!r} is named twice")
        return value

    @field_validator("schedulers")
    @classmethod
    def _known_schedulers(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if find_scheduler(name) is None]
        if unknown:
            raise ValueError(f"unknown scheduler {unknown[0]!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
        return value


class RunConfig(_Section):
    model: ModelConfig = Field(description="The pipeline: which model, in which dtype, with which scheduler and LoRAs.")
    prompts: list[Prompt] | None = Field(
        default=None,
        description=(
            "The prompts, inline: strings, or mappings with the keys of a .jsonl line (prompt, "
            "negative_prompt, seed, steps, guidance_scale, height, width; for img2img init_image, a path "
            "relative to the config, with strength (0 to 1, default 0.75) and resize_mode (0 just resize, 1 crop"
            " and resize, 2 resize and fill); for inpainting also mask_image, white where to repaint). Give "
            "prompts or prompts_file; a server's config needs neither."
        ),
    )
    prompts_file: str | None = Field(
        default=None,
        description=(
            "A .txt file (one prompt per line) or a .jsonl file (per line: prompt, negative_prompt, seed, "
            "steps, guidance_scale, height, width, init_image, mask_image, strength, resize_mode), relative to "
            "the config file (as the images' paths are)."
        ),
        json_schema_extra=RESUME_NO_EFFECT,
    )
    negative_prompt: str = Field(default="", description="The negative prompt of every prompt without its own.")
    prompt_syntax: Literal["webui", "plain"] = Field(
        default="webui",
        description=(
            "How prompts are read. webui: as the AUTOMATIC1111 web UI reads them, for the families with CLIP "
            "text encoders (SD 1.x/2.x, SDXL): (word:1.2), (word) = 1.1, [word] = 1/1.1, \\( escapes and BREAK, "
            "and prompts past 75 tokens encoded in 75-token chunks (each chunk count a shape key, compiled "
            "once); other families get the text with the syntax taken out. plain: the text as it is, "
            "encoded by the pipeline itself (a CLIP prompt cut at 77 tokens)."
        ),
    )
    clip_skip: int = Field(
        default=1,
        ge=1,
        le=12,
        description=(
            "The web UI's clip skip (CLIP_stop_at_last_layers), SD 1.x/2.x: prompts are read from this layer of the "
            "text encoder counted from its last (1: the last; 2: the one before, as many SD 1.5 models were "
            "trained), through its final layer norm. Another text-encoding graph per value; a server's requests "
            "may ask for another in override_settings."
        ),
    )
    max_chunks: int = Field(
        default=3,
        ge=1,
        le=8,
        description=(
            "prompt_syntax webui: the most 75-token chunks a prompt (or negative prompt) may take; a longer "
            "one is refused, naming it. Each count used is its own shape key."
        ),
    )
    height: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Image height in pixels, a multiple of 8. Unset: the model's own default, else its family's (64 "
            "for the tiny models, 512 for SD 1.x, 768 for SD 2.x, 1024 for SDXL, SD3 and Flux; `tpugen "
            "models` lists them)."
        ),
    )
    width: int | None = Field(
        default=None, gt=0, description="Image width in pixels, a multiple of 8; unset: as for height."
    )
    sizes: list[Size] | None = Field(
        default=None,
        description=(
            "Instead of height and width: [height, width] pairs such as [[1024, 1024], [768, 1344]], every "
            "prompt at every size (a .jsonl line may set its own height and width)."
        ),
    )
    steps: int | None = Field(
        default=None,
        ge=MIN_STEPS,
        le=MAX_STEPS,
        description=(
            "Denoising steps; unset: the model's (or its family's) own default, filled in when the config is resolved."
        ),
    )
    guidance_scale: float | None = Field(
        default=None,
        ge=0,
        description=(
            "Classifier-free guidance (on above 1 for most families; `tpugen models` gives each family's "
            "rule); unset: the model's or its family's default."
        ),
    )
    seed: int = Field(
        default=0,
        ge=0,
        lt=MAX_SEED + 1,
        description="Image i of the run uses seed + i (a .jsonl line's seed s gives s + k for its k-th image).",
    )
    batch_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Images per pipeline call: larger batches use the chip better, and each batch size is one more "
            "compile. The last batch is padded to it."
        ),
    )
    images_per_prompt: int = Field(
        default=1, ge=1, description="Images made from each prompt (a run plans at most 1,000,000 images)."
    )
    hires: HiresConfig | None = Field(
        default=None,
        description=(
            "Hires fix: each text-only image made at the base size, upscaled, then made again from it at the "
            "larger size by img2img ({scale, steps, strength, upscaler}); both sizes compile in warmup. "
            "Prompts with an init_image run as img2img at their size, without it. A server's config with "
            "hires warms it at each serve size. Unset: one pass."
        ),
    )
    tiling: bool = Field(
        default=False,
        description=(
            "Seamless tiling, as the web UI's Tiling: every padded convolution of the UNet and the VAE pads "
            "circularly, so the image wraps round at its edges and tiles without a seam. A tiled image is a shape "
            "key of its own (its graphs compile in warmup). UNet models only (SD 1.x/2.x, SDXL). A server's "
            "requests ask for it themselves (the web UI's tiling; serve.tiling keeps it warm)."
        ),
    )
    execution: ExecutionConfig = Field(
        default=ExecutionConfig(), description="How the run is executed: backend, mode, devices, memory strategy."
    )
    compile: CompileConfig = Field(default=CompileConfig(), description="How the denoiser is compiled and sped up.")
    cache: CacheConfig = Field(
        default=CacheConfig(), description="torch_xla's persistent compile cache.", json_schema_extra=RESUME_NO_EFFECT
    )
    output: OutputConfig = Field(
        default=OutputConfig(),
        description="Where the run directory goes and what it is called.",
        json_schema_extra=RESUME_NO_EFFECT,
    )
    serve: ServeConfig = Field(
        default=ServeConfig(),
        description=(
            "`tpugen serve`: what the server keeps warm and how it batches requests (other commands ignore it)."
        ),
        json_schema_extra=RESUME_NO_EFFECT,
    )

    @field_validator("height", "width")
    @classmethod
    def _multiple_of_8(cls, value: int | None) -> int | None:
        if value is not None:
            _check_side(value)
        return value

    @field_validator("sizes")
    @classmethod
    def _sizes_not_empty(cls, value: list | None) -> list | None:
        if value is not None and not value:
            raise ValueError("the list is empty; give [height, width] pairs or leave sizes out")
        return value

    @field_validator("negative_prompt")
    @classmethod
    def _negative_is_text(cls, value: str) -> str:
        if problem := text_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("prompts")
    @classmethod
    def _prompts_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("the list is empty; give at least one prompt")
        return value

    @model_validator(mode="after")
    def _warm_chunks_allowed(self) -> RunConfig:
        over = [count for count in self.serve.prompt_chunks if count > self.max_chunks]
        if over:
            raise ValueError(f"serve.prompt_chunks: {over[0]} is more than max_chunks ({self.max_chunks})")
        return self


# ---------------------------------------------------------------- walking the schema


def field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def section_at(path: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = model_type(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def model_type(annotation: Any) -> type[BaseModel] | None:
    """The section a key holds (a model, or an optional one); a list of models (model.loras) is a value."""
    unions = (typing.Union, types.UnionType)
    for candidate in (annotation, *(typing.get_args(annotation) if typing.get_origin(annotation) in unions else ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def is_text_field(annotation: Any) -> bool:
    options = typing.get_args(annotation) or (annotation,)
    return str in options or (typing.get_origin(annotation) is Literal)


def all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts, for suggestions and docs."""
    keys = []
    for name, field in model.model_fields.items():
        inner = model_type(field.annotation)
        if inner is not None:
            keys.extend(all_keys(inner, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys
