"""The web UI's /sdapi/v1/img2img (and inpainting with a mask) on the session's server, through the real
`webuiapi` client; the pixels against diffusers' own pipelines are tests/test_img2img.py's."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from serve_support import KEY

pytestmark = pytest.mark.xla


def _init_and_mask() -> tuple[Image.Image, Image.Image]:
    rng = np.random.default_rng(3)
    pixels = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    pixels[16:48, 16:48] = (30, 60, 220)
    mask = np.zeros((64, 64), np.uint8)
    mask[20:44, 36:60] = 255  # repaint a box on the right
    return Image.fromarray(pixels), Image.fromarray(mask)


def _compiles(client) -> float:
    text = client.get("/metrics").text
    return float(
        next(line.split()[-1] for line in text.splitlines() if line.startswith("tpugen_compiles_after_warmup"))
    )


def test_webuiapi_img2img_and_inpainting_with_its_defaults(server, client):
    import webuiapi

    url, service = server
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
    init, mask = _init_and_mask()
    before = _compiles(client)

    # img2img: the client's defaults (strength 0.75, resize_mode 0, its sampler Euler a and 20 steps), at the
    # server's warm size (the client's own default is 512x512, which this tiny server does not keep warm).
    result = api.img2img(images=[init], prompt="a blue square", seed=5, width=64, height=64)
    assert result.image.size == (64, 64)
    # As the web UI's API: the request's images are echoed in `parameters` only with include_init_images.
    assert result.parameters["init_images"] is None and result.parameters["prompt"] == "a blue square"
    info = result.info
    assert info["seed"] == 5 and "Denoising strength: 0.75" in info["infotexts"][0]
    png = Image.open(io.BytesIO(base64.b64decode(result.json["images"][0])))
    record = json.loads(png.text["tpugen"])
    assert record["strength"] == 0.75 and len(record["init_image_sha256"]) == 64

    # Inpainting: the client's defaults (mask_blur 4, inpainting_fill 0, inpaint_full_res with padding 0): the
    # masked box repainted at full resolution and pasted back; pixels far from the mask are the init image's.
    painted = api.img2img(images=[init], mask_image=mask, prompt="a red box", seed=5, width=64, height=64)
    made = np.asarray(painted.image.convert("RGB"), np.int16)
    far = np.ones((64, 64), bool)
    far[10:54, 26:64] = False  # the box with the blur's reach around it
    assert (made[far] == np.asarray(init, np.int16)[far]).all()
    inside = made[24:40, 40:56] - np.asarray(init, np.int16)[24:40, 40:56]
    assert np.abs(inside).mean() > 10  # and the box was repainted
    assert "mask_image_sha256" in json.loads(
        Image.open(io.BytesIO(base64.b64decode(painted.json["images"][0]))).text["tpugen"]
    )
    # Without full-resolution inpainting, with the mask inverted (repaint all but the box).
    outside = api.img2img(
        images=[init],
        mask_image=mask,
        inpaint_full_res=False,
        inpainting_mask_invert=1,
        prompt="x",
        width=64,
        height=64,
    )
    assert outside.image.size == (64, 64)
    assert _compiles(client) == before  # every task was warm: nothing compiled for these


def test_img2img_bad_input_is_a_422_naming_the_field(client):
    init, _ = _init_and_mask()
    buffer = io.BytesIO()
    init.save(buffer, format="PNG")
    good = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    base = {"prompt": "a", "width": 64, "height": 64, "steps": 2}
    for body, words in [
        ({**base}, "init_images: give one image"),
        ({**base, "init_images": ["bm90IGFuIGltYWdl"]}, "init_images[0]: is not an image PIL can read"),
        ({**base, "init_images": [good], "denoising_strength": 0}, "denoising_strength: must be above 0"),
        ({**base, "init_images": [good], "mask": good, "inpainting_fill": 2}, "inpainting_fill: 2 is not built"),
        ({**base, "init_images": [good], "resize_mode": 7}, "resize_mode: must be one of 0"),
        ({**base, "init_images": [good], "mask": "bm90"}, "mask: is not an image"),
    ]:
        response = client.post("/sdapi/v1/img2img", json=body)
        assert response.status_code == 422, (body.keys(), response.text)
        assert words in response.text, response.text


def test_openai_images_edit_with_and_without_a_mask(server, client):
    from openai import OpenAI
    from serve_support import KEY

    url, _ = server
    init, mask = _init_and_mask()
    rgba = init.convert("RGBA")
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[20:44, 36:60] = 0  # OpenAI's masks: the transparent pixels are the ones to repaint
    rgba.putalpha(Image.fromarray(alpha))

    def png(image: Image.Image) -> bytes:
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    before = _compiles(client)
    openai = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    edited = openai.images.edit(image=("init.png", png(init)), prompt="a blue square", n=2, size="64x64")
    assert len(edited.data) == 2
    record = json.loads(Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))).text["tpugen"])
    assert record["strength"] == 0.75 and "mask_image_sha256" not in record  # img2img: no mask, no transparency
    masked = openai.images.edit(
        image=("init.png", png(init)), mask=("mask.png", png(rgba)), prompt="a red box", size="64x64"
    )
    record = json.loads(Image.open(io.BytesIO(base64.b64decode(masked.data[0].b64_json))).text["tpugen"])
    assert "mask_image_sha256" in record
    assert _compiles(client) == before
    response = client.post("/v1/images/edits", files={"image": ("x.png", b"not a png")}, data={"prompt": "a"})
    assert response.status_code == 422 and "image: is not an image PIL can read" in response.text
    response = client.post("/v1/images/edits", files={"mask": ("m.png", png(init))}, data={"prompt": "a"})
    assert response.status_code == 422 and "image: missing" in response.text
