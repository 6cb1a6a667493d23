"""LoRAs behind `tpugen serve`: a <lora:name:scale> tag in a prompt fuses one of serve.lora_dir for that request
only, other LoRA sets are never batched together, and a run sent to the server names them by file stem."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from conftest import OTHER_GRAPH, generate
from PIL import Image
from serve_support import BASE, batches, decode, pixels, run_body, txt2img, wait_run

pytestmark = pytest.mark.xla


def test_a_lora_named_in_the_prompt_is_fused_for_that_request_only(client, server, tmp_path):
    with_lora = txt2img(client, prompt="a cat, <lora:style:0.7>", seed=3)
    image = decode(with_lora["images"][0])
    info = json.loads(with_lora["info"])
    assert info["prompt"] == "a cat"  # the tag is taken out of the prompt, as the web UI does
    lora_dir = server[1].output_root.parent / "loras"
    from tpugen.config.loras import file_hashes

    short = file_hashes(lora_dir / "style.safetensors")[1]
    assert f'Lora hashes: "style: {short}"' in image.text["parameters"]
    # The reply names the LoRA by its name in serve.lora_dir, never by where that folder is on the server.
    (record,) = json.loads(image.text["tpugen"])["loras"]
    assert (record["name"], record["id"]) == ("style", "style.safetensors")
    assert str(lora_dir) not in image.text["tpugen"]
    # The same LoRA through a run config: the same pixels.
    run_dir = generate(
        tmp_path,
        prompts=["a cat"],
        seed=3,
        model={"id": "tiny-sd", "loras": [{"id": str(lora_dir / "style.safetensors"), "scale": 0.7}]},
    )
    (made,) = run_dir.glob("[0-9]*.png")
    assert int(np.abs(pixels(image) - pixels(Image.open(made))).max()) <= OTHER_GRAPH
    # Without the tag, the base model's image, bit for bit whatever was fused before.
    base = [pixels(decode(txt2img(client, prompt="a cat", seed=3)["images"][0])) for _ in range(2)]
    assert np.array_equal(base[0], base[1]) and not np.array_equal(base[0], pixels(image))
    txt2img(client, prompt="<lora:subject:1> a cat", seed=3)
    assert np.array_equal(pixels(decode(txt2img(client, prompt="a cat", seed=3)["images"][0])), base[0])
    listed = client.get("/sdapi/v1/loras").json()
    assert [(lora["name"], lora["path"]) for lora in listed] == [
        ("style", "style.safetensors"),
        ("subject", "subject.safetensors"),
    ]
    unknown = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "<lora:nope:1> a cat"})
    assert (unknown.status_code, unknown.json()["detail"]) == (
        422,
        ["prompt: no LoRA 'nope' in serve.lora_dir (it has: style, subject)"],
    )


def test_requests_with_other_lora_sets_are_never_batched_together(client):
    before = batches(client)
    threads = [
        threading.Thread(target=txt2img, args=(client,), kwargs={"prompt": prompt, "seed": 4})
        for prompt in ("an owl <lora:style:0.5>", "an owl")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert batches(client) - before == 2  # one image each, within one batch window, but other weights


def test_a_run_sent_to_the_server_may_name_loras_of_its_lora_dir(client, server):
    body = run_body("with-lora", prompts=["a cat"], model={"id": "tiny-sd", "loras": [{"id": "style", "scale": 0.7}]})
    assert client.post("/v1/runs", content=body).status_code == 201
    status = wait_run(client, "with-lora")
    assert status["status"] == "complete", status
    assert [(lora["name"], lora["id"], lora["scale"]) for lora in status["report"]["model"]["loras"]] == [
        ("style", "style.safetensors", 0.7)
    ]
    outside = run_body("outside", prompts=["a cat"], model={"loras": [{"id": "../serve.yaml"}]})
    response = client.post("/v1/runs", content=outside)
    assert (response.status_code, response.json()["detail"]) == (
        422,
        [
            "model.loras[0].id: '../serve.yaml': a run sent to the server names a LoRA of serve.lora_dir by its file stem"
        ],
    )
