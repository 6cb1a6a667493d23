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
from PIL import Image
from serve_support import AUTH, KEY, running_server, serve_config, wait_ready


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
