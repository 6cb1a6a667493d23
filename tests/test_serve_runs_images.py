"""Runs with input images sent to a server (/v1/runs, `tpugen generate --server`): the images travel in the
request as base64 data: URIs of the files' own bytes, and the server reads no path a client names."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config, with_prompts_file, write_config
from PIL import Image
from serve_support import KEY, run_body

from tpugen.config import load_config
from tpugen.errors import InputError
from tpugen.modes.serve.client import run_payload

PNG_URI = "data:image/png;base64,"


def _inputs(folder: Path) -> dict[str, str]:
    """At the session server's warm size (64x64): an init image as PNG and as JPEG, and a mask; their sha256."""
    rng = np.random.default_rng(5)
    pixels = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    pixels[16:48, 16:48] = (30, 60, 220)
    mask = np.zeros((64, 64), np.uint8)
    mask[20:44, 36:60] = 255
    Image.fromarray(pixels).save(folder / "init.png")
    Image.fromarray(pixels).save(folder / "init.jpg", quality=90)
    Image.fromarray(mask).save(folder / "mask.png")
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in ("init.png", "init.jpg", "mask.png")
    }


PROMPTS = [
    {"prompt": "a blue square", "init_image": "init.png"},
    {"prompt": "repaint the right", "init_image": "init.jpg", "mask_image": "mask.png", "seed": 3},
]


def _server_side(tmp_path: Path, jsonl: bool = False):
    """A server's Service with no engine (resolve_run needs none), and a client's run of PROMPTS beside it (inline,
    or in a .jsonl prompts file)."""
    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service

    config = tiny_config(tmp_path)
    del config["prompts"]
    served = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    service = Service(served, [], output_root=tmp_path / "runs", display=Display())
    client = tmp_path / "client"
    client.mkdir()
    sha = _inputs(client)
    config = tiny_config(client, prompts=PROMPTS)
    if jsonl:
        config = with_prompts_file(client, config, [json.dumps(entry) for entry in PROMPTS], "p.jsonl")
    run = load_config(write_config(client / "c.yaml", config))
    return service, run, sha


@pytest.mark.parametrize("jsonl", [False, True], ids=["inline prompts", "a jsonl prompts file"])
def test_the_client_sends_each_input_image_as_its_own_bytes_and_the_server_stores_them(tmp_path, jsonl):
    service, run, sha = _server_side(tmp_path, jsonl)
    data = run_payload(run, "r1")
    first, second = data["prompts"]
    assert first["strength"] == 0.75 and first["resize_mode"] == 0 and "mask_image" not in first
    folder = tmp_path / "client"
    for entry, key, name in ((first, "init_image", "init.png"), (second, "init_image", "init.jpg")):
        header, _, payload = entry[key].partition(",")
        assert header.startswith("data:") and base64.b64decode(payload) == (folder / name).read_bytes()
    assert base64.b64decode(second["mask_image"].partition(",")[2]) == (folder / "mask.png").read_bytes()
    assert str(folder) not in json.dumps(data)  # no local path goes

    resolved = service.sent_runs.resolve(json.loads(json.dumps(data)))
    sources = [spec.source for spec in resolved.prompts]
    assert [s.init_image_sha256 for s in sources] == [sha["init.png"], sha["init.jpg"]]
    assert sources[1].mask_image_sha256 == sha["mask.png"] and sources[0].mask_image is None
    for source in sources:
        for _, path, digest in source.files():
            assert Path(path) == tmp_path / "runs" / ".inputs" / f"{digest}.img"
    # While the run is queued or running, its images are held: never evicted from .inputs.
    from tpugen.modes.serve.run_handles import RunHandle

    assert service.sent_runs.input_paths() == set()
    service.sent_runs.live["r1"] = RunHandle("r1", resolved, tmp_path / "runs" / "r1", 2)
    assert service.sent_runs.input_paths() == {path for s in sources for _, path, _ in s.files()}


def test_a_file_changed_after_the_config_was_read_is_not_sent(tmp_path):
    _, run, _ = _server_side(tmp_path)
    Image.new("RGB", (64, 64)).save(tmp_path / "client" / "init.png")
    with pytest.raises(InputError) as changed:
        run_payload(run, "r1")
    (line,) = changed.value.lines
    assert line.startswith("prompts[0].init_image: ") and "changed since the config was read" in line


@pytest.mark.parametrize(
    "value,line",
    [
        ("somewhere.png", "send the image itself (a base64 data: URI); the server reads no paths"),
        ("/etc/passwd", "send the image itself (a base64 data: URI); the server reads no paths"),
        (5, "send the image itself (a base64 data: URI); the server reads no paths"),
        ("data:image/png,not-base64", "send the image itself (a base64 data: URI); the server reads no paths"),
        (PNG_URI + "a*b=", "the data: URI's base64 does not decode"),
        (PNG_URI + base64.b64encode(b"not an image").decode(), "is not an image PIL can read (UnidentifiedImageError)"),
    ],
    ids=["a relative path", "an absolute path", "a number", "no base64", "bad base64", "not an image"],
)
def test_a_run_image_that_is_not_a_data_uri_of_an_image_is_refused_naming_its_key(tmp_path, value, line):
    service, _, _ = _server_side(tmp_path)
    prompts = ["a cat", {"prompt": "a", "init_image": PNG_URI, "mask_image": value}]
    with pytest.raises(InputError) as refused:
        service.sent_runs.resolve({"prompts": prompts, "output": {"run_id": "r"}})
    assert refused.value.lines == [
        "prompts[1].init_image: is not an image PIL can read (UnidentifiedImageError)",  # an empty one
        f"prompts[1].mask_image: {line}",
    ]


@pytest.mark.xla
def test_generate_on_a_server_sends_the_input_images_and_the_records_name_them(server, tmp_path):
    from typer.testing import CliRunner

    from tpugen.cli import app

    url, service = server
    sha = _inputs(tmp_path)
    config = tiny_config(tmp_path, prompts=PROMPTS, output={"dir": str(tmp_path / "local"), "run_id": "with-images"})
    path = write_config(tmp_path / "c.yaml", config)
    result = CliRunner().invoke(app, ["generate", str(path), "--server", url, "--quiet"], env={"TPUGEN_API_KEY": KEY})
    assert result.exit_code == 0, result.output
    local = tmp_path / "local" / "with-images"
    report = json.loads((local / "report.json").read_text())
    assert report["complete"] is True and report["images"] == 2 and report["compiles_after_warmup"] == 0
    records = [json.loads(Image.open(p).text["tpugen"]) for p in sorted(local.glob("[0-9]*.png"))]
    assert [r["init_image_sha256"] for r in records] == [sha["init.png"], sha["init.jpg"]]
    assert "mask_image_sha256" not in records[0] and records[1]["mask_image_sha256"] == sha["mask.png"]
    assert [r["strength"] for r in records] == [0.75, 0.75]
    recorded = json.loads((local / "run.json").read_text())["prompts"]
    assert [p["source"]["init_image_sha256"] for p in recorded] == [sha["init.png"], sha["init.jpg"]]
    # Stored by content under the server's output root, where no run listing shows them.
    stored = service.output_root / ".inputs" / f"{sha['mask.png']}.img"
    assert stored.read_bytes() == (tmp_path / "mask.png").read_bytes()


@pytest.mark.xla
@pytest.mark.parametrize(
    "value,words",
    [("somewhere.png", "data:"), ("data:image/png;base64," + base64.b64encode(b"GIF8 no").decode(), "not an image")],
    ids=["a path", "not an image"],
)
def test_a_run_posted_with_an_image_path_or_a_non_image_is_a_422_naming_the_key(client, value, words):
    import yaml

    body = yaml.safe_load(run_body("refused-image"))
    body["prompts"] = [{"prompt": "a", "init_image": value}]
    response = client.post("/v1/runs", json=body)
    assert response.status_code == 422, response.text
    (line,) = response.json()["detail"]
    assert line.startswith("prompts[0].init_image: ") and words in line
    assert client.get("/v1/runs/refused-image").status_code == 404  # nothing was started
