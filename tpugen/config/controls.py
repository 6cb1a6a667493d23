"""A prompt's ControlNet units at the door: its control images (one per ControlNet of model.controlnets), how each
is turned into the control (a preprocessor, built in and needing no weights), and how strongly and over which
steps each steers the denoiser."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tpugen.config.digests import file_sha256
from tpugen.config.images import InputImage, read_input_image, shipped_name_problem
from tpugen.config.schema import CONTROL_SCALE_MAX, RunConfig
from tpugen.errors import InputError

# The preprocessors (the web UI's ControlNet "modules") that need no weights, by tpugen's name: what each makes of
# the image, and its thresholds' defaults (the extension's threshold_a and threshold_b; None: it takes none).
CONTROL_MODULES: dict[str, tuple[str, float | None, float | None]] = {
    "none": ("the image is the control, as it is", None, None),
    "canny": ("OpenCV's Canny edges, white on black (threshold_a: low, threshold_b: high)", 100.0, 200.0),
    "invert": ("the image's colours inverted: black lines on white become white on black", None, None),
    "scribble": ("a drawing's dark strokes, thickened, white on black (threshold_a: darkness 0-255)", 127.0, None),
    "tile": ("a downscaled copy, scaled back up: layout and colours without detail (threshold_a: factor)", 4.0, None),
    # The ControlNet extension's own (sd-webui-controlnet 1.1.455), computed as it computes them.
    "threshold": ("white where every channel is above threshold_a (0-255), black elsewhere", 127.0, None),
    "blur_gaussian": ("a Gaussian blur (threshold_a: sigma, 0.01-64)", 9.0, None),
    "color": ("a grid of the image's colours: 64 times smaller, scaled back up by nearest neighbours", None, None),
    "recolor_luminance": ("the image's lightness (LAB's L) as grey (threshold_a: gamma, 0.1-2)", 1.0, None),
    "recolor_intensity": ("the image's intensity (HSV's V) as grey (threshold_a: gamma, 0.1-2)", 1.0, None),
    "scribble_xdog": ("XDoG edges as scribbles, white on black (threshold_a: threshold, 1-64)", 32.0, None),
    "lineart_standard": ("dark lines on a light ground as white line art on black (a difference of blurs)", None, None),
    "tile_resample": ("the image scaled down by threshold_a (1-8, area-averaged; under 1.1 as it is)", 1.0, None),
}
# Where a module's threshold_a must lie (the extension's slider), for those that bound it.
THRESHOLD_A_RANGES: dict[str, tuple[float, float, str]] = {
    "tile": (1, 64, "factor"),
    "threshold": (0, 255, "threshold"),
    "blur_gaussian": (0.01, 64, "sigma"),
    "recolor_luminance": (0.1, 2, "gamma"),
    "recolor_intensity": (0.1, 2, "gamma"),
    "scribble_xdog": (1, 64, "threshold"),
    "tile_resample": (1, 8, "down sampling rate"),
}
# The web UI extension's own module names that are these (its requests send them).
MODULE_ALIASES = {
    "invert (from white bg & black line)": "invert",
    "scribble_thr": "scribble",
    "t2ia_color_grid": "color",
    "lineart_standard (from white bg & black line)": "lineart_standard",
}


# The extension's control types (its preprocessors' tags, sd-webui-controlnet 1.1.455), and each of tpugen's
# preprocessors' tags among them: /controlnet/control_types groups the preprocessors by these.
CONTROL_TYPES = (
    "Canny",
    "Depth",
    "IP-Adapter",
    "Inpaint",
    "Instant-ID",
    "InstructP2P",
    "Lineart",
    "MLSD",
    "NormalMap",
    "OpenPose",
    "Recolor",
    "Reference",
    "Revision",
    "Scribble",
    "Segmentation",
    "Shuffle",
    "SoftEdge",
    "SparseCtrl",
    "T2I-Adapter",
    "Tile",
)
MODULE_TAGS: dict[str, tuple[str, ...]] = {
    "none": ("InstructP2P",),
    "canny": ("Canny",),
    "invert": ("Canny", "Lineart", "Scribble", "MLSD"),
    "scribble": ("Scribble",),
    "tile": ("Tile",),
    "threshold": (),
    "blur_gaussian": ("Tile",),
    "color": ("T2I-Adapter",),
    "recolor_luminance": ("Recolor",),
    "recolor_intensity": ("Recolor",),
    "scribble_xdog": ("Scribble", "SparseCtrl"),
    "lineart_standard": ("Lineart",),
    "tile_resample": ("Tile",),
    "softedge_hed": ("SoftEdge",),
    "softedge_hedsafe": ("SoftEdge",),
    "scribble_hed": ("Scribble", "SparseCtrl"),
    "softedge_pidinet": ("SoftEdge",),
    "softedge_pidisafe": ("SoftEdge",),
    "scribble_pidinet": ("Scribble", "SparseCtrl"),
    "lineart_realistic": ("Lineart",),
    "lineart_coarse": ("Lineart",),
    "depth_midas": ("Depth",),
    "openpose": ("OpenPose",),
    "openpose_hand": ("OpenPose",),
    "openpose_face": ("OpenPose",),
    "openpose_faceonly": ("OpenPose",),
    "openpose_full": ("OpenPose",),
    "mlsd": ("MLSD",),
}
# The extension's preprocessor each control type defaults to (its highest sorting priority), where tpugen runs it.
TYPE_DEFAULTS = {
    "Canny": "canny",
    "Depth": "depth_midas",
    "Lineart": "lineart_standard",
    "MLSD": "mlsd",
    "OpenPose": "openpose_full",
    "Recolor": "recolor_luminance",
    "Scribble": "scribble_pidinet",
    "SoftEdge": "softedge_pidinet",
    "SparseCtrl": "scribble_pidinet",
    "T2I-Adapter": "color",
    "Tile": "tile_resample",
}
# The words a ControlNet's name holds for each type (the extension's filters: the type's own name, its aliases,
# and "union" for the types a ControlNet-Union covers).
TYPE_FILTERS = {
    "InstructP2P": ("ip2p",),
    "Segmentation": ("seg",),
    "NormalMap": ("normal",),
    "T2I-Adapter": ("t2i_adapter", "t2iadapter", "t2ia"),
    "IP-Adapter": ("ip_adapter", "ipadapter"),
    "OpenPose": ("openpose", "densepose"),
    "Instant-ID": ("instant_id", "instantid"),
    "Scribble": ("sketch",),
    "Tile": ("blur",),
}
UNION_TYPES = (
    "OpenPose",
    "Depth",
    "SoftEdge",
    "Scribble",
    "Canny",
    "Lineart",
    "MLSD",
    "NormalMap",
    "Segmentation",
    "Inpaint",
    "Tile",
)


def module_label(name: str) -> str:
    """The extension's label of one of tpugen's preprocessors (the name its requests and lists give)."""
    labels = {module: label for label, module in MODULE_ALIASES.items() if label != "scribble_thr"}
    return labels.get(name, name)


def control_types(modules: list[str], controlnets: list[str]) -> dict:
    """The extension's /controlnet/control_types for these preprocessors (tpugen's names, in order) and loaded
    ControlNets (by name): for "All" and each of its types, the preprocessors of that type ("none" first), the
    ControlNets whose names hold the type's words ("None" first), and the defaults its web UI selects."""
    labels = [module_label(name) for name in modules]
    models = ["None", *controlnets]
    found = {"All": {"module_list": labels, "model_list": models, "default_option": "none", "default_model": "None"}}
    for kind in CONTROL_TYPES:
        words = {kind.lower(), *TYPE_FILTERS.get(kind, ()), *(("union",) if kind in UNION_TYPES else ())}
        fitting = ["None", *(m for m in controlnets if any(word in m.lower() for word in words))]
        default_model = "None"
        if len(fitting) > 1:
            default_model = next((m for m in fitting[1:] if "11" in m.split("[")[0]), fitting[1])
        typed = ["none", *(name for name in modules if name != "none" and kind in MODULE_TAGS.get(name, ()))]
        default = TYPE_DEFAULTS.get(kind)
        option = default if default in typed else (typed[1] if len(typed) > 1 else "none")
        found[kind] = {
            "module_list": [module_label(name) for name in typed],
            "model_list": fitting,
            "default_option": module_label(option),
            "default_model": default_model,
        }
    return {"control_types": found}


# The sliders the extension's web UI shows for a preprocessor's thresholds (/controlnet/module_list's
# module_detail), for the thresholds tpugen reads, in order (threshold_a's, threshold_b's): the extension's name,
# range and step; the value is the module's own default (module_thresholds), and where THRESHOLD_A_RANGES bounds
# threshold_a its range is that one (None here). There is no resolution slider: tpugen does not read processor_res.
SLIDERS: dict[str, tuple[tuple[str, float | None, float | None, float], ...]] = {
    "canny": (("Low Threshold", 1, 255, 1), ("High Threshold", 1, 255, 1)),
    "scribble": (("Binarization Threshold", 0, 255, 1),),
    "tile": (("Down Sampling Factor", None, None, 0.01),),
    "tile_resample": (("Down Sampling Rate", None, None, 0.01),),
    "threshold": (("Binarization Threshold", None, None, 0.01),),
    "blur_gaussian": (("Sigma", None, None, 0.01),),
    "recolor_luminance": (("Gamma Correction", None, None, 0.001),),
    "recolor_intensity": (("Gamma Correction", None, None, 0.001),),
    "scribble_xdog": (("XDoG Threshold", None, None, 0.01),),
    "mlsd": (("MLSD Value Threshold", 0.01, 2.0, 0.01), ("MLSD Distance Threshold", 0.01, 20.0, 0.01)),
}


def module_detail(named: str) -> dict:
    """A preprocessor's detail as the extension's /controlnet/module_list gives it: `model_free` (whether a unit
    runs without a ControlNet model: never in tpugen) and its sliders ({name, value, min, max, step})."""
    sliders = []
    for (name, low, high, step), value in zip(SLIDERS.get(named, ()), module_thresholds(named), strict=False):
        if low is None:
            low, high, _ = THRESHOLD_A_RANGES[named]
        sliders.append({"name": name, "value": value, "min": low, "max": high, "step": step})
    return {"model_free": False, "sliders": sliders}


def threshold_a_problem(named: str, value: float | None) -> str | None:
    """Why `value` is not a threshold_a module `named` takes (its range), or None."""
    if named not in THRESHOLD_A_RANGES or value is None:
        return None
    low, high, what = THRESHOLD_A_RANGES[named]
    if low <= value <= high:
        return None
    return f"{named}'s {what} must be from {low:g} to {high:g}, got {value:g}"


@dataclass(frozen=True)
class Annotator:
    """A preprocessor that runs an annotator model (controlnet_aux's detector of that name) on the host, from the
    weights files model.annotators_dir holds, as the web UI's ControlNet extension runs it."""

    detector: str
    files: tuple[str, ...]  # the files it reads from the folder, by lllyasviel/Annotators' names
    description: str
    options: tuple[tuple[str, object], ...] = ()  # its call's fixed keyword arguments
    # The detector's keyword arguments that threshold_a and threshold_b set, with their defaults (None: none).
    threshold_a: tuple[str, float] | None = None
    threshold_b: tuple[str, float] | None = None


_HED, _PIDINET, _LINEART = ("ControlNetHED.pth",), ("table5_pidinet.pth",), ("sk_model.pth", "sk_model2.pth")
# The annotators tpugen runs, by the extension's module names (lllyasviel's ControlNet 1.1 preprocessors).
ANNOTATORS: dict[str, Annotator] = {
    "softedge_hed": Annotator("HEDdetector", _HED, "HED's soft edges, white on black"),
    "softedge_hedsafe": Annotator("HEDdetector", _HED, "HED's soft edges, quantized", (("safe", True),)),
    "scribble_hed": Annotator(
        "HEDdetector", _HED, "HED's edges thinned and thickened into scribbles", (("scribble", True),)
    ),
    "softedge_pidinet": Annotator("PidiNetDetector", _PIDINET, "PiDiNet's soft edges, white on black"),
    "softedge_pidisafe": Annotator("PidiNetDetector", _PIDINET, "PiDiNet's soft edges, quantized", (("safe", True),)),
    "scribble_pidinet": Annotator("PidiNetDetector", _PIDINET, "PiDiNet's edges as scribbles", (("scribble", True),)),
    "lineart_realistic": Annotator("LineartDetector", _LINEART, "line art of a photo, white on black"),
    "lineart_coarse": Annotator("LineartDetector", _LINEART, "coarse line art of a photo", (("coarse", True),)),
    "depth_midas": Annotator("MidasDetector", ("dpt_hybrid-midas-501f0c75.pt",), "MiDaS's depth map, near in white"),
    **{
        name: Annotator(
            "OpenposeDetector",
            ("body_pose_model.pth", "hand_pose_model.pth", "facenet.pth"),
            f"OpenPose's {what}, drawn as the extension draws it",
            (("include_body", body), ("include_hand", hand), ("include_face", face)),
        )
        # As the web UI's extension runs them (its openpose_hand draws the body too; controlnet_aux's does not).
        for name, what, body, hand, face in (
            ("openpose", "body pose", True, False, False),
            ("openpose_hand", "body and hand poses", True, True, False),
            ("openpose_face", "body pose and face", True, False, True),
            ("openpose_faceonly", "face", False, False, True),
            ("openpose_full", "body and hand poses and face", True, True, True),
        )
    },
    "mlsd": Annotator(
        "MLSDdetector",
        ("mlsd_large_512_fp32.pth",),
        "M-LSD's straight lines (threshold_a: value, threshold_b: distance)",
        threshold_a=("thr_v", 0.1),
        threshold_b=("thr_d", 0.1),
    ),
}
# What running them needs installed (the tpugen[annotators] extra).
ANNOTATORS_NEED = "the annotators run through controlnet_aux, which is not installed: pip install 'tpugen[annotators]'"
# The extension's older names of these.
ANNOTATOR_ALIASES = {
    "hed": "softedge_hed",
    "hed_safe": "softedge_hedsafe",
    "pidinet": "softedge_pidinet",
    "pidinet_safe": "softedge_pidisafe",
    "pidinet_scribble": "scribble_pidinet",
    "softedge_pidsafe": "softedge_pidisafe",  # controlnet_aux's own name of it
    "lineart": "lineart_realistic",
    "depth": "depth_midas",
}
# Preprocessors that need an annotator's weights, which tpugen does not run yet: named, so a request for one is
# refused saying what it needs rather than that it is unknown.
NEEDS_WEIGHTS = ("depth", "dw", "openpose", "lineart", "hed", "mlsd", "normal", "seg", "softedge", "shuffle")

# The keys a prompt's entry may hold for its control images.
CONTROL_KEYS = (
    "control_image",
    "control_module",
    "control_scale",
    "control_start",
    "control_end",
    "control_threshold_a",
    "control_threshold_b",
    "control_mode",
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
    # The web UI extension's control mode (CONTROL_MODES: 0 Balanced, 1 My prompt is more important, 2 ControlNet is
    # more important) and per-residual weights (its advanced_weighting, in place of the scale), for UNet ControlNets.
    mode: int = 0
    layer_weights: tuple[float, ...] | None = None

    def record(self) -> dict:
        """What an image record says of it: the image by content (the mode and per-residual weights where set)."""
        record = {
            "image_sha256": self.image.sha256,
            "module": self.module,
            "scale": self.scale,
            "start": self.start,
            "end": self.end,
            "threshold_a": self.threshold_a,
            "threshold_b": self.threshold_b,
            "resize_mode": self.resize_mode,
        }
        if self.mode:
            record["control_mode"] = self.mode
        if self.layer_weights is not None:
            record["layer_weights"] = list(self.layer_weights)
        return record

    @property
    def call_key(self) -> tuple:
        """What a pipeline call takes once for all its rows (diffusers' controlnet_conditioning_scale,
        control_guidance_start and _end; the mode and per-residual weights), so a batch has one."""
        return (self.scale, self.start, self.end, self.mode, self.layer_weights)


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

    @property
    def weighed(self) -> bool:
        """Whether a unit asks for a control mode but Balanced or per-residual weights."""
        return any(unit.mode or unit.layer_weights is not None for unit in self.units)

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
            if unit.get("layer_weights") is not None:
                unit["layer_weights"] = tuple(unit["layer_weights"])
            units.append(ControlUnit(**unit))
        return cls(tuple(units))


def controlled_problems(family, controls: Controls, source=None, controlnets: list[dict] | tuple = ()) -> dict:
    """Why an image with these units (and the image it starts from, `source`) cannot run for a model of `family`,
    whose ControlNets' configs are `controlnets` (those known), by what each reason is about: "image" (its task),
    "strength", "window" (the units' start and end), "weights" (their modes and per-residual weights). Empty: it
    can. A run config and a server word them apart."""
    found, parts = {}, family.controlnet
    if parts is None:  # a family without ControlNets: model.controlnets is refused at the door
        return found
    if source is not None and (why := parts.refusal(source.task, controlnets)):
        found["image"] = f"{family.title} models: {why}"
    elif source is not None and source.task == "inpaint" and source.strength != 1:
        if strength := parts.inpaint_strength_refusal:
            found["strength"] = f"{family.title} models: {strength}"
    refusal = parts.window_refusal
    if refusal and any(unit.start > 0 or unit.end < 1 for unit in controls.units):
        found["window"] = f"{family.title} models: {refusal}"
    weighed = [n for n, unit in enumerate(controls.units) if unit.mode or unit.layer_weights is not None]
    if weighed and parts.residual_weights_refusal:
        found["weights"] = f"{family.title} models: {parts.residual_weights_refusal}"
    for n in (n for n in weighed if n < len(controlnets)):  # the configs known (a hub one's: once it is loaded)
        weights, count = controls.units[n].layer_weights, parts.residual_count(controlnets[n])
        if weights is not None and count is not None and len(weights) != count:
            found["weights"] = f"ControlNet {n} takes {count} residual weights, one per residual; got {len(weights)}"
    return found


# The web UI extension's control modes, by number (its units' control_mode: the number, or the name).
CONTROL_MODES = ("Balanced", "My prompt is more important", "ControlNet is more important")
# Each by what a unit or a prompt may say: the number, the name, or the extension's enum's name (ControlMode.PROMPT).
MODE_NAMES = {
    **{name.lower(): n for n, name in enumerate(CONTROL_MODES)},
    **{
        f"{prefix}{name}": n
        for n, name in enumerate(("balanced", "prompt", "control"))
        for prefix in ("", "controlmode.")
    },
}
MODES_WANTED = "one of " + ", ".join(f"{name} ({n})" for n, name in enumerate(CONTROL_MODES))


def control_mode_number(value) -> int | None:
    """A control mode as a unit or a prompt gives it (0-2, or a name), by number; None: not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < len(CONTROL_MODES) else None
    return MODE_NAMES.get(value.strip().lower()) if isinstance(value, str) else None


# Each residual's share of a unit's scale in the modes but Balanced (the extension's soft injection): the i-th of a
# UNet ControlNet's residuals (the stem's first, the mid block's last) weighs this to the power 12 - i.
SOFT_INJECTION = 0.825


def residual_factors(unit: ControlUnit, count: int) -> tuple[float, ...]:
    """What each of a ControlNet's `count` residuals is multiplied by beside the scale diffusers applies, as the
    extension weighs them: per-residual weights in place of the scale (the scale is then 1), Balanced 1 each, the
    other modes 0.825 ** (12 - i) (SDXL's 10 residuals take the first 10 of those, as the extension's zip does)."""
    if unit.layer_weights is not None:
        return tuple(float(w) for w in unit.layer_weights)
    if unit.mode:
        return tuple(SOFT_INJECTION ** float(12 - i) for i in range(count))
    return (1.0,) * count


def recorded_name(controlnet_id: str) -> str:
    """How an image record names a ControlNet: a built-in or hub id as it is, a local folder by its name (where it
    is, on this machine or a pod worker, is not what made the image; the config hash counts its content)."""
    return control_name(controlnet_id) if Path(controlnet_id).is_absolute() else controlnet_id


def control_name(controlnet_id: str) -> str:
    """How the web UI's model list, its units and the PNG parameters name a ControlNet: a built-in's name, a
    folder's or hub repo's last part (records: recorded_name)."""
    return controlnet_id.rstrip("/").split("/")[-1]


def _missing(annotator: Annotator, folder: str | None) -> list[str]:
    return [name for name in annotator.files if folder is None or not (Path(folder) / name).is_file()]


def module_name(name: str, annotators: str | None = None) -> str | None:
    """tpugen's name of a preprocessor a config or the web UI names (None: not one tpugen runs here): a built-in,
    or an annotator whose weights the folder `annotators` (model.annotators_dir) holds."""
    name = MODULE_ALIASES.get(name, name)
    if name in CONTROL_MODULES:
        return name
    name = ANNOTATOR_ALIASES.get(name, name)
    return name if name in ANNOTATORS and not _missing(ANNOTATORS[name], annotators) else None


def module_problem(name: str, annotators: str | None = None) -> str:
    """Why tpugen cannot run the preprocessor `name` here, in one line."""
    annotator = ANNOTATORS.get(ANNOTATOR_ALIASES.get(name, name))
    if annotator is not None and annotators is None:
        return (
            f"{name!r} runs an annotator model (controlnet_aux's {annotator.detector}) from its weights on this "
            f"machine: name a folder holding {', '.join(annotator.files)} in model.annotators_dir"
        )
    if annotator is not None:
        return f"{name!r} needs {', '.join(_missing(annotator, annotators))} in model.annotators_dir ({annotators})"
    if name.split("_")[0] in NEEDS_WEIGHTS:
        return (
            f"{name!r} needs an annotator model tpugen does not run yet (it runs {', '.join(ANNOTATORS)} from "
            f"model.annotators_dir); preprocess the image yourself and send it with module none (built in: "
            f"{', '.join(CONTROL_MODULES)})"
        )
    return f"unknown module {name!r}; built in: {', '.join(CONTROL_MODULES)}"


def annotator_weights(folder: str | None, prompts) -> dict[str, str | None]:
    """The sha256 of each weights file of `folder` (model.annotators_dir) the prompts' units read, by file name."""
    files = sorted(
        {name for spec in prompts if spec.controls for unit in spec.controls.units for name in _files(unit.module)}
    )
    return {name: file_sha256(Path(folder) / name) for name in files} if folder else {}


# What pod-run may name a shipped folder: gcloud scp hands the remote path to a shell on each worker.
_SHIPPABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,123}")


def shipped_models(config: RunConfig, prompts, folder: str) -> list[tuple[Path, str]]:
    """The local model files pod-run ships beside the config it ships (`config`: its copy of the run's, edited
    here): each local ControlNet folder as `folder`/controlnets/NAME (its id made ./ that, so records and the
    server's unit names, its last part, stay the same), and the weights of model.annotators_dir the prompts read
    as `folder`/annotators/FILE (the folder made that). (local path, path beside the config) each. InputError:
    two ControlNet folders of one name, or a name a worker's shell would read as something else."""
    from tpugen.models import classify_controlnet_id

    shipped, named, problems = [], {}, []
    for n, controlnet in enumerate(config.model.controlnets):
        source = classify_controlnet_id(controlnet.id)
        if isinstance(source, str) or source.kind != "local":
            continue
        name = Path(source.ref).name
        where = f"model.controlnets[{n}].id"
        if problem := shipped_name_problem(where, "ControlNet folders", name, _SHIPPABLE, named, "model.controlnets"):
            problems.append(problem)
        else:
            named[name] = n
            controlnet.id = f"./{folder}/controlnets/{name}"
            shipped.append((Path(source.ref), f"{folder}/controlnets/{name}"))
    if problems:
        raise InputError(*problems)
    weights = annotator_weights(config.model.annotators_dir, prompts)
    source = config.model.annotators_dir
    config.model.annotators_dir = f"{folder}/annotators" if weights else None  # no prompt reads one: none shipped
    return shipped + [(Path(source) / name, f"{folder}/annotators/{name}") for name in weights]


def controlnet_identity(controlnet: dict) -> dict:
    """What the config hash counts of a ControlNet (model.controlnets' entry, its id resolved): a local folder by
    its name and content (the sha256 of its config.json and of each weights file, read once per file version:
    tpugen.config.digests), so that moving the folder, or pod-run shipping it, keeps the hash, and another checkpoint
    of the same architecture does not; a built-in or hub id as it is."""
    folder = Path(controlnet["id"])
    if not folder.is_absolute() or not folder.is_dir():
        return controlnet
    weights = [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
    files = {path.name: file_sha256(path) for path in sorted([folder / "config.json", *weights])}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {**controlnet, "id": f"{folder.name} {digest[:16]}"}


def _files(module: str) -> tuple[str, ...]:
    return ANNOTATORS[module].files if module in ANNOTATORS else ()


def module_thresholds(named: str) -> tuple[float | None, float | None]:
    """The defaults of a preprocessor's threshold_a and threshold_b (None: it takes none)."""
    if named in CONTROL_MODULES:
        return CONTROL_MODULES[named][1:]
    annotator = ANNOTATORS[named]
    return tuple(None if spec is None else spec[1] for spec in (annotator.threshold_a, annotator.threshold_b))


def module_descriptions(annotators: str | None = None) -> dict[str, str]:
    """Every preprocessor tpugen runs here, and what it makes: the built-ins, and the annotators the folder
    `annotators` has the weights of."""
    runnable = {name: a.description for name, a in ANNOTATORS.items() if not _missing(a, annotators)}
    return {**{name: text for name, (text, _, _) in CONTROL_MODULES.items()}, **runnable}


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
        annotators = run.model.annotators_dir
        named = module_name(module, annotators) if isinstance(module, str) else None
        if named is None:
            at_module = f"{where}: control_module[{n}]" if count > 1 else f"{where}: control_module"
            problems.append(f"{at_module}: {module_problem(str(module)[:80], annotators)}")
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
        default_a, default_b = module_thresholds(named)
        thresholds = []
        for key, default in (("control_threshold_a", default_a), ("control_threshold_b", default_b)):
            value = lists.get(key, [default] * count)[n]
            if key in lists and default is None and value is not None:
                bad.append(f"{key}: module {named} takes no {key.removeprefix('control_')}")
            elif value is not None and not number_in(value, 0, 10_000):
                bad.append(f"{key} must be a number from 0 to 10000, got {value!r}")
            thresholds.append(None if value is None else float(value))
        if why := threshold_a_problem(named, thresholds[0]):
            bad.append(f"control_threshold_a: {why}")
        mode = control_mode_number(lists.get("control_mode", [0] * count)[n])
        if mode is None:
            bad.append(f"control_mode must be {MODES_WANTED}, got {lists['control_mode'][n]!r}")
        if bad:
            problems.extend(f"{where}: {problem}" for problem in bad)
            continue
        image = read_input_image(path, base_dir, at, problems)
        if image is None:
            continue
        units.append(ControlUnit(image, named, float(scale), float(start), float(end), *thresholds, mode=mode))
    return Controls(tuple(units)) if len(units) == count and len(problems) == before else None
