"""Editing by reference over HTTP (FLUX.2): serve.tasks edit and serve.reference_counts at the door, the images of
OpenAI's /v1/images/edits and the web UI's /sdapi/v1/img2img as references, a run's reference_images sent as
bytes, and what a request that cannot be served is told. One server for the module: its compiles dominate."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import run_cli, tiny_config, write_config
from PIL import Image
from serve_support import AUTH, KEY, metric, running_server, serve_config, wait_ready

MODEL = {"id": "tiny-flux2-klein-distilled", "dtype": "float32"}  # no CFG: the cheapest FLUX.2 to warm
SERVE = {"tasks": ["txt2img", "edit"], "reference_counts": [1, 2]}


def _pictures(folder: Path) -> dict[str, Path]:
    """Two 64x64 noise pictures to edit from, by name."""
    rng = np.random.default_rng(11)
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name in ("a", "b"):
        made[name] = folder / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(made[name])
    return made


def _editing_config(tmp: Path, **serve) -> Path:
    """A server's config of MODEL at 64x64, batch 2, 2 steps, warm for edits."""
    path = serve_config(tmp, **{**SERVE, **serve})
    config = yaml.safe_load(path.read_text())
    config.update(model=MODEL, steps=2)
    return write_config(path, config)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- at the door, no server


@pytest.mark.parametrize(
    ("model", "serve", "expected"),
    [
        (
            {"id": "tiny-sd"},
            {"tasks": ["txt2img", "edit"]},
            "serve.tasks: edit: Stable Diffusion 1.x/2.x models do not edit by reference images (FLUX.2 [klein], "
            "FLUX.2 [klein] distilled, FLUX.2 [klein] KV, FLUX.2 [dev], Qwen-Image-Edit Plus, Qwen-Image-Edit models "
            "do)",
        ),
        (
            MODEL,
            {"reference_counts": [1, 5]},
            "serve.reference_counts[1]: 5 references; FLUX.2 [klein] distilled models take at most 4",
        ),
        (MODEL, {"reference_counts": [0]}, "serve.reference_counts[0]: must be greater than or equal to 1, got 0"),
        (MODEL, {"sizes": [[48, 64]]}, "serve.tasks: edit: the image is 64x48 and its references are fitted to its"),
        (MODEL, {}, None),  # FLUX.2 has no img2img, and edit is not refused as img2img is
    ],
    ids=["a family that does not edit", "more than the family takes", "none", "too small", "accepted"],
)
def test_a_server_warming_edits_it_cannot_make_is_refused_in_one_line(tmp_path, model, serve, expected):
    path = _editing_config(tmp_path, **serve)
    config = yaml.safe_load(path.read_text())
    config["model"] = model
    result = run_cli("validate", write_config(path, config), "--serve")
    if expected is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.stderr


def test_a_run_sends_its_references_as_their_bytes_and_the_server_stores_and_holds_them(tmp_path):
    """`tpugen generate --server`'s payload carries each reference as a data: URI of the file's own bytes; the
    server stores each by content, the run's prompt names them in order, and they are held while it runs."""
    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.modes.serve.client import run_payload
    from tpugen.modes.serve.run_handles import RunHandle
    from tpugen.modes.serve.service import Service

    served = load_config(_editing_config(tmp_path), prompts_required=False)
    service = Service(served, [], output_root=tmp_path / "runs", display=Display())
    made = _pictures(tmp_path / "client")
    prompts = [{"prompt": "b in the style of a", "reference_images": ["b.png", "a.png"], "resize_mode": 0}]
    run = load_config(write_config(tmp_path / "client" / "c.yaml", tiny_config(tmp_path, model=MODEL, prompts=prompts)))
    data = json.loads(json.dumps(run_payload(run, "r1")))
    (entry,) = data["prompts"]
    assert entry["resize_mode"] == 0 and "strength" not in entry
    sent = [base64.b64decode(uri.partition(",")[2]) for uri in entry["reference_images"]]
    assert sent == [made["b"].read_bytes(), made["a"].read_bytes()]

    resolved = service.sent_runs.resolve(data)
    references = resolved.prompts[0].references
    assert [image.sha256 for image in references.images] == [_sha(made["b"]), _sha(made["a"])]
    assert references.resize_mode == 0
    stored = {image.path for image in references.images}
    assert stored == {str(tmp_path / "runs" / ".inputs" / f"{_sha(made[n])}.img") for n in "ab"}
    service.sent_runs.live["r1"] = RunHandle("r1", resolved, tmp_path / "runs" / "r1", 1)
    assert service.sent_runs.input_paths() == stored


# ---------------------------------------------------------------- on a warm server


@pytest.fixture(scope="module")
def editing_server(tmp_path_factory):
    """One server of MODEL for the module, warm for txt2img and edits of 1 and 2 references at 64x64."""
    tmp = tmp_path_factory.mktemp("editing-server")
    with running_server(_editing_config(tmp), tmp / "runs", KEY) as (url, service):
        wait_ready(url, seconds=600)
        yield url, service


@pytest.mark.xla
def test_both_apis_and_a_run_edit_by_reference_with_nothing_compiled_after_warmup(editing_server, tmp_path):
    """OpenAI's images.edit with two images and the web UI's img2img with one are edits by reference (named by
    sha256 in the PNG's record); a run sent by `generate --server` with the same reference, seed and prompt as
    the web UI's request makes the same pixels; 0 compiles after warmup."""
    import openai
    import webuiapi
    from typer.testing import CliRunner

    from tpugen.cli import app

    url, service = editing_server
    assert "edits with 1, 2 references" in service.warm_summary()
    made = _pictures(tmp_path)
    ai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    with open(made["a"], "rb") as a, open(made["b"], "rb") as b:
        edited = ai.images.edit(image=[a, b], prompt="a in b", size="64x64", response_format="b64_json")
    (image,) = edited.data
    png = Image.open(io.BytesIO(base64.b64decode(image.b64_json)))
    record = json.loads(png.text["tpugen"])
    assert png.size == (64, 64) and record["reference_images_sha256"] == [_sha(made["a"]), _sha(made["b"])]
    assert "strength" not in record and "init_image_sha256" not in record

    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
    fields = {"prompt": "the cat of a", "negative_prompt": "blurry", "seed": 5, "steps": 2, "cfg_scale": 7.5}
    result = api.img2img(images=[Image.open(made["a"])], sampler_name="Euler", width=64, height=64, **fields)
    assert result.image.size == (64, 64)
    assert result.info["note"] == "denoising_strength is ignored: FLUX.2 [klein] distilled models edit by reference"
    assert "Denoising strength" not in result.info["infotexts"][0]

    prompts = [{"prompt": "the cat of a", "seed": 5, "reference_images": ["a.png"], "resize_mode": 0}]
    config = tiny_config(tmp_path, model=MODEL, prompts=prompts, steps=2, output={"dir": str(tmp_path / "local")})
    path = write_config(tmp_path / "c.yaml", config)
    ran = CliRunner().invoke(app, ["generate", str(path), "--server", url, "--quiet"], env={"TPUGEN_API_KEY": KEY})
    assert ran.exit_code == 0, ran.output
    (made_png,) = (tmp_path / "local" / "run").glob("[0-9]*.png")
    run_record = json.loads(Image.open(made_png).text["tpugen"])
    assert run_record["reference_images_sha256"] == [_sha(made["a"])] and run_record["seed"] == 5
    ours = np.asarray(Image.open(made_png).convert("RGB"))
    assert np.array_equal(ours, np.asarray(result.image.convert("RGB")))
    assert metric(url, "tpugen_compiles_after_warmup_total") == 0


@pytest.mark.xla
def test_edits_the_server_cannot_make_are_one_line_4xx_in_the_requests_words(editing_server, tmp_path):
    url, _ = editing_server
    made = _pictures(tmp_path)
    png = made["a"].read_bytes()
    form = {"prompt": "edit", "size": "64x64", "response_format": "b64_json"}

    def edit(*parts: tuple[str, bytes]) -> tuple[int, list[str]]:
        files = [(name, (f"{n}.png", data, "image/png")) for n, (name, data) in enumerate(parts)]
        answer = httpx.post(f"{url}/v1/images/edits", headers=AUTH, data=form, files=files, timeout=120)
        return answer.status_code, answer.json()["detail"]

    assert edit(*[("image[]", png)] * 5) == (422, ["image: 5 images; FLUX.2 [klein] distilled models take at most 4"])
    assert edit(("image", png), ("mask", png)) == (
        422,
        ["mask: FLUX.2 [klein] distilled models edit by reference images, without a mask; send no mask"],
    )
    assert edit(("image[]", png), ("image[]", b"GIF89a, not really")) == (
        422,
        ["image[1]: is not an image PIL can read (UnidentifiedImageError)"],
    )
    status, (line,) = edit(*[("image[]", png)] * 3)
    assert status == 422
    assert line.startswith(
        "edit with 3 references is not warm (serve.reference_counts: 1, 2) (serve.new_shapes: reject)"
    )

    body = {"prompt": "edit", "init_images": [base64.b64encode(png).decode()], "width": 64, "height": 64, "steps": 2}
    answer = httpx.post(f"{url}/sdapi/v1/img2img", headers=AUTH, json={**body, "mask": body["init_images"][0]})
    assert answer.status_code == 422
    assert answer.json()["detail"] == [
        "mask: FLUX.2 [klein] distilled models edit by reference images, without a mask; send no mask"
    ]
