"""A config resolved: read, overridden, validated, defaults filled, paths made absolute, prompts read."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from tpugen.config.controls import (
    ANNOTATORS_NEED,
    annotator_weights,
    control_name,
    controlled_problems,
    controlnet_identity,
)
from tpugen.config.embeddings import Embedding, embeddings_by_content, resolve_embeddings
from tpugen.config.hires import hires_problems
from tpugen.config.loras import Lora, loras_by_content, resolve_loras
from tpugen.config.messages import format_error
from tpugen.config.overrides import apply_overrides
from tpugen.config.prompts import PromptSpec, planned_images, resolve_prompts, run_sizes
from tpugen.config.request import cannot_edit_by_reference, references_too_small, too_many_references
from tpugen.config.rules import JAX_WEIGHED, jax_edit_refusal, run_problems
from tpugen.config.schema import RunConfig
from tpugen.config.yamlio import dump_yaml, read_yaml
from tpugen.errors import InputError
from tpugen.families import CONTROLNETS, FAMILIES, Family
from tpugen.models import (
    ModelSource,
    classify_controlnet_id,
    classify_model_id,
    controlnet_configs,
    family_of,
    local_config,
    model_defaults,
)


@dataclass(frozen=True)
class ResolvedRun:
    """A config that passed every check, with defaults filled and paths made absolute."""

    config: RunConfig
    prompts: list[PromptSpec]
    model_source: ModelSource
    config_hash: str
    family: str = "sd"
    loras: tuple[Lora, ...] = ()  # model.loras, each file found and hashed
    base_dir: str | None = None  # the folder its relative paths (model.loras ids) are relative to, absolute
    # model.embeddings, each file read and hashed; a run sent to a server: every embedding its engine loaded
    embeddings: tuple[Embedding, ...] = ()

    def to_yaml(self) -> str:
        return dump_config(self.config)


def load_config(
    path: str | Path,
    overrides: list[str] = (),
    *,
    prompts: list[PromptSpec] | None = None,
    prompts_required: bool = True,
    step_cache: bool = True,
) -> ResolvedRun:
    """Read, override, validate and resolve a run config. Raises InputError listing every problem.
    `step_cache=False` leaves the config's compile.step_cache out (what `tpugen calibrate` measures without)."""
    path = Path(path)
    data = read_yaml(path)
    if not step_cache and isinstance(data.get("compile"), dict):
        data["compile"].pop("step_cache", None)
    return resolve(data, overrides, base_dir=path.resolve().parent, prompts=prompts, prompts_required=prompts_required)


def resolve(
    data: dict,
    overrides: list[str] = (),
    *,
    base_dir: Path,
    prompts: list[PromptSpec] | None = None,
    prompts_required: bool = True,
) -> ResolvedRun:
    """Validate a config mapping; fill defaults; make paths absolute; read the prompts.

    With `prompts` (a run's own, as it recorded them), those are the prompts and no prompts file is read;
    `prompts_required=False` (a server's config) allows none."""
    data = json.loads(json.dumps(data, default=str))  # a deep copy we may edit
    problems = apply_overrides(data, list(overrides))
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(format_error(err) for err in exc.errors())
        raise InputError(*problems) from None
    if problems:
        raise InputError(*problems)

    source = classify_model_id(config.model.id, base_dir)
    if isinstance(source, str):
        problems.append(f"model.id: {source}")
    elif source.kind == "local":
        config.model.id = source.ref
    family = FAMILIES["sd"]  # the defaults other checks go on with when the model's family cannot be told
    if not isinstance(source, str):
        found = family_of(source, config.model)
        if isinstance(found, str):
            problems.append(f"model.id: {found}")
        else:
            family = found
    defaults = model_defaults(config.model.id, family)
    config.steps = config.steps if config.steps is not None else defaults["steps"]
    if config.guidance_scale is None:
        config.guidance_scale = defaults["guidance_scale"]
    problems.extend(run_problems(config, family))
    loras = resolve_loras(config.model.loras, base_dir, family.name, config.model.id, problems)
    embeddings = resolve_embeddings(config.model.embeddings, base_dir, family, config.model.id, problems)
    if config.sizes is None and (config.height is None or config.width is None):
        config.height = config.height or defaults["height"]
        config.width = config.width or defaults["width"]

    if config.model.annotators_dir is not None:  # before the prompts, whose control modules it may run
        config.model.annotators_dir = _folder("model.annotators_dir", config.model.annotators_dir, base_dir, problems)
        if importlib.util.find_spec("controlnet_aux") is None:
            problems.append(f"model.annotators_dir: {ANNOTATORS_NEED}")
    resolved_prompts = resolve_prompts(config, base_dir, prompts, problems, required=prompts_required)
    problems.extend(_size_problems(config, resolved_prompts, family))
    problems.extend(_hires_problems(config, family))
    problems.extend(_img2img_problems(config, resolved_prompts, family))
    problems.extend(_reference_problems(config, resolved_prompts, family, serving=not prompts_required))
    problems.extend(_controlnet_problems(config, base_dir, family, serving=not prompts_required))
    if config.model.controlnets:
        # The configs of the ControlNets on this machine (a hub one's: checked when it is loaded), read once.
        known = controlnet_configs(config.model.controlnets) if not problems else []
        problems.extend(_controlnet_kind_problems(known, len(config.model.controlnets), family))
        problems.extend(_controlled_prompt_problems(resolved_prompts, family, known))
        if config.execution.backend == "jax":
            moded = (n for n, spec in enumerate(resolved_prompts) if spec.controls and spec.controls.weighed)
            problems.extend(f"prompts[{n}].control_mode: {JAX_WEIGHED}" for n in list(moded)[:1])
    planned = planned_images(resolved_prompts, config.images_per_prompt)
    if planned > MAX_IMAGES_PER_RUN:  # a plan of 10**8 items took minutes and gigabytes before any check
        problems.append(
            f"images_per_prompt: the run would plan {planned} images; at most {MAX_IMAGES_PER_RUN} per run "
            "(split it into several runs)"
        )

    if not config.output.dir.startswith("gs://"):  # Cloud Storage: written by pod-run's workers
        config.output.dir = _local_dir("output.dir", config.output.dir, problems)
    elif not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}(/[^\s'\"]*)?$", config.output.dir):
        problems.append(f"output.dir: {config.output.dir!r} is not a gs://bucket/prefix address")

    for key in ("lora_dir", "embeddings_dir"):  # the server's folders, relative to the config
        value = getattr(config.serve, key)
        if value is not None:
            setattr(config.serve, key, _folder(f"serve.{key}", value, base_dir, problems))

    _read_mag_ratios(config, base_dir, problems)

    if config.cache.dir is not None and config.cache.dir.startswith("gs://"):
        # TorchTPU's own cache and JAX's read and write Cloud Storage.
        if config.execution.backend not in ("torch_tpu", "jax"):
            problems.append(
                f"cache.dir: {config.cache.dir!r}: a gs:// cache is for execution.backend: jax or torch_tpu; "
                "torch_xla's cache is a local directory"
            )
    elif config.cache.dir is not None:
        config.cache.dir = _local_dir("cache.dir", config.cache.dir, problems)

    if problems:
        raise InputError(*problems)
    digest = config_hash(config, resolved_prompts, embeddings)
    base = str(Path(base_dir).resolve())
    return ResolvedRun(config, resolved_prompts, source, digest, family.name, loras, base, embeddings)


MAX_IMAGES_PER_RUN = 1_000_000  # eleven days at one image a second


def _size_problems(config: RunConfig, prompts: list[PromptSpec], family: Family) -> list[str]:
    """Sizes the family's pipeline cannot make as asked (each is already a multiple of 8)."""
    step = family.size_multiple
    if step == 8:
        return []
    why = f"{family.title} models need a multiple of {step} (the VAE's 8 times 2x2 patches)"
    problems = []
    if config.sizes:
        problems += [
            f"sizes[{i}]: {h}x{w} (height x width): {why}"
            for i, (h, w) in enumerate(config.sizes)
            if h % step or w % step
        ]
    else:
        problems += [
            f"{key}: {why}, got {value}"
            for key, value in (("height", config.height), ("width", config.width))
            if value % step
        ]
    served = config.serve.sizes or []
    problems += [
        f"serve.sizes[{i}]: {h}x{w} (height x width): {why}" for i, (h, w) in enumerate(served) if h % step or w % step
    ]
    asked = {tuple(size) for size in run_sizes(config)}
    own = dict.fromkeys(size for spec in prompts for size in spec.sizes if size not in asked)
    problems += [f"prompts: a prompt's own {h}x{w} (height x width): {why}" for h, w in own if h % step or w % step]
    return problems


def _hires_problems(config: RunConfig, family: Family) -> list[str]:
    """What hires fix cannot do as asked: its second pass is diffusers' img2img from the first pass."""
    hires = config.hires
    if hires is None:
        return []
    keys = {"hires": "hires", "upscaler": "hires.upscaler"}
    return hires_problems(hires.upscaler, family, config.compile.step_cache.method, keys)


def _img2img_problems(config: RunConfig, prompts: list[PromptSpec], family: Family) -> list[str]:
    """A prompt that starts from an image, or a server warming img2img, for a family without img2img."""
    if not family.img2img_refusal:
        return []
    problems = []
    with_image = next((i for i, spec in enumerate(prompts) if spec.source is not None), None)
    if with_image is not None:
        problems.append(f"prompts[{with_image}].init_image: {family.refusals(image=True)['image']}")
    tasks = [task for task in config.serve.tasks if task not in ("txt2img", "edit")]  # edit: _reference_problems
    if tasks:
        problems.append(f"serve.tasks: {tasks[0]} for {family.title} models: {family.img2img_refusal}")
    return problems


def _reference_problems(
    config: RunConfig, prompts: list[PromptSpec], family: Family, *, serving: bool = False
) -> list[str]:
    """A prompt that edits by reference on a family that cannot, with more references than the family takes, or
    at a size under the references' least side; one without references on a family that only edits; and so a
    server warming edits (serve.tasks, serve.reference_counts)."""
    problems = _serve_edit_problems(config, family, serving)
    for number, spec in enumerate(prompts):
        if spec.references is not None and config.execution.backend == "jax" and (why := jax_edit_refusal(family)):
            return [*problems, f"prompts[{number}].reference_images: {why}"]
        if spec.references is None:
            refused = family.refusals()  # a prompt without references, init image or not, as a txt2img's
            if "txt2img" in refused:  # an edit-only family: every prompt edits by reference
                return [*problems, f"prompts[{number}]: {refused['txt2img']}; give it reference_images"]
            continue
        where = f"prompts[{number}].reference_images"
        if not family.max_references:
            return [*problems, f"{where}: {cannot_edit_by_reference(family)}"]
        why = too_many_references(family, spec.references.count) or next(
            filter(None, (references_too_small(h, w) for h, w in spec.sizes)), None
        )
        if why:
            return [*problems, f"{where}: {why}"]
    return problems


def _folder(key: str, value: str, base_dir: Path, problems: list[str]) -> str:
    """A folder a config names (relative to the config file), made absolute; a problem where it is not one."""
    folder = Path(value).expanduser()
    folder = folder if folder.is_absolute() else base_dir / folder
    if not folder.is_dir():
        problems.append(f"{key}: {str(folder)!r} is not a folder")
    return str(folder.resolve())


def _controlnet_problems(config: RunConfig, base_dir: Path, family: Family, *, serving: bool = False) -> list[str]:
    """model.controlnets for a family tpugen drives no ControlNet for, or naming none it can find; each found one's
    id made absolute where it is a folder. A server's (`serving`) names each by its last part (the web UI's units
    name them so): two of one name are refused."""
    if not config.model.controlnets:
        return []
    if family.controlnet is None:
        return [f"model.controlnets: {family.title} models: {family.controlnet_refusal}"]
    parts = family.controlnet
    execution = config.execution
    for key, value, default in (
        ("offload", execution.offload, "none"),
        ("sharding", execution.sharding, "none"),
        ("placement", execution.placement, "none"),
    ):
        if value != default:
            return [
                f"model.controlnets: with execution.{key}: {value}: not built yet (the ControlNets run on the "
                "denoiser's one device); leave one of them out"
            ]
    if config.hires is not None:
        return ["model.controlnets: with hires: the second pass would run without the ControlNets; leave hires out"]
    if len(config.model.controlnets) > 1 and parts.multi_refusal:
        return [f"model.controlnets: {family.title} models: {parts.multi_refusal}"]
    problems = []
    for n, controlnet in enumerate(config.model.controlnets):
        source = classify_controlnet_id(controlnet.id, base_dir)
        if isinstance(source, str):
            problems.append(f"model.controlnets[{n}].id: {source}")
        elif source.kind == "builtin" and CONTROLNETS[source.ref][1] is not family:
            base = CONTROLNETS[source.ref][1].title
            problems.append(f"model.controlnets[{n}].id: {source.ref} is for {base} models, not {family.title}")
        elif source.kind == "local":
            controlnet.id = source.ref
            found = local_config(Path(source.ref) / "config.json")
            embed = found.get("addition_embed_type")
            if found.get("_class_name") != parts.model_class:
                problems.append(
                    f"model.controlnets[{n}].id: {source.ref!r} is a {found.get('_class_name')}; {family.title} "
                    f"models take a {parts.model_class}"
                )
            elif embed != parts.addition_embed:
                problems.append(
                    f"model.controlnets[{n}].id: {source.ref!r} is another family's ControlNet (its config's "
                    f"addition_embed_type is {embed!r}; a {family.title} one's is {parts.addition_embed!r})"
                )
    names = [control_name(c.id) for c in config.model.controlnets]
    twice = next((name for name in names if names.count(name) > 1), None)
    if serving and twice:
        problems.append(
            f"model.controlnets: two are named {twice!r}; a server's ControlNet units name them, so each needs a "
            "name of its own (rename a folder)"
        )
    return problems


def _controlnet_kind_problems(known: list[dict], count: int, family: Family) -> list[str]:
    """A ControlNet of a kind tpugen cannot run, and kinds the family's pipelines cannot mix, among the `count`
    ControlNets whose configs are `known`."""
    parts = family.controlnet
    if parts is None:  # refused by _controlnet_problems
        return []
    problems = [f"model.controlnets: {family.title} models: {why}" for why in map(parts.unsupported, known) if why]
    if len(known) == count > 1 and (why := parts.mixed(known)):
        problems.append(f"model.controlnets: {family.title} models: {why}")
    return problems


def _controlled_prompt_problems(prompts: list[PromptSpec], family: Family, controlnets: list[dict]) -> list[str]:
    """The first controlled prompt of each kind the family cannot run (controlled_problems): one starting from an
    image, or inpainting, its ControlNets cannot take; one inpainting below strength 1 where its ControlNet inpaints
    from noise; one whose units sit out steps where its ControlNets run at every step."""
    first: dict[str, tuple[int, PromptSpec, str]] = {}
    for n, spec in enumerate(prompts):
        if spec.controls:
            for kind, why in controlled_problems(family, spec.controls, spec.source, controlnets).items():
                first.setdefault(kind, (n, spec, why))
    problems = []
    for kind, (n, spec, why) in first.items():
        if kind == "image":
            what = "with an init image" if spec.source.task == "img2img" else "inpainting"
            problems.append(f"prompts[{n}].control_image: {what}, {why}")
        elif kind == "strength":
            problems.append(f"prompts[{n}].strength: with a control_image, {why}")
        elif kind == "weights":
            problems.append(f"prompts[{n}].control_mode: {why}")
        else:
            problems.append(f"prompts[{n}]: control_start and control_end: {why}")
    return problems


def _serve_edit_problems(config: RunConfig, family: Family, serving: bool) -> list[str]:
    """A server warming edits by reference (serve.tasks edit) for a family that cannot, with more references
    than the family takes (serve.reference_counts), or at a warm size under the references' least side; a
    server's config (`serving`) warming txt2img for a family that only edits."""
    serve = config.serve
    if serving and "txt2img" in serve.tasks and (refused := family.refusals().get("txt2img")):
        return [f"serve.tasks: txt2img: {refused}; set serve.tasks: [edit]"]
    if "edit" not in serve.tasks:
        return []
    if not family.max_references:
        return [f"serve.tasks: edit: {cannot_edit_by_reference(family)}"]
    problems = [
        f"serve.reference_counts[{n}]: {why}"
        for n, count in enumerate(serve.reference_counts)
        if (why := too_many_references(family, count, "references"))
    ]
    sizes = [tuple(size) for size in serve.sizes] if serve.sizes else run_sizes(config)
    small = next(filter(None, (references_too_small(h, w) for h, w in sizes)), None)
    if small:
        problems.append(f"serve.tasks: edit: {small}")
    return problems


def _read_mag_ratios(config: RunConfig, base_dir: Path, problems: list[str]) -> None:
    """compile.step_cache.mag_ratios given as a file (what `tpugen calibrate` writes): its list, in place, so a
    run's config.yaml and config hash hold the ratios themselves, not where they were read from."""
    cache = config.compile.step_cache
    if not isinstance(cache.mag_ratios, str) or not cache.mag_ratios.endswith((".yaml", ".yml", ".json")):
        return
    where = "compile.step_cache.mag_ratios"
    path = Path(cache.mag_ratios).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        data = read_yaml(path)  # JSON is YAML
    except InputError as exc:
        problems.append(f"{where}: {exc.lines[0]}")
        return
    ratios = data.get("mag_ratios")
    if (
        not isinstance(ratios, list)
        or not ratios
        or not all(isinstance(r, (int, float)) and 0 < r < 10 for r in ratios)
    ):
        problems.append(f"{where}: {path} has no mag_ratios list of ratios above 0 and below 10")
        return
    cache.mag_ratios = [float(r) for r in ratios]


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


def config_hash(config: RunConfig, prompts: list[PromptSpec], embeddings: tuple[Embedding, ...] = ()) -> str:
    """8 hex digits naming everything that changes the images (not where they are written, nor the server's
    settings, nor where a ray run's workers are: configs without them hash as they did before they existed).

    LoRAs count by what is fused: each file's content (its sha256, filled in when the config is resolved) and
    scale, as a set (tpugen fuses them in an order of their own), not by where the file is: moving the folder
    that holds the config and its LoRAs, or shipping them to a pod's workers, keeps the hash. Embeddings count
    so too: each one's name (the word prompts write) and content (`embeddings`, as resolved)."""
    payload = config.model_dump(exclude={"output": True, "cache": True, "serve": True, "execution": {"ray"}})
    # Keys added since the first release, at their defaults, leave the hash as it was before they existed.
    if payload["model"]["loras"]:
        payload["model"]["loras"] = loras_by_content(payload["model"]["loras"])
    else:
        del payload["model"]["loras"]
    if payload["model"]["controlnets"]:
        payload["model"]["controlnets"] = [controlnet_identity(c) for c in payload["model"]["controlnets"]]
    else:
        del payload["model"]["controlnets"]
    # The annotators count by the content of the weights the prompts' modules read, not by where the folder is.
    if weights := annotator_weights(config.model.annotators_dir, prompts):
        payload["model"]["annotators_dir"] = weights
    else:
        del payload["model"]["annotators_dir"]
    if payload["model"]["embeddings"]:
        payload["model"]["embeddings"] = embeddings_by_content(embeddings)
    else:
        del payload["model"]["embeddings"]
    if payload["compile"]["flash_attention"] == "auto":
        del payload["compile"]["flash_attention"]
    if payload["compile"]["trace_once"] is True:
        del payload["compile"]["trace_once"]
    cache = payload["compile"]["step_cache"]
    if payload["hires"] is None:
        del payload["hires"]
    if payload["tiling"] is False:
        del payload["tiling"]
    # The web UI's reading: an SD prompt without its syntax, of one chunk, reads as before. Not so SDXL's empty
    # negative prompt (zeros now, as the web UI and diffusers' default make it) nor prompts with the syntax: a run
    # begun before 2026-12-03 evening and resumed after it mixes the two readings (docs/changelog.md says so).
    if payload["prompt_syntax"] == "webui":
        del payload["prompt_syntax"]
    del payload["max_chunks"]  # it refuses prompts; it changes no image
    if payload["clip_skip"] == 1:
        del payload["clip_skip"]
    if cache["method"] == "none":  # its options are refused without a method
        del payload["compile"]["step_cache"]
    else:  # the method's own options: a method added later leaves the others' hashes as they were
        payload["compile"]["step_cache"] = {"method": cache["method"], **config.compile.step_cache.options()}
    payload["prompts"] = [_prompt_by_content(p) for p in prompts]
    payload.pop("prompts_file", None)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:8]


def _prompt_by_content(prompt: PromptSpec) -> dict:
    """A prompt as it counts in the hash: its input images by content (sha256), not where they are; a prompt
    without images as it was before prompts could have them."""
    fields = dict(prompt.__dict__)
    source, references, controls = fields.pop("source"), fields.pop("references"), fields.pop("controls")
    if source is not None:
        fields["source"] = source.record()
    if references is not None:
        fields["references"] = references.record()
    if controls is not None:
        fields["controls"] = controls.record()
    return fields


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, keys in schema order (every key: `tpugen validate` prints them all)."""
    return dump_yaml(config.model_dump())
