"""`tpugen serve`'s runs API, /v1/runs: a run config sent to the server writes what `generate` writes, what it
may not ask for, DELETE and resume, and `tpugen generate --server`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import OTHER_GRAPH, run_cli, tiny_config, write_config
from PIL import Image
from serve_support import KEY, pixels, run_body, wait_run

from tpugen.outputs.manifest import read_manifest

pytestmark = pytest.mark.xla


def test_a_run_sent_to_the_server_writes_what_generate_writes(client, server, xla_run):
    created = client.post("/v1/runs", content=run_body("served"), headers={"Content-Type": "application/x-yaml"})
    assert created.status_code == 201 and created.headers["location"] == "/v1/runs/served"
    status = wait_run(client, "served")
    assert (status["status"], status["images"], status["images_planned"]) == ("complete", 3, 3)
    assert status["report"]["compiles_after_warmup"] == 0
    run_dir = server[1].output_root / "served"
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(p.name for p in xla_run.iterdir())
    for name in sorted(p.name for p in xla_run.glob("[0-9]*.png")):
        assert Image.open(run_dir / name).text == Image.open(xla_run / name).text  # same parameters, same record
        assert int(np.abs(pixels(Image.open(run_dir / name)) - pixels(Image.open(xla_run / name))).max()) <= OTHER_GRAPH
    drop = ("latency_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_manifest(run_dir / "manifest.jsonl")] == [
        {k: v for k, v in r.items() if k not in drop} for r in read_manifest(xla_run / "manifest.jsonl")
    ]
    listing = client.get("/v1/runs/served/files").json()["files"]
    assert "manifest.jsonl" in listing and client.get("/v1/runs/served/files/report.md").text.startswith("# tpugen run")
    assert client.get("/v1/runs/served/files/..%2Fserve.yaml").status_code == 404
    assert client.get("/v1/runs/nope").status_code == 404
    again = client.post("/v1/runs", content=run_body("served"))
    assert again.status_code == 409 and again.json()["detail"] == [
        "output.run_id: served exists on this server; choose another run_id"
    ]


@pytest.mark.parametrize(
    "changes,lines",
    [
        ({"model": {"id": "tiny-sdxl"}}, ["model.id: the server runs model.id: 'tiny-sd'; leave it out or equal"]),
        (
            {"model": {"id": "tiny-sd", "allow_remote_code": True}},
            ["model.allow_remote_code: a run sent to the server cannot run a model's code"],
        ),
        (
            {"prompts": None, "prompts_file": "/etc/passwd"},
            ["prompts_file: send the prompts themselves (prompts: [...]); the server reads no files"],
        ),
        (
            {"batch_size": 1},
            [
                "the run needs 64x64 b1 cfg, not warm (serve.new_shapes: reject); warm: sizes 64x64 (width x height; "
                "cfg, batch 2); samplers DDIM, Euler a; tasks txt2img, img2img, inpaint"
            ],
        ),
        ({"steps": 0}, ["steps: must be greater than or equal to 1, got 0"]),
        ({"output": "foo"}, ["output: must be a mapping (the server reads output.run_id from it), or left out"]),
        (
            {"prompts": ["a cat", "a \ud83d dog"]},
            ["prompts[1]: unpaired surrogate U+D83D at character 2 (not valid Unicode text)"],
        ),
        (
            {"images_per_prompt": 4000},
            ["the run plans 12000 images; this server runs at most 10000 per run (serve.max_images_per_run)"],
        ),
    ],
    ids=[
        "another model",
        "remote code",
        "a file on the server",
        "a cold shape",
        "bad steps",
        "output not a mapping",
        "half a UTF-16 pair",
        "too many images",
    ],
)
def test_a_run_config_cannot_ask_the_server_for_what_it_does_not_serve(client, changes, lines):
    response = client.post("/v1/runs", content=run_body("refused", **changes))
    assert (response.status_code, response.json()["detail"]) == (422, lines)


def test_a_run_body_that_is_not_yaml_is_one_line(client):
    response = client.post("/v1/runs", content="prompts: [a cat\nsteps: 2\n")
    assert response.status_code == 422
    (line,) = response.json()["detail"]
    assert line.startswith("body: malformed YAML at line 2, column")


def test_delete_stops_a_run_after_its_batch_in_flight_and_it_resumes(client, server):
    prompts = [f"a painted {w}" for w in ("cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu")]
    assert client.post("/v1/runs", content=run_body("stopped", prompts=prompts, steps=20)).status_code == 201
    deadline = time.monotonic() + 120
    while client.get("/v1/runs/stopped").json()["images"] == 0:
        assert time.monotonic() < deadline, "the run made no image within 120 s"
        time.sleep(0.05)
    assert client.delete("/v1/runs/stopped").status_code == 202
    status = wait_run(client, "stopped")
    assert status["status"] == "stopped" and 1 <= status["images"] < 8
    assert status["report"]["complete"] is False and status["report"]["error"] == "interrupted by SIGTERM"
    run_dir = server[1].output_root / "stopped"
    result = run_cli("resume", run_dir, "--quiet")  # the run directory is an ordinary, resumable one
    assert result.exit_code == 0, result.output
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(8))


def test_generate_on_a_server_copies_the_run_here_and_imports_no_torch(server, xla_run, tmp_path):
    url, _ = server
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "local"), "run_id": "remote"})
    path = write_config(tmp_path / "c.yaml", config)
    code = (
        "import sys\nfrom tpugen.cli import app\n"
        f"try:\n    app(['generate', {str(path)!r}, '--server', {url!r}, '--quiet'])\n"
        "except SystemExit as exit:\n    print('exit', exit.code)\n"
        "print('loaded', [m for m in ('torch', 'torch_xla', 'diffusers') if m in sys.modules])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TPUGEN_API_KEY": KEY},
    )
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "loaded []"], proc.stderr
    local = tmp_path / "local" / "remote"
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in xla_run.iterdir())
    for name in sorted(p.name for p in xla_run.glob("[0-9]*.png")):
        assert int(np.abs(pixels(Image.open(local / name)) - pixels(Image.open(xla_run / name))).max()) <= OTHER_GRAPH
    report = json.loads((local / "report.json").read_text())
    assert report["complete"] is True and report["images"] == 3
