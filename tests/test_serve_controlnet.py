"""The web UI's ControlNet extension API through `tpugen serve`: units sent with `webuiapi`'s ControlNetUnit, warm
from the start, the image a run config with the same control makes; /controlnet/model_list, module_list and
detect; hostile units and detect requests a 422 (or 413/415), never a 500."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import annotator_weights, run_cli, tiny_config, write_config
from PIL import Image, ImageDraw
from serve_support import AUTH, KEY, decode, metric, pixels, running_server, wait_ready

from tpugen.config.controls import ANNOTATORS, CONTROL_MODULES, CONTROL_TYPES
from tpugen.engine.controls import preprocess

pytestmark = pytest.mark.xla

SMALL = {"height": 64, "width": 64, "batch_size": 1, "steps": 2}
CONTROLNETS = [{"id": "tiny-sd-controlnet"}]
FIELDS = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 11, "steps": 2, "cfg_scale": 7.5}


def _disc() -> Image.Image:
    disc = Image.new("RGB", (64, 64))
    ImageDraw.Draw(disc).ellipse((20, 8, 50, 38), fill=(255, 255, 255))
    return disc


def _b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _unit(**changes) -> dict:
    unit = {
        "image": _b64(_disc()),
        "module": "canny",
        "model": "tiny-sd-controlnet",
        "weight": 0.8,
        "resize_mode": "Crop and Resize",
        "threshold_a": 100,
        "threshold_b": 200,
        "guidance_start": 0.0,
        "guidance_end": 1.0,
        "control_mode": "Balanced",
    }
    return {**unit, **changes}


@pytest.fixture(scope="module")
def controlnet_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("controlnet-server")
    config = tiny_config(tmp, **SMALL, output={"dir": str(tmp / "runs")})
    config["model"]["controlnets"] = CONTROLNETS
    config["model"]["annotators_dir"] = str(annotator_weights(tmp / "annotators"))
    del config["prompts"]
    config["output"].pop("run_id")
    config["serve"] = {"batch_window_ms": 0, "tasks": ["txt2img"]}
    with running_server(write_config(tmp / "serve.yaml", config), tmp / "runs", KEY) as (url, service):
        wait_ready(url, seconds=300)
        yield url, service


def test_a_webuiapi_unit_steers_warm_as_a_run_config_does(controlnet_server, tmp_path):
    import webuiapi

    url, service = controlnet_server
    assert service.warm_summary().endswith("; ControlNet units for tiny-sd-controlnet")
    assert sorted(service.engines[0].warm) == sorted([("64x64 b1 cfg", "DDIM"), ("64x64 b1 cfg 1 controlnet", "DDIM")])
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
    unit = webuiapi.ControlNetUnit(
        image=_disc(),
        module="canny",
        model="tiny-sd-controlnet",
        weight=0.8,
        resize_mode="Crop and Resize",
        threshold_a=100,
        threshold_b=200,
    )
    common = dict(width=64, height=64, sampler_name="DDIM", **FIELDS)
    # A fresh alwayson_scripts: webuiapi's txt2img puts the units into its default mapping, shared by every later
    # call in the process (another test's WebUIApi then sent them to a server without ControlNets).
    controlled = api.txt2img(controlnet_units=[unit], alwayson_scripts={}, **common)
    assert len(controlled.images) == 2  # the image, then the unit's detected map
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        answer = http.post("/sdapi/v1/txt2img", json={**FIELDS, "sampler_name": "DDIM"})
    assert answer.status_code == 200, answer.text
    plain_info, plain_image = json.loads(answer.json()["info"]), decode(answer.json()["images"][0])
    info = controlled.info["infotexts"][0]
    assert (
        ', ControlNet 0: "Module: canny, Model: tiny-sd-controlnet, Weight: 0.8, Resize Mode: Crop and Resize, '
        'Threshold A: 100.0, Threshold B: 200.0, Guidance Start: 0.0, Guidance End: 1.0, Control Mode: Balanced", '
    ) in info
    assert "ControlNet" not in plain_info["infotexts"][0]
    made, unsteered = pixels(controlled.image), pixels(plain_image)
    assert np.abs(made - unsteered).mean() > 1  # the unit steers
    # A disabled unit is no unit: the plain image.
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        off = http.post(
            "/sdapi/v1/txt2img",
            json={**FIELDS, "alwayson_scripts": {"controlnet": {"args": [_unit(enabled=False)]}}},
        )
    assert off.status_code == 200 and (pixels(decode(off.json()["images"][0])) == unsteered).all()
    assert metric(url, "tpugen_compiles_after_warmup_total") == 0

    # A run config with the same control image makes the same pixels.
    _disc().save(tmp_path / "disc.png")
    prompt = {
        "prompt": FIELDS["prompt"],
        "seed": FIELDS["seed"],
        "control_image": "disc.png",
        "control_module": "canny",
        "control_scale": 0.8,
    }
    run = tiny_config(tmp_path, **SMALL, prompts=[prompt], model={"id": "tiny-sd", "controlnets": CONTROLNETS})
    assert run_cli("generate", write_config(tmp_path / "run.yaml", run), "--quiet").exit_code == 0
    (image,) = (tmp_path / "outputs" / "run").glob("00000-*.png")
    assert (pixels(Image.open(image)) == made).all()


# The extension's own web API tests' unit (tests/web_api/template.py's default_unit), with this server's ControlNet.
EXTENSION_UNIT = {
    "control_mode": 0,
    "enabled": True,
    "guidance_end": 1,
    "guidance_start": 0,
    "pixel_perfect": True,
    "processor_res": 512,
    "resize_mode": 1,
    "threshold_a": 64,
    "threshold_b": 64,
    "weight": 1,
    "module": "canny",
    "model": "tiny-sd-controlnet",
}


@pytest.mark.parametrize(
    "fields, unit, count",
    [
        ({}, {}, 2),  # the image, then the unit's detected map
        ({"n_iter": 2}, {}, 3),  # one map per unit and request
        ({}, {"save_detected_map": False}, 1),
        ({}, {"save_detected_map": True}, 2),
        ({}, {"foo": True, "is_ui": False}, 2),  # keys the extension ignores (its test_unrecognized_param)
        ({"enable_hr": False}, {"hr_option": "HiResFixOption.BOTH"}, 2),  # no hires fix: hr_option is moot
        ({}, {"enabled": False}, 1),
    ],
)
def test_detected_maps_follow_the_images(controlnet_server, fields, unit, count):
    """The extension's replies carry each enabled unit's detected map after the images: its tests count them."""
    import cv2

    url, _ = controlnet_server
    body = {**FIELDS, "width": 64, "height": 64, **fields}
    body["alwayson_scripts"] = {"ControlNet": {"args": [{**EXTENSION_UNIT, "image": _b64(_disc()), **unit}]}}
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        answer = http.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text
    images = answer.json()["images"]
    assert len(images) == count
    if count > body.get("n_iter", 1) and unit.get("enabled", True):
        # The map is the control the ControlNet took: the 64x64 disc (fitted to 64x64 as it is) through Canny at
        # the unit's thresholds, white edges on black.
        edges = cv2.Canny(np.asarray(_disc()), 64, 64)
        assert np.array_equal(np.asarray(decode(images[-1]).convert("RGB")), np.repeat(edges[:, :, None], 3, axis=2))
        assert edges.any()
    assert metric(url, "tpugen_compiles_after_warmup_total") == 0


def test_control_modes_and_per_residual_weights_weigh_the_residuals_as_the_extension_does(controlnet_server):
    """The extension's control_mode (all three) and advanced_weighting: each image within 2/255 of diffusers' own
    pipeline on the CPU with its ControlNet's residuals weighed as the extension's hook weighs them, each apart from
    Balanced's, none compiling after warmup."""
    from test_controlnet import WITHIN, _diffusers_controlled, weighing

    url, _ = controlnet_server
    weights = [0.2, 1.5, 0.0, 0.7, 1.1, 0.4, 1.9]  # tiny-sd-controlnet's 7 residuals (the hostile case's count)
    control = preprocess(_disc(), "canny", 100, 200)
    record = {
        **FIELDS,
        "guidance_scale": FIELDS["cfg_scale"],
        "controlnet_units": [{"scale": 0.8, "start": 0, "end": 1}],
    }
    made = {}
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        for name, unit in (
            ("balanced", {"control_mode": "Balanced"}),
            ("prompt", {"control_mode": "My prompt is more important"}),
            ("control", {"control_mode": 2}),
            ("weights", {"advanced_weighting": weights}),
        ):
            body = {**FIELDS, "sampler_name": "DDIM", "alwayson_scripts": {"controlnet": {"args": [_unit(**unit)]}}}
            answer = http.post("/sdapi/v1/txt2img", json=body)
            assert answer.status_code == 200, answer.text
            made[name] = pixels(decode(answer.json()["images"][0]))
            infotext = json.loads(answer.json()["info"])["infotexts"][0]
            if name in ("prompt", "control"):
                assert (
                    f'Control Mode: {unit["control_mode"] if name == "prompt" else "ControlNet is more important"}"'
                    in infotext
                )
    for name, hook, scale in (
        ("prompt", weighing(1), 0.8),
        ("control", weighing(2), 0.8),
        ("weights", weighing(0, weights), 1.0),  # the weights stand in for the scale
    ):
        units = [{**record["controlnet_units"][0], "scale": scale}]
        expected = _diffusers_controlled({**record, "controlnet_units": units}, control, residual_hook=hook)
        assert int(np.abs(made[name] - expected.astype(np.int16)).max()) <= WITHIN, name
        assert np.abs(made[name] - made["balanced"]).mean() > 0.5, name  # the mode changes the image
    assert metric(url, "tpugen_compiles_after_warmup_total") == 0


def test_the_controlnet_routes(controlnet_server):
    import cv2

    url, service = controlnet_server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        assert http.get("/controlnet/model_list").json() == {"model_list": ["tiny-sd-controlnet"]}
        # As many units as a request may carry; a query the route does not take changes nothing.
        assert http.get("/controlnet/settings").json() == {"control_net_unit_count": 4}
        assert http.get("/controlnet/settings", params={"x" * 2000: "y" * 4000}).json() == {"control_net_unit_count": 4}
        modules = http.get("/controlnet/module_list").json()
        built_in = len(CONTROL_MODULES)
        assert modules["module_list"][:built_in] == list(CONTROL_MODULES)
        assert modules["module_list"][:5] == ["none", "canny", "invert", "scribble", "tile"]
        # model.annotators_dir holds all their weights but MiDaS's and OpenPose's
        heavy = ("MidasDetector", "OpenposeDetector")
        assert modules["module_list"][built_in:] == [name for name, a in ANNOTATORS.items() if a.detector not in heavy]
        aliases = http.get("/controlnet/module_list", params={"alias_names": "true"}).json()["module_list"]
        assert "tile_resample" in aliases and "invert (from white bg & black line)" in aliases
        assert "t2ia_color_grid" in aliases and "lineart_standard (from white bg & black line)" in aliases
        detail = http.get("/controlnet/module_list", params={"alias_names": "true"}).json()["module_detail"]
        assert list(detail) == aliases  # the details under the names the list gives
        assert detail["canny"]["model_free"] is False and [s["name"] for s in detail["canny"]["sliders"]] == [
            "Low Threshold",
            "High Threshold",
        ]
        # The extension's control types: each type's preprocessors here ("none" first), its ControlNets by name.
        types = http.get("/controlnet/control_types").json()["control_types"]
        # A query it does not take (a 6 kB one) changes nothing.
        assert http.get("/controlnet/control_types", params={"x" * 2000: "y" * 4000}).json()["control_types"] == types
        assert list(types) == ["All", *CONTROL_TYPES]
        assert types["All"]["model_list"] == ["None", "tiny-sd-controlnet"] and types["All"]["module_list"] == aliases
        assert types["Canny"] == {
            "module_list": ["none", "canny", "invert (from white bg & black line)"],
            "model_list": ["None"],  # its name says no type
            "default_option": "canny",
            "default_model": "None",
        }
        assert types["Tile"]["module_list"] == ["none", "tile", "blur_gaussian", "tile_resample"]
        assert types["Tile"]["default_option"] == "tile_resample"
        assert types["Recolor"]["default_option"] == "recolor_luminance"
        assert types["Depth"]["module_list"] == ["none"] and types["Depth"]["default_option"] == "none"  # no MiDaS
        # One of the extension's weight-free modules, by its label: what the extension's own code made of the picture
        # (tests/test_control_modules.py has them all).
        with np.load(Path(__file__).parent / "data" / "controlnet_extension_modules.npz") as made:
            drawing, expected = made["image/drawing"], made["scribble_xdog|10.0|drawing"]
        body = {
            "controlnet_module": "scribble_xdog",
            "controlnet_input_images": [_b64(Image.fromarray(drawing))],
            "controlnet_threshold_a": 10,
        }
        answer = http.post("/controlnet/detect", json=body)
        assert answer.status_code == 200, answer.text
        assert (np.asarray(decode(answer.json()["images"][0]).convert("RGB")) == expected).all()
        rng = np.random.default_rng(1)
        picture = (rng.random((48, 80, 3)) * 255).astype(np.uint8)
        answer = http.post(
            "/controlnet/detect",
            json={
                "controlnet_module": "canny",
                "controlnet_input_images": [_b64(Image.fromarray(picture))],
                "controlnet_threshold_a": 50,
                "controlnet_threshold_b": 120,
            },
        )
        assert answer.status_code == 200 and answer.json()["info"] == "Success"
        detected = np.asarray(decode(answer.json()["images"][0]))
        assert detected.shape == (48, 80, 3) and (detected == cv2.Canny(picture, 50, 120)[:, :, None]).all()
        # An annotator, by the extension's old name, from the server's model.annotators_dir.
        body = {"controlnet_module": "hed", "controlnet_input_images": [_b64(Image.fromarray(picture))]}
        answer = http.post("/controlnet/detect", json=body)
        assert answer.status_code == 200, answer.text
        own = preprocess(Image.fromarray(picture), "softedge_hed", annotators=service.run.config.model.annotators_dir)
        assert np.array_equal(np.asarray(decode(answer.json()["images"][0])), np.asarray(own))
        # A unit with it steers as the canny one does: 200, and the parameters name the module.
        answer = http.post(
            "/sdapi/v1/txt2img", json={**FIELDS, "alwayson_scripts": {"controlnet": {"args": [_unit(module="hed")]}}}
        )
        assert answer.status_code == 200, answer.text
        assert '"Module: softedge_hed, Model: tiny-sd-controlnet' in json.loads(answer.json()["info"])["infotexts"][0]


@pytest.mark.parametrize(
    "scripts, wanted",
    [
        (
            {"controlnet": {"args": [_unit(model="control_v11p_sd15_canny [d14c016b]")]}},
            "'control_v11p_sd15_canny' is not loaded on this server; it has tiny-sd-controlnet",
        ),
        ({"adetailer": {"args": []}}, "alwayson_scripts: 'adetailer': this script is not built (ControlNet is)"),
        ({"controlnet": {"args": "all of them"}}, "alwayson_scripts.controlnet: must be an object with args"),
        ({"controlnet": {"args": [_unit(image="%%%not base64")]}}, "args[0].image: not base64"),
        ({"controlnet": {"args": [_unit(image="bm90IGFuIGltYWdl")]}}, "args[0].image: is not an image PIL can read"),
        ({"controlnet": {"args": [_unit(image="")]}}, "args[0].image: give the control image"),
        ({"controlnet": {"args": [_unit(mask=_b64(_disc()))]}}, "args[0].mask: a unit's own mask (where the unit"),
        ({"controlnet": {"args": [_unit(mask_image=_b64(_disc()))]}}, "args[0].mask_image: a unit's own mask"),
        (
            {"controlnet": {"args": [_unit(image={"image": _b64(_disc()), "mask": _b64(_disc())})]}},
            "args[0].image.mask: a unit's own mask",
        ),
        (
            {"controlnet": {"args": [_unit(advanced_weighting=[0.75] * 13)]}},
            "ControlNet 0 takes 7 residual weights, one",
        ),
        ({"controlnet": {"args": [_unit(effective_region_mask="x" * 64)]}}, "args[0].effective_region_mask: a unit's"),
        ({"controlnet": {"args": [_unit(ipadapter_input=["x"])]}}, "args[0].ipadapter_input: IP-Adapter is not built"),
        ({"controlnet": {"args": [_unit(union_control_type="Depth")]}}, "args[0].union_control_type: 'Depth'"),
        ({"controlnet": {"args": [_unit(hr_option="Sometimes")]}}, "args[0].hr_option: 'Sometimes'; one of Both"),
        ({"controlnet": {"args": [_unit(hr_option=[1] * 10_000)]}}, "args[0].hr_option: '[1, 1, 1"),
        ({"controlnet": {"args": [_unit(save_detected_map="no")]}}, "args[0].save_detected_map: must be true or false"),
        ({"controlnet": {"args": [_unit(input_image=_b64(_disc()))]}}, "args[0]: give image or input_image"),
        ({"controlnet": {"args": [_unit(control_mode=3)]}}, "args[0].control_mode: '3'; one of Balanced (0), My"),
        ({"controlnet": {"args": [_unit(control_mode="Louder")]}}, "args[0].control_mode: 'Louder'; one of Balanced"),
        ({"controlnet": {"args": [_unit(advanced_weighting=[True])]}}, "args[0].advanced_weighting: each weight must"),
        ({"controlnet": {"args": [_unit(advanced_weighting=[1] * 65)]}}, "args[0].advanced_weighting: a list of 1 to"),
        ({"controlnet": {"args": [_unit(advanced_weighting="all")]}}, "args[0].advanced_weighting: a list of 1 to"),
        ({"controlnet": {"args": [_unit(advanced_weighting=[10**400])]}}, "args[0].advanced_weighting: each weight"),
        ({"controlnet": {"args": [_unit(weight="heavy")]}}, "args[0].weight: must be a number"),
        ({"controlnet": {"args": [_unit(weight=1e300)]}}, "args[0].weight: must be from 0 to 2"),
        ({"controlnet": {"args": [_unit(weight=10**400)]}}, "args[0].weight: must be a number"),
        ({"controlnet": {"args": [_unit(threshold_a=[1])]}}, "args[0].threshold_a: must be a number"),
        ({"controlnet": {"args": [_unit(enabled="false")]}}, "args[0].enabled: must be true or false, got 'false'"),
        ({"controlnet": {"args": [_unit(model=["a list"])]}}, "args[0].model: \"['a list']\" is not loaded"),
        ({"controlnet": {"args": [_unit(guidance_start=0.9, guidance_end=0.2)]}}, "guidance_start (0.9) must be below"),
        (
            {"controlnet": {"args": [_unit(module="depth_midas")]}},
            "'depth_midas' needs dpt_hybrid-midas-501f0c75.pt in",
        ),
        ({"controlnet": {"args": [_unit(module="openpose")]}}, "'openpose' needs body_pose_model.pth, hand_pose_model"),
        ({"controlnet": {"args": [_unit(module="seg_ofade20k")]}}, "'seg_ofade20k' needs an annotator model tpugen"),
        ({"controlnet": {"args": [_unit(resize_mode="Stretch")]}}, "args[0].resize_mode: 'Stretch'"),
        ({"controlnet": {"args": [_unit(), _unit()]}}, "args[1].model: 'tiny-sd-controlnet' has a unit already"),
        ({"controlnet": {"args": [_unit()] * 5}}, "args: 5 units; at most 4"),
        ({"controlnet": {"args": ["a unit"]}}, "args[0]: must be an object (a ControlNet unit)"),
        ("controlnet", "alwayson_scripts: must be an object of scripts by name"),
    ],
)
def test_hostile_units_are_a_422_naming_them(controlnet_server, scripts, wanted):
    url, _ = controlnet_server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        answer = http.post("/sdapi/v1/txt2img", json={**FIELDS, "alwayson_scripts": scripts})
    assert answer.status_code == 422, answer.text
    assert any(wanted in line for line in answer.json()["detail"]), answer.json()["detail"]


def test_hostile_detect_requests(controlnet_server):
    url, _ = controlnet_server
    one = _b64(_disc())
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        for body, wanted in (
            ({"controlnet_module": "openpose", "controlnet_input_images": [one]}, "'openpose' needs body_pose_model"),
            ({"controlnet_module": "normal_bae", "controlnet_input_images": [one]}, "'normal_bae' needs an annotator"),
            ({"controlnet_module": "canny", "controlnet_input_images": [one] * 5}, "5 images; give 1 to 4"),
            ({"controlnet_module": "canny", "controlnet_input_images": []}, "0 images; give 1 to 4"),
            ({"controlnet_module": "canny", "controlnet_input_images": ["bm90IGFuIGltYWdl"]}, "not an image PIL"),
            ({"controlnet_module": "tile", "controlnet_input_images": [one], "controlnet_threshold_a": 0}, "factor"),
            ({"controlnet_module": ["canny"], "controlnet_input_images": [one]}, "controlnet_module"),
            (
                {"controlnet_module": "softedge_hed", "controlnet_input_images": [_b64(Image.new("RGB", (10, 300)))]},
                "10x300: an annotator takes images at most 16 times as long as wide",
            ),
        ):
            answer = http.post("/controlnet/detect", json=body)
            assert answer.status_code == 422, answer.text
            assert any(wanted in line for line in answer.json()["detail"]), answer.json()["detail"]
        # A 1x1 image runs through an annotator (at its least side, 64), as the extension's detect does.
        dot = http.post(
            "/controlnet/detect",
            json={"controlnet_module": "hed", "controlnet_input_images": [_b64(Image.new("RGB", (1, 1)))]},
        )
        assert dot.status_code == 200 and decode(dot.json()["images"][0]).size == (1, 1), dot.text
        # A page on another site can send text/plain unasked: refused before anything is read.
        form = http.post(
            "/controlnet/detect", content=b"controlnet_module=canny", headers={"content-type": "text/plain"}
        )
        assert form.status_code == 415
        # A body past the image routes' limit, declared or chunked, is a 413 before it is read whole.
        huge = http.post(
            "/controlnet/detect", content=b"{" + b" " * (90 << 20) + b"}", headers={"content-type": "application/json"}
        )
        assert huge.status_code == 413 and huge.json()["detail"][0].startswith("the body is over")
    # Units on a request the server cannot steer (SD upscale) are refused, naming them.
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        answer = http.post(
            "/sdapi/v1/img2img",
            json={
                **FIELDS,
                "init_images": [one],
                "script_name": "SD upscale",
                "alwayson_scripts": {"controlnet": {"args": [_unit()]}},
            },
        )
    assert answer.status_code == 422
    assert any("ControlNet units are not built with script_name sd upscale" in line for line in answer.json()["detail"])
    assert json.loads(json.dumps(answer.json()))  # a JSON body, one line per problem


def test_the_extensions_minus_one_thresholds_are_the_preprocessors_own(controlnet_server):
    url, _ = controlnet_server
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        answers = [
            http.post("/sdapi/v1/txt2img", json={**FIELDS, "alwayson_scripts": {"controlnet": {"args": [unit]}}})
            for unit in (_unit(), _unit(threshold_a=-1, threshold_b=-1, processor_res=-1))
        ]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    made = [pixels(decode(a.json()["images"][0])) for a in answers]
    assert (made[0] == made[1]).all()


def test_a_run_sent_with_control_images_travels_them_and_a_path_is_refused(controlnet_server, tmp_path):
    import hashlib

    from typer.testing import CliRunner

    from tpugen.cli import app

    url, service = controlnet_server
    _disc().save(tmp_path / "disc.png")
    prompts = [{"prompt": "a red circle", "control_image": "disc.png", "control_module": "invert"}]
    config = tiny_config(tmp_path, **SMALL, prompts=prompts, output={"dir": str(tmp_path / "local"), "run_id": "cn"})
    config["model"]["controlnets"] = CONTROLNETS
    path = write_config(tmp_path / "c.yaml", config)
    result = CliRunner().invoke(app, ["generate", str(path), "--server", url, "--quiet"], env={"TPUGEN_API_KEY": KEY})
    assert result.exit_code == 0, result.output
    local = tmp_path / "local" / "cn"
    report = json.loads((local / "report.json").read_text())
    assert report["complete"] is True and report["compiles_after_warmup"] == 0
    (image,) = sorted(local.glob("[0-9]*.png"))
    (unit,) = json.loads(Image.open(image).text["tpugen"])["controlnet_units"]
    assert unit["image_sha256"] == hashlib.sha256((tmp_path / "disc.png").read_bytes()).hexdigest()
    assert unit["module"] == "invert"
    # A path is never read on the server: the run is refused naming the key, and nothing starts.
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        body = {"prompts": [{"prompt": "a", "control_image": "/etc/passwd"}], "output": {"run_id": "cn-path"}}
        answer = http.post("/v1/runs", json=body)
        assert answer.status_code == 422, answer.text
        (line,) = answer.json()["detail"]
        assert line.startswith("prompts[0].control_image: ") and "data:" in line
        assert http.get("/v1/runs/cn-path").status_code == 404
        # Other ControlNets than the server's are refused, naming its own.
        other = {**body, "prompts": ["a"], "model": {"controlnets": [{"id": "tiny-sd-controlnet", "scale": 0.5}]}}
        answer = http.post("/v1/runs", json=other)
        assert answer.status_code == 422
        assert answer.json()["detail"] == [
            "model.controlnets: the server runs tiny-sd-controlnet (scale 1); leave it out or equal"
        ]
        # Inpainting the masked area alone with units is refused (the control is not cropped with it).
        answer = http.post(
            "/sdapi/v1/img2img",
            json={
                **FIELDS,
                "init_images": [_b64(_disc())],
                "mask": _b64(_disc()),
                "inpaint_full_res": True,
                "alwayson_scripts": {"controlnet": {"args": [_unit()]}},
            },
        )
        assert answer.status_code == 422 and "inpaint_full_res: inpainting the masked area alone" in answer.text
