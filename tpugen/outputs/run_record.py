"""run.json, what made a run: written as a run starts, read back by a resume, which it refuses where the images
would differ and warns where they would differ by rounding only. Each key's effect on a resume is declared with
the key (tpugen.config.schema.resume_effects)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from tpugen.config import ModelConfig, PromptSpec, ResolvedRun, RunConfig, load_config
from tpugen.config.controls import Controls, annotator_weights, controlnet_identity
from tpugen.config.images import ImageSource, References, sha256_of
from tpugen.config.loras import loras_by_content
from tpugen.config.prompts import resolve_prompts
from tpugen.config.schema import resume_effects
from tpugen.errors import InputError
from tpugen.files import write_json
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.run_dir import MANIFEST, RUN_RECORD


def plain_json(value):
    """JSON-shaped (tuples as lists), so a stored record and a fresh one compare equal."""
    return json.loads(json.dumps(value))


def config_data(run: ResolvedRun) -> dict:
    """The config as a run record holds it: a local ControlNet and the annotator weights the prompts read by
    content, as the config hash counts them (a resume then refuses weights changed in place, and takes a folder
    moved)."""
    data = plain_json(run.config.model_dump())
    model = data["model"]
    model["controlnets"] = [controlnet_identity(controlnet) for controlnet in model["controlnets"]]
    if model.get("annotators_dir") is not None:
        model["annotators_dir"] = annotator_weights(model["annotators_dir"], run.prompts) or None
    return data


def prompts_data(prompts: list[PromptSpec]) -> list[dict]:
    """The prompts as a run record holds them; a prompt without references or control images as before prompts
    could have them."""
    data = [asdict(p) for p in prompts]
    return plain_json(
        [{k: v for k, v in p.items() if k not in ("references", "controls") or v is not None} for p in data]
    )


def write_run_record(run_dir: Path, run: ResolvedRun, run_id: str, *, exclusive: bool = False) -> None:
    """run.json: the config and the prompts a run starts with, so a resume can tell what made its images even
    after config.yaml or the prompts file has been edited."""
    write_json(
        run_dir / RUN_RECORD,
        {
            "tpugen_run": 1,
            "run_id": run_id,
            "config_hash": run.config_hash,
            "config": config_data(run),
            "prompts": prompts_data(run.prompts),
        },
        exclusive=exclusive,
    )


def read_run_record(run_dir: Path) -> dict | None:
    """The run's run.json, or None for a run made before tpugen wrote one."""
    path = run_dir / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError(f"{path}: unreadable (not the JSON tpugen wrote); the run cannot be checked") from None
    if not isinstance(record, dict) or not {"config", "prompts", "config_hash"} <= set(record):
        raise InputError(f"{path}: not a tpugen run record; the run cannot be checked")
    return record


def recorded_prompts(record: dict) -> list[PromptSpec]:
    return [
        PromptSpec(
            **{
                **p,
                "sizes": tuple(tuple(s) for s in p["sizes"]),
                "source": ImageSource(**p["source"]) if p.get("source") else None,
                "references": References.from_record(p["references"]) if p.get("references") else None,
                "controls": Controls.from_record(p["controls"]) if p.get("controls") else None,
            }
        )
        for p in record["prompts"]
    ]


def load_run(run_dir: Path) -> ResolvedRun:
    """`tpugen resume RUN_DIR`: the run's own config.yaml, with the prompts the run started with (a prompts
    file edited since is not read again)."""
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}: not a tpugen run directory (no config.yaml)")
    record = read_run_record(run_dir)
    if record is None:
        return load_config(run_dir / "config.yaml")
    prompts = recorded_prompts(record)
    changed = [
        f"{run_dir}: prompt {number}'s {key} {path} changed since the run started (or is gone); put it back as it "
        "was, or start a new run"
        for number, prompt in enumerate(prompts)
        for key, path, sha256 in prompt.files()
        if sha256_of(path) != sha256
    ]
    if changed:
        raise InputError(*changed)
    return load_config(run_dir / "config.yaml", prompts=prompts)


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(old_config: dict, new_config: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for each key whose value differs between two configs. A key one side
    lacks (a run recorded before tpugen had it) counts as that key's default."""
    defaults = _flatten(plain_json(RunConfig(model=ModelConfig(id="-")).model_dump()))
    a, b = _flatten(_loras_by_content(old_config)), _flatten(_loras_by_content(new_config))

    def value(flat: dict, key: str):
        # A run made before model.loras existed has no such key: it had no LoRAs, as [] says.
        found = flat.get(key, defaults.get(key))
        return None if found == [] else found

    return [(key, value(a, key), value(b, key)) for key in sorted(set(a) | set(b)) if value(a, key) != value(b, key)]


def _loras_by_content(config: dict) -> dict:
    """The config with model.loras as what names the images: each file's sha256 and scale, in no order (an id is
    where the file was found, which a moved project or an older run recorded otherwise)."""
    loras = (config.get("model") or {}).get("loras")
    if not loras:
        return config
    return {**config, "model": {**config["model"], "loras": loras_by_content(loras)}}


def _image_effect(key: str, old_config: dict, new_config: dict) -> str:
    """What a change of `key` does to the images: "none", "rounding" or "changes", as the schema declares it for
    the key or the section it is under (tpugen.config.schema.resume_effects)."""
    declared = resume_effects()
    owner = next((k for k in declared if key == k or key.startswith(k + ".")), None)
    effect = declared.get(owner, "changes")
    if effect == "placement":
        placed = any(c.get("execution", {}).get("placement", "none") != "none" for c in (old_config, new_config))
        return "rounding" if placed else "none"
    return effect


def image_changing_differences(old_config: dict, new_config: dict) -> list[str]:
    """The dotted keys whose values differ between two configs in a way that changes images (more than by
    rounding)."""
    return [
        key
        for key, _, _ in changed_keys(old_config, new_config)
        if _image_effect(key, old_config, new_config) == "changes"
    ]


def rounding_differences(old_config: dict, new_config: dict) -> list[str]:
    """`key (old -> new)` for each key that differs in a way that changes pixels by rounding only (another device
    count, graph or placement of the same computation)."""
    return [
        f"{key} ({old} -> {new})"
        for key, old, new in changed_keys(old_config, new_config)
        if _image_effect(key, old_config, new_config) == "rounding"
    ]


def differences(run: ResolvedRun, old_config: dict, old_prompts: list[dict]) -> list[str]:
    """The keys in which `run` would make other images than the recorded config and prompts made."""
    differing = image_changing_differences(old_config, config_data(run))
    # Prompts count by their content, wherever they came from (an inline list or a file).
    if old_prompts != prompts_data(run.prompts) and "prompts" not in differing:
        differing.append("prompts" if run.config.prompts is not None else "prompts_file (its prompts)")
    return differing


def check_resumable(run: ResolvedRun, run_dir: Path) -> str | None:
    """Refuse, naming what changed, a resume whose work would differ from what made the run's images; the
    warning for one whose images would differ by rounding only, or None."""
    if not run_dir.is_dir():
        raise InputError(f"--resume: {run_dir} is not a run directory")
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"--resume: {run_dir} has no config.yaml, so it is not a tpugen run directory")
    record = read_run_record(run_dir)
    if record is not None:
        old_config, old_prompts = record["config"], record["prompts"]
    else:  # a run from before run.json: its config.yaml is all there is
        previous = load_config(run_dir / "config.yaml")
        old_config, old_prompts = config_data(previous), prompts_data(previous.prompts)
    differing = differences(run, old_config, old_prompts)
    if differing:
        raise InputError(
            f"--resume: the config differs from the run in {run_dir} in keys that change images: "
            + ", ".join(differing)
        )
    if record is None:
        path = run_dir / MANIFEST
        made_by = {r.get("config_hash") for r in (read_manifest(path) if path.exists() else [])}
        made_by -= {None, run.config_hash, previous.config_hash}
        if made_by:
            raise InputError(
                f"--resume: the images in {run_dir} were made by config hash {', '.join(sorted(made_by))}, and "
                f"this config resolves to {run.config_hash} (was config.yaml or the prompts file edited?)"
            )
    rounding = rounding_differences(old_config, config_data(run))
    if rounding:
        return (
            f"--resume: the config differs from the run in {run_dir} in {', '.join(rounding)}: the images made now "
            "may differ from those already made by rounding (about 1/255)"
        )
    return None


def as_recorded(run: ResolvedRun, run_dir: Path) -> ResolvedRun:
    """`run` with the config hash of the run in `run_dir` (run.json's), so that the images a resume makes carry
    the hash the run's first images carry, whatever key that changes no image (execution.chip, say) differs."""
    try:
        record = read_run_record(run_dir)
    except InputError:  # the owner of the session checked it; a rank elsewhere may not read it
        record = None
    if record is None or record["config_hash"] == run.config_hash:
        return run
    return replace(run, config_hash=record["config_hash"])


def prompts_file_edited(run: ResolvedRun, run_dir: Path) -> str | None:
    """The warning for a resume whose prompts file no longer holds the prompts the run goes on with (those it
    started with, from run.json), or None."""
    if run.config.prompts_file is None:
        return None
    problems: list[str] = []
    now = resolve_prompts(run.config.model_copy(deep=True), run_dir, None, problems)
    if not problems and prompts_data(now) == prompts_data(run.prompts):
        return None
    file = Path(run.config.prompts_file).expanduser()
    file = file if file.is_absolute() else run_dir / file
    what = (
        "changed since the run started; its edits are not used" if file.is_file() else "is gone since the run started"
    )
    return (
        f"prompts_file: {file} {what}: the run goes on with the {len(run.prompts)} prompts it started with (kept "
        f"in {RUN_RECORD})"
    )
