"""`tpugen serve` over HTTP refuses what one image's rules refuse (tpugen.config.request): 422, one line each,
never an image made of it."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.xla

# A request the session's server (tests/conftest.py's `server`) makes at once: its warm size, steps and sampler.
WARM = {"prompt": "a cat", "negative_prompt": "blurry", "steps": 3, "cfg_scale": 7.5, "width": 64, "height": 64}


@pytest.mark.parametrize(
    "fields,line",
    [
        # Finite to JSON and pydantic, infinite in float32; past where the web UI's CFG slider stops.
        ({"cfg_scale": 1e308}, "guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 1e+308"),
        # Not "the server's width": 0 was taken for unset before.
        ({"width": 0}, "size: 0x64: width and height must be positive multiples of 8"),
        (
            {"prompt": "a cat\x00 on a mat"},
            "prompt: control character U+0000 at character 5 (only line breaks and tabs are allowed)",
        ),
    ],
    ids=["cfg_scale 1e308", "width 0", "NUL in the prompt"],
)
def test_a_web_ui_request_past_a_bound_is_refused_in_one_line(client, fields, line):
    body = json.dumps({**WARM, **fields})  # ASCII: the NUL travels as \u0000, as a client's JSON writes it
    response = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text[:200]  # not 200 with an image
    assert response.json()["detail"] == [line]


def test_an_openai_request_with_a_control_character_is_refused_in_one_line(client):
    response = client.post("/v1/images/generations", json={"prompt": "a \x1b[2Jcat", "size": "64x64"})
    assert response.status_code == 422, response.text[:200]
    assert response.json()["detail"] == [
        "prompt: control character U+001B at character 2 (only line breaks and tabs are allowed)"
    ]
