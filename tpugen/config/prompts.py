"""The run's prompts: an inline list, or a .txt or .jsonl file, each checked at the door."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tpugen.config.controls import CONTROL_KEYS, Controls, read_controls
from tpugen.config.images import ImageSource, References, read_input_image
from tpugen.config.messages import suggest
from tpugen.config.request import DEFAULT_STRENGTH, entry_problems
from tpugen.config.schema import RunConfig
from tpugen.lines import text_lines


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of the run, with its per-prompt overrides already applied."""

    prompt: str
    negative_prompt: str
    seed: int | None  # None: the run's seed + image index
    steps: int
    guidance_scale: float
    sizes: tuple[tuple[int, int], ...]  # (height, width) pairs this prompt is rendered at
    source: ImageSource | None = None  # img2img and inpainting: the images it starts from (None: text only)
    references: References | None = None  # an edit by reference: the images it edits from (None: none)
    controls: Controls | None = None  # its control images, one per ControlNet (None: it is not controlled)

    def files(self) -> list[tuple[str, str, str]]:
        """(key, path, sha256) of each image file the prompt reads (its init image and mask, its references, its
        control images)."""
        return [
            *(self.source.files() if self.source else ()),
            *(self.references.files() if self.references else ()),
            *(self.controls.files() if self.controls else ()),
        ]


JSONL_KEYS = {
    "prompt",
    "negative_prompt",
    "seed",
    "steps",
    "guidance_scale",
    "height",
    "width",
    "init_image",
    "mask_image",
    "strength",
    "resize_mode",
    "reference_images",
    *CONTROL_KEYS,
}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows (give a finite number)")


def read_prompt_file(path: Path, problems: list[str]) -> list[dict]:
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
        unknown = sorted(set(entry) - JSONL_KEYS)
        if unknown:
            problems.append(f"{where}:{number}: unknown key {unknown[0]!r}{suggest(unknown[0], sorted(JSONL_KEYS))}")
            continue
        entry["_line"] = number
        entries.append(entry)
    if not entries and not problems:
        problems.append(f"{where}: {str(path)!r} has no prompts")
    return entries


def check_prompt_entry(
    entry: dict, where: str, run: RunConfig, problems: list[str], base_dir: Path | None = None
) -> PromptSpec | None:
    """The prompt of a config's entry (a .jsonl line, or a mapping in prompts), or None with every problem it has
    in `problems`, each after `where` (the rules: tpugen.config.request). Its images' paths are relative to
    `base_dir`, the config's folder."""
    prompt = entry.get("prompt")
    if not isinstance(prompt, str):
        problems.append(f"{where}: 'prompt' must be a string" if "prompt" in entry else f"{where}: 'prompt' is missing")
        return None
    found = entry_problems(entry)
    if found:
        problems.extend(f"{where}: {problem}" for problem in found)
        return None
    if "height" in entry or "width" in entry:
        sizes = ((entry.get("height", run.height), entry.get("width", run.width)),)
    else:
        sizes = run_sizes(run)
    images = {}
    for key in ("init_image", "mask_image"):
        if key in entry:
            found = read_input_image(entry[key], base_dir or Path.cwd(), f"{where}: {key}", problems)
            if found is None:
                return None
            images[key], images[f"{key}_sha256"] = found.path, found.sha256
    source = None
    if images:
        source = ImageSource(
            strength=float(entry.get("strength", DEFAULT_STRENGTH)), resize_mode=entry.get("resize_mode", 0), **images
        )
    references = None
    if "reference_images" in entry:
        found = [
            read_input_image(value, base_dir or Path.cwd(), f"{where}: reference_images[{n}]", problems)
            for n, value in enumerate(entry["reference_images"])
        ]
        if None in found:
            return None
        references = References(tuple(found), entry.get("resize_mode", 1))
    before = len(problems)
    controls = read_controls(entry, run, base_dir or Path.cwd(), where, problems)
    if len(problems) > before:
        return None
    return PromptSpec(
        prompt=prompt,
        negative_prompt=entry.get("negative_prompt", run.negative_prompt),
        seed=entry.get("seed"),
        steps=entry.get("steps", run.steps),
        guidance_scale=float(entry.get("guidance_scale", run.guidance_scale)),
        sizes=sizes,
        source=source,
        references=references,
        controls=controls,
    )


def planned_images(prompts: list[PromptSpec], images_per_prompt: int) -> int:
    """How many images these prompts make: each of its sizes, images_per_prompt times (counted, not listed)."""
    return sum(len(spec.sizes) for spec in prompts) * images_per_prompt


def run_sizes(run: RunConfig) -> tuple[tuple[int, int], ...]:
    """The sizes every prompt without its own is rendered at."""
    if run.sizes:
        return tuple((h, w) for h, w in run.sizes)
    return ((run.height, run.width),)


def resolve_prompts(
    config: RunConfig, base_dir: Path, given: list[PromptSpec] | None, problems: list[str], *, required: bool = True
) -> list[PromptSpec]:
    """The run's prompts (a run's recorded ones when `given`), noting every problem in `problems`. A server's
    config (`required=False`) may have none."""
    prompts: list[PromptSpec] = []
    if given is not None:
        prompts = list(given)
    elif config.prompts is not None and config.prompts_file is not None:
        problems.append("prompts: give either prompts or prompts_file, not both")
    elif config.prompts is None and config.prompts_file is None:
        if required:
            problems.append("prompts: no prompts given; set prompts (a list) or prompts_file (.txt or .jsonl)")
    elif config.prompts is not None:
        for i, item in enumerate(config.prompts):
            entry = item if isinstance(item, dict) else {"prompt": item}
            unknown = sorted(set(entry) - JSONL_KEYS)
            if unknown:
                problems.append(f"prompts[{i}]: unknown key {unknown[0]!r}{suggest(unknown[0], sorted(JSONL_KEYS))}")
                continue
            spec = check_prompt_entry(entry, f"prompts[{i}]", config, problems, base_dir)
            if spec:
                prompts.append(spec)
    else:
        file = Path(config.prompts_file).expanduser()
        file = file if file.is_absolute() else base_dir / file
        for entry in read_prompt_file(file, problems):
            spec = check_prompt_entry(entry, f"prompts_file:{entry['_line']}", config, problems, base_dir)
            if spec:
                prompts.append(spec)
        config.prompts_file = str(file.resolve())
    return prompts
