"""The web UI's ControlNet extension API: units in a txt2img or img2img request's `alwayson_scripts`, and its
/controlnet routes (the models and preprocessors this server has, and a preprocessor run alone)."""

from __future__ import annotations

import math
from typing import Any

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel

from tpugen.config.controls import (
    MODES_WANTED,
    Controls,
    ControlUnit,
    control_mode_number,
    control_name,
    control_types,
    module_descriptions,
    module_detail,
    module_label,
    module_name,
    module_thresholds,
    number_in,
    threshold_a_problem,
)
from tpugen.config.controls import module_problem as why_not_module
from tpugen.config.images import InputImage
from tpugen.config.schema import CONTROL_SCALE_MAX
from tpugen.errors import InputError
from tpugen.modes.serve.replies import base64_image, base64_png, json_response, parse
from tpugen.modes.serve.service import Service

router = APIRouter(prefix="/controlnet")

# The extension's resize modes, by name and number (tpugen.config.request.RESIZE_MODES numbers them the same).
RESIZE_NAMES = {"just resize": 0, "crop and resize": 1, "resize and fill": 2, "envelope (outer fit)": 2}
MAX_LAYER_WEIGHTS = 64  # a UNet ControlNet has 13 residuals (SDXL's 10); the count is checked against it
MAX_UNITS = 4  # more than the web UI's default of three unit tabs
MAX_DETECT_IMAGES = 4
SCRIPT = "controlnet"


def script_problems(scripts: Any) -> list[str]:
    """What a request's alwayson_scripts asks for that tpugen does not run: any script but ControlNet."""
    if not scripts:
        return []
    if not isinstance(scripts, dict):
        return ["alwayson_scripts: must be an object of scripts by name"]
    return [
        f"alwayson_scripts: {str(name)[:60]!r}: this script is not built (ControlNet is)"
        for name in scripts
        if str(name).lower() != SCRIPT
    ]


def _units(scripts: dict) -> list:
    found = next((value for name, value in scripts.items() if str(name).lower() == SCRIPT), None)
    if found is None:
        return []
    if not isinstance(found, dict) or not isinstance(found.get("args", []), list):
        raise InputError("alwayson_scripts.controlnet: must be an object with args, a list of units")
    return found.get("args", [])


def _number(
    unit: dict, key: str, default: float, low: float, high: float, where: str, problems: list[str], *, unset=False
) -> float:
    """A unit's number, or `default` where it is unset (null; with `unset`, any negative number too: the
    extension's -1, "the preprocessor's own")."""
    value = unit.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not number_in(value, -math.inf, math.inf):
        problems.append(f"{where}.{key}: must be a number, got {str(value)[:40]!r}")
        return default
    if unset and value < 0:
        return default
    if not low <= value <= high:
        problems.append(f"{where}.{key}: must be from {low:g} to {high:g}, got {value:g}")
    return float(value)


# The extension's unit fields that change what a unit does and that tpugen does not run: each refused by name where
# a request sets it (anything but null, false or empty), with why.
UNBUILT_UNIT_FIELDS = {
    "mask": "a unit's own mask (where the unit acts) is not built",
    "mask_image": "a unit's own mask (where the unit acts) is not built",
    "effective_region_mask": "a unit's effective region is not built",
    "ipadapter_input": "IP-Adapter is not built",
    "animatediff_batch": "AnimateDiff batches are not built",
    "batch_images": "a unit's batch of images is not built; give one image",
    "batch_image_files": "a unit's batch of images is not built; give one image",
    "batch_mask_dir": "a unit's batch of masks is not built",
}
# union_control_type's values that ask for nothing (a Union ControlNet's type is refused where it is loaded).
UNION_UNSET = {"unknown", "controlnetunioncontroltype.unknown"}
# hr_option's values, as the extension reads them (it takes the enum's name, its value, or "HiResFixOption.NAME"). A
# request without a hires fix ignores it, as the extension does; with one, units are refused (images_for).
HR_OPTIONS = {"both", "low res only", "high res only", "low_res_only", "high_res_only"}


def _layer_weights(value, where: str, problems: list[str]) -> tuple[float, ...] | None:
    """A unit's advanced_weighting (a weight per residual of its ControlNet, in place of its weight), or None."""
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_LAYER_WEIGHTS:
        problems.append(f"{where}.advanced_weighting: a list of 1 to {MAX_LAYER_WEIGHTS} numbers, one per residual")
        return None
    if not all(number_in(w, 0, CONTROL_SCALE_MAX) for w in value):
        problems.append(f"{where}.advanced_weighting: each weight must be a number from 0 to {CONTROL_SCALE_MAX:g}")
        return None
    return tuple(float(w) for w in value)


def unit_field_problems(unit: dict, where: str) -> list[str]:
    """What an enabled unit asks for beside what controls_for reads: the fields tpugen does not run, refused by name
    (UNBUILT_UNIT_FIELDS); save_detected_map and hr_option checked. Fields the extension itself ignores (an
    unknown key, its UI's own) are ignored here too, as its own tests expect."""
    problems = [
        f"{where}.{key}: {why}"
        for key, why in UNBUILT_UNIT_FIELDS.items()
        if unit.get(key) not in (None, False, "", [], {})
    ]
    image = unit.get("image")
    if isinstance(image, dict) and image.get("mask"):
        problems.append(f"{where}.image.mask: {UNBUILT_UNIT_FIELDS['mask']}")
    if unit.get("image") and unit.get("input_image"):
        problems.append(f"{where}: give image or input_image (its old name), not both")
    save = unit.get("save_detected_map", True)
    if not isinstance(save, bool):
        problems.append(f"{where}.save_detected_map: must be true or false, got {str(save)[:40]!r}")
    union = unit.get("union_control_type")
    if union is not None and str(union).lower() not in UNION_UNSET:
        problems.append(f"{where}.union_control_type: {str(union)[:60]!r}: ControlNet Union is not built")
    option = unit.get("hr_option", "Both")
    named = option.lower().removeprefix("hiresfixoption.") if isinstance(option, str) else None
    if named not in HR_OPTIONS:
        problems.append(f"{where}.hr_option: {str(option)[:60]!r}; one of Both, Low res only, High res only")
    return problems


def saves_maps(scripts: dict | None) -> dict[str, bool]:
    """Whether each enabled unit's detected map goes back with the images (the extension's save_detected_map, true
    unless a unit says false), by the ControlNet the unit names (a request has one unit per ControlNet). The units
    were checked by controls_for."""
    saves = {}
    for unit in _units(scripts or {}):
        if isinstance(unit, dict) and unit.get("enabled", True) is True:
            model = str(unit.get("model") or "None").split(" [")[0].strip()
            saves[model] = unit.get("save_detected_map", True) is not False
    return saves


def detected_maps(service: Service, scripts: dict | None, controls: Controls | None, width: int, height: int):
    """The extension's detected maps, which its replies carry after the images: each enabled unit's control image
    as the ControlNet took it (fitted to the request's size, then its preprocessor run), base64 PNG, one per unit
    and request, in the server's ControlNet order (a unit with save_detected_map false has none)."""
    if controls is None:
        return []
    from tpugen.engine.controls import control_image

    saves = saves_maps(scripts)
    names = [control_name(c.id) for c in service.run.config.model.controlnets]
    annotators = service.run.config.model.annotators_dir
    maps = []
    for name, unit in zip(names, controls.units, strict=True):
        if saves.get(name, True):
            maps.append(base64_png(control_image(unit, width, height, annotators)))
    return maps


def controls_for(service: Service, scripts: dict, decode, init: tuple[str, int] | None = None) -> Controls | None:
    """A request's ControlNet units (None: it sends none that are enabled), ordered as the server's ControlNets;
    an InputError with every problem, one line each. `decode(text, where)`: a base64 image's bytes. `init`: an
    img2img request's init image and resize_mode, which a unit without an image takes, as the extension's do."""
    units = _units(scripts or {})
    if not units:
        return None
    if len(units) > MAX_UNITS:
        raise InputError(f"alwayson_scripts.controlnet.args: {len(units)} units; at most {MAX_UNITS}")
    loaded = [c.id for c in service.run.config.model.controlnets]
    names = [control_name(c) for c in loaded]
    annotators = service.run.config.model.annotators_dir
    problems: list[str] = []
    by_model: dict[int, ControlUnit] = {}
    for n, unit in enumerate(units):
        where = f"alwayson_scripts.controlnet.args[{n}]"
        if not isinstance(unit, dict):
            problems.append(f"{where}: must be an object (a ControlNet unit)")
            continue
        enabled = unit.get("enabled", True)
        if not isinstance(enabled, bool):
            problems.append(f"{where}.enabled: must be true or false, got {str(enabled)[:40]!r}")
            continue
        if not enabled:
            continue
        model = str(unit.get("model") or "None").split(" [")[0].strip()  # "name [hash]", as the web UI lists it
        if model not in names:
            have = ", ".join(names) or "none (model.controlnets)"
            problems.append(f"{where}.model: {model[:80]!r} is not loaded on this server; it has {have}")
            continue
        module = unit.get("module") or "none"
        named = module_name(module, annotators) if isinstance(module, str) else None
        if named is None:
            problems.append(f"{where}.module: {why_not_module(str(module)[:80], annotators)}")
            continue
        mode = control_mode_number(unit.get("control_mode", 0))
        if mode is None:
            problems.append(f"{where}.control_mode: {str(unit.get('control_mode'))[:60]!r}; {MODES_WANTED}")
        layer_weights = _layer_weights(unit.get("advanced_weighting"), where, problems)
        problems.extend(unit_field_problems(unit, where))
        resize = unit.get("resize_mode", 1)
        resize = RESIZE_NAMES.get(resize.lower()) if isinstance(resize, str) else resize
        if resize not in (0, 1, 2) or isinstance(resize, bool):
            problems.append(
                f"{where}.resize_mode: {str(unit.get('resize_mode'))[:40]!r}; Just Resize, Crop and Resize or Resize and Fill (0, 1, 2)"
            )
            resize = 1
        scale = _number(unit, "weight", 1.0, 0, CONTROL_SCALE_MAX, where, problems)
        start = _number(unit, "guidance_start", 0.0, 0, 1, where, problems)
        end = _number(unit, "guidance_end", 1.0, 0, 1, where, problems)
        if start >= end:
            problems.append(f"{where}: guidance_start ({start:g}) must be below guidance_end ({end:g})")
        default_a, default_b = module_thresholds(named)
        thresholds = [
            _number(unit, key, default, 0, 10_000, where, problems, unset=True) if default is not None else None
            for key, default in (("threshold_a", default_a), ("threshold_b", default_b))
        ]
        if why := threshold_a_problem(named, thresholds[0]):
            problems.append(f"{where}.threshold_a: {why}")
        image = unit.get("image") or unit.get("input_image")
        if isinstance(image, dict):  # the extension also takes {"image": ..., "mask": ...} (a mask is refused above)
            image = image.get("image")
        image_where = f"{where}.image"
        if not image and init is not None:
            (image, resize), image_where = init, "init_images[0]"
        if not isinstance(image, str) or not image:
            problems.append(f"{where}.image: give the control image (base64 PNG or JPEG)")
            continue
        index = names.index(model)
        if index in by_model:
            problems.append(f"{where}.model: {model!r} has a unit already; one unit per ControlNet")
            continue
        if problems:
            continue
        try:
            stored = InputImage(*service.input_image(decode(image, image_where), image_where))
        except InputError as exc:
            problems.extend(exc.lines)
            continue
        by_model[index] = ControlUnit(
            stored, named, scale, start, end, *thresholds, resize_mode=resize, mode=mode, layer_weights=layer_weights
        )
    if not problems and by_model and len(by_model) < len(loaded):
        missing = ", ".join(names[i] for i in range(len(loaded)) if i not in by_model)
        problems.append(
            f"alwayson_scripts.controlnet.args: this server runs its ControlNets together; send a unit for {missing} too"
        )
    if problems:
        raise InputError(*problems)
    return Controls(tuple(by_model[i] for i in range(len(loaded)))) if by_model else None


# ---------------------------------------------------------------- /controlnet routes


@router.get("/version")
def version() -> dict:
    """The extension's API version clients check before they send units."""
    return {"version": 2}


@router.get("/settings")
def settings() -> dict:
    """The extension's settings clients read: how many units a request may carry (a client sends that many tabs'
    units, the ones not enabled among them)."""
    return {"control_net_unit_count": MAX_UNITS}


@router.get("/model_list")
def model_list(request: Request) -> dict:
    """The ControlNets this server has loaded (model.controlnets), by the names units give."""
    service: Service = request.app.state.service
    return {"model_list": [control_name(c.id) for c in service.run.config.model.controlnets]}


@router.get("/module_list")
def module_list(request: Request, alias_names: bool = False) -> dict:
    """The preprocessors this server runs (the built-ins, and the annotators model.annotators_dir has the weights
    of), by tpugen's names or (alias_names) the extension's labels; module_detail under the same names: the
    extension's model_free and sliders (tpugen.config.controls.module_detail), and what the module makes."""
    service: Service = request.app.state.service
    modules = module_descriptions(service.run.config.model.annotators_dir)
    names = {name: module_label(name) if alias_names else name for name in modules}
    return {
        "module_list": list(names.values()),
        "module_detail": {names[name]: {**module_detail(name), "description": text} for name, text in modules.items()},
    }


@router.get("/control_types")
def control_types_route(request: Request) -> dict:
    """The extension's control types: for each, the preprocessors of that type this server runs, the ControlNets
    it has loaded whose names say that type, and the defaults the web UI selects (tpugen.config.controls)."""
    service: Service = request.app.state.service
    config = service.run.config
    modules = list(module_descriptions(config.model.annotators_dir))
    return control_types(modules, [control_name(c.id) for c in config.model.controlnets])


class Detect(BaseModel):
    controlnet_module: str = "none"
    controlnet_input_images: list[str] = []
    controlnet_processor_res: int = 512
    controlnet_threshold_a: float | None = None
    controlnet_threshold_b: float | None = None


@router.post("/detect")
async def detect(request: Request):
    """A preprocessor run on each image sent, at the image's own size: {"images": [base64 PNG], "info": ...}."""
    service: Service = request.app.state.service
    body = await parse(request, Detect)
    return await anyio.to_thread.run_sync(detect_reply, service, body)


def detect_reply(service: Service, body: Detect):
    from tpugen.config.images import open_checked
    from tpugen.engine.controls import preprocess

    problems = []
    annotators = service.run.config.model.annotators_dir
    named = module_name(body.controlnet_module, annotators)
    if named is None:
        problems.append(f"controlnet_module: {why_not_module(body.controlnet_module[:80], annotators)}")
    count = len(body.controlnet_input_images)
    if not 1 <= count <= MAX_DETECT_IMAGES:
        problems.append(f"controlnet_input_images: {count} images; give 1 to {MAX_DETECT_IMAGES}")
    if problems:
        raise InputError(*problems)
    default_a, default_b = module_thresholds(named)
    # Unset, null or negative (the extension's -1): the preprocessor's own default.
    a, b = body.controlnet_threshold_a, body.controlnet_threshold_b
    a = a if default_a is not None and a is not None and a >= 0 else default_a
    b = b if default_b is not None and b is not None and b >= 0 else default_b
    for key, value in (("controlnet_threshold_a", a), ("controlnet_threshold_b", b)):
        if value is not None and not number_in(value, 0, 10_000):
            problems.append(f"{key}: must be from 0 to 10000, got {value:g}")
    if why := threshold_a_problem(named, a):
        problems.append(f"controlnet_threshold_a: {why}")
    if problems:
        raise InputError(*problems)
    # One image at a time, decoded, run and encoded, so a request holds one decoded image (up to 8192 x 8192).
    out = []
    for n, text in enumerate(body.controlnet_input_images):
        where = f"controlnet_input_images[{n}]"
        image, why = open_checked(base64_image(text, where), lambda opened: opened.convert("RGB"))
        if why:
            raise InputError(f"{where}: {why}")
        made = preprocess(image, named, a, b, annotators)
        del image
        out.append(base64_png(made))
    return json_response({"images": out, "info": "Success"})
