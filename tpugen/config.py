"""The YAML run config: schema, key=value overrides, prompt files, and every check made at the door."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from tpugen.errors import InputError
from tpugen.families import family_of, model_defaults
from tpugen.lines import text_lines
from tpugen.models import ModelSource, classify_model_id
from tpugen.schedulers import SCHEDULER_NAMES, find_scheduler


class _Section(BaseModel):
    # strict: YAML already types its values, so "20" for steps is a mistake worth naming, not coercing.
    # No infinities: guidance_scale .inf runs to all-black images, chip_memory_gb .inf plans nothing.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str | None) -> str | None:
        if value is not None and find_scheduler(value) is None:
            raise ValueError(f"unknown scheduler {value!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
        return value


class PodConfig(_Section):
    # Set by `tpugen pod-run`; else TPU_WORKER_ID / CLOUD_TPU_TASK_ID, else torch_xla's host index.
    worker_index: int | None = Field(default=None, ge=0)
    num_workers: int | None = Field(default=None, ge=1)


class TorchTpuConfig(_Section):
    # eager (strict, the default), defer_and_fuse (TORCH_TPU_DEFER_AND_FUSE=1), or compile (torch.compile "tpu").
    mode: Literal["eager", "defer_and_fuse", "compile"] = "eager"


class CompileConfig(_Section):
    # torch.compile the denoiser on the cpu and cuda backends (xla compiles through torch_xla already).
    torch_compile: bool = False
    # xla: run Flux's repeated blocks through torch_xla's scan, so one block per type is compiled.
    scan_blocks: bool = False


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


class ExecutionConfig(_Section):
    backend: Literal["xla", "cpu", "cuda", "torch_tpu"] = "xla"
    # single: one device; multi: one replica per device, through torch_xla.launch (xla) or torchrun, one
    # process each (torch_tpu: process group tpu_dist, cuda: nccl, cpu: gloo, with cores processes).
    mode: Literal["single", "multi"] = "single"
    # multi and spmd: how many devices (0 = every local device; on XLA:CPU, CPU_NUM_DEVICES or 1).
    cores: int = Field(default=0, ge=0)
    strict_shapes: bool = False
    pod: PodConfig = PodConfig()
    # model: each component moves to the device only while it runs (cuda, torch_tpu).
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


def _non_empty_prompt(text: str) -> str:
    if not text.strip():
        raise ValueError("prompt is empty")
    return text


Prompt = Annotated[str, AfterValidator(_non_empty_prompt)]


def _check_side(value: int) -> int:
    if value <= 0 or value % 8:
        raise ValueError(f"must be a positive multiple of 8 (the VAE downsamples by 8), got {value}")
    return value


def _check_size(pair: list[int]) -> list[int]:
    if len(pair) != 2:
        raise ValueError(f"a size is a [height, width] pair, got {pair}")
    for side in pair:
        _check_side(side)
    return pair


Size = Annotated[list[int], AfterValidator(_check_size)]


class RunConfig(_Section):
    model: ModelConfig
    prompts: list[Prompt] | None = None
    prompts_file: str | None = None
    negative_prompt: str = ""
    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    sizes: list[Size] | None = None
    # None: the model's (or its family's) own default, filled in when the config is resolved.
    steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int = Field(default=0, ge=0, lt=2**63)
    batch_size: int = Field(default=1, ge=1)
    images_per_prompt: int = Field(default=1, ge=1)
    execution: ExecutionConfig = ExecutionConfig()
    compile: CompileConfig = CompileConfig()
    cache: CacheConfig = CacheConfig()
    output: OutputConfig = OutputConfig()

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

    @field_validator("prompts")
    @classmethod
    def _prompts_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("the list is empty; give at least one prompt")
        return value


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of the run, with its per-prompt overrides already applied."""

    prompt: str
    negative_prompt: str
    seed: int | None  # None: the run's seed + image index
    steps: int
    guidance_scale: float
    sizes: tuple[tuple[int, int], ...]  # (height, width) pairs this prompt is rendered at


@dataclass(frozen=True)
class ResolvedRun:
    """A config that passed every check, with defaults filled and paths made absolute."""

    config: RunConfig
    prompts: list[PromptSpec]
    model_source: ModelSource
    config_hash: str
    family: str = "sd"

    def to_yaml(self) -> str:
        return dump_config(self.config)


# ---------------------------------------------------------------- reading YAML as written


class _YamlLoader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2's numbers instead of YAML 1.1's.

    YAML 1.1 reads `seed: 0042` as octal 34, `steps: 1:30` as 90 (base 60) and `0x10` as 16. Here an
    integer is decimal digits with an optional sign and no leading zero, and a float has a decimal point
    (as in YAML 1.1, so `1e3` stays text); anything else stays a string, which the schema then refuses with
    the key's name.
    """


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(0|[1-9][0-9]*)$"), list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


class _YamlDumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or tpugen's loader would read as something else ("1e3",
    "0042"), so a config written by tpugen reads back the same anywhere."""


_YamlDumper.yaml_implicit_resolvers = {
    first: list(resolvers) + [r for r in _YamlLoader.yaml_implicit_resolvers.get(first, []) if r not in resolvers]
    for first, resolvers in yaml.SafeDumper.yaml_implicit_resolvers.items()
}
for _first, _resolvers in _YamlLoader.yaml_implicit_resolvers.items():
    _YamlDumper.yaml_implicit_resolvers.setdefault(_first, list(_resolvers))


def yaml_load(text: str) -> Any:
    """A YAML document read safely (no tags, no objects), numbers as YAML 1.2 reads them."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 -- a SafeLoader subclass


# ---------------------------------------------------------------- schema walking


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _section_at(path: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = _model_type(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_type(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_text_field(annotation: Any) -> bool:
    options = typing.get_args(annotation) or (annotation,)
    return str in options or (typing.get_origin(annotation) is Literal)


def all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts, for suggestions and docs."""
    keys = []
    for name, field in model.model_fields.items():
        inner = _model_type(field.annotation)
        if inner is not None:
            keys.extend(all_keys(inner, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------- overrides


def apply_overrides(data: dict, overrides: list[str]) -> list[str]:
    """Set each `key.sub=value` into `data`, typed by the schema. Returns the problems found."""
    problems = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"{text}: an override must look like key=value (for example steps=30)")
            continue
        parts = key.split(".")
        section = _section_at(parts[:-1])
        if section is None or parts[-1] not in section.model_fields:
            problems.append(f"{key}: unknown key{_suggest(key, all_keys())}")
            continue
        field = section.model_fields[parts[-1]]
        if _model_type(field.annotation) is not None:
            problems.append(
                f"{key}: is a section; set one of its keys, e.g. {key}.{_field_names(_model_type(field.annotation))[0]}=..."
            )
            continue
        if _is_text_field(field.annotation) and raw.strip().lower() not in ("null", "~"):
            value: Any = raw
        else:
            try:
                value = yaml_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                problems.append(f"{key}: cannot read the value {raw!r}")
                continue
        target = data
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[parts[-1]] = value
        # One prompt source wins: an override of one replaces the other from the file.
        if key == "prompts":
            data.pop("prompts_file", None)
        elif key == "prompts_file":
            data.pop("prompts", None)
    return problems


# ---------------------------------------------------------------- error formatting


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "config"


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "model_type": "a mapping of keys",
    "dict_type": "a mapping of keys",
}


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"


# What YAML 1.1 would have read as an integer and tpugen reads as text: octal, hex, base 60.
_YAML11_INTEGER = re.compile(r"[-+]?(0[0-9_]+|0[xXoObB][0-9a-fA-F_]+|[0-9]+(:[0-5]?[0-9])+)")


def _format_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = _dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        section = _section_at([p for p in loc[:-1] if isinstance(p, str)]) or RunConfig
        return f"{where}: unknown key{_suggest(str(loc[-1]), _field_names(section))}"
    if kind == "missing":
        return f"{where}: required key is missing"
    if kind == "int_type" and isinstance(err.get("input"), str) and _YAML11_INTEGER.fullmatch(err["input"]):
        return f"{where}: expected a decimal integer without leading zeros or ':', got {err['input']!r}"
    if kind in _TYPE_NAMES:
        return f"{where}: expected {_TYPE_NAMES[kind]}, got {_describe(err.get('input'))}"
    if kind == "finite_number":
        return f"{where}: must be a finite number, got {_describe(err.get('input'))}"
    if kind == "literal_error":
        return f"{where}: {err['msg'].replace('Input should be', 'must be')}, got {_describe(err.get('input'))}"
    if kind == "value_error":
        return f"{where}: {err['msg'].removeprefix('Value error, ')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{where}: {err['msg'].replace('Input should be', 'must be')}, got {_describe(err.get('input'))}"
    return f"{where}: {err['msg']}"


# ---------------------------------------------------------------- prompt files

_JSONL_KEYS = {"prompt", "negative_prompt", "seed", "steps", "guidance_scale", "height", "width"}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows (give a finite number)")


def _read_prompt_file(path: Path, problems: list[str]) -> list[dict]:
    where = "prompts_file"
    if not path.is_file():
        problems.append(
            f"{where}: {str(path)!r} does not exist" if not path.exists() else f"{where}: {str(path)!r} is not a file"
        )
        return []
    if path.suffix not in (".txt", ".jsonl"):
        problems.append(f"{where}: {path.name!r} must end in .txt (one prompt per line) or .jsonl")
        return []
    raw = path.read_bytes()
    if b"\0" in raw:
        problems.append(f"{where}: {str(path)!r} is binary, not a text file")
        return []
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        problems.append(f"{where}: {str(path)!r} is not UTF-8 (bad byte at offset {exc.start})")
        return []
    entries: list[dict] = []
    for number, line in enumerate(text_lines(text), start=1):
        if not line.strip():
            continue
        if path.suffix == ".txt":
            entries.append({"prompt": line.strip(), "_line": number})
            continue
        try:
            entry = json.loads(line, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}:{number}: not valid JSON ({exc.msg})")
            continue
        except ValueError as exc:
            problems.append(f"{where}:{number}: {exc}")
            continue
        if not isinstance(entry, dict):
            problems.append(f"{where}:{number}: expected a JSON object with a 'prompt' key")
            continue
        unknown = sorted(set(entry) - _JSONL_KEYS)
        if unknown:
            problems.append(f"{where}:{number}: unknown key {unknown[0]!r}{_suggest(unknown[0], sorted(_JSONL_KEYS))}")
            continue
        entry["_line"] = number
        entries.append(entry)
    if not entries and not problems:
        problems.append(f"{where}: {str(path)!r} has no prompts")
    return entries


def _check_prompt_entry(entry: dict, where: str, run: RunConfig, problems: list[str]) -> PromptSpec | None:
    prompt = entry.get("prompt")
    if not isinstance(prompt, str):
        problems.append(f"{where}: 'prompt' must be a string" if "prompt" in entry else f"{where}: 'prompt' is missing")
        return None
    if not prompt.strip():
        problems.append(f"{where}: prompt is empty")
        return None
    checks = {
        "negative_prompt": (str, lambda v: True, "a string"),
        "seed": (int, lambda v: 0 <= v < 2**63, "an integer >= 0"),
        "steps": (int, lambda v: 1 <= v <= 1000, "an integer from 1 to 1000"),
        "guidance_scale": ((int, float), lambda v: v >= 0, "a number >= 0"),
        "height": (int, lambda v: v > 0 and v % 8 == 0, "a positive multiple of 8"),
        "width": (int, lambda v: v > 0 and v % 8 == 0, "a positive multiple of 8"),
    }
    for key, (kind, ok, wanted) in checks.items():
        if key in entry:
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
                problems.append(f"{where}: {key} must be {wanted}, got {value!r}")
                return None
    if "height" in entry or "width" in entry:
        sizes = ((entry.get("height", run.height), entry.get("width", run.width)),)
    else:
        sizes = run_sizes(run)
    return PromptSpec(
        prompt=prompt,
        negative_prompt=entry.get("negative_prompt", run.negative_prompt),
        seed=entry.get("seed"),
        steps=entry.get("steps", run.steps),
        guidance_scale=float(entry.get("guidance_scale", run.guidance_scale)),
        sizes=sizes,
    )


def run_sizes(run: RunConfig) -> tuple[tuple[int, int], ...]:
    """The sizes every prompt without its own is rendered at."""
    if run.sizes:
        return tuple((h, w) for h, w in run.sizes)
    return ((run.height, run.width),)


# ---------------------------------------------------------------- loading


def read_yaml(path: Path) -> dict:
    """The config file as a mapping, or an InputError naming what is wrong with it."""
    if not path.exists():
        raise InputError(f"{path}: config file does not exist")
    if not path.is_file():
        raise InputError(f"{path}: is not a file")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        raise InputError(f"{path}: the config is empty")
    if not isinstance(data, dict):
        raise InputError(f"{path}: the config must be a mapping of keys, got {type(data).__name__}")
    return data


def load_config(path: str | Path, overrides: list[str] = (), *, prompts: list[PromptSpec] | None = None) -> ResolvedRun:
    """Read, override, validate and resolve a run config. Raises InputError listing every problem."""
    path = Path(path)
    data = read_yaml(path)
    return resolve(data, overrides, base_dir=path.resolve().parent, prompts=prompts)


def resolve(
    data: dict, overrides: list[str] = (), *, base_dir: Path, prompts: list[PromptSpec] | None = None
) -> ResolvedRun:
    """Validate a config mapping; fill defaults; make paths absolute; read the prompts.

    With `prompts` (a run's own, as it recorded them), those are the prompts and no prompts file is read."""
    given = prompts
    data = json.loads(json.dumps(data, default=str))  # a deep copy we may edit
    problems = apply_overrides(data, list(overrides))
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(_format_error(err) for err in exc.errors())
        raise InputError(*problems) from None
    if problems:
        raise InputError(*problems)

    source = classify_model_id(config.model.id, base_dir)
    if isinstance(source, str):
        problems.append(f"model.id: {source}")
    elif source.kind == "local":
        config.model.id = source.ref
    family = family_of(config.model.id, *(("hub", "") if isinstance(source, str) else (source.kind, source.ref)))
    defaults = model_defaults(config.model.id, family)
    config.steps = config.steps if config.steps is not None else defaults["steps"]
    if config.guidance_scale is None:
        config.guidance_scale = defaults["guidance_scale"]
    if family.flow_matching and config.model.scheduler:
        problems.append(
            f"model.scheduler: {family.title} models keep their own flow-matching scheduler; leave it unset"
        )

    pod = config.execution.pod
    if pod.worker_index is not None and pod.num_workers is not None and pod.worker_index >= pod.num_workers:
        problems.append(f"execution.pod.worker_index: {pod.worker_index} is not below num_workers ({pod.num_workers})")

    execution = config.execution
    if execution.mode == "multi" and execution.backend == "cpu" and execution.cores == 0:
        problems.append("execution.cores: mode multi on backend cpu starts that many rank processes; set it above 0")
    if config.compile.torch_compile and execution.backend not in ("cpu", "cuda"):
        problems.append(
            "compile.torch_compile: is for the cpu and cuda backends; xla compiles through torch_xla, "
            "and torch_tpu compiles with execution.torch_tpu.mode: compile"
        )
    if config.compile.scan_blocks and (execution.backend != "xla" or family.name not in ("flux", "sd3")):
        problems.append("compile.scan_blocks: is built for Flux and SD3 models on execution.backend: xla")
    if execution.offload == "model" and execution.backend == "cpu":
        problems.append("execution.offload: model moves components onto an accelerator; the cpu backend has none")

    if execution.sharding == "spmd":
        problems.extend(_spmd_problems(config))
    elif execution.mesh != MeshConfig():
        problems.append("execution.mesh: is used only with execution.sharding: spmd")

    if execution.placement != "none":
        problems.extend(_placement_problems(config))

    if config.model.custom_pipeline and not config.model.allow_remote_code:
        problems.append(
            "model.custom_pipeline: runs code downloaded with the model; set model.allow_remote_code: true to allow it"
        )

    if config.sizes is not None and (config.height is not None or config.width is not None):
        problems.append("sizes: give either sizes or height/width, not both")
    elif config.sizes is None and (config.height is None or config.width is None):
        config.height = config.height or defaults["height"]
        config.width = config.width or defaults["width"]

    prompts: list[PromptSpec] = []
    if given is not None:
        prompts = list(given)
    elif config.prompts is not None and config.prompts_file is not None:
        problems.append("prompts: give either prompts or prompts_file, not both")
    elif config.prompts is None and config.prompts_file is None:
        problems.append("prompts: no prompts given; set prompts (a list) or prompts_file (.txt or .jsonl)")
    elif config.prompts is not None:
        for i, text in enumerate(config.prompts):
            spec = _check_prompt_entry({"prompt": text}, f"prompts[{i}]", config, problems)
            if spec:
                prompts.append(spec)
    else:
        file = Path(config.prompts_file).expanduser()
        file = file if file.is_absolute() else base_dir / file
        for entry in _read_prompt_file(file, problems):
            spec = _check_prompt_entry(entry, f"prompts_file:{entry['_line']}", config, problems)
            if spec:
                prompts.append(spec)
        config.prompts_file = str(file.resolve())

    if not config.output.dir.startswith("gs://"):  # Cloud Storage: written by pod-run's workers
        config.output.dir = _local_dir("output.dir", config.output.dir, problems)
    elif not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}(/[^\s'\"]*)?$", config.output.dir):
        problems.append(f"output.dir: {config.output.dir!r} is not a gs://bucket/prefix address")

    if config.cache.dir is not None:
        config.cache.dir = _local_dir("cache.dir", config.cache.dir, problems)

    if problems:
        raise InputError(*problems)
    return ResolvedRun(config, prompts, source, config_hash(config, prompts), family.name)


def _placement_problems(config: RunConfig) -> list[str]:
    execution, problems = config.execution, []
    if execution.backend != "xla":
        problems.append(f"execution.placement: needs execution.backend: xla, not {execution.backend}")
    for key, active in (
        ("execution.sharding: spmd", execution.sharding == "spmd"),
        ("execution.offload: model", execution.offload == "model"),
        ("execution.mode: multi", execution.mode == "multi"),
    ):
        if active:
            problems.append(f"execution.placement: and {key} exclude each other; choose one way to use the chips")
    return problems


def _spmd_problems(config: RunConfig) -> list[str]:
    execution, problems = config.execution, []
    if execution.backend != "xla":
        problems.append(f"execution.sharding: spmd needs execution.backend: xla, not {execution.backend}")
    if execution.offload != "none":
        problems.append(
            "execution.offload: model and execution.sharding: spmd exclude each other: split the model over the "
            "chips (spmd) or move it on and off one chip (offload), not both"
        )
    if execution.mode == "multi":
        problems.append(
            "execution.mode: multi runs a replica per chip, and spmd one model over all chips; use mode: single"
        )
    mesh, cores = execution.mesh, execution.cores
    if config.batch_size % mesh.data:
        problems.append(f"execution.mesh.data: {mesh.data} does not divide batch_size {config.batch_size}")
    if cores and (cores % mesh.data or (mesh.model and mesh.data * mesh.model != cores)):
        problems.append(
            f"execution.mesh: data {mesh.data} x model {mesh.model or '(the rest)'} does not cover "
            f"execution.cores: {cores} devices exactly"
        )
    return problems


def _local_dir(key: str, value: str, problems: list[str]) -> str:
    """A directory made absolute (relative to the working directory), its problem noted if it has one."""
    path = Path(value).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    problem = _dir_problem(path)
    if problem:
        problems.append(f"{key}: {problem}")
    return str(path)


def _dir_problem(out_dir: Path) -> str | None:
    probe = out_dir
    while not probe.exists():
        if probe.parent == probe:
            return f"{str(out_dir)!r} cannot be created"
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    return None


def config_hash(config: RunConfig, prompts: list[PromptSpec]) -> str:
    """8 hex digits naming everything that changes the images (not where they are written)."""
    payload = config.model_dump(exclude={"output", "cache"})
    payload["prompts"] = [p.__dict__ for p in prompts]
    payload.pop("prompts_file", None)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:8]


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, keys in schema order."""
    return yaml.dump(config.model_dump(), Dumper=_YamlDumper, sort_keys=False, allow_unicode=True, width=1000)
