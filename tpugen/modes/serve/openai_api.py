"""The OpenAI images API (`POST /v1/images/generations`), so the official openai client works with
base_url=http://HOST:PORT/v1."""

from __future__ import annotations

import random
import re
import time

import anyio.to_thread
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from tpugen.config.request import RANDOM_SEEDS
from tpugen.errors import InputError
from tpugen.modes.serve.a1111 import collect, refuse
from tpugen.modes.serve.replies import image_b64, image_record, json_response, parse, problem_response
from tpugen.modes.serve.service import Service
from tpugen.plan import ImageWork

router = APIRouter(prefix="/v1/images")


class Generation(BaseModel):
    """OpenAI's request; quality, style, user and the other fields that pick among OpenAI's own models are
    accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    n: int = 1
    size: str | None = None
    response_format: str | None = None
    model: str | None = None


def size_of(service: Service, size: str | None) -> tuple[int, int]:
    """(height, width) from "WxH" (None: the server's first warm size)."""
    if size is None or size == "auto":
        return service.sizes[0]
    match = re.fullmatch(r"(\d+)x(\d+)", size)
    if not match:
        raise InputError(f"size: must look like WIDTHxHEIGHT (for example 1024x1024), got {size!r}")
    return int(match.group(2)), int(match.group(1))


@router.post("/generations")
async def generations(request: Request):
    """OpenAI's image generation: `prompt`, `n`, `size` (a warm size) and `response_format: b64_json`; each image a
    base64 PNG."""
    service: Service = request.app.state.service
    body = await parse(request, Generation)
    # The images, their PNGs and the base64 reply are made in a worker thread, off the event loop.
    return await anyio.to_thread.run_sync(generations_reply, service, body)


def generations_reply(service: Service, body: Generation):
    """The request's images and the OpenAI reply, made in a worker thread."""
    if body.response_format not in (None, "b64_json"):
        return problem_response(400, [f"response_format: {body.response_format} is not served; use b64_json"])
    served = {service.engines[0].model_label, service.run.config.model.id}
    if body.model is not None and body.model not in served:
        return problem_response(
            400, [f"model: this server serves {service.engines[0].model_label!r}, not {body.model!r}"]
        )
    problems = [f"n: must be at least 1, got {body.n}"] if body.n < 1 else []
    size = collect(problems, size_of, service, body.size)
    images = _specs(service, problems, max(body.n, 1), body.prompt, size)
    return _answer(service, problems, images)


def _specs(
    service, problems: list[str], count: int, prompt: str, size, source=None, references=None
) -> list[ImageWork] | None:
    """A request's `count` images at the server's settings (its negative prompt, steps, guidance, clip skip),
    seeded from a fresh seed (OpenAI's API has none), from an image (`source`) or references (`references`);
    None where the size is (a problem already noted)."""
    if size is None:
        return None
    config = service.run.config
    seed = random.randrange(RANDOM_SEEDS)
    height, width = size
    fields = {"source": source, "references": references, "clip_skip": config.clip_skip}

    def make(i: int) -> ImageWork:
        return ImageWork(
            prompt=prompt,
            negative_prompt=config.negative_prompt,
            seed=seed + i,
            steps=config.steps,
            guidance_scale=config.guidance_scale,
            height=height,
            width=width,
            **fields,
        )

    return collect(problems, service.image_works, count, make)


def _answer(service, problems: list[str], images: list[ImageWork] | None):
    """The reply: every image made (OpenAI's never stop short), or the request's problems."""
    refuse(problems, service, images)
    made = service.generate(images)
    data = [{"b64_json": image_b64(pixels, image_record(service, images[position]))} for position, pixels in made]
    return json_response({"created": int(time.time()), "data": data})


# Form fields of images.edit that tpugen reads (the rest, such as quality or user, are accepted and ignored).
EDIT_FILES = ("image", "mask")  # the parts of an edit that are files; every other is a text field
EDIT_STRENGTH = 0.75  # an edit without a mask or transparency: img2img at the web UI's default strength


@router.post("/edits")
async def edits(request: Request):
    """OpenAI's image edit (multipart): `image`, an optional `mask` whose transparent pixels are repainted (or the
    image's own transparency), `prompt`, `n`, `size`, `response_format: b64_json`. Without either it is img2img
    at strength 0.75. On a model that edits by reference (FLUX.2), every `image` part (`image[]`, as the client
    sends a list) is a reference, in order, and there is no mask."""
    service: Service = request.app.state.service
    from tpugen.config.request import MAX_INPUT_BYTES

    most = service.family.max_references
    # A model that edits by reference takes its most images, and one file more: past it, a request is answered
    # with its count (edits_reply), not the form parser's words.
    form = await request.form(max_files=max(2, most + 1), max_fields=16, max_part_size=MAX_INPUT_BYTES)
    fields: dict = {}
    problems = []
    for name, value in form.multi_items():
        name = name.removesuffix("[]")
        is_file = hasattr(value, "read")
        if most and name == "image" and is_file:
            fields.setdefault("image", []).append(await value.read())  # the references, in order
        elif most and name == "mask":
            fields["mask"] = True  # refused whatever it is (Service.references)
        elif name in fields:
            problems.append(f"{name}: sent twice; an edit takes one")
        elif is_file and name not in EDIT_FILES:
            problems.append(f"{name}: must be a form field, not a file")
        elif not is_file and name in EDIT_FILES:
            problems.append(f"{name}: must be a file (a PNG or JPEG)")
        else:
            fields[name] = await value.read() if is_file else value
    if problems:
        raise InputError(*problems)
    return await anyio.to_thread.run_sync(edits_reply, service, fields)


def edits_reply(service: Service, fields: dict):
    """The edit's images and the OpenAI reply, made in a worker thread."""
    from tpugen.config.images import ImageSource
    from tpugen.engine import images as pictures

    problems: list[str] = []
    if fields.get("response_format") not in (None, "b64_json"):
        return problem_response(400, [f"response_format: {fields['response_format']} is not served; use b64_json"])
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        problems.append("prompt: missing")
    try:
        n = int(fields.get("n", 1))
    except ValueError:
        n = 0
    if n < 1:
        problems.append(f"n: must be an integer of at least 1, got {fields.get('n')!r}")
    size = collect(problems, size_of, service, fields.get("size"))
    if service.family.max_references:
        sent = fields.get("image")
        sent = sent if isinstance(sent, list) else []  # an `image` text field is refused at the door
        references = service.references(sent, "image", problems, mask="mask" in fields)
        if problems or references is None or size is None:
            refuse(problems or ["size: missing"], service, None)
        return _answer(service, problems, _specs(service, problems, n, prompt, size, references=references))
    image_bytes = fields.get("image")
    if not isinstance(image_bytes, bytes):
        problems.append("image: missing (a PNG or JPEG file)")
    init = mask = None
    if isinstance(image_bytes, bytes):
        init = collect(problems, pictures.open_bytes, image_bytes, "image", keep_alpha=True)
    if isinstance(fields.get("mask"), bytes):
        mask = collect(problems, pictures.open_bytes, fields["mask"], "mask", keep_alpha=True)
        if mask is not None and "A" not in mask.getbands():
            problems.append("mask: must have transparency (its transparent pixels are repainted)")
    if problems or size is None:
        refuse(problems or ["size: missing"], service, None)
    height, width = size
    painted = pictures.transparent_mask(mask if mask is not None else init)
    init = pictures.fit(init.convert("RGB"), width, height, 0)
    source_fields = {}
    if painted is not None:
        painted = pictures.fit(painted, width, height, 0)
        source_fields = dict(
            zip(
                ("mask_image", "mask_image_sha256"),
                service.input_image(pictures.png_bytes(painted), "mask"),
                strict=True,
            )
        )
    source = ImageSource(
        *service.input_image(pictures.png_bytes(init), "image"), strength=EDIT_STRENGTH, **source_fields
    )
    return _answer(service, problems, _specs(service, problems, n, prompt, size, source))
