"""`tpugen serve`'s HTTP layer, whatever the API: health and readiness, the API key, metrics, and the one-line
answers to unknown endpoints, wrong methods and bodies it will not read. The session's one server (a real uvicorn
on 127.0.0.1 and a free port, spoken to over HTTP) is tests/conftest.py's `server`; the A1111, OpenAI, runs and
LoRA routes are tested in test_serve_a1111.py, test_serve_openai.py, test_serve_runs.py and test_serve_loras.py,
a server in a process of its own in test_serve_process.py."""

from __future__ import annotations

import httpx
import pytest
from serve_support import AUTH, KEY, txt2img

pytestmark = pytest.mark.xla


def test_health_needs_no_key_and_ready_says_what_is_warm(server):
    url, _ = server
    assert httpx.get(f"{url}/healthz").json() == {"status": "alive"}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 200 and ready.json() == {
        "status": "ready",
        "warm": "sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint",
    }


def test_the_api_key_is_needed_as_bearer_or_as_a_basic_password(server):
    url, _ = server
    assert httpx.get(f"{url}/sdapi/v1/options").status_code == 401
    wrong = httpx.get(f"{url}/sdapi/v1/options", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "Bearer" in wrong.headers["www-authenticate"]
    assert httpx.get(f"{url}/sdapi/v1/options", auth=("any-user", KEY)).status_code == 200
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200


def test_other_endpoints_and_failures_are_one_line_and_counted(client, server, monkeypatch):
    missing = client.get("/sdapi/v1/extra-single-image")
    assert (missing.status_code, missing.json()["detail"]) == (
        404,
        ["/sdapi/v1/extra-single-image: no such endpoint here (tpugen serves the A1111, OpenAI images and runs APIs)"],
    )
    wrong = client.put("/sdapi/v1/txt2img", json={})
    assert (wrong.status_code, wrong.json()["detail"]) == (
        405,
        ["PUT /sdapi/v1/txt2img: not served here (allowed: POST)"],
    )
    nested = b"[" * 100_000 + b"]" * 100_000  # under 1 MiB, deeper than any JSON reader recurses
    for path in ("/sdapi/v1/txt2img", "/v1/images/generations", "/v1/runs"):
        response = client.post(path, content=nested, headers={"Content-Type": "application/json"})
        assert (response.status_code, response.json()["detail"]) == (422, ["body: nested too deeply to read"]), path

    def broken() -> int:
        raise RuntimeError("a bug in the server")

    monkeypatch.setattr(server[1], "interrupt", broken)
    failed = client.post("/sdapi/v1/interrupt")
    assert (failed.status_code, failed.json()["detail"]) == (500, ["RuntimeError: a bug in the server"])
    assert 'tpugen_requests_total{endpoint="/sdapi/v1/interrupt",status="500"} 1.0' in client.get("/metrics").text


def test_a_text_body_over_one_mebibyte_is_refused_and_an_image_body_is_not(client):
    import base64
    import io

    import numpy as np
    from PIL import Image

    response = client.post(
        "/v1/images/generations", content=b"{" + b" " * (1 << 20) + b"}", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413 and response.json()["detail"] == ["the body is over 1024 KiB"]
    # A 1024x1024 init image of noise: a 3 MiB PNG, 4 MiB in base64 (fitted to the warm 64x64 on the host).
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), np.uint8)).save(buffer, "PNG")
    assert buffer.tell() > 3 << 20
    body = {"prompt": "a cat", "init_images": [base64.b64encode(buffer.getvalue()).decode()], "steps": 3}
    answer = client.post(
        "/sdapi/v1/img2img", json={**body, "width": 64, "height": 64, "seed": 1, "include_init_images": True}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["parameters"]["init_images"] == body["init_images"]  # echoed, as asked


def test_metrics_count_requests_images_batches_and_padding(client):
    txt2img(client, prompt="a bee", seed=5)
    text = client.get("/metrics").text
    for name in (
        'tpugen_requests_total{endpoint="/sdapi/v1/txt2img",status="200"}',
        "tpugen_images_total",
        "tpugen_batch_seconds_bucket",
        "tpugen_queue_depth 0.0",
        "tpugen_requests_open 0.0",
        "tpugen_padding_rows_total",
        "tpugen_compiles_after_warmup_total 0.0",
    ):
        assert name in text, name
    # The host's and the device's milliseconds per denoising step of the last batch, as a run's report has them.
    for name in ("tpugen_host_ms_per_step", "tpugen_device_ms_per_step"):
        (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
        assert float(line.split()[1]) > 0, line
