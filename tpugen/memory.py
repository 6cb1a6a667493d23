"""Memory planning: each component's size in the run's dtype, and whether the model fits a TPU chip.

Sizes come from a model directory's safetensors headers (no weights are read), a hub model's (from the local
Hugging Face cache, or the hub's reading of them when online), or, offline, for known hub models
that are not on disk, from each component built from its config on the meta device (no weights at all).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from tpugen.errors import InputError
from tpugen.families import KNOWN_MODELS, Family

# HBM per chip, GB (10^9 bytes), by TPU generation.
CHIP_MEMORY_GB = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Weights are not all a chip holds: activations, the compiled programs and XLA's buffers need room too.
HEADROOM = 1.2


def known_components(model_id: str) -> dict[str, tuple[str, dict]] | None:
    """The component configs tpugen keeps for a known hub model (its family's folder holds them), or None."""
    known = KNOWN_MODELS.get(model_id)
    return known[0].components if known and known[0].components else None


@dataclass(frozen=True)
class ComponentSize:
    name: str
    parameters: int
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    components: tuple[ComponentSize, ...]
    source: str  # "safetensors headers" | "configs on the meta device"
    chip: str
    chip_gb: float
    verdict: str  # "fits" | "offload" | "shard"
    chips_needed: int
    advice: str

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "chip": self.chip,
            "chip_gb": self.chip_gb,
            "total_gb": self.total_bytes / 1e9,
            "verdict": self.verdict,
            "chips_needed": self.chips_needed,
            "advice": self.advice,
            "components": [{"name": c.name, "parameters": c.parameters, "gb": c.bytes / 1e9} for c in self.components],
        }


# ---------------------------------------------------------------- counting parameters


SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors format's own limit on its JSON header (as config/loras.py)


def safetensors_parameters(path: Path) -> int:
    """Parameters in one .safetensors file, from its header alone. The header's length is checked before it is
    read (at most the format's 100 MB, and inside the file): a corrupt file is an InputError naming it, not
    gigabytes read."""
    with open(path, "rb") as handle:
        head, size = handle.read(8), os.fstat(handle.fileno()).st_size
        if len(head) < 8:
            raise InputError(f"{path}: corrupt safetensors file ({size} bytes, shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > SAFETENSORS_MAX_HEADER:
            why = "over the format's 100 MB limit"
        elif length + 8 > size:
            why = f"more than the file's {size} bytes hold"
        elif length < 2:
            why = "too short for a JSON header"
        else:
            why = None
        if why:
            raise InputError(f"{path}: corrupt safetensors file (its header length says {length} bytes, {why})")
        try:
            header = json.loads(handle.read(length))
            return sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
        except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
            raise InputError(
                f"{path}: corrupt safetensors file (its header is not the JSON of tensor shapes)"
            ) from None


def component_files(model_dir: Path, variant: str | None = None) -> dict[str, list[Path]]:
    """The safetensors files each component of a diffusers directory loads from (the variant's, where it has them)."""
    index = json.loads((model_dir / "model_index.json").read_text())
    found = {}
    for name in _components_of(index):
        folder = model_dir / name
        if folder.is_dir():
            chosen = _loaded_files(sorted(f.name for f in folder.glob("*.safetensors")), variant)
            if chosen:
                found[name] = [folder / f for f in chosen]
    return found


def _components_of(index: dict) -> list[str]:
    """The components a model_index.json lists (their [library, class] pairs; config keys start with _)."""
    return [name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)]


# Components that hold no weights: tokenizers, schedulers, image processors and feature extractors.
_WEIGHTLESS = ("Tokenizer", "Scheduler", "Processor", "FeatureExtractor")


def _weighted_components(index: dict) -> set[str]:
    """The components of a model_index.json that have weights: present ([library, class], not [null, null]) and
    of a class that holds parameters."""
    return {
        name
        for name in _components_of(index)
        if all(index[name][:2]) and not any(word in str(index[name][1]) for word in _WEIGHTLESS)
    }


def _loaded_files(names: list[str], variant: str | None) -> list[str]:
    """Of a component folder's .safetensors files, those diffusers loads: the variant's, else the plain ones."""
    wanted = [f for f in names if variant and f".{variant}." in f]
    plain = [f for f in names if len(f.split(".")) == 2 or "-of-" in f.split(".")[0]]
    return wanted or plain or names


def hub_parameters(repo: str, revision: str | None = None, variant: str | None = None) -> tuple[dict, str] | None:
    """(parameters of each component, where they came from) of a hub model without downloading its weights:
    the safetensors headers of a snapshot in the local Hugging Face cache, else (online) the hub's own reading
    of each file's header; None when neither can be had (offline and not downloaded, or no safetensors)."""
    from huggingface_hub import try_to_load_from_cache

    from tpugen.settings import hub_offline

    cached = try_to_load_from_cache(repo, "model_index.json", revision=revision)
    if isinstance(cached, str):
        snapshot = Path(cached).parent
        index = json.loads(Path(cached).read_text())
        counts = directory_parameters(snapshot, variant)
        if counts and set(counts) >= _weighted_components(index):
            return counts, "safetensors headers (the local Hugging Face cache)"
    if hub_offline():
        return None
    try:
        from huggingface_hub import HfApi, hf_hub_download

        api = HfApi()
        index = json.loads(Path(hf_hub_download(repo, "model_index.json", revision=revision)).read_text())
        files = api.list_repo_files(repo, revision=revision)
        counts = {}
        for name in _components_of(index):
            names = sorted(f.split("/", 1)[1] for f in files if f.startswith(f"{name}/") and f.count("/") == 1)
            chosen = _loaded_files([f for f in names if f.endswith(".safetensors")], variant)
            if chosen:
                counts[name] = sum(
                    sum(
                        api.parse_safetensors_file_metadata(
                            repo, f"{name}/{f}", revision=revision
                        ).parameter_count.values()
                    )
                    for f in chosen
                )
        return (counts, "safetensors headers on the hub") if counts else None
    except Exception:  # the hub's answer is a convenience: tpugen's own table, or no plan, is the fallback
        return None


def directory_parameters(model_dir: Path, variant: str | None = None) -> dict[str, int]:
    """Parameters of each component of a diffusers directory, counted from safetensors headers."""
    return {
        name: sum(safetensors_parameters(f) for f in files)
        for name, files in component_files(model_dir, variant).items()
    }


def _without_torch_xla() -> None:
    """Keep torch_xla unimported while model classes are imported: diffusers, accelerate and transformers
    import it at their own import when it is installed, which starts nothing useful for planning and logs
    "Defaulting to PJRT_DEVICE=CPU". Only in a process of its own (see _counted_apart): the libraries then
    keep their XLA paths off for the rest of the process."""
    os.environ["USE_TORCH_XLA"] = "0"  # accelerate and transformers read it
    import diffusers.utils.import_utils as diffusers_imports  # imports no model code yet

    diffusers_imports._torch_xla_available = False


def _counts_cache() -> Path:
    from tpugen.settings import cache_root

    return cache_root() / "parameter-counts.json"


def _count_key(class_name: str, config: dict) -> str:
    from importlib import metadata

    versions = []
    for package in ("diffusers", "transformers"):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            versions.append(None)
    payload = json.dumps([class_name, config, versions], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _kept_counts() -> dict:
    from tpugen.files import read_json_object

    return read_json_object(_counts_cache())


def _known_counts(components: dict[str, tuple[str, dict]]) -> dict[str, int] | None:
    """The kept counts of every component, or None if any is missing."""
    kept = _kept_counts()
    keys = {name: _count_key(class_name, config) for name, (class_name, config) in components.items()}
    if all(isinstance(kept.get(key), int) for key in keys.values()):
        return {name: kept[key] for name, key in keys.items()}
    return None


def meta_parameters(components: dict[str, tuple[str, dict]]) -> dict[str, int]:
    """Parameters of each component built from its config on the meta device: no memory, no download.

    Counts are kept in tpugen's cache, keyed by class, config and library versions, so planning the same
    model again imports no model code at all.
    """
    done = _known_counts(components)
    if done is not None:
        return done
    known = _kept_counts()
    keys = {name: _count_key(class_name, config) for name, (class_name, config) in components.items()}

    import diffusers
    import torch
    import transformers

    counts = {}
    for name, (class_name, config) in components.items():
        if isinstance(known.get(keys[name]), int):
            counts[name] = known[keys[name]]
            continue
        with torch.device("meta"):
            if hasattr(diffusers, class_name):
                model = getattr(diffusers, class_name)(**config)
            else:
                model_class = getattr(transformers, class_name)
                config_class = model_class.config_class
                model = model_class(config_class(**config))
        counts[name] = sum(p.numel() for p in model.parameters())
    try:
        from tpugen.files import write_json

        _counts_cache().parent.mkdir(parents=True, exist_ok=True)
        write_json(_counts_cache(), {**known, **{keys[name]: count for name, count in counts.items()}})
    except OSError:  # a cache that cannot be written only costs the next plan its speed
        pass
    return counts


# ---------------------------------------------------------------- the verdict (pure)


def plan_memory(counts: dict[str, int], *, dtype: str, chip: str, chip_gb: float | None, source: str) -> MemoryPlan:
    """Whether a model of these component sizes fits one chip, and what to do when it does not."""
    width = DTYPE_BYTES[dtype]
    components = tuple(ComponentSize(n, p, p * width) for n, p in sorted(counts.items(), key=lambda kv: -kv[1]))
    capacity = (chip_gb or CHIP_MEMORY_GB[chip]) * 1e9
    total = sum(c.bytes for c in components) * HEADROOM
    largest = max((c.bytes for c in components), default=0) * HEADROOM
    chips = max(1, math.ceil(total / capacity))
    if total <= capacity:
        verdict, advice = "fits", f"fits one {chip} chip"
    elif largest <= capacity:
        verdict = "offload"
        advice = (
            f"too big for one {chip} chip all at once; each component alone fits: offload (execution.offload: "
            f"model), place components on different chips (execution.placement: auto), or shard over {chips} chips "
            "(execution.sharding: spmd)"
        )
    else:
        biggest = components[0].name
        verdict = "shard"
        advice = (
            f"{biggest} alone does not fit one {chip} chip: shard it over {chips} or more chips "
            "(execution.sharding: spmd)"
        )
    return MemoryPlan(components, source, chip, capacity / 1e9, verdict, chips, advice)


def component_counts(
    source, variant: str | None = None, revision: str | None = None
) -> tuple[dict[str, int], str] | None:
    """(parameters per component, where the counts came from), or None when the model is not known here."""
    if source.kind == "builtin":
        from tpugen.tiny import builtin_path

        return directory_parameters(builtin_path(source.ref)), "safetensors headers"
    if source.kind == "local":
        return directory_parameters(Path(source.ref), variant), "safetensors headers"
    counted = hub_parameters(source.ref, revision, variant)
    if counted:
        return counted
    components = known_components(source.ref)
    if components:
        return meta_parameters(components), "configs on the meta device"
    return None


def _needs_model_code(source) -> bool:
    """Whether counting would import model code here (building a built-in, or configs on the meta device)."""
    if source.kind == "builtin":
        from tpugen.tiny import is_built

        return not is_built(source.ref)
    components = known_components(source.ref) if source.kind == "hub" else None
    return components is not None and _known_counts(components) is None


# The counting process builds a built-in model or counts configs on the meta device: seconds; a minute is wrong.
COUNT_SECONDS = 300.0


def _counted_apart(source, variant: str | None, revision: str | None) -> tuple[dict[str, int], str] | None:
    """component_counts in a process of its own that never imports torch_xla (`python -m tpugen.memory`),
    offline (the hub's headers are read here, before it starts) and stopped after COUNT_SECONDS."""
    import subprocess

    from tpugen.settings import offline_environment

    request = json.dumps({"kind": source.kind, "ref": source.ref, "variant": variant, "revision": revision})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tpugen.memory", request],
            capture_output=True,
            text=True,
            timeout=COUNT_SECONDS,
            env=offline_environment(),
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"counting the model's parameters took longer than {COUNT_SECONDS:g} s (in a process of its own, "
            "offline) and was stopped"
        ) from None
    if proc.returncode:
        last = (proc.stderr.strip().split("\n") or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(f"counting the model's parameters failed: {last}")
    answer = json.loads(proc.stdout)
    return (answer["counts"], answer["how"]) if answer else None


def memory_plan_for(
    source, model, chip: str = "v5e", chip_gb: float | None = None, *, device_free: bool = False
) -> MemoryPlan | None:
    """The memory plan of a model (its source and the config's model section), or None when neither its
    files nor its configs are known here.

    `device_free` (`tpugen plan`): model code that counting needs runs in a process of its own, so this
    one never starts torch_xla (diffusers imports it whenever it is installed)."""
    apart = device_free and not {"diffusers", "torch_xla"} & set(sys.modules) and _needs_model_code(source)
    if apart:
        # the hub's own reading of the weights' headers needs no model code: here, so the child stays offline
        counted = hub_parameters(source.ref, model.revision, model.variant) if source.kind == "hub" else None
        counted = counted or _counted_apart(source, model.variant, model.revision)
    else:
        counted = component_counts(source, model.variant, model.revision)
    if counted is None:
        return None
    counts, how = counted
    counts = {**counts, **controlnet_counts(model)}
    return plan_memory(counts, dtype=model.dtype, chip=chip, chip_gb=chip_gb, source=how)


def controlnet_folders(model) -> dict[str, Path]:
    """Each ControlNet of model.controlnets whose files are on this machine (a local folder, a built-in already
    built), by its name in the memory plan."""
    from tpugen.models import controlnet_folder

    folders = {}
    for n, controlnet in enumerate(model.controlnets):
        if (folder := controlnet_folder(controlnet.id)) is not None:
            folders["controlnet" if len(model.controlnets) == 1 else f"controlnet {n}"] = folder
    return folders


def controlnet_counts(model) -> dict[str, int]:
    """Parameters of each ControlNet whose files are on this machine, from their safetensors headers: they sit on
    the device beside the denoiser."""
    return {
        name: sum(safetensors_parameters(f) for f in sorted(folder.glob("*.safetensors")))
        for name, folder in controlnet_folders(model).items()
    }


def controlnet_activations(
    family: Family, model, shapes, *, vae_scale: int, text_tokens: int, denoiser: str
) -> dict | None:
    """What the ControlNets add to a step's activations at the run's largest controlled shape key: what they hand
    the denoiser (ControlNets.residuals), held until it has added them; their own attention is no larger
    than the denoiser's, which the plan gives already. None: no controlled key, or a ControlNet's config is not
    here (a hub id) or not counted for the family."""
    configs = {}
    for name, folder in controlnet_folders(model).items():
        try:
            configs[name] = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
    if not configs or len(configs) < len(model.controlnets):
        return None
    largest = None
    for shape in shapes:
        if not shape.controls:
            continue
        sizes = [
            family.controlnet.residuals(config, shape.height, shape.width, vae_scale=vae_scale, text_tokens=text_tokens)
            for config in configs.values()
        ]
        if None in sizes:
            return None
        rows = shape.batch_size * (2 if shape.cfg else 1)
        total = rows * sum(sizes) * DTYPE_BYTES[model.dtype]
        if largest is None or total > largest[0]:
            largest = (total, shape, rows)
    if largest is None:
        return None
    total, shape, rows = largest
    size = f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.3g} MB"
    whose = "the ControlNet's" if len(configs) == 1 else f"the {len(configs)} ControlNets'"
    return {
        "bytes": total,
        "shape_key": str(shape),
        "note": (
            f"controlnets: {whose} residuals, handed to the {denoiser} at every step, take {size} at {shape} "
            f"({rows} rows, {model.dtype})"
        ),
    }


# ---------------------------------------------------------------- the largest attention matrix (pure)


@dataclass(frozen=True)
class AttentionSize:
    """The largest attention of one denoiser call: one layer's softmax(q k^T), which an unfused attention holds
    whole (rows x heads x tokens x tokens) and the flash kernel never does."""

    component: str
    tokens: int
    heads: int
    rows: int  # batch rows the denoiser sees: the batch, doubled by classifier-free guidance
    dtype_bytes: int
    # Per image size of the run: (height, width, the attention calls of one denoiser call that reach the flash
    # kernel's threshold, all its attention calls); empty where they are not counted. Not part of the size.
    kernel_calls: tuple[tuple[int, int, int, int], ...] = field(default=(), compare=False)

    @property
    def bytes(self) -> int:
        return self.rows * self.heads * self.tokens**2 * self.dtype_bytes


def largest_attention(
    family: Family, config: dict, shapes, *, component: str, dtype: str, vae_scale: int, text_tokens: int
) -> AttentionSize | None:
    """The biggest attention matrix over a run's shape keys (height, width, batch_size, cfg)."""
    sizes = []
    for shape in shapes:
        tokens, heads = family.attention_geometry(
            config, shape.height, shape.width, vae_scale=vae_scale, text_tokens=text_tokens
        )
        rows = shape.batch_size * (2 if shape.cfg else 1)
        sizes.append(AttentionSize(component, tokens, heads, rows, DTYPE_BYTES[dtype]))
    largest = max(sizes, key=lambda a: a.bytes, default=None)
    if largest is None or not family.flash_attention.components:
        return largest
    counted = []
    for height, width in dict.fromkeys((shape.height, shape.width) for shape in shapes):
        calls = attention_calls(family, config, height, width, vae_scale=vae_scale, text_tokens=text_tokens)
        if calls is None:
            return largest
        counted.append((height, width, kernel_reach(calls, family.flash_attention.min_tokens), len(calls)))
    return replace(largest, kernel_calls=tuple(counted))


# A UNet's cross-attention attends over the prompt's CLIP tokens, padded to 77.
UNET_TEXT_TOKENS = 77
# diffusers' UNet2DConditionModel defaults, for configs that leave them out (tpugen's own SD 1.5 config does).
_UNET_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
_UNET_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")


def attention_calls(
    family: Family, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int
) -> list[tuple[int, int]] | None:
    """(query tokens, key tokens) of each attention call in one call of the denoiser at this image size, from its
    config; None where they are not counted (a denoiser with no flash route, or blocks tpugen does not know).

    A UNet: each transformer layer of a block with attention runs a self-attention over its level's latent
    (halved per level) and a cross-attention over the 77 text tokens, in the down blocks, the mid block and the
    up blocks (one layer more per block than down). Flux: one joint attention per block over patches and text."""
    if family.denoiser == "unet":
        return _unet_attention_calls(config, -(-height // vae_scale), -(-width // vae_scale))
    if family.flash_attention.is_flux and "num_layers" in config:
        tokens, _ = family.attention_geometry(config, height, width, vae_scale=vae_scale, text_tokens=text_tokens)
        return [(tokens, tokens)] * (config["num_layers"] + config.get("num_single_layers", 0))
    return None


def _unet_attention_calls(config: dict, height: int, width: int) -> list[tuple[int, int]] | None:
    down = list(config.get("down_block_types") or _UNET_DOWN)
    up = list(config.get("up_block_types") or _UNET_UP)
    mid = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    known = {"DownBlock2D", "CrossAttnDownBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"}
    if len(up) != len(down) or not set(down + up) <= known or mid not in ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D"):
        return None

    def each(value, count: int) -> list:
        return list(value) if isinstance(value, (list, tuple)) else [value] * count

    levels = len(down)
    layers = each(config.get("layers_per_block", 2), levels)
    depth = each(config.get("transformer_layers_per_block", 1), levels)
    up_depth = config.get("reverse_transformer_layers_per_block") or depth[::-1]
    tokens = []
    for _ in range(levels):
        tokens.append(height * width)
        height, width = -(-height // 2), -(-width // 2)  # a stride-2 convolution between levels
    calls: list[tuple[int, int]] = []

    def transformers(level: int, depths: list[int]) -> None:  # one Transformer2DModel per attention of a block
        for layer_count in depths:
            calls.extend([(tokens[level], tokens[level]), (tokens[level], UNET_TEXT_TOKENS)] * layer_count)

    for i, block in enumerate(down):
        if block.startswith("CrossAttn"):
            transformers(i, each(depth[i], layers[i]))
    if mid == "UNetMidBlock2DCrossAttn":
        transformers(levels - 1, each(depth[-1], 1))
    for i, block in enumerate(up):
        if block.startswith("CrossAttn"):
            transformers(levels - 1 - i, each(up_depth[i], layers[::-1][i] + 1))
    return calls


def kernel_reach(calls: list[tuple[int, int]], min_tokens: int) -> int:
    """How many of these attention calls diffusers hands to the flash kernel: those whose query and key (and so
    value) have `min_tokens` tokens or more."""
    return sum(1 for query, key in calls if min(query, key) >= min_tokens)


def kernel_route_text(calls: int | None, min_tokens: int) -> str:
    """What the flash kernel takes before the run's sizes are known (an engine opens for any size): `, for those
    of its 12 attention calls per step that have 4096 tokens or more` (`calls`: None where not counted)."""
    if calls is None:
        return f", for attentions of {min_tokens} tokens or more" if min_tokens else ""
    if min_tokens:
        return f", for those of its {calls} attention calls per step that have {min_tokens} tokens or more"
    return f", for all {calls} of its attention calls per step"


def kernel_calls_text(kernel_calls, min_tokens: int) -> str:
    """`0 of 12 attention calls per step at 64x64 reach the kernel's 4096 tokens`, each size of the run in turn
    (`kernel_calls`: (height, width, reaching, all) per size)."""
    sizes = ", ".join(
        f"{reach} of {total}{' attention calls per step' if i == 0 else ''} at {height}x{width}"
        for i, (height, width, reach, total) in enumerate(kernel_calls)
    )
    return sizes + (f" reach the kernel's {min_tokens} tokens" if min_tokens else " use the kernel")


def attention_summary(attention: AttentionSize, *, flash_on: bool, min_tokens: int) -> dict:
    """What the memory plan says about attention: the matrix an unfused attention holds, or that the kernel
    holds none. Per layer, one at a time, for the whole batch (SPMD divides it over the mesh)."""
    gb = attention.bytes / 1e9
    size = f"{gb:.2f} GB" if attention.bytes >= 1e8 else f"{attention.bytes / 1e6:.3g} MB"
    shape = (
        f"{attention.rows} rows x {attention.heads} heads x {attention.tokens}^2 tokens x {attention.dtype_bytes} bytes"
    )
    materialised = not (flash_on and attention.tokens >= min_tokens)
    if not materialised:
        note = (
            f"flash attention: no full attention matrix ({attention.component}'s largest attention, {shape}, "
            f"would be {size} unfused)"
        )
    else:
        note = f"attention: {attention.component}'s largest attention matrix is {size} per layer ({shape})"
        if flash_on:
            note += f"; flash attention is on, but diffusers runs the kernel only from {min_tokens} tokens"
    return {
        "component": attention.component,
        "tokens": attention.tokens,
        "heads": attention.heads,
        "rows": attention.rows,
        "gb": gb,
        "materialised": materialised,
        "note": note,
        **(
            {
                "kernel_min_tokens": min_tokens,
                "kernel_calls": [
                    {"height": h, "width": w, "reach": reach, "calls": total}
                    for h, w, reach, total in attention.kernel_calls
                ],
            }
            if attention.kernel_calls
            else {}
        ),
    }


def denoiser_config(source, denoiser: str) -> tuple[dict, int] | None:
    """(the denoiser's config, the VAE's downscale factor) from a model directory's config.json files or the
    configs tpugen knows for hub models; None when neither is here."""
    if source.kind in ("builtin", "local"):
        if source.kind == "builtin":
            from tpugen.tiny import builtin_path, is_built

            if not is_built(source.ref):  # building one imports model code; the memory plan does that apart
                return None
            root = builtin_path(source.ref)
        else:
            root = Path(source.ref)
        try:
            config = json.loads((root / denoiser / "config.json").read_text())
            vae = json.loads((root / "vae" / "config.json").read_text())
        except (OSError, ValueError):
            return None
    elif denoiser in (known_components(source.ref) or {}):
        components = known_components(source.ref)
        config = components[denoiser][1]
        vae = components.get("vae", (None, {}))[1]
    else:
        return None
    if "temperal_downsample" in vae:  # Qwen-Image's 5-D VAE: one halving per entry (diffusers' vae_scale_factor)
        return config, 2 ** len(vae["temperal_downsample"])
    return config, 2 ** (len(vae.get("block_out_channels") or [0] * 4) - 1)


# ---------------------------------------------------------------- out of memory on the device (pure)

_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM when allocating")


def is_out_of_memory(exc: BaseException) -> bool:
    """XLA reports RESOURCE_EXHAUSTED, CUDA and TorchTPU "out of memory"; all arrive as RuntimeError."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _OUT_OF_MEMORY)


def out_of_memory_advice(execution, batch_size: int, dtype: str) -> str:
    """What would make the run fit, given what the config already does."""
    options = ["model.dtype: bfloat16 (half the bytes of float32)"] if dtype == "float32" else []
    if execution.offload == "none" and execution.sharding == "none" and execution.placement == "none":
        options += [
            "execution.offload: model (one component on the chip at a time)",
            "execution.sharding: spmd (split the weights over the VM's chips)",
            "execution.placement: auto (components on different chips)",
        ]
    elif execution.sharding == "spmd" and execution.mesh.data > 1:
        options.append("a smaller execution.mesh.data, so more chips split each weight")
    elif execution.placement != "none":
        options.append("execution.sharding: spmd (a component too big for a chip must be split)")
    if batch_size > 1:
        options.append("a smaller batch_size")
    hint = "; ".join(options) if options else "a bigger chip (execution.chip)"
    return f"try {hint}; `tpugen plan CONFIG` shows each component's size against the chip"


def fit_problem(plan: MemoryPlan, execution, devices: int, model: str) -> str | None:
    """Why the configured way of running cannot fit this model on these chips, or None if it can.

    Estimates with the plan's headroom: under spmd the denoiser (and text encoders from 2 GiB) is divided
    over the model axis and the rest copied to every chip; under offload the biggest component must fit alone.
    """
    capacity = plan.chip_gb * 1e9
    chip = f"one {plan.chip} chip ({plan.chip_gb:g} GB)"
    if execution.placement != "none":
        return None  # decided per chip when the components are assigned
    if execution.sharding == "spmd":
        axis = model_axis(execution, devices)
        whole, parts = (HEADROOM * n for n in spmd_bytes(plan))
        if whole + parts / axis <= capacity:
            return None
        needed = math.ceil(parts / (capacity - whole)) if capacity > whole else None
        more = f"about {needed} chips on the model axis" if needed else "more memory than the copied components leave"
        return (
            f"execution.sharding: {model} split over {axis} chips still needs {(whole + parts / axis) / 1e9:.3g} GB "
            f"on {chip}; it needs {more}"
        )
    if execution.offload == "model":
        largest = plan.components[0]
        if largest.bytes * HEADROOM <= capacity:
            return None
        return (
            f"execution.offload: {largest.name} alone needs {largest.bytes * HEADROOM / 1e9:.3g} GB with headroom, "
            f"more than {chip}: split it with execution.sharding: spmd"
        )
    if plan.total_bytes * HEADROOM <= capacity:
        return None
    return (
        f"model.id: {model} needs {plan.total_bytes * HEADROOM / 1e9:.3g} GB with headroom, more than {chip}: "
        f"{plan.advice}"
    )


def model_axis(execution, devices: int) -> int:
    """The chips SPMD splits the big weights over: mesh.model, else what the data axis leaves of `devices`."""
    return execution.mesh.model or max(1, devices // execution.mesh.data)


def spmd_bytes(plan: MemoryPlan) -> tuple[int, int]:
    """(bytes copied to every chip, bytes split over the model axis) under SPMD: the denoiser and text encoders
    from 2 GiB are split (tpugen.sharding), the rest copied."""
    from tpugen.sharding import DENOISERS, TEXT_ENCODER_SHARD_BYTES

    def split(c: ComponentSize) -> bool:
        return c.name in DENOISERS or (c.name.startswith("text_encoder") and c.bytes >= TEXT_ENCODER_SHARD_BYTES)

    return sum(c.bytes for c in plan.components if not split(c)), sum(c.bytes for c in plan.components if split(c))


def weights_per_chip(plan: MemoryPlan, execution, devices: int) -> int:
    """The weights one chip holds: all of them, or under SPMD its share (no headroom added)."""
    if execution.sharding != "spmd":
        return plan.total_bytes
    whole, parts = spmd_bytes(plan)
    return int(whole + parts / model_axis(execution, devices))


def how_it_runs(execution) -> str:
    """The config's way of using the chips, in its own keys' words."""
    if execution.sharding == "spmd":
        return f"execution.sharding: spmd, mesh data {execution.mesh.data} x model {execution.mesh.model or 'the rest'}"
    if execution.offload == "model":
        return "execution.offload: model"
    if execution.placement != "none":
        return f"execution.placement: {execution.placement}"
    return "the whole model on each chip"


def config_fit(plan: MemoryPlan, execution, model: str) -> str:
    """Whether the config's own way of running fits; for spmd without a device count, per VM size."""
    if execution.placement != "none":
        return "decided per chip by `tpugen generate` from each chip's memory"
    if execution.sharding == "spmd" and not (execution.mesh.model or execution.cores):
        fits = [n for n in (1, 2, 4, 8) if n % execution.mesh.data == 0 and not fit_problem(plan, execution, n, model)]
        chips = f"{fits[0]} chip" + ("s" if fits and fits[0] > 1 else "") if fits else ""
        return f"fits a VM of {chips} or more" if fits else "does not fit 8 chips"
    devices = execution.cores or (execution.mesh.data * execution.mesh.model) or 1
    return fit_problem(plan, execution, devices, model) or "fits"


def _main(request: str) -> int:
    """`python -m tpugen.memory '{"kind": ..., "ref": ..., "variant": ...}'`: the counts as JSON on stdout."""
    from tpugen.models import ModelSource

    _without_torch_xla()
    wanted = json.loads(request)
    counted = component_counts(
        ModelSource(wanted["kind"], wanted["ref"]), wanted.get("variant"), wanted.get("revision")
    )
    print(json.dumps({"counts": counted[0], "how": counted[1]} if counted else None))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
