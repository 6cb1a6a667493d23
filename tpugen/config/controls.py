"""A prompt's ControlNet units at the door: its control images (one per ControlNet of model.controlnets), how each
is turned into the control (a preprocessor, built in and needing no weights), and how strongly and over which
steps each steers the denoiser."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tpugen.config.images import InputImage, read_input_image
from tpugen.config.schema import CONTROL_SCALE_MAX, RunConfig

# The preprocessors (the web UI's ControlNet "modules") that need no weights, by tpugen's name: what each makes of
# the image, and its thresholds' defaults (the extension's threshold_a and threshold_b; None: it takes none).
CONTROL_MODULES: dict[str, tuple[str, float | None, float | None]] = {
    "none": ("the image is the control, as it is", None, None),
    "canny": ("OpenCV's Canny edges, white on black (threshold_a: low, threshold_b: high)", 100.0, 200.0),
    "invert": ("the image's colours inverted: black lines on white become white on black", None, None),
    "scribble": ("a drawing's dark strokes, thickened, white on black (threshold_a: darkness 0-255)", 127.0, None),
    "tile": ("a downscaled copy, scaled back up: layout and colours without detail (threshold_a: factor)", 4.0, None),
}
# The web UI extension's own module names that are these (its requests send them).
MODULE_ALIASES = {
    "invert (from white bg & black line)": "invert",
    "scribble_thr": "scribble",
    "tile_resample": "tile",
}
# Preprocessors that need an annotator's weights, which tpugen does not run: named, so a request for one is refused
# saying what it needs rather than that it is unknown.
NEEDS_WEIGHTS = ("depth", "openpose", "lineart", "hed", "mlsd", "normal", "seg", "softedge", "shuffle")

# Why an img2img or inpainting image cannot take two or more ControlNets.
MULTI_IMG2IMG = (
    "with an init image, one ControlNet at a time: diffusers 0.42's ControlNet img2img and inpaint pipelines take one "
    "control image per ControlNet for a whole batch"
)
# The keys a prompt's entry may hold for its control images.
CONTROL_KEYS = (
    "control_image",
    "control_module",
    "control_scale",
    "control_start",
    "control_end",
    "control_threshold_a",
    "control_threshold_b",
)


@dataclass(frozen=True)
class ControlUnit:
    """One ControlNet's part in a prompt: its control image (as given, before the preprocessor), the preprocessor
    and its thresholds, the scale, and the share of the steps it runs in (start to end, 0 to 1)."""

    image: InputImage
    module: str = "none"
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    threshold_a: float | None = None
    threshold_b: float | None = None
    resize_mode: int = 1  # how the image is fitted to the size (tpugen.config.request.RESIZE_MODES): crop and resize

    def record(self) -> dict:
        """What an image record says of it: the image by content."""
        return {
            "image_sha256": self.image.sha256,
            "module": self.module,
            "scale": self.scale,
            "start": self.start,
            "end": self.end,
            "threshold_a": self.threshold_a,
            "threshold_b": self.threshold_b,
            "resize_mode": self.resize_mode,
        }

    @property
    def call_key(self) -> tuple:
        """What a pipeline call takes once for all its rows (diffusers' controlnet_conditioning_scale,
        control_guidance_start and _end), so a batch has one."""
        return (self.scale, self.start, self.end)


@dataclass(frozen=True)
class Controls:
    """A prompt's units, one per ControlNet of model.controlnets, in that order."""

    units: tuple[ControlUnit, ...]

    @property
    def count(self) -> int:
        return len(self.units)

    @property
    def call_key(self) -> tuple:
        return tuple(unit.call_key for unit in self.units)

    def record(self) -> dict:
        return {"controlnet_units": [unit.record() for unit in self.units]}

    def files(self) -> list[tuple[str, str, str]]:
        """(key, path, sha256) of each control image."""
        return [(f"control_image[{n}]", unit.image.path, unit.image.sha256) for n, unit in enumerate(self.units)]

    @classmethod
    def from_record(cls, fields: dict) -> Controls:
        """The controls as a run record holds them (dataclasses.asdict)."""
        units = []
        for unit in fields["units"]:
            unit = dict(unit)
            unit["image"] = InputImage(**unit["image"])
            units.append(ControlUnit(**unit))
        return cls(tuple(units))


def window_problem(controls: Controls, family) -> str | None:
    """Why these units cannot sit out part of the steps for a model of `family` (None: they can, or do not)."""
    refusal = family.control_window_refusal
    if refusal and any(unit.start > 0 or unit.end < 1 for unit in controls.units):
        return f"{family.title} models: {refusal}"
    return None


def control_name(controlnet_id: str) -> str:
    """How records, the web UI's model list and its units name a ControlNet: a built-in's name, a folder's or hub
    repo's last part."""
    return controlnet_id.rstrip("/").split("/")[-1]


def module_name(name: str) -> str | None:
    """tpugen's name of a preprocessor a config or the web UI names (None: not one tpugen runs)."""
    name = MODULE_ALIASES.get(name, name)
    return name if name in CONTROL_MODULES else None


def module_problem(name: str) -> str:
    """Why tpugen cannot run the preprocessor `name`, in one line."""
    wanted = name.split("_")[0]
    if wanted in NEEDS_WEIGHTS:
        return (
            f"{name!r} needs an annotator model's weights, which tpugen does not run; preprocess the image "
            f"yourself and send it with module none (built in: {', '.join(CONTROL_MODULES)})"
        )
    return f"unknown module {name!r}; built in: {', '.join(CONTROL_MODULES)}"


def _each(value, count: int, key: str, problems: list[str], where: str) -> list | None:
    """A value given once for every ControlNet, or as a list of one per ControlNet."""
    if isinstance(value, list):
        if len(value) != count:
            problems.append(
                f"{where}: {key}: a list of {len(value)}; model.controlnets has {count} (give one value, or one each)"
            )
            return None
        return value
    return [value] * count


def number_in(value, low: float, high: float) -> bool:
    """A number (not a bool) from low to high: an integer past any float (JSON allows 1 and 400 zeros) is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and low <= value <= high
    except OverflowError:
        return False


def read_controls(entry: dict, run: RunConfig, base_dir: Path, where: str, problems: list[str]) -> Controls | None:
    """A prompt entry's control units (None: it gives no control_image, or one with its problems noted)."""
    given = [key for key in CONTROL_KEYS if key in entry]
    if not given:
        return None
    if "control_image" not in entry:
        problems.append(f"{where}: {given[0]} is for a prompt with a control_image; give one or leave {given[0]} out")
        return None
    count = len(run.model.controlnets)
    if count == 0:
        problems.append(f"{where}: control_image: the model has no ControlNet; name one in model.controlnets")
        return None
    if "reference_images" in entry:
        problems.append(f"{where}: control_image: a prompt that edits by reference takes no control image")
        return None
    if count > 1 and "init_image" in entry:
        problems.append(f"{where}: control_image: {MULTI_IMG2IMG}")
        return None
    before = len(problems)
    lists = {key: _each(entry[key], count, key, problems, where) for key in given}
    if len(problems) > before:
        return None
    units = []
    for n in range(count):
        at = f"{where}: control_image[{n}]" if count > 1 else f"{where}: control_image"
        path = lists["control_image"][n]
        if not isinstance(path, str) or not path.strip():
            problems.append(f"{at}: must be a path to an image (relative to the config), got {path!r}")
            continue
        module = lists.get("control_module", ["none"] * count)[n]
        named = module_name(module) if isinstance(module, str) else None
        if named is None:
            at_module = f"{where}: control_module[{n}]" if count > 1 else f"{where}: control_module"
            problems.append(f"{at_module}: {module_problem(str(module)[:80])}")
            continue
        scale = lists.get("control_scale", [run.model.controlnets[n].scale] * count)[n]
        start = lists.get("control_start", [0.0] * count)[n]
        end = lists.get("control_end", [1.0] * count)[n]
        bad = [
            f"{key} must be {wanted}, got {value!r}"
            for key, value, low, high, wanted in (
                ("control_scale", scale, 0, CONTROL_SCALE_MAX, f"a number from 0 to {CONTROL_SCALE_MAX:g}"),
                ("control_start", start, 0, 1, "a number from 0 to 1"),
                ("control_end", end, 0, 1, "a number from 0 to 1"),
            )
            if not number_in(value, low, high)
        ]
        if not bad and start >= end:
            bad.append(f"control_start ({start:g}) must be below control_end ({end:g})")
        _, default_a, default_b = CONTROL_MODULES[named]
        thresholds = []
        for key, default in (("control_threshold_a", default_a), ("control_threshold_b", default_b)):
            value = lists.get(key, [default] * count)[n]
            if key in lists and default is None and value is not None:
                bad.append(f"{key}: module {named} takes no {key.removeprefix('control_')}")
            elif value is not None and not number_in(value, 0, 10_000):
                bad.append(f"{key} must be a number from 0 to 10000, got {value!r}")
            thresholds.append(None if value is None else float(value))
        if named == "tile" and thresholds[0] is not None and not 1 <= thresholds[0] <= 64:
            bad.append(f"control_threshold_a: tile's factor must be from 1 to 64, got {thresholds[0]:g}")
        if bad:
            problems.extend(f"{where}: {problem}" for problem in bad)
            continue
        image = read_input_image(path, base_dir, at, problems)
        if image is None:
            continue
        units.append(ControlUnit(image, named, float(scale), float(start), float(end), *thresholds))
    return Controls(tuple(units)) if len(units) == count and len(problems) == before else None
