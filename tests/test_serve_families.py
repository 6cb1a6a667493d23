"""The 2026 families behind `tpugen serve`: the A1111 and OpenAI routes answer with the images `generate` makes,
and nothing compiles after warmup."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import yaml
from conftest import run_cli, tiny_config, write_config
from PIL import Image, ImageDraw
from serve_support import AUTH, KEY, metric, pixels, running_server, serve_config, wait_ready


@pytest.mark.xla
def test_a_qwen_image_server_answers_both_apis_with_generates_images(tmp_path):
    import openai

    model = {"id": "tiny-qwen-image", "dtype": "float32"}
    path = serve_config(tmp_path, max_images_per_request=4)
    config = yaml.safe_load(path.read_text())
    config["model"] = model
    write_config(path, config)
    with running_server(path, tmp_path / "runs", KEY) as (url, service):
        wait_ready(url)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            body = {"prompt": "a red cat", "negative_prompt": "blurry", "steps": 3, "cfg_scale": 7.5}
            answer = client.post("/sdapi/v1/txt2img", json={**body, "width": 64, "height": 64, "seed": 11})
            assert answer.status_code == 200, answer.text
            info = json.loads(answer.json()["info"])
            assert info["seed"] == 11 and info["sd_model_name"] == "tiny-qwen-image"
            served = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["images"][0]))).convert("RGB"))
            ai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            result = ai.images.generate(prompt="a dog", n=2, size="64x64", response_format="b64_json")
            assert len(result.data) == 2
            metrics = client.get("/metrics").text
        assert "tpugen_compiles_after_warmup_total 0.0" in metrics
    # The same image from `generate` (same seed, prompt and settings), in this process.
    run = tiny_config(tmp_path / "g", model=model, prompts=["a red cat"], seed=11, batch_size=2)
    result = run_cli("generate", write_config(tmp_path / "g.yaml", run), "--quiet")
    assert result.exit_code == 0, result.output
    (png,) = (tmp_path / "g" / "outputs" / "run").glob("[0-9]*.png")
    assert np.array_equal(np.asarray(Image.open(png).convert("RGB")), served)


@pytest.mark.xla
def test_a_z_image_server_runs_a_controlnet_unit_as_diffusers_does_and_refuses_a_window(tmp_path):
    # A webuiapi ControlNetUnit for Z-Image's ControlNet, warm from the start: the image diffusers' own
    # ZImageControlNetPipeline makes; a unit that would sit out steps is a 422 naming why (its pipeline has no window).
    import torch
    import webuiapi
    from diffusers import AutoPipelineForText2Image, DiffusionPipeline, ZImageControlNetModel

    from tpugen.tiny import builtin_path

    path = serve_config(tmp_path, tasks=["txt2img", "inpaint"], batch_window_ms=0)
    config = yaml.safe_load(path.read_text())
    config["model"] = {"id": "tiny-z-image", "dtype": "float32", "controlnets": [{"id": "tiny-z-image-controlnet"}]}
    write_config(path, config)
    disc = Image.new("RGB", (64, 64))
    ImageDraw.Draw(disc).ellipse((8, 30, 30, 52), fill=(255, 255, 255))
    fields = {"prompt": "a red cat", "negative_prompt": "", "seed": 11, "steps": 2, "cfg_scale": 4.0}
    with running_server(path, tmp_path / "runs", KEY) as (url, service):
        wait_ready(url, seconds=300)
        assert service.warm_summary().endswith("; ControlNet units for tiny-z-image-controlnet")
        host, port = url.removeprefix("http://").split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
        unit = webuiapi.ControlNetUnit(image=disc, module="none", model="tiny-z-image-controlnet", weight=0.8)
        made = api.txt2img(
            controlnet_units=[unit], alwayson_scripts={}, sampler_name="Euler", width=64, height=64, **fields
        )
        assert 'ControlNet 0: "Module: none, Model: tiny-z-image-controlnet, Weight: 0.8' in made.info["infotexts"][0]
        # Inpainting under the unit (ZImageControlNetInpaintPipeline), warm too: from noise, so at strength 1 only.
        mask = Image.new("L", (64, 64))
        ImageDraw.Draw(mask).rectangle((0, 0, 31, 63), fill=255)
        inpaint = dict(images=[disc], mask_image=mask, inpaint_full_res=False, controlnet_units=[unit], **fields)
        painted = api.img2img(
            denoising_strength=1.0, sampler_name="Euler", width=64, height=64, alwayson_scripts={}, **inpaint
        )
        assert 'ControlNet 0: "Module: none, Model: tiny-z-image-controlnet' in painted.info["infotexts"][0]
        with pytest.raises(RuntimeError, match="422.*set the strength to 1"):
            api.img2img(
                denoising_strength=0.75, sampler_name="Euler", width=64, height=64, alwayson_scripts={}, **inpaint
            )
        # A unit without an image of its own takes the init image, fitted by the request's resize_mode, as the
        # extension's do: the image that unit makes given the init image itself; its detected map follows.
        body = dict(fields, sampler_name="Euler", width=64, height=64, denoising_strength=1.0, resize_mode=1)
        body.update(init_images=[_png64(disc)], mask=_png64(mask), inpaint_full_res=False)
        own = {**unit.to_dict(), "resize_mode": 1}
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            given, taken = (
                client.post("/sdapi/v1/img2img", json={**body, "alwayson_scripts": {"controlnet": {"args": [u]}}})
                for u in (own, {**own, "image": ""})
            )
        assert given.status_code == 200 and taken.status_code == 200, (given.text, taken.text)
        assert len(taken.json()["images"]) == 2  # the image, then the unit's detected map
        assert (_unpng(taken.json()["images"][0]) == _unpng(given.json()["images"][0])).all()
        assert (_unpng(taken.json()["images"][1]) == np.asarray(disc)).all()  # module none: the init image
        window = {**unit.to_dict(), "guidance_end": 0.5}
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            refused = client.post(
                "/sdapi/v1/txt2img", json={**fields, "alwayson_scripts": {"controlnet": {"args": [window]}}}
            )
        assert refused.status_code == 422, refused.text
        [line] = refused.json()["detail"]  # one line, naming the keys and why
        assert line.startswith(
            "ControlNet units' guidance_start and guidance_end: Z-Image models: the ControlNet runs at every step"
        ), line
        # The extension's control modes weigh a UNet ControlNet's residuals: refused in one line for Z-Image's.
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            refused = client.post(
                "/sdapi/v1/txt2img",
                json={**fields, "alwayson_scripts": {"controlnet": {"args": [{**unit.to_dict(), "control_mode": 1}]}}},
            )
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"] == [
            "ControlNet units' control_mode and advanced_weighting: Z-Image models: the control modes but Balanced and "
            "per-residual weights (advanced_weighting) weigh a UNet ControlNet's residuals (SD 1.x/2.x's and SDXL's); "
            "this family's ControlNets are built otherwise"
        ]
        assert metric(url, "tpugen_compiles_after_warmup_total") == 0
    base = DiffusionPipeline.from_pretrained(str(builtin_path("tiny-z-image")))
    controlnet = ZImageControlNetModel.from_pretrained(str(builtin_path("tiny-z-image-controlnet")))
    pipe = AutoPipelineForText2Image.from_pipe(base, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = pipe(
            prompt="a red cat",
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=4.0,
            control_image=disc,
            controlnet_conditioning_scale=0.8,
            generator=torch.Generator("cpu").manual_seed(11),
            output_type="np",
        ).images[0]
    apart = np.abs(pixels(made.image) - (expected * 255).round().astype(np.int16)).max()
    assert apart <= 2, apart


def _png64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _unpng(text: str):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB"))
