"""The AUTOMATIC1111 web UI's API (`/sdapi/v1/...`), so the clients and UIs people already have work unchanged."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from tpugen.config.hires import MAX_HIRES_SCALE, UPSCALERS, HiresFix, hires_problems
from tpugen.config.images import ImageSource
from tpugen.config.loras import safetensors_header
from tpugen.config.request import DEFAULT_STRENGTH, MAX_STEPS, seed_for, strength_ok
from tpugen.errors import InputError
from tpugen.modes.serve import sd_upscale
from tpugen.modes.serve.controlnet_api import controls_for, detected_maps, script_problems
from tpugen.modes.serve.progress import Job
from tpugen.modes.serve.replies import base64_image, image_b64, image_record, json_response, parse
from tpugen.modes.serve.service import Service
from tpugen.outputs.png import a1111_parameters
from tpugen.plan import ImageWork
from tpugen.schedulers import SCHEDULER_NAMES, find_scheduler

router = APIRouter(prefix="/sdapi/v1")


class Txt2Img(BaseModel):
    """The web UI's txt2img request. Unset size, steps, CFG scale, sampler and negative prompt take the server's
    config. sampler_index is accepted and ignored: the web UI's own request model fills it with "Euler" when a
    client sets nothing, which would override the server's sampler; sampler_name picks one."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = ""
    negative_prompt: str | None = None
    styles: list[str] = []
    seed: int = -1
    subseed: int = -1
    subseed_strength: float = 0.0
    seed_resize_from_h: int = -1
    seed_resize_from_w: int = -1
    sampler_name: str | None = None
    sampler_index: str | None = None
    scheduler: str | None = None
    batch_size: int = 1
    n_iter: int = 1
    steps: int | None = None
    cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    restore_faces: bool | None = None
    tiling: bool | None = None
    do_not_save_samples: bool = False
    do_not_save_grid: bool = False
    eta: float | None = None
    denoising_strength: float | None = None
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    override_settings: dict[str, Any] | None = None
    override_settings_restore_afterwards: bool = True
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None
    disable_extra_networks: bool = False
    firstpass_image: str | None = None
    comments: dict[str, Any] | None = None
    enable_hr: bool = False
    firstphase_width: int = 0
    firstphase_height: int = 0
    hr_scale: float = 2.0
    hr_upscaler: str | None = None
    hr_second_pass_steps: int = 0
    hr_resize_x: int = 0
    hr_resize_y: int = 0
    hr_checkpoint_name: str | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str = ""
    hr_negative_prompt: str = ""
    force_task_id: str | None = None
    script_name: str | None = None
    script_args: list[Any] = []
    send_images: bool = True
    save_images: bool = False
    alwayson_scripts: dict[str, Any] = {}
    infotext: str | None = None


# Fields that ask for what tpugen does not have: a request that sets one (to anything but "nothing", such as
# enable_hr: false or an empty alwayson_scripts) is refused, naming the field.
MISSING_FEATURES = {
    "restore_faces": "face restoration is not built",
    "script_name": "scripts are not built",
    "subseed_strength": "variation seeds are not built",
    "refiner_checkpoint": "a refiner is not built",
    "firstpass_image": "a hires fix from a given first-pass image is not built; send the image to img2img",
}


def missing_features(raw: dict) -> list[str]:
    problems = [f"{field}: {why}" for field, why in MISSING_FEATURES.items() if raw.get(field)]
    return problems + script_problems(raw.get("alwayson_scripts"))


# The web UI's hr_upscaler names tpugen has (tpugen.config.hires.UPSCALERS), in lower case; unset: Latent.
HR_UPSCALERS = {name.lower(): key for key, name in UPSCALERS.items()}
# hires fix fields a request may leave at the web UI's "the same as the first pass" only: unset, empty, the web
# UI's own words for it, or the first pass's value.
HR_UNBUILT = {
    "hr_resize_x": "a second pass sized by hr_resize_x/y is not built; give hr_scale",
    "hr_resize_y": "a second pass sized by hr_resize_x/y is not built; give hr_scale",
    "firstphase_width": "a first pass sized by firstphase_width/height is not built; give width, height and hr_scale",
    "firstphase_height": "a first pass sized by firstphase_width/height is not built; give width, height and hr_scale",
    "hr_checkpoint_name": "another model for the second pass is not built",
    "hr_sampler_name": "another sampler for the second pass is not built",
    "hr_scheduler": "another schedule for the second pass is not built",
    "hr_prompt": "another prompt for the second pass is not built",
    "hr_negative_prompt": "another negative prompt for the second pass is not built",
}
HR_SAME = {"Use same checkpoint", "Use same sampler", "Use same scheduler", "Automatic"}


def _same_as_first_pass(body: Txt2Img, field: str) -> bool:
    value = getattr(body, field)
    first = {
        "hr_sampler_name": body.sampler_name,
        "hr_scheduler": body.scheduler,
        "hr_prompt": body.prompt,
        "hr_negative_prompt": body.negative_prompt,
    }
    return value in (None, "", 0) or value in HR_SAME or value == first.get(field)


def hires_for(service: Service, body: Txt2Img, steps: int) -> HiresFix | None:
    """The request's hires fix (enable_hr), None without one, or an InputError naming each field it cannot do.
    The web UI's img2img has no hires fix: an img2img request's enable_hr is ignored, as the web UI ignores it."""
    if not body.enable_hr or type(body) is not Txt2Img:
        return None
    problems = [f"{field}: {why}" for field, why in HR_UNBUILT.items() if not _same_as_first_pass(body, field)]
    upscaler = HR_UPSCALERS.get((body.hr_upscaler or "Latent").strip().lower())
    if upscaler is None:
        problems.append(f"hr_upscaler: {body.hr_upscaler!r} is not built; {', '.join(UPSCALERS.values())}")
    if not 1 < body.hr_scale <= MAX_HIRES_SCALE:
        problems.append(f"hr_scale: must be above 1 and at most {MAX_HIRES_SCALE:g}, got {body.hr_scale:g}")
    # Unset: the web UI's API default for txt2img (its slider's is 0.7, which its clients send).
    strength = body.denoising_strength if body.denoising_strength is not None else DEFAULT_STRENGTH
    if not (strength == 0 or strength_ok(strength)):  # 0: the upscale alone, as the web UI does
        problems.append(f"denoising_strength: must be from 0 to 1, got {strength:g}")
    if not 0 <= body.hr_second_pass_steps <= MAX_STEPS:
        problems.append(f"hr_second_pass_steps: must be from 0 (as many as the first pass) to {MAX_STEPS}")
    keys = {"hires": "enable_hr", "upscaler": "hr_upscaler"}
    problems += hires_problems(
        upscaler or "lanczos", service.family, service.run.config.compile.step_cache.method, keys
    )
    if problems:
        raise InputError(*problems)
    return HiresFix(float(body.hr_scale), body.hr_second_pass_steps or steps, float(strength), upscaler)


def sampler_for(service: Service, sampler_name: str | None, scheduler: str | None) -> str | None:
    """tpugen's scheduler for the web UI's sampler and scheduler (noise schedule) fields (None: the model's
    own). The schedule is Automatic (the sampler's own) or Karras where the sampler has a Karras form."""
    schedule = (scheduler or "").strip()
    automatic = schedule.lower() in ("", "automatic")
    if not sampler_name:
        if not automatic:
            raise InputError(f"scheduler: {schedule!r} needs the sampler_name it applies to")
        return None
    family = service.family
    if family.flow_matching:
        if sampler_name in ("Euler", "Flow Euler") and automatic:
            return None
        raise InputError(f"sampler_name: {family.title} models keep their own flow-matching scheduler (Euler)")
    choice = find_scheduler(sampler_name)
    if choice is None:
        raise InputError(f"sampler_name: unknown sampler {sampler_name!r}; valid names: {', '.join(SCHEDULER_NAMES)}")
    if not automatic:
        karras = [name for name in SCHEDULER_NAMES if name.endswith(" Karras")]
        if schedule.lower() != "karras":
            raise InputError(f"scheduler: {schedule!r} is not built; Automatic, or Karras with {', '.join(karras)}")
        if not choice.name.endswith(" Karras"):
            choice = find_scheduler(f"{choice.name} Karras")
            if choice is None:
                raise InputError(
                    f"scheduler: 'Karras' with sampler {sampler_name!r} is not built; Karras forms: {', '.join(karras)}"
                )
    return None if choice.name == service.engines[0].loaded.default_scheduler else choice.name


# The web UI's extra-network syntax for a LoRA in the prompt: <lora:NAME> or <lora:NAME:SCALE> (scale 1 if unset).
LORA_TAG = re.compile(r"<lora:([^:>]+)(?::([^:>]*))?[^>]*>")
MAX_LORA_TAGS = 8


def take_loras(service: Service, prompt: str) -> tuple[str, tuple]:
    """(the prompt without its <lora:...> tags, the LoRAs they name), as the web UI reads them. The tags are
    counted and compared before any LoRA file is read."""
    tags = [(m.group(1).strip(), (m.group(2) or "1").strip()) for m in LORA_TAG.finditer(prompt)]
    if len(tags) > MAX_LORA_TAGS:
        raise InputError(f"prompt: {len(tags)} <lora:...> tags; at most {MAX_LORA_TAGS}")
    if len({name for name, _ in tags}) < len(tags):
        raise InputError("prompt: the same LoRA is named twice")
    loras = []
    for name, scale in tags:
        try:
            value = float(scale)
        except ValueError:
            raise InputError(f"prompt: <lora:{name}:{scale}>: the scale is not a number") from None
        loras.append(service.lora_named(name, value))
    if len({lora.sha256 for lora in loras}) < len(loras):
        raise InputError("prompt: the same LoRA is named twice")
    text = re.sub(r"\s+", " ", LORA_TAG.sub("", prompt)).strip().strip(",").strip()
    return text, tuple(loras)


MAX_STYLES = 16


def styled(text: str, style: str) -> str:
    """`text` with a saved style's text, as the web UI applies it: `{prompt}` in the style stands for the text,
    else the style follows it after a comma."""
    if "{prompt}" in style:
        return style.replace("{prompt}", text)
    return ", ".join(part for part in (text.strip(), style.strip()) if part)


def with_styles(service: Service, body: Txt2Img) -> tuple[str, str | None]:
    """(prompt, negative prompt) with the request's `styles` applied in order (serve.prompt_styles); the negative
    prompt stays None (the server's) when the request and its styles give none."""
    if len(body.styles) > MAX_STYLES:
        raise InputError(f"styles: {len(body.styles)} named; at most {MAX_STYLES}")
    have = {style.name: style for style in service.serve.prompt_styles}
    unknown = [name for name in body.styles if name not in have]
    if unknown:
        named = ", ".join(repr(name) for name in have) or "none (serve.prompt_styles)"
        raise InputError(f"styles: no style {str(unknown[0])[:100]!r} on this server; it has {named}")
    prompt, negative = body.prompt, body.negative_prompt
    for name in body.styles:
        style = have[name]
        prompt = styled(prompt, style.prompt)
        if style.negative_prompt:
            negative = styled(negative or "", style.negative_prompt)
    return prompt, negative


def images_for(service: Service, body: Txt2Img, init: tuple[str, int] | None = None) -> list[ImageWork]:
    """The request's images, or an InputError with every problem it has (one line each). `init`: an img2img
    request's init image (base64) and resize_mode, which a ControlNet unit without an image of its own takes."""
    config = service.run.config
    height, width = service.sizes[0]
    problems: list[str] = []
    problems.extend(settings_problems(service, body.override_settings))
    clip_skip = collect(problems, clip_skip_for, service, body.override_settings)
    styled = collect(problems, with_styles, service, body)
    prompt, negative = styled or (body.prompt, body.negative_prompt)
    prompt, loras = collect(problems, take_loras, service, prompt) or (prompt, ())
    scheduler = collect(problems, sampler_for, service, body.sampler_name, body.scheduler)
    if body.batch_size < 1 or body.n_iter < 1:
        problems.append(f"batch_size and n_iter: must be at least 1, got {body.batch_size} and {body.n_iter}")
    count = max(body.batch_size, 1) * max(body.n_iter, 1)
    seed = seed_for(body.seed)  # -1: a random one; another negative seed is refused with the request
    steps = body.steps if body.steps is not None else config.steps
    hires = collect(problems, hires_for, service, body, steps)
    controls = collect(problems, controls_for, service, body.alwayson_scripts, base64_image, init)
    if controls is not None and hires is not None:
        problems.append("enable_hr: a hires fix with ControlNet units is not built (its second pass would run without)")

    def make(i: int) -> ImageWork:
        return ImageWork(
            prompt=prompt,
            negative_prompt=negative if negative is not None else config.negative_prompt,
            seed=seed + i,  # the web UI's rule: image i of a request gets seed + i
            steps=steps,
            guidance_scale=body.cfg_scale if body.cfg_scale is not None else config.guidance_scale,
            height=body.height if body.height is not None else height,  # 0 is refused, not the default
            width=body.width if body.width is not None else width,
            scheduler=scheduler,
            loras=loras,
            hires=hires,
            tiling=bool(body.tiling),  # unset: off, as the web UI's own default
            clip_skip=clip_skip or 1,
            controls=controls,
        )

    images = collect(problems, service.image_works, count, make)
    refuse(problems, service, images)
    return images


def refuse(problems: list[str], service: Service, images: list[ImageWork] | None) -> None:
    """An InputError with `problems`, if there are any, and what service.check finds in `images` beside them
    (every problem of a request at once)."""
    if problems:
        if images:
            collect(problems, service.check, images)
        raise InputError(*problems)


def collect(problems: list[str], check, *args, **kwargs):
    """check(*args)'s result, or None with its InputError's lines added to `problems`."""
    try:
        return check(*args, **kwargs)
    except InputError as exc:
        problems.extend(exc.lines)
        return None


@router.post("/txt2img")
async def txt2img(request: Request):
    """The web UI's text to image: its request fields (unset ones take the server's config), images as base64 PNGs with
    their infotext, `info` as the web UI writes it."""
    service: Service = request.app.state.service
    body = await parse(request, Txt2Img, missing_features)
    # The rest runs in a worker thread: LoRA files are hashed, PNGs encoded and a reply of megabytes put in
    # base64 and JSON there, so no other request (a /healthz among them) waits behind it on the event loop.
    return await anyio.to_thread.run_sync(txt2img_reply, service, body)


def txt2img_reply(service: Service, body: Txt2Img):
    """txt2img's images and its web UI reply, made in a worker thread."""
    return _reply(service, body, images_for(service, body))


def _reply(
    service: Service,
    body: Txt2Img,
    images: list[ImageWork],
    crop: dict | None = None,
    combine=None,
    note: str | None = None,
):
    """The web UI's reply for `images` once made; `crop`: inpaint_full_res's, each result pasted back there;
    `combine`: SD upscale's (sd_upscale_images), which turns the tiles made into the images the reply answers with;
    `note`: what the reply's `info` says of the request beside the web UI's keys (`note`)."""
    made = service.generate(images, interruptible=True, task=body.force_task_id)
    if combine is not None:
        images, made = combine(made)
    # After an interrupt, the images made are not always the first ones: each keeps its own seed and record.
    answered = [images[position] for position, _ in made]
    pixels = [image for _, image in made]
    if crop is not None:
        from tpugen.engine.images import paste_back

        pixels = [paste_back(p, crop["image"], crop["mask"], crop["region"]) for p in pixels]
    records = [image_record(service, image) for image in answered]
    infotexts = [a1111_parameters(record) for record in records]
    first = images[0]
    info = {
        "prompt": first.prompt,
        "all_prompts": [image.prompt for image in answered],
        "negative_prompt": first.negative_prompt,
        "all_negative_prompts": [image.negative_prompt for image in answered],
        "seed": first.seed,
        "all_seeds": [image.seed for image in answered],
        "subseed": body.subseed,
        "all_subseeds": [body.subseed] * len(pixels),
        "subseed_strength": body.subseed_strength,
        "width": first.width,
        "height": first.height,
        "sampler_name": records[0]["scheduler"] if records else None,
        "cfg_scale": first.guidance_scale,
        "steps": first.steps,
        "batch_size": body.batch_size,
        "restore_faces": False,
        "sd_model_name": service.engines[0].model_label,
        "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "index_of_first_image": 0,
        "infotexts": infotexts,
        "version": f"tpugen {records[0]['tpugen_version']}" if records else None,
    }
    if note:
        info["note"] = note
    encoded = [image_b64(p, r) for p, r in zip(pixels, records, strict=True)] if body.send_images else []
    if encoded:  # the ControlNet extension's detected maps follow the images, one per unit
        encoded += detected_maps(service, body.alwayson_scripts, first.controls, first.width, first.height)
    return json_response(
        {
            "images": encoded,
            "parameters": _echoed(body),
            "info": json.dumps(info, ensure_ascii=False),
        }
    )


class Img2Img(Txt2Img):
    """The web UI's img2img request: txt2img's fields and the image (and mask) it starts from. Unset size takes the
    server's first warm size; the image is fitted to it as resize_mode says."""

    init_images: list[str] = []
    resize_mode: int = 0
    denoising_strength: float | None = 0.75
    image_cfg_scale: float | None = None
    mask: str | None = None
    mask_blur: int = 4
    mask_blur_x: int | None = None
    mask_blur_y: int | None = None
    inpainting_fill: int = 0
    inpaint_full_res: bool = True
    inpaint_full_res_padding: int = 0
    inpainting_mask_invert: int = 0
    initial_noise_multiplier: float | None = None
    include_init_images: bool = False


MAX_INPAINT_PADDING = 256  # the web UI's "Only masked padding, pixels" slider stops there
# The web UI's inpainting_fill values tpugen has: what the masked area holds before it is noised.
INPAINTING_FILLS = {0: "fill", 1: "original"}


def img2img_problems(raw: dict) -> list[str]:
    """What an img2img request asks for that tpugen does not have, beside txt2img's missing features."""
    built = ("enable_hr", "firstpass_image") + (("script_name",) if sd_upscale.named(raw.get("script_name")) else ())
    problems = [p for p in missing_features(raw) if not p.startswith(built)]
    fill = raw.get("inpainting_fill", 0)
    if fill not in INPAINTING_FILLS:
        built = ", ".join(f"{k} ({v})" for k, v in INPAINTING_FILLS.items())
        problems.append(f"inpainting_fill: {fill!r} is not built; {built}")
    if raw.get("initial_noise_multiplier") not in (None, 1, 1.0):
        problems.append("initial_noise_multiplier: only 1 (the noise as drawn) is built")
    return problems


def _init_problems(body: Img2Img) -> tuple[list[str], float]:
    """(what is wrong with an img2img request's init_images and denoising_strength, the strength: unset 0.75)."""
    problems = []
    if not body.init_images:
        problems.append("init_images: give one image (base64 PNG or JPEG)")
    if len(body.init_images) > 1:
        problems.append(f"init_images: {len(body.init_images)} images; tpugen takes one per request")
    strength = body.denoising_strength if body.denoising_strength is not None else 0.75
    if not strength_ok(strength):
        problems.append(f"denoising_strength: must be above 0 and at most 1, got {strength}")
    return problems, strength


def img2img_images(service: Service, body: Img2Img) -> tuple[list[ImageWork], dict | None]:
    """The request's images (each starting from the init image, fitted, and its mask prepared as the web UI does),
    and for inpaint_full_res the crop each result is pasted back at (None otherwise)."""
    from tpugen.engine import images as pictures

    problems, strength = _init_problems(body)
    problems += _resize_mode_problems(body)
    if not 0 <= body.mask_blur <= 64:
        problems.append(f"mask_blur: must be from 0 to 64, got {body.mask_blur}")
    if not 0 <= body.inpaint_full_res_padding <= MAX_INPAINT_PADDING:
        problems.append(
            f"inpaint_full_res_padding: must be from 0 to {MAX_INPAINT_PADDING} pixels, got {body.inpaint_full_res_padding}"
        )
    init = (body.init_images[0], body.resize_mode) if body.init_images else None
    txt = images_for(service, body, init) if not problems else None
    if problems or not txt:
        refuse(problems or ["init_images: missing"], service, None)
    first = txt[0]
    if first.controls and body.mask and body.inpaint_full_res:
        raise InputError(
            "inpaint_full_res: inpainting the masked area alone with ControlNet units is not built (the control "
            "would not be cropped with it); send inpaint_full_res: false"
        )
    init = collect(problems, pictures.open_bytes, base64_image(body.init_images[0], "init_images[0]"), "init_images[0]")
    mask = None
    if body.mask:
        mask = collect(problems, pictures.open_bytes, base64_image(body.mask, "mask"), "mask", mask=True)
    if problems:
        raise InputError(*problems)
    init = pictures.fit(init, first.width, first.height, body.resize_mode)
    crop = None
    if mask is not None:
        if mask.size != (first.width, first.height):
            mask = pictures.fit(mask, first.width, first.height, body.resize_mode)
        mask = pictures.web_ui_mask(mask, body.mask_blur, invert=bool(body.inpainting_mask_invert))
        if body.inpainting_fill == 0:
            init = pictures.fill_masked(init, mask)
        if body.inpaint_full_res:
            region = pictures.crop_region(mask, first.width, first.height, body.inpaint_full_res_padding)
            crop = {"region": region, "image": init, "mask": mask}
            init, mask = init.crop(region), mask.crop(region)
    source = ImageSource(
        *service.input_image(pictures.png_bytes(init), "init_images[0]"),
        strength=strength,
        resize_mode=0,
        **(
            dict(
                zip(
                    ("mask_image", "mask_image_sha256"),
                    service.input_image(pictures.png_bytes(mask), "mask"),
                    strict=True,
                )
            )
            if mask is not None
            else {}
        ),
    )
    return [replace(image, source=source) for image in txt], crop


@router.post("/img2img")
async def img2img(request: Request):
    """The web UI's image to image, and inpainting when a mask comes with it: txt2img's reply, from an image."""
    service: Service = request.app.state.service
    body = await parse(request, Img2Img, img2img_problems)
    return await anyio.to_thread.run_sync(img2img_reply, service, body)


def _echoed(body: Txt2Img) -> dict:
    """The request as the reply's `parameters` echo it: as the web UI's API does, an img2img request's images
    (init_images, mask) only with include_init_images, so a reply does not carry its request's megabytes back."""
    parameters = body.model_dump()
    if isinstance(body, Img2Img) and not body.include_init_images:
        parameters["init_images"], parameters["mask"] = None, None
    return parameters


def img2img_reply(service: Service, body: Img2Img):
    if body.script_name:  # SD upscale: img2img_problems refused every other script
        images, combine = sd_upscale_images(service, body)
        return _reply(service, body, images, combine=combine)
    if service.family.max_references:  # FLUX.2: init_images are the references it edits from
        images = edit_images(service, body)
        note = f"denoising_strength is ignored: {service.family.title} models edit by reference"
        return _reply(service, body, images, note=note)
    images, crop = img2img_images(service, body)
    return _reply(service, body, images, crop)


def edit_images(service: Service, body: Img2Img) -> list[ImageWork]:
    """The request's images on a model that edits by reference (FLUX.2): txt2img's, with init_images as the
    references, in order, each stored as sent and fitted to the size by the engine (resize_mode as the request
    sets it; unset, crop and resize, as FLUX.2's pipelines fit one). denoising_strength is not read (an edit
    starts from noise); a mask is refused."""
    problems = _resize_mode_problems(body)
    txt = images_for(service, body) if not problems else None
    if problems or not txt:
        refuse(problems or ["init_images: missing"], service, None)
    sent = [collect(problems, base64_image, text, f"init_images[{n}]") for n, text in enumerate(body.init_images)]
    resize_mode = body.resize_mode if "resize_mode" in body.model_fields_set else 1
    references = None
    if not problems:
        references = service.references(sent, "init_images", problems, mask=bool(body.mask), resize_mode=resize_mode)
    if problems:
        raise InputError(*problems)
    return [replace(image, references=references) for image in txt]


def _resize_mode_problems(body: Img2Img) -> list[str]:
    from tpugen.config.request import RESIZE_MODES

    if body.resize_mode in RESIZE_MODES:
        return []
    return [f"resize_mode: must be one of {', '.join(f'{k} ({v})' for k, v in RESIZE_MODES.items())}"]


def sd_upscale_images(service: Service, body: Img2Img):
    """The web UI's SD upscale script (tpugen.modes.serve.sd_upscale): the init image upscaled as script_args
    say, then cut into tiles of the request's size (a size the server keeps warm), each an img2img image of the
    request's prompt, steps, sampler and strength. n_iter upscales; image n's tile k gets seed + n + k, as the
    web UI seeds them a tile at a time. Returns (the tiles' images, how the tiles made become the upscaled
    images the reply answers with: each blended across its seams; a tile an interrupt left unmade keeps the
    upscaled image's own pixels)."""
    import hashlib

    import numpy as np
    from PIL import Image

    from tpugen.engine import images as pictures
    from tpugen.modes.serve.admission import COMPILED_MAX_SIDE

    problems, strength = _init_problems(body)
    if body.mask:
        problems.append("mask: SD upscale redraws the whole image; send no mask with script_name sd upscale")
    if body.enable_hr:
        problems.append("enable_hr: a hires fix is not built with script_name sd upscale")
    if body.alwayson_scripts:
        problems.append("alwayson_scripts: ControlNet units are not built with script_name sd upscale")
    # One image per n_iter: the web UI's batch_size is the tiles it draws at a time, and this server batches them.
    one_each = body.model_copy(update={"batch_size": min(body.batch_size, 1)})
    upscales = images_for(service, one_each) if not problems else None
    if problems or not upscales:
        refuse(problems or ["init_images: missing"], service, None)
    first = upscales[0]
    script = collect(problems, sd_upscale.read_args, body.script_args, first.width, first.height)
    data = collect(problems, base64_image, body.init_images[0], "init_images[0]")
    init = collect(problems, pictures.open_bytes, data, "init_images[0]") if data is not None else None
    if problems:
        raise InputError(*problems)
    width, height = script.size(init.width, init.height)
    most = service.admission.max_side or COMPILED_MAX_SIDE
    if max(width, height) > most:
        raise InputError(
            f"script_args: {init.width}x{init.height} upscaled x{script.scale:g} is {width}x{height}; this server "
            f"makes images of at most {most} pixels a side (serve.max_side)"
        )
    grid = sd_upscale.TileGrid.of(width, height, first.width, first.height, script.overlap)
    per_image, limit = len(grid.xs) * len(grid.ys), service.serve.max_images_per_request
    if per_image * len(upscales) > limit:
        raise InputError(
            f"script_args: {width}x{height} in {first.width}x{first.height} tiles overlapping by {script.overlap} "
            f"pixels is {per_image} tiles an image, {per_image * len(upscales)} for n_iter {len(upscales)}; this "
            f"server makes at most {limit} images per request (serve.max_images_per_request)"
        )
    tiles = grid.cut(np.asarray(script.upscaled(init)))
    sources = [
        ImageSource(
            *service.input_image(pictures.png_bytes(Image.fromarray(np.ascontiguousarray(tile))), "init_images[0]"),
            strength=strength,
        )
        for tile in tiles
    ]
    images = [replace(image, seed=image.seed + k, source=sources[k]) for image in upscales for k in range(per_image)]
    # What each answered image's record says it was made from: the init image as sent (by its sha256), whole.
    whole = ImageSource("", hashlib.sha256(data).hexdigest(), strength=strength)
    answered = [replace(image, width=width, height=height, source=whole) for image in upscales]

    def combine(made: list[tuple[int, object]]) -> tuple[list[ImageWork], list[tuple[int, object]]]:
        drawn: dict[int, dict[int, object]] = {}
        for position, pixels in made:
            drawn.setdefault(position // per_image, {})[position % per_image] = pixels
        upscaled = []
        for n, found in sorted(drawn.items()):
            blended = grid.blend([found.get(k, tile) for k, tile in enumerate(tiles)])
            upscaled.append((n, np.rint(blended).clip(0, 255).astype(np.uint8)))
        return answered, upscaled

    return images, combine


@router.get("/samplers")
def samplers(request: Request) -> list[dict]:
    """The samplers this server keeps warm, by the web UI's names."""
    service: Service = request.app.state.service
    if service.family.flow_matching:
        return [{"name": "Euler", "aliases": ["Flow Euler", "FlowMatchEulerDiscreteScheduler"], "options": {}}]
    return [{"name": name, "aliases": [find_scheduler(name).class_name], "options": {}} for name in SCHEDULER_NAMES]


@router.get("/sd-models")
def sd_models(request: Request) -> list[dict]:
    """The one model this server serves, as the web UI lists checkpoints."""
    service: Service = request.app.state.service
    label = service.engines[0].model_label
    return [
        {
            "title": label,
            "model_name": label,
            "hash": None,
            "sha256": None,
            "filename": service.run.config.model.id,
            "config": None,
        }
    ]


@router.get("/schedulers")
def schedulers(request: Request) -> list[dict]:
    """The noise schedules txt2img's `scheduler` takes: Automatic (the sampler's own), and Karras for the
    samplers with a Karras form."""
    service: Service = request.app.state.service
    found = [{"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1, "need_inner_model": False}]
    if not service.family.flow_matching:
        found.append(
            {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0, "need_inner_model": False}
        )
    return found


def fixed_options(service: Service) -> dict:
    """The web UI's options that say what this server serves, which no request or write changes."""
    return {
        "sd_model_checkpoint": service.engines[0].model_label,
        "samples_format": "png",
        "CLIP_stop_at_last_layers": service.run.config.clip_skip,
        "sd_vae": "Automatic",
    }


# The web UI's own options that change nothing in an image (what its page copies from one tab to another):
# written and read back, and fine in a request's override_settings. Their defaults.
WRITABLE_OPTIONS = {"send_seed": True, "send_size": True}


def option_problems(service: Service, values: dict, prefix: str = "") -> tuple[list[str], list[str]]:
    """(what is wrong with `values` as the web UI's options: a fixed one at another value, a writable one not
    true or false; the keys this server does not keep). `prefix` goes before each key named."""
    fixed, problems, unknown = fixed_options(service), [], []
    for key, value in sorted(values.items()):
        shown = str(value)[:100]
        if key == "sd_model_checkpoint":
            if value not in (fixed[key], service.run.config.model.id):
                problems.append(
                    f"{prefix}{key}: this server serves {fixed[key]!r} and does not switch models; got {shown!r}"
                )
        elif key in fixed:
            if value != fixed[key]:
                problems.append(f"{prefix}{key}: this server keeps {fixed[key]!r}; got {shown!r}")
        elif key in WRITABLE_OPTIONS:
            if not isinstance(value, bool):
                problems.append(f"{prefix}{key}: must be true or false")
        else:
            unknown.append(str(key)[:100])
    return problems, unknown


CLIP_SKIP = "CLIP_stop_at_last_layers"


def clip_skip_for(service: Service, settings: dict | None) -> int:
    """The clip skip a request's override_settings asks for (CLIP_stop_at_last_layers), else the server's."""
    value = (settings or {}).get(CLIP_SKIP, service.run.config.clip_skip)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 12:
        raise InputError(
            f"override_settings.{CLIP_SKIP}: must be a whole number from 1 to 12, got {str(value)[:100]!r}"
        )
    return value


def settings_problems(service: Service, settings: dict | None) -> list[str]:
    """What a request's override_settings asks that this server cannot do for it (option_problems), and the
    settings it does not keep, named in one line. The fixed options at their values, the writable ones and a
    clip skip (clip_skip_for; the family's rule is the admission's) are fine."""
    if not settings:
        return []
    problems, other = option_problems(
        service, {k: v for k, v in settings.items() if k != CLIP_SKIP}, "override_settings."
    )
    if other:
        shown = ", ".join(other[:8]) + (f" and {len(other) - 8} more" if len(other) > 8 else "")
        problems.append(f"override_settings: {shown}: not settings this server changes for a request")
    return problems


class WebUiOptions:
    """The web UI's options as this server keeps them. Fixed ones say what it serves (the checkpoint, PNG files,
    no clip skip, the model's own VAE): a write must leave them as they are (422 naming each). The web UI's own
    that change nothing in an image (send_seed, send_size: what its page copies from one tab to another) are
    written and read back. A key it does not know is ignored, as the web UI ignores one."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._written = dict(WRITABLE_OPTIONS)
        self._lock = threading.Lock()

    def current(self) -> dict:
        with self._lock:
            return {**fixed_options(self.service), **self._written}

    def write(self, values: dict) -> None:
        """The writable options among `values` set, all or none: an InputError naming each that cannot be
        (option_problems); keys this server does not keep are ignored."""
        problems, _ = option_problems(self.service, values)
        if problems:
            raise InputError(*problems)
        with self._lock:
            self._written.update({key: value for key, value in values.items() if key in WRITABLE_OPTIONS})


def web_ui_options(request: Request) -> WebUiOptions:
    """The server's options (made once per app: each server keeps its own)."""
    state = request.app.state
    with _options_made:
        if getattr(state, "web_ui_options", None) is None:
            state.web_ui_options = WebUiOptions(state.service)
        return state.web_ui_options


_options_made = threading.Lock()


@router.get("/options")
def options(request: Request) -> dict:
    """The options a web UI client reads before it generates (the served checkpoint among them)."""
    return web_ui_options(request).current()


class OptionsUpdate(BaseModel):
    model_config = ConfigDict(extra="allow")


@router.post("/options")
async def set_options(request: Request):
    """Web UI clients set options before they generate: the fixed ones at their values (the served model by
    its title or model.id), send_seed and send_size to either value; keys this server does not know are
    ignored, as the web UI ignores them. Anything else is a 422 naming it."""
    body = await parse(request, OptionsUpdate)
    web_ui_options(request).write(body.model_extra or {})
    return None


# Lists the web UI's clients read when they connect, each in the web UI's shape, holding what this server has.
@router.get("/cmd-flags")
def cmd_flags(request: Request) -> dict:
    """The web UI's command-line flags, those that say something true of this server (not its folders: no
    reply shows a path of the server's)."""
    service: Service = request.app.state.service
    return {
        "api": True,
        "nowebui": True,
        "no_half": service.run.config.model.dtype == "float32",
        "xformers": False,
        "medvram": False,
        "lowvram": False,
    }


@router.get("/upscalers")
def upscalers() -> list[dict]:
    """The image upscalers, in the web UI's order, so SD upscale's script_args may name one or give its index:
    None, Lanczos, Nearest. A hires fix's hr_upscaler takes Lanczos (besides the latent one)."""
    return [
        {"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
        for name in sd_upscale.UPSCALERS
    ]


@router.get("/latent-upscale-modes")
def latent_upscale_modes() -> list[dict]:
    """The latent upscalers of a hires fix: Latent."""
    return [{"name": "Latent"}]


@router.get("/hypernetworks")
def hypernetworks() -> list[dict]:
    """None: hypernetworks are not built."""
    return []


@router.get("/face-restorers")
def face_restorers() -> list[dict]:
    """None: face restoration is not built (restore_faces is a 422)."""
    return []


@router.get("/realesrgan-models")
def realesrgan_models() -> list[dict]:
    """None: Real-ESRGAN upscalers are not built."""
    return []


@router.get("/prompt-styles")
def prompt_styles(request: Request) -> list[dict]:
    """serve.prompt_styles, which a request's `styles` names."""
    styles = request.app.state.service.serve.prompt_styles
    return [{"name": s.name, "prompt": s.prompt, "negative_prompt": s.negative_prompt} for s in styles]


@router.get("/embeddings")
def embeddings(request: Request) -> dict:
    """The textual-inversion embeddings loaded (model.embeddings and serve.embeddings_dir's), by the names prompts
    write, and the files of serve.embeddings_dir that did not load, in the web UI's shape: `shape` the values of a
    vector, `vectors` the tokens it takes (none of either until the model has loaded)."""
    service: Service = request.app.state.service
    loaded, skipped = service.embeddings()

    def entry(shape, vectors) -> dict:
        return {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": shape, "vectors": vectors}

    return {
        "loaded": {e.name: entry(e.shape, e.vectors) for e in loaded},
        "skipped": {e.name: entry(e.shape, e.vectors) for e in skipped},
    }


@router.get("/progress")
def progress(request: Request) -> dict:
    """The web UI's progress of its current job: here the request being worked on (else the one queued last);
    idle, progress 0 and no current_task."""
    service: Service = request.app.state.service
    job = service.progress.current("request")
    if job is None:
        return {
            "progress": 0.0,
            "eta_relative": 0.0,
            "state": job_state(None, service.batch_size),
            "current_image": None,
            "textinfo": None,
            "current_task": None,
        }
    return {
        "progress": job.fraction,
        "eta_relative": job.eta() or 0.0,
        "state": job_state(job, service.batch_size),
        "current_image": None,
        "textinfo": task_text(job),
        "current_task": job.name,
    }


def job_state(job: Job | None, batch_size: int) -> dict:
    """The web UI's state snapshot: its job_count and job_no are the request's batches, planned and done."""
    batches = -(-job.images_planned // batch_size) if job is not None else 0
    return {
        "skipped": False,
        "interrupted": job is not None and job.state == "interrupted",
        "job": "",
        "job_count": batches,
        "job_timestamp": job.timestamp if job is not None else "0",
        "job_no": min(-(-job.images_done // batch_size), batches) if job is not None else 0,
        "sampling_step": job.step if job is not None else 0,
        "sampling_steps": job.steps if job is not None else 0,
    }


def task_text(job: Job) -> str:
    if job.state == "queued":
        return "In queue..."
    return f"{job.images_done} of {job.images_planned} images" + (f", {job.state}" if job.done else "")


internal_router = APIRouter(prefix="/internal")


class ProgressRequest(BaseModel):
    """The web UI's POST /internal/progress body: the task (txt2img's force_task_id) asked about. Live
    previews are not made here, so id_live_preview and live_preview change nothing."""

    model_config = ConfigDict(extra="ignore")

    id_task: str | None = None
    id_live_preview: int = -1
    live_preview: bool = True


@internal_router.post("/progress")
async def task_progress(request: Request) -> dict:
    """A task's progress in the web UI's shape (its modules/progress.py): active, queued, completed, progress
    (0 to 1), eta (seconds, or null until it has made an image), no live preview. A task this server does not
    know (not sent yet, or long finished) is neither active, queued nor completed: "Waiting...", as there."""
    service: Service = request.app.state.service
    body = await parse(request, ProgressRequest)
    job = service.progress.find("request", body.id_task) if body.id_task else None
    if job is None:
        return {
            "active": False,
            "queued": False,
            "completed": False,
            "progress": None,
            "eta": None,
            "live_preview": None,
            "id_live_preview": -1,
            "textinfo": "Waiting...",
        }
    return {
        "active": job.state == "running",
        "queued": job.state == "queued",
        "completed": job.done,
        "progress": job.fraction,
        "eta": job.eta(),
        "live_preview": None,
        "id_live_preview": -1,
        "textinfo": task_text(job),
    }


@router.get("/loras")
def loras(request: Request) -> list[dict]:
    """The LoRAs in serve.lora_dir, by the names <lora:NAME:SCALE> takes. The web UI's `path` is the file's name in
    serve.lora_dir: a reply never shows where that folder is on the server."""
    service: Service = request.app.state.service
    found = []
    for path in service.lora_files():
        header = safetensors_header(path) or {}
        found.append(
            {"name": path.stem, "alias": path.stem, "path": path.name, "metadata": header.get("__metadata__", {})}
        )
    return found


@router.get("/scripts")
def scripts() -> dict:
    """The web UI's script lists, by their names in script_name: img2img's SD upscale (script_args: info, tile
    overlap, upscaler, scale factor)."""
    return {"txt2img": [], "img2img": [sd_upscale.TITLE.lower()]}


@router.post("/interrupt")
def interrupt(request: Request):
    """The web UI's open requests stop waiting for images not yet started and answer with the ones they have."""
    request.app.state.service.interrupt()
    return None
