"""The web UI's SD upscale img2img script (`script_name: sd upscale`) on the session's server: the web UI's own
API test's request, its tiles made as plain img2img images, and hostile script_args refused in one line each.
The tile grid and blend on their own: tests/test_sd_upscale.py."""

from __future__ import annotations

import base64
import hashlib
import io
import json

import numpy as np
import pytest
from conftest import OTHER_GRAPH
from PIL import Image
from serve_support import batches, decode, pixels
from test_webui_api_tests import webui_img2img_request

pytestmark = pytest.mark.xla


def _init_png() -> bytes:
    rng = np.random.default_rng(11)
    image = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    image[8:40, 24:56] = (200, 40, 40)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _web_ui_request(init: bytes) -> dict:
    """The web UI's test/test_img2img.py request, as test_img2img_sd_upscale_performed sends it."""
    request = webui_img2img_request(base64.b64encode(init).decode())
    return {**request, "script_name": "sd upscale", "script_args": ["", 8, "Lanczos", 2.0]}


def _compiles(client) -> float:
    text = client.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("tpugen_compiles_after")))


def test_the_web_uis_sd_upscale_request_gives_the_upscaled_image_drawn_in_tiles(client):
    """Before: 422 "scripts are not built". The 64x64 image upscaled x2 with Lanczos is 128x128, drawn as 3 x 3
    tiles of the request's 64x64 (a warm size: nothing compiles) in one request, which the server batches. Where
    one tile alone holds the pixels, they are that tile's img2img image: the same as a plain img2img request of
    that tile at its seed (image n's tile k: seed + n + k, as the web UI seeds them)."""
    init = _init_png()
    compiled, before = _compiles(client), batches(client)
    response = client.post("/sdapi/v1/img2img", json=_web_ui_request(init))
    assert response.status_code == 200, response.text[:500]
    answer = response.json()
    (image,) = [decode(b64) for b64 in answer["images"]]
    assert image.size == (128, 128)
    info = json.loads(answer["info"])
    assert (info["width"], info["height"], len(info["all_seeds"])) == (128, 128, 1)
    assert "Size: 128x128" in info["infotexts"][0] and "Denoising strength: 0.75" in info["infotexts"][0]
    record = json.loads(image.text["tpugen"])
    assert record["init_image_sha256"] == hashlib.sha256(init).hexdigest() and record["seed"] == info["seed"]
    assert batches(client) - before == 5  # 9 tiles at the compiled batch size 2
    assert _compiles(client) == compiled
    assert client.get("/sdapi/v1/scripts").json() == {"txt2img": [], "img2img": ["sd upscale"]}

    upscaled = Image.open(io.BytesIO(init)).convert("RGB").resize((128, 128), Image.Resampling.LANCZOS)
    made = pixels(image)
    # Tiles start at 0, 32 and 64 on each side; each seam ramps over 8 pixels in the middle of the 32 two
    # tiles share (44 to 51, 76 to 83), so tile 0 alone holds 0..43 and the middle tile (4) 52..75.
    for tile, (x, y), alone in [(0, (0, 0), slice(0, 44)), (4, (32, 32), slice(52, 76))]:
        cut = upscaled.crop((x, y, x + 64, y + 64))
        buffer = io.BytesIO()
        cut.save(buffer, format="PNG")
        plain = {**_web_ui_request(buffer.getvalue()), "seed": info["seed"] + tile}
        del plain["script_name"], plain["script_args"]
        reply = client.post("/sdapi/v1/img2img", json=plain)
        assert reply.status_code == 200, reply.text[:500]
        own = pixels(decode(reply.json()["images"][0]))
        inside = (slice(alone.start - y, alone.stop - y), slice(alone.start - x, alone.stop - x))
        assert int(np.abs(made[alone, alone] - own[inside]).max()) <= OTHER_GRAPH, tile


def test_hostile_script_args_are_one_line_each_naming_script_args(client):
    """Each a 422 with one line naming script_args (never a 500), before any image is made."""
    init = _init_png()
    body = {**_web_ui_request(init), "steps": 2, "seed": 3}
    before = batches(client)
    for args, words in [
        ({"script_args": ["", 8, "Lanczos", 1e9]}, "script_args[3] (scale factor): must be a number from 1 to 4"),
        ({"script_args": ["", 100, "Lanczos", 2]}, "script_args[1] (tile overlap): must be a whole number"),
        ({"script_args": ["", 8, "R-ESRGAN 4x+", 2]}, "script_args[2] (upscaler): must be one of None (0)"),
        ({"script_args": ["", "8", "Lanczos", 2]}, "script_args[1] (tile overlap)"),
        ({"script_args": ["", 8, 7, 2]}, "script_args[2] (upscaler)"),
        ({"script_args": ["", 8, "Lanczos", "2"]}, "script_args[3] (scale factor)"),
        ({"script_args": ["", 8, "Lanczos", True]}, "script_args[3] (scale factor)"),
        ({"script_args": [{}, [8], "Lanczos", 2]}, "script_args[1] (tile overlap)"),
        ({"script_args": [0] * 10_000}, "script_args: 10000 values; SD upscale takes at most 4"),
        ({"script_args": "8, Lanczos, 2"}, "script_args"),
        ({"script_args": ["", 8, "Lanczos", 4]}, "(serve.max_images_per_request)"),  # 256x256: 25 tiles
        ({"n_iter": 2}, "(serve.max_images_per_request)"),  # 9 tiles twice
    ]:
        response = client.post("/sdapi/v1/img2img", json={**body, **args})
        assert response.status_code == 422, (args, response.text[:300])
        lines = response.json()["detail"]
        assert len(lines) == 1 and lines[0].startswith("script_args") and words in lines[0], (str(args)[:80], lines)
    # Other scripts are refused as before; the upscale takes no mask.
    for fields, words in [
        ({"script_name": "x/y/z plot"}, "script_name: scripts are not built"),
        ({"script_name": "SD upscale", "mask": body["init_images"][0]}, "mask: SD upscale redraws the whole image"),
    ]:
        response = client.post("/sdapi/v1/img2img", json={**body, **fields})
        assert response.status_code == 422 and response.json()["detail"][0].startswith(words), response.text[:300]
    assert batches(client) == before
