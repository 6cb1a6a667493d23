"""`tpugen serve`'s A1111 (web UI) API, /sdapi/v1/*: txt2img's images and infotexts, samplers and seeds, requests
coalescing into batches, one line per problem in a bad request, options, interrupt and the other endpoints."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import OTHER_GRAPH, PROMPTS
from PIL import Image
from serve_support import AUTH, BASE, batches, decode, metric, pixels, txt2img

from tpugen.outputs.png import image_filename

pytestmark = pytest.mark.xla


def test_txt2img_gives_the_image_and_parameters_generate_writes(client, xla_run):
    answer = txt2img(client, prompt=PROMPTS[1], seed=8)
    (image,) = [decode(b64) for b64 in answer["images"]]
    reference = Image.open(xla_run / image_filename(1, 8, PROMPTS[1]))
    assert image.text["parameters"] == reference.text["parameters"]  # the same chunk `tpugen generate` writes
    assert int(np.abs(pixels(image) - pixels(reference)).max()) <= OTHER_GRAPH
    info = json.loads(answer["info"])
    assert (info["seed"], info["all_seeds"], info["prompt"], info["all_prompts"]) == (8, [8], PROMPTS[1], [PROMPTS[1]])
    assert (info["steps"], info["cfg_scale"], info["width"], info["height"], info["sampler_name"]) == (
        3,
        7.5,
        64,
        64,
        "DDIM",
    )
    assert info["infotexts"] == [reference.text["parameters"]]
    assert answer["parameters"]["prompt"] == PROMPTS[1] and answer["parameters"]["enable_hr"] is False


def test_a_warm_second_sampler_answers_without_compiling_and_the_engine_keeps_its_own(client, server):
    url, service = server
    compiled = metric(url, "tpugen_compiles_after_warmup_total")
    other = txt2img(client, prompt="a cat", seed=5, sampler_name="Euler a")
    own = txt2img(client, prompt="a cat", seed=5)
    assert [json.loads(answer["info"])["sampler_name"] for answer in (other, own)] == ["Euler a", "DDIM"]
    images = [decode(answer["images"][0]) for answer in (other, own)]
    assert "Sampler: Euler a," in images[0].text["parameters"] and "Sampler: DDIM," in images[1].text["parameters"]
    assert int(np.abs(pixels(images[0]) - pixels(images[1])).max()) > 0
    assert metric(url, "tpugen_compiles_after_warmup_total") == compiled  # warmed at start, compiled nothing now
    assert service.engines[0].scheduler_name == "DDIM"  # what runs on this engine record


def test_seed_minus_one_and_n_iter_times_batch_size(client):
    info = json.loads(txt2img(client, prompt="a cat", seed=-1, batch_size=2, n_iter=2)["info"])
    seeds = info["all_seeds"]
    assert len(seeds) == 4 and seeds == list(range(seeds[0], seeds[0] + 4)) and 0 <= seeds[0] < 4294967294
    assert json.loads(txt2img(client, prompt="a cat", seed=seeds[0], batch_size=1)["info"])["all_seeds"] == seeds[:1]


def test_requests_coalesce_into_full_batches_and_their_images_do_not_depend_on_companions(client, server, monkeypatch):
    alone = pixels(decode(txt2img(client, prompt="an owl", seed=101)["images"][0]))
    before = batches(client)
    answers = {}
    # A full batch leaves at once, so a long window costs these four nothing and no late thread splits a pair.
    monkeypatch.setattr(server[1].queue, "window", 30.0)
    https = [httpx.Client(base_url=str(client.base_url), headers=AUTH, timeout=120) for _ in range(4)]

    def ask(http: httpx.Client, seed: int) -> None:
        with http:
            answers[seed] = txt2img(http, prompt="an owl", seed=seed)

    threads = [threading.Thread(target=ask, args=pair) for pair in zip(https, (101, 102, 103, 104), strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(answers) == [101, 102, 103, 104]
    assert batches(client) - before == 2  # four one-image requests, two calls at the compiled batch size 2
    assert int(np.abs(pixels(decode(answers[101]["images"][0])) - alone).max()) <= OTHER_GRAPH


@pytest.mark.parametrize(
    "fields,status,lines",
    [
        (
            {"restore_faces": True, "steps": "many"},
            422,
            ["restore_faces: face restoration is not built", "steps: expected an integer, got 'many'"],
        ),
        (
            {"enable_hr": True, "hr_upscaler": "R-ESRGAN 4x+", "hr_resize_x": 1024, "hr_scale": 8},
            422,
            [
                "hr_resize_x: a second pass sized by hr_resize_x/y is not built; give hr_scale",
                "hr_upscaler: 'R-ESRGAN 4x+' is not built; Latent, Lanczos",
                "hr_scale: must be above 1 and at most 4, got 8",
            ],
        ),
        (
            {"enable_hr": True, "hr_scale": 1.5},
            422,
            [
                "hires fix x1.5 latent is not warm (the server's config has no hires section) (serve.new_shapes: "
                "reject); warm: sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, "
                "img2img, inpaint"
            ],
        ),
        ({"enable_hr": False, "restore_faces": False, "alwayson_scripts": {}, "prompt": "fine"}, 200, None),
        ({"script_name": "x/y/z plot"}, 422, ["script_name: scripts are not built"]),
        ({"prompt": "x" * 10_001}, 422, ["prompt: 10001 characters; at most 10000"]),
        (  # 90 tokens of tiny-sd's tokenizer: two chunks (tests/test_prompt_reading.py)
            {"prompt": " ".join(["ab"] * 45)},
            422,
            [
                "a prompt of 2 chunks of 75 tokens is not warm (serve.prompt_chunks: 1) (serve.new_shapes: reject); "
                "warm: sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, "
                "inpaint"
            ],
        ),
        (
            {"negative_prompt": "a BREAK b BREAK c BREAK d"},
            422,
            [
                "negative_prompt 'a BREAK b BREAK c BREAK d': a prompt needs 4 chunks of 75 tokens, more than max_chunks (3)"
            ],
        ),
        (
            {"override_settings": {"CLIP_stop_at_last_layers": 2}},
            422,
            [
                "clip skip 2 is not warm (clip_skip: 1) (serve.new_shapes: reject); warm: sizes 64x64 (width x "
                "height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint"
            ],
        ),
        (
            {"override_settings": {"CLIP_stop_at_last_layers": "two", "sd_vae": "other"}},
            422,
            [
                "override_settings.sd_vae: this server keeps 'Automatic'; got 'other'",
                "override_settings.CLIP_stop_at_last_layers: must be a whole number from 1 to 12, got 'two'",
            ],
        ),
        (  # the worst of the syntax at the most characters a prompt may have: 4,999 brackets left open
            {"prompt": "(a" * 4_999},
            422,
            [f"prompt '{'(a' * 28}(...': a prompt needs 67 chunks of 75 tokens, more than max_chunks (3)"],
        ),
        ({"batch_size": 5, "n_iter": 2}, 422, ["10 images asked for; this server makes at most 9 per request"]),
        (
            {"sampler_name": "DPM++ 3M"},
            422,
            [
                "sampler_name: unknown sampler 'DPM++ 3M'; valid names: DPM++ 2M, DPM++ 2M Karras, DPM++ 2M SDE, "
                "Euler, Euler a, Heun, LMS, DDIM, PNDM, UniPC, DEIS, LCM"
            ],
        ),
        (
            {"seed": 2**63, "cfg_scale": -1},
            422,
            [
                "guidance scale: must be a finite number, 0 or more; got -1.0",
                "seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got 9223372036854775808",
            ],
        ),
        (
            {"width": 96},
            422,
            [
                "size 96x64 is not warm (serve.new_shapes: reject); warm: sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint"
            ],
        ),
        (
            {"sampler_name": "Euler"},
            422,
            [
                "sampler 'Euler' is not warm (serve.new_shapes: reject); warm: sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint"
            ],
        ),
        (
            {"prompt": "a \ud83d cat", "negative_prompt": "\udc00"},  # half an emoji, as a cut JS string sends
            422,
            [
                "prompt: unpaired surrogate U+D83D at character 2 (not valid Unicode text)",
                "negative_prompt: unpaired surrogate U+DC00 at character 0 (not valid Unicode text)",
            ],
        ),
        (
            {"prompt": " ", "n_iter": 0, "steps": 0, "sampler_name": "Bogus", "width": 60},
            422,
            [
                "sampler_name: unknown sampler 'Bogus'; valid names: DPM++ 2M, DPM++ 2M Karras, DPM++ 2M SDE, "
                "Euler, Euler a, Heun, LMS, DDIM, PNDM, UniPC, DEIS, LCM",
                "batch_size and n_iter: must be at least 1, got 1 and 0",
                "prompt: is empty",
                "size: 60x64: width and height must be positive multiples of 8",
                "steps: must be from 1 to 1000, got 0",
            ],
        ),
        (
            {"batch_size": 100_000, "n_iter": 100_000},  # refused without building ten billion images' specs
            422,
            ["10000000000 images asked for; this server makes at most 9 per request"],
        ),
        (
            {"sampler_name": "Euler a", "scheduler": "Karras"},
            422,
            ["scheduler: 'Karras' with sampler 'Euler a' is not built; Karras forms: DPM++ 2M Karras"],
        ),
        (
            {"sampler_name": "DPM++ 2M", "scheduler": "Exponential"},
            422,
            ["scheduler: 'Exponential' is not built; Automatic, or Karras with DPM++ 2M Karras"],
        ),
        (
            {"sampler_name": "DPM++ 2M", "scheduler": "karras"},
            422,
            [
                "sampler 'DPM++ 2M Karras' is not warm (serve.new_shapes: reject); warm: sizes 64x64 (width x height; "
                "cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint"
            ],
        ),
        ({"sampler_name": "Euler a", "scheduler": "Automatic"}, 200, None),
    ],
    ids=[
        "missing features and a bad type",
        "hires fix fields that are not built",
        "a hires fix the server does not warm",
        "asking for nothing",
        "script",
        "long prompt",
        "two chunks, not warm",
        "more chunks than max_chunks",
        "4,999 open brackets",
        "a clip skip not warm",
        "a clip skip that is no number",
        "too many",
        "sampler",
        "seed and guidance out of range",
        "cold size",
        "cold sampler",
        "half a UTF-16 pair",
        "every problem at once",
        "ten billion images",
        "a Karras form that is not built",
        "a schedule that is not built",
        "Karras maps to the sampler's Karras form",
        "automatic schedule",
    ],
)
def test_bad_requests_get_one_line_per_problem(client, fields, status, lines):
    body = json.dumps({**BASE, "prompt": "a cat", **fields})  # ASCII, escapes as a client writes them (\ud83d)
    response = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    if lines is not None:
        assert response.json()["detail"] == lines


def test_an_infinite_cfg_scale_is_refused_alone_not_with_its_batch(client):
    body = b'{"prompt": "a cat", "steps": 3, "width": 64, "height": 64, "cfg_scale": 1e999}'  # JSON's inf
    response = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": "application/json"})
    assert (response.status_code, response.json()["detail"]) == (
        422,
        ["guidance scale: must be a finite number, 0 or more; got inf"],
    )


def test_web_ui_clients_may_set_the_served_checkpoint_and_list_schedules(client):
    assert client.get("/sdapi/v1/schedulers").json()[1]["label"] == "Karras"
    same = client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "tiny-sd", "samples_format": "png"})
    assert (same.status_code, same.json()) == (200, None)
    other = client.post(
        "/sdapi/v1/options",
        json={"sd_model_checkpoint": "sdxl-base", "sd_vae": "x", "samples_format": "jpg", "send_seed": "yes"},
    )
    assert (other.status_code, other.json()["detail"]) == (
        422,
        [
            "samples_format: this server keeps 'png'; got 'jpg'",
            "sd_model_checkpoint: this server serves 'tiny-sd' and does not switch models; got 'sdxl-base'",
            "sd_vae: this server keeps 'Automatic'; got 'x'",
            "send_seed: must be true or false",
        ],
    )


def test_the_web_uis_own_api_tests_of_its_utility_routes_pass(client):
    """The web UI's test/test_utils.py, sent as it sends them: an options write that round-trips, and every
    listing route 200 in the web UI's shape. Before: send_seed missing, seven routes 404."""
    before = client.get("/sdapi/v1/options").json()["send_seed"]
    assert client.post("/sdapi/v1/options", json={"send_seed": not before}).status_code == 200
    assert client.get("/sdapi/v1/options").json()["send_seed"] is (not before)
    # A key the server does not know is ignored, as the web UI ignores it; a refused write changes nothing.
    assert client.post("/sdapi/v1/options", json={"send_seed": before, "some_extension_key": 3}).status_code == 200
    assert client.post("/sdapi/v1/options", json={"send_seed": not before, "samples_format": "jpg"}).status_code == 422
    assert client.get("/sdapi/v1/options").json()["send_seed"] is before
    listed = {}
    for route in (
        "cmd-flags",
        "samplers",
        "upscalers",
        "sd-models",
        "hypernetworks",
        "face-restorers",
        "realesrgan-models",
        "prompt-styles",
        "embeddings",
        "latent-upscale-modes",
    ):
        answer = client.get(f"/sdapi/v1/{route}")
        assert answer.status_code == 200, (route, answer.text[:200])
        listed[route] = answer.json()
    assert listed["cmd-flags"]["api"] is True and "/tmp" not in json.dumps(listed)  # no server path
    assert [u["name"] for u in listed["upscalers"]] == ["None", "Lanczos", "Nearest"]  # the web UI's order
    assert listed["latent-upscale-modes"] == [{"name": "Latent"}]
    assert listed["hypernetworks"] == listed["face-restorers"] == listed["realesrgan-models"] == []
    assert listed["embeddings"] == {"loaded": {}, "skipped": {}}
    assert listed["prompt-styles"] == [
        {"name": "oil", "prompt": "{prompt}, oil painting", "negative_prompt": "blurry"},
        {"name": "moody", "prompt": "dark, moody", "negative_prompt": ""},
    ]


def test_saved_prompt_styles_are_applied_as_the_web_ui_applies_them(client):
    """Before: `styles` was a 422. The server's serve.prompt_styles now apply in order: `{prompt}` stands for
    the prompt, else the style follows after a comma; the image's parameters hold the styled prompt."""
    body = {**BASE, "prompt": "a cat", "negative_prompt": "", "styles": ["oil", "moody"], "seed": 21}
    answer = client.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text[:300]
    info = json.loads(answer.json()["info"])
    assert info["prompt"] == "a cat, oil painting, dark, moody" and info["negative_prompt"] == "blurry"
    plain = client.post(
        "/sdapi/v1/txt2img", json={**body, "styles": [], "prompt": info["prompt"], "negative_prompt": "blurry"}
    )
    assert plain.json()["images"] == answer.json()["images"]  # the same as writing the styled prompt out
    unknown = client.post("/sdapi/v1/txt2img", json={**body, "styles": ["oil", "neon"]})
    assert unknown.status_code == 422
    assert unknown.json()["detail"] == ["styles: no style 'neon' on this server; it has 'oil', 'moody'"]


def test_interrupt_answers_the_web_uis_requests_with_what_they_have_and_no_others(client, server, monkeypatch):
    service = server[1]
    results = {}
    # The device waits after each batch until the test lets it go: what the web UI request has when it is
    # interrupted is then known exactly, whatever the machine's speed.
    gate = threading.Event()
    run_batch = service.device_loops.run_batch

    def batch_then_wait(engine, jobs):
        run_batch(engine, jobs)
        gate.wait(120)

    monkeypatch.setattr(service.device_loops, "run_batch", batch_then_wait)

    def web_ui() -> None:
        body = {**BASE, "prompt": "a cat", "seed": 40, "batch_size": 4, "n_iter": 2, "steps": 8}
        results["web ui"] = client.post("/sdapi/v1/txt2img", json=body)

    def openai() -> None:
        results["openai"] = client.post("/v1/images/generations", json={"prompt": "a dog", "n": 2, "size": "64x64"})

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"not within 120 s: {what}"
            time.sleep(0.01)

    asking = [threading.Thread(target=web_ui), threading.Thread(target=openai)]
    try:
        asking[0].start()
        wait_for(lambda: any(r.pixels for r in service.queue.open_requests()), "the web UI request's first batch")
        (web,) = service.queue.open_requests()
        had = len(web.pixels)  # the device now waits: no more images until the gate opens
        asking[1].start()
        wait_for(lambda: len(service.queue.open_requests()) == 2, "the OpenAI request open beside it")
        assert client.post("/sdapi/v1/interrupt").status_code == 200
    finally:
        gate.set()
        for thread in asking:
            thread.join(120)
    answer = results["web ui"].json()
    info = json.loads(answer["info"])
    assert 1 <= had < 8 and len(answer["images"]) == had and len(info["all_seeds"]) == had
    # Each image answered keeps its own seed: the PNG's parameters and info's list agree.
    seeds = [int(re.search(r"Seed: (\d+)", decode(b64).text["parameters"]).group(1)) for b64 in answer["images"]]
    assert seeds == info["all_seeds"] and set(seeds) <= set(range(40, 48))
    assert results["openai"].status_code == 200 and len(results["openai"].json()["data"]) == 2  # not interrupted


def test_the_web_uis_other_endpoints(client):
    names = [s["name"] for s in client.get("/sdapi/v1/samplers").json()]
    assert names[:3] == ["DPM++ 2M", "DPM++ 2M Karras", "DPM++ 2M SDE"] and "DDIM" in names
    assert client.get("/sdapi/v1/sd-models").json()[0]["title"] == "tiny-sd"
    assert client.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "tiny-sd"
    assert client.get("/sdapi/v1/progress").json()["progress"] == 0.0
    assert client.get("/sdapi/v1/scripts").json() == {"txt2img": [], "img2img": ["sd upscale"]}
    assert client.post("/sdapi/v1/interrupt").status_code == 200


def test_override_settings_may_hold_what_the_server_keeps_and_any_other_setting_is_named(client):
    """Before: any override_settings was a 422. The web UI's test requests send `override_settings: {}`; clients
    send the checkpoint and clip skip 1 with every request; a clip skip is honoured where it is warm."""
    body = {**BASE, "prompt": "a cat", "seed": 3}
    same = {"CLIP_stop_at_last_layers": 1, "sd_model_checkpoint": "tiny-sd", "send_seed": False}
    for settings in ({}, same):
        answer = client.post("/sdapi/v1/txt2img", json={**body, "override_settings": settings})
        assert answer.status_code == 200, answer.text[:300]
    other = {"CLIP_stop_at_last_layers": 2, "eta_noise_seed_delta": 31337, "sd_vae": "other.safetensors"}
    refused = client.post("/sdapi/v1/txt2img", json={**body, "override_settings": other})
    assert refused.status_code == 422
    # A clip skip is a request's to ask (tests/test_prompt_reading.py); this server keeps only its own warm.
    assert refused.json()["detail"] == [
        "override_settings.sd_vae: this server keeps 'Automatic'; got 'other.safetensors'",
        "override_settings: eta_noise_seed_delta: not settings this server changes for a request",
        "clip skip 2 is not warm (clip_skip: 1) (serve.new_shapes: reject); warm: sizes 64x64 (width x height; "
        "cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint",
    ]


def test_hostile_styles_and_settings_are_one_line_each_and_cost_nothing(client):
    """The worst the new fields take: thousands of style names (one long), a style name that is no text,
    thousands of settings, an options write of the same: each a 422 or ignored, in lines of bounded length."""
    body = {**BASE, "prompt": "a cat", "seed": 3}
    many = client.post("/sdapi/v1/txt2img", json={**body, "styles": ["oil"] * 5000})
    assert many.status_code == 422 and many.json()["detail"] == ["styles: 5000 named; at most 16"]
    long = client.post("/sdapi/v1/txt2img", json={**body, "styles": ["x" * 100_000]})
    assert long.status_code == 422 and len(long.json()["detail"][0]) < 300
    assert client.post("/sdapi/v1/txt2img", json={**body, "styles": [{"a": 1}]}).status_code == 422
    settings = {f"k{i}": "v" * 100 for i in range(5000)}  # 0.6 MB, under the 1 MiB body limit
    crowded = client.post("/sdapi/v1/txt2img", json={**body, "override_settings": settings})
    (line,) = crowded.json()["detail"]
    assert crowded.status_code == 422 and line.endswith("and 4992 more: not settings this server changes for a request")
    assert client.post("/sdapi/v1/options", json=settings).status_code == 200  # unknown keys: ignored
    assert set(client.get("/sdapi/v1/options").json()) == {
        "sd_model_checkpoint",
        "samples_format",
        "CLIP_stop_at_last_layers",
        "sd_vae",
        "send_seed",
        "send_size",
    }
