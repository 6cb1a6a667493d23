"""The AUTOMATIC1111 web UI's own API tests (its repository's test/test_txt2img.py, test_img2img.py and
test_utils.py: 26 requests, each asserted 200), sent as they are, over HTTP, to a tpugen server of tiny-sd that
keeps every task warm and compiles what is new (serve.new_shapes: compile). Written here from what those tests
send; their asserts are the status codes, and so are these."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

# What their txt2img and img2img requests (simple_txt2img_request, simple_img2img_request) both send.
_BOTH = {
    "batch_size": 1,
    "cfg_scale": 7,
    "eta": 0,
    "height": 64,
    "n_iter": 1,
    "negative_prompt": "",
    "prompt": "example prompt",
    "restore_faces": False,
    "s_churn": 0,
    "s_noise": 1,
    "s_tmax": 0,
    "s_tmin": 0,
    "sampler_index": "Euler a",
    "seed": -1,
    "seed_resize_from_h": -1,
    "seed_resize_from_w": -1,
    "steps": 3,
    "styles": [],
    "subseed": -1,
    "subseed_strength": 0,
    "tiling": False,
    "width": 64,
}
# Their txt2img request, field for field.
TXT2IMG = {**_BOTH, "denoising_strength": 0, "enable_hr": False, "firstphase_height": 0, "firstphase_width": 0}


def _png_b64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def webui_img2img_request(init_b64: str) -> dict:
    """Their img2img request, field for field, starting from `init_b64` (their test file's picture, base64)."""
    return {
        **_BOTH,
        "denoising_strength": 0.75,
        "include_init_images": False,
        "init_images": [init_b64],
        "inpaint_full_res": False,
        "inpaint_full_res_padding": 0,
        "inpainting_fill": 0,
        "inpainting_mask_invert": False,
        "mask": None,
        "mask_blur": 4,
        "override_settings": {},
        "resize_mode": 0,
    }


def _img2img() -> dict:
    """Their img2img request, with a 64x64 picture of our own for their test file."""
    picture = Image.new("RGB", (64, 64), (40, 90, 200))
    picture.paste((220, 40, 40), (16, 16, 48, 48))
    return webui_img2img_request(_png_b64(picture))


def _mask() -> str:
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    return _png_b64(mask)


# Each of their requests: its test's name, and what it changes in the request it starts from.
TXT2IMG_TESTS = [
    ("txt2img_simple", {}),
    ("txt2img_with_negative_prompt", {"negative_prompt": "example negative prompt"}),
    (
        "txt2img_with_complex_prompt",
        {"prompt": "((emphasis)), (emphasis1:1.1), [to:1], [from::2], [from:to:0.3], [alt|alt1]"},
    ),
    ("txt2img_not_square_image", {"height": 128}),
    ("txt2img_with_hrfix", {"enable_hr": True}),
    ("txt2img_with_tiling", {"tiling": True}),
    ("txt2img_with_restore_faces", {"restore_faces": True}),
    ("txt2img_with_vanilla_sampler[PLMS]", {"sampler_index": "PLMS"}),
    ("txt2img_with_vanilla_sampler[DDIM]", {"sampler_index": "DDIM"}),
    ("txt2img_with_vanilla_sampler[UniPC]", {"sampler_index": "UniPC"}),
    ("txt2img_multiple_batches", {"n_iter": 2}),
    ("txt2img_batch", {"batch_size": 2}),
]
IMG2IMG_TESTS = [
    ("img2img_simple", {}),
    ("inpainting_masked", {"mask": "MASK"}),
    ("inpainting_with_inverted_masked", {"mask": "MASK", "inpainting_mask_invert": True}),
    ("img2img_sd_upscale", {"script_name": "sd upscale", "script_args": ["", 8, "Lanczos", 2.0]}),
]
GET_URLS = [
    "sdapi/v1/cmd-flags",
    "sdapi/v1/samplers",
    "sdapi/v1/upscalers",
    "sdapi/v1/sd-models",
    "sdapi/v1/hypernetworks",
    "sdapi/v1/face-restorers",
    "sdapi/v1/realesrgan-models",
    "sdapi/v1/prompt-styles",
    "sdapi/v1/embeddings",
]
# Face restoration needs weights (GFPGAN, CodeFormer) a TPU VM may not have: a server without a restorer says so.
BY_DESIGN = {"txt2img_with_restore_faces": (422, ["restore_faces: face restoration is not built"])}


@pytest.fixture(scope="module")
def webui_server(server, tmp_path_factory):
    """A server as their tests expect one: no key, every task warm, new shapes compiled once. It asks for the
    session's server so that it runs in that server's test process (tests/conftest.py: SHARED_FIXTURES) and finds
    the graphs of the sizes both keep warm in the process's compile cache."""
    from serve_support import running_server, serve_config, wait_ready

    tmp = tmp_path_factory.mktemp("webui-tests")
    path = serve_config(tmp, tasks=["txt2img", "img2img", "inpaint"], new_shapes="compile")
    with running_server(path, tmp / "runs", None) as (url, _service):
        wait_ready(url, seconds=600)  # their tests start on a server that has started
        yield url


@pytest.mark.xla
def test_the_web_uis_own_api_tests_pass(webui_server):
    statuses: dict[str, tuple[int, object]] = {}
    with httpx.Client(base_url=webui_server, timeout=300) as http:
        for name, changes in TXT2IMG_TESTS:
            answer = http.post("/sdapi/v1/txt2img", json={**TXT2IMG, **changes})
            statuses[name] = answer.status_code, answer.json().get("detail")
        mask = _mask()
        for name, changes in IMG2IMG_TESTS:
            request = {**_img2img(), **{k: (mask if v == "MASK" else v) for k, v in changes.items()}}
            answer = http.post("/sdapi/v1/img2img", json=request)
            statuses[name] = answer.status_code, answer.json().get("detail")
        # test_options_write: send_seed flipped, read back, put back.
        before = http.get("/sdapi/v1/options")
        flipped = not before.json()["send_seed"]
        wrote = http.post("/sdapi/v1/options", json={"send_seed": flipped})
        after = http.get("/sdapi/v1/options")
        round_trip = before.status_code == wrote.status_code == after.status_code == 200
        statuses["options_write"] = (200 if round_trip and after.json()["send_seed"] == flipped else 500), None
        http.post("/sdapi/v1/options", json={"send_seed": not flipped})
        for url in GET_URLS:
            statuses[f"get_api_url[{url}]"] = http.get(f"/{url}").status_code, None
    assert len(statuses) == 26
    expected = {name: BY_DESIGN.get(name, (200, None)) for name in statuses}
    assert statuses == expected
