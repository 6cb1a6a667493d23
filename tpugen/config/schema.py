"""The run config's schema: every key, its type, its default and its own checks (pydantic)."""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tpugen.config.request import MAX_SEED, MAX_STEPS, MIN_STEPS, SIDE_MULTIPLE, side_ok, text_problem
from tpugen.schedulers import SCHEDULER_NAMES, find_scheduler


class _Section(BaseModel):
    # strict: YAML already types its values, so "20" for steps is a mistake worth naming, not coercing.
    # No infinities: guidance_scale .inf runs to all-black images, chip_memory_gb .inf plans nothing.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# A LoRA's scale: 1.0 is the strength it was trained at and web UIs' sliders stop at 2; past 4 its change
# swamps the model's own weights (noise, not style). Negative scales invert what it learned, which LoRAs are
# not trained for: a sign typed by mistake more often than meant.
LORA_SCALE_MAX = 4.0


class LoraConfig(_Section):
    # A .safetensors LoRA file (relative to the config file), a folder holding one, or a hub repo id org/name.
    # Formats: diffusers/PEFT and kohya (sd-scripts), for the UNet or transformer and the text encoders.
    id: str
    # How strongly it is fused into the weights, from 0 to 4 (1.0: as trained).
    scale: float = 1.0
    # The file inside a hub repo or a folder (default: its only .safetensors, or pytorch_lora_weights.safetensors).
    weight_name: str | None = None
    # The file's sha256, filled in when the config is resolved; set it to pin the file (any other is refused).
    sha256: str | None = None

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


class ModelConfig(_Section):
    id: str
    revision: str | None = None
    variant: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    scheduler: str | None = None
    # Code from a model repository runs only when the config says so.
    allow_remote_code: bool = False
    custom_pipeline: str | None = None
    # SDXL's invisible watermark (runs on the host, so off by default on TPU).
    watermark: bool = False
    # LoRAs fused into the weights on the host before the model moves to the device, in this order: the compiled
    # graphs stay the base model's (no compile per LoRA), and a warm engine can switch them without compiling.
    loras: list[LoraConfig] = []

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str | None) -> str | None:
        if value is not None and find_scheduler(value) is None:
            raise ValueError(f"unknown scheduler {value!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
        return value


class PodConfig(_Section):
    # num_workers is set by `tpugen pod-run`; the index, unless set, is TPU_WORKER_ID / CLOUD_TPU_TASK_ID, else
    # torch_xla's host index.
    worker_index: int | None = Field(default=None, ge=0)
    num_workers: int | None = Field(default=None, ge=1)


class TorchTpuConfig(_Section):
    # eager (strict, the default), defer_and_fuse (TORCH_TPU_DEFER_AND_FUSE=1), or compile (torch.compile "tpu").
    mode: Literal["eager", "defer_and_fuse", "compile"] = "eager"


def _check_auto_or_bool(value: Any) -> Any:
    if value == "auto" or isinstance(value, bool):
        return value
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(f"must be auto, true or false, got {shown}")


# One readable error for a bad value, instead of one per member of `bool | Literal["auto"]`.
AutoOrBool = Annotated[Any, AfterValidator(_check_auto_or_bool)]


# The step caches diffusers 0.42 ships that tpugen does not run, each with why (compile.step_cache.method).
STEP_CACHE_NOT_YET = {
    "fastercache": "is not supported yet (only taylorseer is)",
    "pyramid_attention_broadcast": "is not supported yet (only taylorseer is)",
    "magcache": "is not supported yet: it needs mag_ratios calibrated for the model, which tpugen cannot make yet",
    "first_block_cache": (
        "cannot run as static graphs: its threshold compares each step's residual on the device, a branch on "
        "the data (a read back to the host every step); use taylorseer"
    ),
}
STEP_CACHE_METHODS = ("none", "taylorseer")


def _check_step_cache_method(value: Any) -> Any:
    if value in STEP_CACHE_METHODS:
        return value
    if value in STEP_CACHE_NOT_YET:
        raise ValueError(f"{value} {STEP_CACHE_NOT_YET[value]}")
    shown = value if not isinstance(value, str) else repr(value)
    raise ValueError(f"must be none or taylorseer, got {shown}")


class StepCacheConfig(_Section):
    # none, or taylorseer: diffusers' TaylorSeer (diffusers.hooks.TaylorSeerCacheConfig, attached with
    # transformer.enable_cache): between full steps, the attention outputs are predicted from a Taylor series of
    # the last full ones. Each step's kind follows from its index alone, so on XLA each kind is one graph,
    # compiled in warmup. Images differ from uncached ones (the PNG record and parameters say so).
    method: Annotated[str, AfterValidator(_check_step_cache_method)] = "none"
    # The rest are TaylorSeerCacheConfig's own options, with its names and defaults.
    # Full steps come every cache_interval steps once caching has started; the others are predicted.
    cache_interval: int = Field(default=5, ge=1)
    # Steps 0 .. this - 1 run full (they gather the Taylor factors); at least 1, so step 0 always runs full.
    disable_cache_before_step: int = Field(default=3, ge=1)
    # From this step on every step runs full again (none: caching to the end).
    disable_cache_after_step: int | None = Field(default=None, ge=1)
    # The Taylor series' highest order (1: a straight line through the last two full steps).
    max_order: int = Field(default=1, ge=0, le=4)
    # The factors' dtype: float32 keeps the images closest to uncached ones (diffusers' default is bfloat16).
    taylor_factors_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # Regexes (re.fullmatch on module names) of modules predicted as zeros, and of modules Taylor-predicted;
    # none: the attention of every transformer block.
    skip_predict_identifiers: list[str] | None = None
    cache_identifiers: list[str] | None = None
    # TaylorSeer lite: blocks skipped, only proj_out predicted (faster, further from the uncached image).
    use_lite_mode: bool = False

    @field_validator("skip_predict_identifiers", "cache_identifiers")
    @classmethod
    def _regexes(cls, value: list[str] | None) -> list[str] | None:
        for pattern in value or ():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _options_need_a_method(self) -> StepCacheConfig:
        # Options at their defaults pass: a resolved config (a run's config.yaml) writes every key out.
        fields = type(self).model_fields
        given = [name for name in fields if name != "method" and getattr(self, name) != fields[name].default]
        if self.method == "none" and given:
            raise ValueError(f"{', '.join(given)}: TaylorSeer's options; set method: taylorseer or leave them out")
        return self

    def options(self) -> dict:
        """The method's own options, as diffusers' config class names them ({} for none)."""
        return {} if self.method == "none" else self.model_dump(exclude={"method"})

    def record(self) -> dict | None:
        """What an image record says of the cache (None: no cache, and the record stays as it was before)."""
        return None if self.method == "none" else {"method": self.method, **self.options()}


class CompileConfig(_Section):
    # torch.compile the denoiser on the cpu and cuda backends (xla compiles through torch_xla already).
    torch_compile: bool = False
    # xla, Flux and SD3: run repeated blocks through torch_xla's scan, so one block per kind is compiled.
    scan_blocks: bool = False
    # xla: the denoiser's attention through torch_xla's Pallas flash-attention kernel (diffusers' XLA path). auto: on
    # a TPU only; true: try it anywhere. If it cannot run (no jax, not a TPU, a compile error), the run goes on without.
    flash_attention: AutoOrBool = "auto"
    # Skip work between denoising steps with one of diffusers' step caches (transformer families).
    step_cache: StepCacheConfig = StepCacheConfig()


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
    # Devices that each take a share of the batch (batch_size must divide by it).
    data: int = Field(default=1, ge=1)
    # Devices each weight is split over; 0 = every device the data axis leaves.
    model: int = Field(default=0, ge=0)


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
    address: Annotated[str, AfterValidator(_check_ray_address)] = "local"
    # A number, or auto: one per TPU host of the cluster (as many as resources_per_worker fit on its TPU
    # nodes), else one per node.
    workers: Annotated[Any, AfterValidator(_check_workers)] = "auto"
    # What each worker asks Ray for; default {TPU: chips per host} on a cluster with TPUs, else {CPU: 1}.
    resources_per_worker: Annotated[Any, AfterValidator(_check_resources)] = None
    # How often Ray starts a lost worker again (it opens and warms its engine again each time).
    max_restarts: int = Field(default=3, ge=0)
    # Passed to ray.init (pip, env_vars, working_dir, ...).
    runtime_env: dict[str, Any] | None = None
    # How long the address may take to answer.
    connect_timeout_s: float = Field(default=30.0, gt=0)
    # A batch's deadline, in seconds from when its worker could start it (its previous batch done): a worker
    # that misses it is taken as lost (hung), its batches in flight go back to the queue and its actor is killed,
    # so Ray restarts it while max_restarts allow. Warm batches take seconds; the warmup has no deadline, nor
    # (with --skip-warmup) a worker's first batch of each shape key, which compiles. null: no deadline.
    batch_timeout_s: float | None = Field(default=600.0, gt=0)


class ExecutionConfig(_Section):
    backend: Literal["xla", "cpu", "cuda", "torch_tpu"] = "xla"
    # single: one device; multi: one replica per device, through torch_xla.launch (xla) or torchrun, one
    # process each (torch_tpu: process group tpu_dist, cuda: nccl, cpu: gloo, with cores processes); ray: batches
    # handed out to the workers of a Ray cluster (execution.ray).
    mode: Literal["single", "multi", "ray"] = "single"
    # multi and spmd: how many devices (0 = every local device; on XLA:CPU, CPU_NUM_DEVICES or 1).
    cores: int = Field(default=0, ge=0)
    strict_shapes: bool = False
    pod: PodConfig = PodConfig()
    # model: each component moves to the device only while it runs (xla, cuda, torch_tpu).
    offload: Literal["none", "model"] = "none"
    # spmd (xla): one process drives every local device as a mesh; big weights are split over it.
    sharding: Literal["none", "spmd"] = "none"
    # The SPMD mesh: {data: D, model: M}, D x M = the devices (on XLA:CPU, execution.cores).
    mesh: MeshConfig = MeshConfig()
    # xla: whole components on different chips of this VM: auto (greedy by size), or {component: chip index}.
    placement: Placement = "none"
    # The TPU generation memory plans are made for (HBM per chip: v4 32 GB, v5e 16, v5p 95, v6e 32).
    chip: Literal["v4", "v5e", "v5p", "v6e"] = "v5e"
    # Overrides the chip's HBM in GB.
    chip_memory_gb: float | None = Field(default=None, gt=0)
    torch_tpu: TorchTpuConfig = TorchTpuConfig()
    ray: RayConfig = RayConfig()


class CacheConfig(_Section):
    # auto: on where XLA can reload compiled programs (TPU); off on XLA:CPU, which cannot.
    enabled: bool | Literal["auto"] = "auto"
    dir: str | None = None


# A run id is a folder name here and, with pod-run, in gcloud scp paths that a shell on every worker reads:
# only characters no shell splits, expands or runs.
RUN_ID_RULE = "use 1 to 128 ASCII letters, digits, '.', '_' or '-', not starting with '.' or '-'"
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def is_safe_run_id(value: str) -> bool:
    return _RUN_ID.fullmatch(value) is not None


class OutputConfig(_Section):
    dir: str = "outputs"
    run_id: str | None = None

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


class ServeConfig(_Section):
    # The sizes kept warm, [height, width] pairs; unset: the config's own sizes (sizes, or height x width).
    sizes: list[Size] | None = None
    # Schedulers kept warm besides the model's own (the names model.scheduler takes).
    schedulers: list[str] = []
    # A request for a size, CFG or scheduler that is not warm: reject (422 naming what is warm), or compile
    # it once (it then stays warm).
    new_shapes: Literal["reject", "compile"] = "reject"
    # How long the first image of a batch waits for companions with the same shape, steps and guidance.
    batch_window_ms: int = Field(default=20, ge=0, le=60_000)
    # Requests waiting or running at once; one more gets 503 with Retry-After.
    max_queue: int = Field(default=64, ge=1)
    # Images one request may ask for (A1111 batch_size x n_iter, OpenAI n).
    max_images_per_request: int = Field(default=16, ge=1)
    # Images one run sent to /v1/runs may plan (prompts x images_per_prompt x sizes); more gets 422.
    max_images_per_run: int = Field(default=10_000, ge=1)
    # A request still waiting after this long gets 504 and its images are dropped from the queue.
    request_timeout_s: float = Field(default=600.0, gt=0)
    # A folder of LoRA .safetensors files that requests name by file stem (A1111's <lora:NAME:SCALE>, and
    # model.loras of runs sent to /v1/runs); relative to the config file.
    lora_dir: str | None = None
    # Runs sent to /v1/runs that may be queued or running at once; one more gets 429 with Retry-After. Under
    # execution.mode: multi each run goes to the engine with the fewest runs, so set it to the device count
    # or more to keep every chip busy with runs.
    max_runs: int = Field(default=2, ge=1)
    # Batches in a row that may fail on one engine (not counting a request's own bad input) before the server
    # calls its device broken: /readyz turns 503 with the last error, and once the requests in flight are
    # answered the process exits 1 so its supervisor (systemd, Kubernetes, Ray) restarts it.
    max_failed_batches: int = Field(default=3, ge=1)

    @field_validator("schedulers")
    @classmethod
    def _known_schedulers(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if find_scheduler(name) is None]
        if unknown:
            raise ValueError(f"unknown scheduler {unknown[0]!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
        return value


class RunConfig(_Section):
    model: ModelConfig
    prompts: list[Prompt] | None = None
    prompts_file: str | None = None
    negative_prompt: str = ""
    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    sizes: list[Size] | None = None
    # None: the model's (or its family's) own default, filled in when the config is resolved.
    steps: int | None = Field(default=None, ge=MIN_STEPS, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int = Field(default=0, ge=0, lt=MAX_SEED + 1)
    batch_size: int = Field(default=1, ge=1)
    images_per_prompt: int = Field(default=1, ge=1)
    execution: ExecutionConfig = ExecutionConfig()
    compile: CompileConfig = CompileConfig()
    cache: CacheConfig = CacheConfig()
    output: OutputConfig = OutputConfig()
    # `tpugen serve`: what the server keeps warm and how it batches requests (other commands ignore it).
    serve: ServeConfig = ServeConfig()

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
