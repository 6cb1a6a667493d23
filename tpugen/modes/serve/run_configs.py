"""A client's run config (POST /v1/runs) checked against the server's and resolved under its model, its way of
running and its output root."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tpugen.config import ResolvedRun, resolve
from tpugen.config.loras import is_hub_lora
from tpugen.config.request import MAX_REFERENCES
from tpugen.config.schema import ServeConfig, StepCacheConfig
from tpugen.errors import InputError
from tpugen.modes.serve.input_images import data_uri_bytes
from tpugen.modes.serve.lora_dir import LORA_NAME, lora_files

ImageStore = Callable[[bytes, str], tuple[str, str]]  # an image sent and where: (its path, its sha256)


def resolve_run(data: dict, server_run: ResolvedRun, output_root: Path, store: ImageStore) -> ResolvedRun:
    """A client's run config under the server's model and way of running (absent or equal is fine): `server_run`
    is the server's own, the run writes under `output_root`, by run id, and its input images go to `store`
    (InputImages.store)."""
    if not isinstance(data, dict):
        raise InputError("the run config must be a mapping of keys")
    served = server_run.config
    problems = []
    for section in ("model", "execution", "compile", "cache"):
        given = data.get(section)
        if given is None:
            continue
        ours = getattr(served, section).model_dump()
        if not isinstance(given, dict):
            problems.append(f"{section}: must be a mapping, or left out (the server's is used)")
            continue
        for key, value in sorted(given.items()):
            if section == "model" and key == "loras":
                continue  # allowed: LoRAs are switched on the warm engine (names in serve.lora_dir)
            if section == "model" and key == "allow_remote_code" and value:
                problems.append("model.allow_remote_code: a run sent to the server cannot run a model's code")
            elif section == "compile" and key == "step_cache":
                problems.extend(step_cache_problem(value, served.compile.step_cache))
            elif section == "model" and key == "controlnets":
                problems.extend(controlnets_problem(value, served.model.controlnets))
            elif key not in ours or ours[key] != value:
                problems.append(
                    f"{section}.{key}: the server runs {section}.{key}: {ours.get(key)!r}; leave it out or equal"
                )
    if data.get("prompts_file") is not None:
        problems.append("prompts_file: send the prompts themselves (prompts: [...]); the server reads no files")
    if not isinstance(data.get("output") or {}, dict):
        problems.append("output: must be a mapping (the server reads output.run_id from it), or left out")
    prompts = run_prompts(data.get("prompts"), problems, store)
    if problems:
        raise InputError(*problems)
    merged = {key: value for key, value in data.items() if key not in ("output", "serve")}
    if prompts is not None:
        merged["prompts"] = prompts
    merged.setdefault("batch_size", served.batch_size)  # the batch the server's graphs were compiled for
    for key in ("prompt_syntax", "clip_skip", "max_chunks"):  # its prompts read as the server reads its own
        merged.setdefault(key, getattr(served, key))
    for section in ("model", "execution", "compile", "cache"):
        merged[section] = getattr(served, section).model_dump()
    merged["model"]["loras"] = run_loras((data.get("model") or {}).get("loras") or [], served.serve)
    # A client's output.dir means nothing here: the server writes under its own root, by run id.
    merged["output"] = {"dir": str(output_root), "run_id": (data.get("output") or {}).get("run_id")}
    return resolve(merged, base_dir=Path(served.serve.lora_dir or output_root))


def run_prompts(prompts, problems: list[str], store: ImageStore) -> list | None:
    """A run's prompts with each input image sent (a base64 data: URI: init_image, mask_image, each of
    reference_images and control_image) stored by its content (`store`) and named by its path; a path is refused, since the server
    reads none a client names. None: no list of prompts (resolve says what is wrong with it)."""
    if not isinstance(prompts, list):
        return None

    def stored_path(value, where: str):
        try:
            return store(data_uri_bytes(value, where), where)[0]
        except InputError as exc:
            problems.extend(exc.lines)
            return value

    stored = []
    for number, entry in enumerate(prompts):
        if isinstance(entry, dict):
            entry = dict(entry)
            for key in ("init_image", "mask_image"):
                if key in entry:
                    entry[key] = stored_path(entry[key], f"prompts[{number}].{key}")
            controls = entry.get("control_image")
            if isinstance(controls, str):
                entry["control_image"] = stored_path(controls, f"prompts[{number}].control_image")
            elif isinstance(controls, list) and len(controls) <= MAX_REFERENCES:
                where = f"prompts[{number}].control_image"
                entry["control_image"] = [stored_path(value, f"{where}[{n}]") for n, value in enumerate(controls)]
            references = entry.get("reference_images")
            # Not a list of at most MAX_REFERENCES: resolve says what it must be, without storing any.
            if isinstance(references, list) and len(references) <= MAX_REFERENCES:
                where = f"prompts[{number}].reference_images"
                entry["reference_images"] = [stored_path(value, f"{where}[{n}]") for n, value in enumerate(references)]
        stored.append(entry)
    return stored


def controlnets_problem(given, ours) -> list[str]:
    """A run's model.controlnets against the server's: the same ControlNets by name (a client's folder is named by
    its last part, as the server's are), in the same order, at the same scales once defaults are filled in."""
    from pydantic import ValidationError

    from tpugen.config.controls import control_name
    from tpugen.config.schema import ControlNetConfig

    wanted = [(control_name(c.id), c.scale) for c in ours]
    try:
        if (
            isinstance(given, list)
            and [(control_name(c.id), c.scale) for c in (ControlNetConfig(**g) for g in given)] == wanted
        ):
            return []
    except (ValidationError, TypeError):
        pass
    runs = ", ".join(f"{name} (scale {scale:g})" for name, scale in wanted) or "none"
    return [f"model.controlnets: the server runs {runs}; leave it out or equal"]


def step_cache_problem(given, ours: StepCacheConfig) -> list[str]:
    """A run's compile.step_cache against the server's (`ours`): equal once its defaults are filled in, or
    refused, since the server's one cache is on its loaded denoiser, warm for every request and run."""
    from pydantic import ValidationError

    try:
        if isinstance(given, dict) and StepCacheConfig(**given) == ours:
            return []
    except ValidationError:
        pass
    runs = "no step cache" if ours.method == "none" else f"step cache {ours.method} with {ours.options()}"
    return [f"compile.step_cache: the server runs {runs} for all its requests and runs; leave it out or equal"]


def run_loras(loras, serve: ServeConfig) -> list:
    """model.loras of a run sent here: each id a LoRA's name in serve.lora_dir, or a hub repo (org/name) where
    serve.hub_loras allows them."""
    if not isinstance(loras, list):
        raise InputError("model.loras: must be a list of {id, scale}")
    converted, problems = [], []
    for number, lora in enumerate(loras):
        where = f"model.loras[{number}].id"
        lora_id = lora.get("id") if isinstance(lora, dict) else None
        if not isinstance(lora_id, str):
            problems.append(f"{where}: a LoRA's name in serve.lora_dir, or a hub repo org/name")
        elif is_hub_lora(lora_id):
            if not serve.hub_loras:
                problems.append(
                    f"{where}: {lora_id!r} is a hub repo; this server takes the LoRAs of serve.lora_dir only "
                    "(serve.hub_loras: true lets runs download hub LoRAs with the server's token)"
                )
            elif problem := weight_name_problem(lora.get("weight_name")):
                problems.append(f"model.loras[{number}].weight_name: {problem}")
            else:
                converted.append(lora)
        elif not LORA_NAME.fullmatch(lora_id.removesuffix(".safetensors")):
            problems.append(
                f"{where}: {lora_id!r}: a run sent to the server names a LoRA of serve.lora_dir by its file stem"
            )
        elif serve.lora_dir is None:
            problems.append(f"{where}: {lora_id!r} needs serve.lora_dir, which this server has not set")
        elif not (Path(serve.lora_dir) / (lora_id.removesuffix(".safetensors") + ".safetensors")).is_file():
            # Named, not shown as the path under serve.lora_dir it would be (a reply never shows that folder).
            known = ", ".join(p.stem for p in lora_files(serve.lora_dir)) or "none"
            problems.append(
                f"{where}: no LoRA {lora_id.removesuffix('.safetensors')!r} in serve.lora_dir (it has: {known})"
            )
        else:
            # A file of serve.lora_dir: its name, scale and pin only (a weight_name picks in a folder or repo).
            # The id stays its name (relative to serve.lora_dir): the run's records and files name it so.
            stem = lora_id.removesuffix(".safetensors")
            kept = {key: lora[key] for key in ("scale", "sha256") if key in lora}
            converted.append({**kept, "id": stem + ".safetensors"})
    if problems:
        raise InputError(*problems)
    return converted


def weight_name_problem(name) -> str | None:
    """Why a hub LoRA's weight_name cannot be a file of its repo (a path that leaves it), or None."""
    if name is None:
        return None
    if not isinstance(name, str) or not name.strip():
        return "a file name in the LoRA's repo"
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\", "~")) or ":" in name or ".." in parts:
        return f"{name[:100]!r}: a file of the LoRA's repo, not a path out of it"
    return None
