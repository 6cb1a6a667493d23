"""What the server sends back: errors as one line each, images as base64 PNGs, JSON bodies."""

from __future__ import annotations

import base64
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tpugen.config.request import MAX_INPUT_BYTES
from tpugen.errors import InputError
from tpugen.modes.serve.service import Service
from tpugen.outputs import writers
from tpugen.outputs.png import png_bytes
from tpugen.plan import ImageWork

MAX_BODY_BYTES = 1 << 20  # a request of text
# Routes whose bodies carry images (base64 in JSON, or multipart): room for the largest input image tpugen takes
# (MAX_INPUT_BYTES) in base64. A 1024x1024 PNG is 1.5 to 3 MB, past a text request's limit.
IMAGE_ROUTES = ("/sdapi/v1/img2img", "/controlnet/detect", "/v1/images/edits", "/v1/runs")
# Image routes on a server with ControlNets (model.controlnets) only: txt2img's units carry images there.
CONTROLNET_IMAGE_ROUTES = ("/sdapi/v1/txt2img",)
MAX_IMAGE_BODY_BYTES = MAX_INPUT_BYTES * 4 // 3 + (1 << 20)


def body_limit(path: str, controlnets: bool = False) -> int:
    """The largest body a route takes: an image route's, or a text request's; `controlnets`: on a server with
    ControlNets, whose txt2img units carry images."""
    image = path in IMAGE_ROUTES or (controlnets and path in CONTROLNET_IMAGE_ROUTES)
    return MAX_IMAGE_BODY_BYTES if image else MAX_BODY_BYTES


def too_large(limit: int) -> str:
    return f"the body is over {limit // 1024} KiB"


def problem_response(status: int, lines: list[str], headers: dict | None = None) -> JSONResponse:
    """Every error the server sends: one line per problem in `detail`, and an OpenAI-style `error` object
    (what the openai client reads) holding the same words."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    body = {"detail": lines, "error": {"message": "; ".join(lines), "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class TooLarge(InputError):
    """A body over its route's body_limit (413)."""


class WrongType(InputError):
    """A body sent as a type its route does not read (415): what a page on another site could send unasked."""


def base64_image(text: str, where: str) -> bytes:
    """A base64 image as the web UI's clients send it, with or without a data: URL prefix."""
    import base64
    import binascii

    header, comma, data = text.partition(",")
    if text.startswith("data:") and not comma:
        raise InputError(f"{where}: a data: URL with no data after its header (data:image/png;base64,DATA)")
    payload = data if text.startswith("data:") else text
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: not base64") from None


def image_b64(pixels, record: dict) -> str:
    """An image as base64 PNG bytes, carrying the same chunks `tpugen generate` writes."""
    from PIL import Image

    return base64.b64encode(png_bytes(Image.fromarray(pixels), record)).decode("ascii")


def base64_png(image) -> str:
    """A PIL image as base64 PNG bytes, nothing else in the file (a preprocessor's map)."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def image_record(service: Service, work: ImageWork) -> dict:
    """What made a server's image, as a run's PNG records it (there is no run file or batch here)."""
    engine = service.engines[0]
    return writers.image_record(
        service.run,
        work,
        scheduler=work.scheduler or engine.loaded.default_scheduler,
        model_label=engine.model_label,
        loras=work.loras,
    )


def json_response(data, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json", headers=headers)


async def parse(request: Request, model: type[BaseModel], extra_problems=None):
    """The JSON body as `model`, or 422 with one line per problem: the schema's, and those `extra_problems`
    finds in the raw mapping (so a bad type and a missing feature are reported together)."""
    from fastapi.exceptions import RequestValidationError

    from tpugen.config.messages import format_error

    body = await request.body()  # over its route's limit, chunked or not, http.Guarded has refused it (413)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if (media or body) and media != "application/json" and not media.endswith("+json"):
        raise WrongType(f"Content-Type: {media[:100] or 'none'}; this endpoint reads application/json")
    try:
        raw = json.loads(body or b"{}")
    except ValueError:
        raise InputError("body: not valid JSON") from None
    if not isinstance(raw, dict):
        raise InputError("body: must be a JSON object")
    problems = extra_problems(raw) if extra_problems else []
    try:
        parsed = model.model_validate(raw)
    except ValidationError as exc:
        if not problems:
            raise RequestValidationError(exc.errors()) from None
        raise InputError(*problems, *(format_error(dict(e)) for e in exc.errors())) from None
    if problems:
        raise InputError(*problems)
    return parsed
