"""Where a model id points and which family it is, without loading the model: built-ins, local folders and hub
ids read by their model_index.json; and what a hub failure means in a user's words."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tpugen.errors import one_line
from tpugen.families import BUILTINS, CONTROLNETS, KNOWN_MODELS, Family, covered_classes, family_for_class
from tpugen.settings import hub_offline, hub_token

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a hub repository's id, org/name."""
    return _HUB_ID.fullmatch(text) is not None


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "builtin" | "local" | "hub"
    ref: str  # built-in name, absolute directory, or hub id


def _classify(ref: str, base_dir: Path | None, builtins, noun: str, local_problem) -> ModelSource | str:
    """Where an id points: one of `builtins`, a local folder (`local_problem(folder)` says what is wrong with it, or
    None), or a hub id; else a one-line reason naming what it is not (`noun`)."""
    if ref in builtins:
        return ModelSource("builtin", ref)
    candidate = Path(ref).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        candidate = base_dir / candidate
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1 or candidate.exists():
        if not candidate.is_dir():
            return f"{noun} directory {str(candidate)!r} does not exist"
        return local_problem(candidate) or ModelSource("local", str(candidate.resolve()))
    if is_hub_id(ref):
        return ModelSource("hub", ref)
    named = "built-in" if noun == "model" else f"built-in {noun}"
    return f"{ref!r} is not a {named} ({', '.join(builtins)}), an existing directory, or a hub id of the form org/name"


def classify_model_id(model_id: str, base_dir: Path | None = None) -> ModelSource | str:
    """Where `model_id` points, or a one-line reason it points nowhere. Touches only the filesystem."""

    def problem(folder: Path) -> str | None:
        if not (folder / "model_index.json").is_file():
            return f"{str(folder)!r} has no model_index.json (not a diffusers pipeline directory)"
        return None

    return _classify(model_id, base_dir, BUILTINS, "model", problem)


def classify_controlnet_id(controlnet_id: str, base_dir: Path | None = None) -> ModelSource | str:
    """Where a ControlNet's id points (a built-in, a local ControlNetModel folder, a hub id), or a one-line reason it
    points nowhere. Touches only the filesystem."""

    def problem(folder: Path) -> str | None:
        found = _class_in(folder / "config.json")
        if not isinstance(found, tuple):
            return found
        if "ControlNet" not in found[0]:
            return f"{str(folder)!r} holds a {found[0] or 'model with no _class_name'}, not a ControlNet"
        return None

    return _classify(controlnet_id, base_dir, CONTROLNETS, "ControlNet", problem)


def controlnet_folder(controlnet_id: str) -> Path | None:
    """Where a ControlNet's files are on this machine, its id resolved: a local folder, or a built-in already built
    (None: a hub id, a built-in not built yet, or an id that points nowhere)."""
    from tpugen.tiny import builtin_path, is_built

    source = classify_controlnet_id(controlnet_id)
    if isinstance(source, str) or source.kind == "hub" or (source.kind == "builtin" and not is_built(source.ref)):
        return None
    return builtin_path(source.ref) if source.kind == "builtin" else Path(source.ref)


def controlnet_configs(controlnets) -> list[dict]:
    """The config.json of each of model.controlnets whose files are on this machine (controlnet_folder)."""
    found = []
    for controlnet in controlnets:
        folder = controlnet_folder(controlnet.id)
        try:
            found.extend([json.loads((folder / "config.json").read_text())] if folder else [])
        except (OSError, ValueError):
            continue
    return found


# ---------------------------------------------------------------- which family a model is


def family_of(source: ModelSource, model, *, download: bool = True) -> Family | str:
    """The family of a model, read from what it is: a built-in's or a known hub id's own, else its
    model_index.json's `_class_name` (a local folder's file; a hub model's from the local Hugging Face cache, else
    a few hundred bytes downloaded and then cached). A one-line reason when the class is one no family covers or
    cannot be read. `model`: the config's model section (revision, custom_pipeline)."""
    if source.kind == "builtin":
        return BUILTINS[source.ref][1]
    if source.kind == "hub" and source.ref in KNOWN_MODELS and not model.custom_pipeline:
        return KNOWN_MODELS[source.ref][1]
    if source.kind == "local":
        found = _class_in(Path(source.ref) / "model_index.json")
    else:
        found = _hub_class(source.ref, model.revision, download=download)
    if not isinstance(found, tuple):
        return found
    class_name, index = found
    return family_for_class(class_name, index) or not_covered(source.ref, class_name)


def not_covered(model_id: str, class_name: str) -> str:
    """The one line for a pipeline of a class no family covers."""
    return f"{model_id!r} is a {class_name or 'pipeline with no _class_name'}; tpugen knows {covered_classes()}"


def local_config(path: Path) -> dict:
    """A local model's or component's config file (model_index.json, config.json) as a mapping; {} where it cannot
    be read as one."""
    found = _class_in(path)
    return found[1] if isinstance(found, tuple) else {}


def _class_in(index: Path) -> tuple[str, dict] | str:
    """(model_index.json's class name, the whole index) or why it cannot be read."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read {str(index)!r}: {exc}"
    data = data if isinstance(data, dict) else {}
    class_name = data.get("_class_name")
    return (class_name if isinstance(class_name, str) else "", data)


def _hub_class(repo: str, revision: str | None, *, download: bool) -> tuple[str, dict] | str:
    """model_index.json's class of a hub model: from the local cache, else downloaded (and so cached)."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo, "model_index.json", revision=revision)
    if isinstance(cached, str):
        return _class_in(Path(cached))
    if not download or hub_offline():
        return (
            f"cannot tell which family {repo!r} is: offline (HF_HUB_OFFLINE) and its model_index.json is not in "
            "the local cache (HF_HOME)"
        )
    from huggingface_hub import hf_hub_download

    try:
        return _class_in(Path(hf_hub_download(repo, "model_index.json", revision=revision, etag_timeout=10)))
    except Exception as exc:  # any hub failure becomes one line saying what it means
        return f"cannot tell which family {repo!r} is from its model_index.json: {hub_failure(exc)}"


def model_defaults(model_id: str, family: Family) -> dict:
    """height, width, steps and guidance_scale for a config that leaves them out."""
    known = KNOWN_MODELS.get(model_id, (None,))[0]
    builtin = BUILTINS.get(model_id, (None,))[0]
    size = (known and known.size) or (builtin and builtin.size) or family.size
    steps = (known and known.steps) or (builtin and builtin.steps) or family.steps
    given = [m.guidance_scale for m in (known, builtin) if m is not None and m.guidance_scale is not None]
    guidance = given[0] if given else family.guidance_scale
    return {"height": size, "width": size, "steps": steps, "guidance_scale": guidance}


# ---------------------------------------------------------------- what a hub failure means

# Connection failures of the HTTP clients huggingface_hub runs on (httpx, and requests in older releases), whose
# classes are not builtin ConnectionErrors: told by name, as importing both clients here would cost every command.
_CONNECTION_FAILURES = ("ConnectError", "ConnectTimeout", "ConnectionError")


def _hub_kind(exc: BaseException) -> str | None:
    """What one exception says of the hub, by its type: gated, missing repo, missing file, offline, or None."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):  # before RepositoryNotFoundError, which it subclasses
        return "gated"
    if isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
        return "missing repo"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, ConnectionError)):
        return "offline"  # LocalEntryNotFoundError is an EntryNotFoundError too: not in the cache, not missing
    if isinstance(exc, errors.EntryNotFoundError):  # RemoteEntryNotFoundError among them
        return "missing file"
    if type(exc).__name__ in _CONNECTION_FAILURES:
        return "offline"
    return None


def hub_failure(exc: BaseException, *, what: str = "model", file: str | None = None, from_hub: bool = True) -> str:
    """Why `what` (a model, a LoRA) could not be had, in the words a user can act on: offline, gated, missing,
    or as raised. `file`: the file asked for, named when the repo lacks it. `from_hub`: False for a local folder,
    whose failure is its own (HF_HUB_OFFLINE then explains nothing)."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    kinds = {_hub_kind(e) for e in chain}
    if "gated" in kinds:
        if not hub_token():
            return (
                "gated on the hub and no token is set (accept the licence on the model page, then "
                "`hf auth login` or set HF_TOKEN)"
            )
        return "gated on the hub and your token's account has no access (accept the licence on the model page)"
    if "missing repo" in kinds:
        return f"no such {what} on the hub (or it is private: `hf auth login` or set HF_TOKEN)"
    if "missing file" in kinds and file:
        return f"the repo has no file {file!r}"
    if "offline" in kinds or (from_hub and hub_offline()):
        return f"offline: the hub cannot be reached and the {what} is not in the local cache (HF_HOME)"
    return one_line(exc)
