"""The web UI's tiling through `tpugen serve`: warm on a server whose config says serve.tiling (its own graphs,
compiled once), the image a run config with tiling makes; on the session's server, which does not warm it, a 422
naming it; hostile values a 422, never a 500. Why a tiled image tiles: tests/test_tiling.py."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from conftest import FIRST_CALL, cold_graphs, run_cli, tiny_config, write_config
from PIL import Image
from serve_support import AUTH, BASE, KEY, decode, metric, pixels, running_server, wait_ready

from tpugen.plan import ShapeKey

pytestmark = pytest.mark.xla

# One small shape: 64x64, batch 1, 2 steps (CFG on).
SMALL = {"height": 64, "width": 64, "batch_size": 1, "steps": 2}
FIELDS = {"prompt": "a tiled floor", "negative_prompt": "blurry", "seed": 7, "steps": 2, "cfg_scale": 7.5}


def test_tiling_is_warm_once_its_own_graphs_and_the_image_a_run_makes(tmp_path):
    config = tiny_config(tmp_path, **SMALL, output={"dir": str(tmp_path / "runs")})
    del config["prompts"]
    config["output"].pop("run_id")
    config["serve"] = {"batch_window_ms": 0, "tasks": ["txt2img"], "tiling": True}
    with running_server(write_config(tmp_path / "serve.yaml", config), tmp_path / "runs", KEY) as (url, service):
        wait_ready(url, seconds=300)
        assert service.warm_summary().endswith("; tiled and untiled")
        engine = service.engines[0]
        key = (str(ShapeKey(height=64, width=64, batch_size=1, cfg=True, tiling=True)), engine.loaded.default_scheduler)
        assert key[0] == "64x64 b1 cfg tiled"
        warm = engine.warm[key]
        assert cold_graphs(warm) == FIRST_CALL  # three graphs, as any shape key
        # Its own denoising step and decoding, compiled for it; text encoding has no convolution: the untiled
        # key's graph, warmed just before it.
        compiled = warm["graphs_per_phase"]
        assert (compiled["text encoding"], compiled["first denoising step"], compiled["decoding"]) == (0, 1, 1)

        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            # Untiled, tiled, untiled, tiled: the switch is undone after each call.
            answers = [http.post("/sdapi/v1/txt2img", json={**FIELDS, "tiling": tiled}) for tiled in (0, 1, 0, 1)]
        assert [answer.status_code for answer in answers] == [200] * 4, answers[0].text
        infos = [json.loads(answer.json()["info"])["infotexts"][0] for answer in answers]
        assert ["Tiling: True" in info for info in infos] == [False, True, False, True]
        assert "Model: tiny-sd, Tiling: True, Version: tpugen" in infos[1]
        made = [pixels(decode(answer.json()["images"][0])) for answer in answers]
        assert (made[0] == made[2]).all() and (made[1] == made[3]).all()
        assert np.abs(made[0] - made[1]).max() > 10  # the same seed, another image
        assert metric(url, "tpugen_compiles_after_warmup_total") == 0
        served = made[1]

    # A run config's tiling makes the same pixels (the same graphs, from the same noise), recorded as tiled.
    run = tiny_config(tmp_path, **SMALL, prompts=[FIELDS["prompt"]], tiling=True)
    assert run_cli("generate", write_config(tmp_path / "run.yaml", run), "--quiet").exit_code == 0
    run_dir = tmp_path / "outputs" / "run"
    (image,) = run_dir.glob("00000-*.png")
    png = Image.open(image)
    assert json.loads(png.text["tpugen"])["tiling"] is True and ", Tiling: True, " in png.text["parameters"]
    assert (pixels(png) == served).all()
    report = json.loads((run_dir / "report.json").read_text())
    assert [entry["shape_key"] for entry in report["warmup"]] == ["64x64 b1 cfg tiled"]


def test_a_tiled_request_the_server_has_not_warmed_is_refused_naming_tiling(client):
    answer = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a tiled floor", "tiling": True})
    assert answer.status_code == 422
    assert answer.json()["detail"][0].startswith(
        "tiling is not warm (serve.tiling: false) (serve.new_shapes: reject); warm: sizes 64x64"
    )
    # Leaving it out, or false, is the untiled image the server keeps warm.
    assert client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a floor", "tiling": False}).status_code == 200


@pytest.mark.parametrize("value", ['"yes please"', "{}", "1e309", "[true]"])
def test_a_hostile_tiling_value_is_a_422_not_a_500(client, value):
    body = f'{{"prompt": "a floor", "steps": 3, "width": 64, "height": 64, "tiling": {value}}}'
    for route in ("/sdapi/v1/txt2img", "/sdapi/v1/img2img"):
        answer = client.post(route, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 422, (route, value, answer.text)
        assert any("tiling" in line for line in answer.json()["detail"]), answer.text
