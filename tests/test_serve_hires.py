"""The web UI's hires fix (txt2img's enable_hr) on a server whose config has a hires section, through the real
`webuiapi` client: warm from the start, and the image a run config with the same hires fix makes."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from conftest import run_cli, tiny_config, write_config
from PIL import Image
from serve_support import AUTH, KEY, metric, running_server, wait_ready

pytestmark = pytest.mark.xla

# 32x32 first passes (a size the session's server does not warm), made 64x64 by the second pass.
HIRES = {"scale": 2, "steps": 4, "strength": 0.5}


def test_enable_hr_is_the_configs_hires_fix_warm_and_the_same_image_a_run_makes(tmp_path):
    import webuiapi

    config = tiny_config(tmp_path, height=32, width=32, hires=HIRES, output={"dir": str(tmp_path / "runs")})
    del config["prompts"]
    config["output"].pop("run_id")
    config["serve"] = {"batch_window_ms": 300, "tasks": ["txt2img"]}
    with running_server(write_config(tmp_path / "serve.yaml", config), tmp_path / "runs", KEY) as (url, service):
        wait_ready(url, seconds=300)
        assert service.warm_summary().endswith("; hires fix x2 latent")
        host, port = url.removeprefix("http://").split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
        fields = {"prompt": "a red fox in snow", "seed": 7, "steps": 3, "cfg_scale": 7.5, "width": 32, "height": 32}
        result = api.txt2img(
            **fields,
            negative_prompt="blurry",
            sampler_name="DDIM",
            enable_hr=True,
            hr_scale=2,
            hr_second_pass_steps=4,
            denoising_strength=0.5,
            # The web UI's words for "as the first pass" ask for nothing more.
            hr_checkpoint_name="Use same checkpoint",
            hr_sampler_name="Use same sampler",
            hr_prompt=fields["prompt"],
        )
        assert result.image.size == (64, 64)
        assert (
            "Size: 32x32, Model: tiny-sd, Denoising strength: 0.5, Hires upscale: 2, Hires steps: 4, "
            "Hires upscaler: Latent," in result.info["infotexts"][0]
        )
        assert metric(url, "tpugen_compiles_after_warmup_total") == 0
        # Another upscaler than the config's is another graph: not warm, said so (serve.new_shapes: reject).
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            body = {**fields, "enable_hr": True, "hr_upscaler": "Lanczos"}
            answer = http.post("/sdapi/v1/txt2img", json=body)
            # denoising_strength 0: the web UI's upscale alone (before: a 422 whatever the server warmed). With the
            # latent upscaler its scaled latents are decoded by a graph of their own: not warm here, and said so.
            alone = http.post("/sdapi/v1/txt2img", json={**fields, "enable_hr": True, "denoising_strength": 0})
        assert answer.status_code == 422
        assert answer.json()["detail"][0].startswith(
            "hires fix x2 lanczos is not warm (the server's config warms hires x2 latent) (serve.new_shapes: reject)"
        )
        assert alone.status_code == 422 and alone.json()["detail"][0].startswith(
            "hires fix x2 latent alone is not warm"
        )
        served = np.asarray(result.image.convert("RGB"))

    # The run config's hires fix makes the same pixels, batch for batch (the same graphs, from the same noise).
    run = tiny_config(tmp_path, prompts=[fields["prompt"]], height=32, width=32, hires=HIRES)
    assert run_cli("generate", write_config(tmp_path / "run.yaml", run), "--quiet").exit_code == 0
    (made,) = (tmp_path / "outputs" / "run").glob("00000-*.png")
    assert json.loads(Image.open(made).text["tpugen"])["hires"]["height"] == 64
    assert (np.asarray(Image.open(made).convert("RGB")) == served).all()
