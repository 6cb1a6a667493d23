"""Nothing lost: a killed run resumes to exactly the files of an uninterrupted one; failures keep what finished."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import generate, run_cli, tiny_config, write_config
from PIL import Image

import tpugen.outputs
from tpugen.outputs import read_manifest

TPUGEN = str(Path(sys.executable).parent / "tpugen")
KILL_PROMPTS = [
    f"prompt {i}: a {w} in the rain" for i, w in enumerate(["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu"])
]


def image_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("[0-9]*.png"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run the killed one must end up equal to (batch 1, so there are 8 batches)."""
    return generate(tmp_path_factory.mktemp("ref"), prompts=KILL_PROMPTS, batch_size=1, steps=20)


@pytest.mark.xla
def test_sigterm_after_the_second_batch_then_resume_gives_the_same_files(reference, tmp_path):
    config = tiny_config(tmp_path, prompts=KILL_PROMPTS, batch_size=1, steps=20)
    path = write_config(tmp_path / "c.yaml", config)
    run_dir = tmp_path / "outputs" / "run"
    manifest = run_dir / "manifest.jsonl"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}

    started = time.perf_counter()
    proc = subprocess.Popen([TPUGEN, "generate", str(path), "--quiet"], stderr=subprocess.PIPE, text=True, env=env)
    while not (manifest.exists() and len(manifest.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stderr.read()
        assert time.perf_counter() - started < 300
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    killed_after = time.perf_counter() - started

    assert proc.returncode == 143, stderr
    lines = stderr.splitlines()
    assert lines[-2].startswith("error: interrupted by SIGTERM, stopped after the batch in flight; ")
    assert lines[-1] == f"error: resume with: tpugen resume {run_dir}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"] == "interrupted by SIGTERM"
    done = len(read_manifest(manifest))
    assert 2 <= done < len(KILL_PROMPTS)
    assert len(image_bytes(run_dir)) == done
    assert not list(run_dir.glob(".*.tmp"))  # no half-written image under any name

    started = time.perf_counter()
    resumed = subprocess.run([TPUGEN, "resume", str(run_dir), "--quiet"], capture_output=True, text=True, env=env)
    resume_seconds = time.perf_counter() - started
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True
    assert (report["images"], report["images_reused"]) == (len(KILL_PROMPTS), done)
    assert image_bytes(run_dir) == image_bytes(reference)  # the same bytes, image for image
    assert [r["index"] for r in read_manifest(manifest)] == list(range(len(KILL_PROMPTS)))
    print(f"killed after {killed_after:.1f} s with {done} images; resume took {resume_seconds:.1f} s")


@pytest.mark.xla
def test_torn_manifest_and_missing_image_resume(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    lines = (run_dir / "manifest.jsonl").read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    (run_dir / "manifest.jsonl").write_text("".join(lines[:-1]) + lines[-1][:25])  # a crash mid-line
    (run_dir / json.loads(lines[2])["file"]).unlink()  # and an image lost
    broken = run_dir / json.loads(lines[4])["file"]
    broken.write_bytes(broken.read_bytes()[:100])  # and one cut short

    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert image_bytes(run_dir) == image_bytes(reference)
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["index"] for r in records] == list(range(len(KILL_PROMPTS)))
    assert records[-1]["file"] == last["file"]
    assert json.loads((run_dir / "report.json").read_text())["images_reused"] == len(KILL_PROMPTS) - 3


def test_resume_with_a_config_that_changes_images_is_refused(xla_run, tmp_path):
    config = tiny_config(tmp_path, steps=4, prompts=["something else"], output={"dir": str(tmp_path / "o")})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--resume", xla_run)
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --resume: the config differs from the run in {xla_run} in keys that change images: prompts, steps\n"
    )


def test_disk_full_keeps_finished_images_and_resume_completes(cpu_run, tmp_path, monkeypatch):
    real_write = tpugen.outputs.atomic_write_bytes
    pngs = []

    def fill_up_at_third_image(path, data):
        if path.suffix == ".png" and path.name != "grid.png":
            pngs.append(path)
            if len(pngs) == 3:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(tpugen.outputs, "atomic_write_bytes", fill_up_at_third_image)
    config = tiny_config(tmp_path, execution={"backend": "cpu"})
    path = write_config(tmp_path / "c.yaml", config)
    run_dir = tmp_path / "outputs" / "run"
    result = run_cli("generate", path, "--quiet")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"error: writing {pngs[2]}: No space left on device",
        f"error: 2 new images, the manifest and report.json are in {run_dir}",
        f"error: resume with: tpugen resume {run_dir}",
    ]
    assert sorted(image_bytes(run_dir)) == sorted(image_bytes(cpu_run))[:2]
    for name in image_bytes(run_dir):
        Image.open(run_dir / name).verify()

    monkeypatch.setattr(tpugen.outputs, "atomic_write_bytes", real_write)  # space freed
    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert image_bytes(run_dir) == image_bytes(cpu_run)


def test_hostile_prompts_give_safe_files_and_exact_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    prompts = ["../../etc/passwd", '"; rm -rf ~ #', "x" * 10_000, "a fox 🦊 in the snow ❄️", "قطة على سجادة"]
    run_dir = generate(tmp_path, prompts=prompts, batch_size=3, execution={"backend": "cpu"})
    names = sorted(p.name for p in run_dir.glob("[0-9]*.png"))
    assert names == [
        "00000-7-etc-passwd.png",
        "00001-8-rm-rf.png",
        f"00002-9-{'x' * 40}.png",
        "00003-10-a-fox-in-the-snow.png",
        "00004-11-image.png",
    ]
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == sorted(names + ["grid.png"])  # nothing escaped
    for name, prompt in zip(names, prompts, strict=True):
        image = Image.open(run_dir / name)
        assert image.text["parameters"].split("\nNegative prompt: ")[0] == prompt
        assert json.loads(image.text["tpugen"])["prompt"] == prompt
    for file in run_dir.iterdir():
        assert b"hf_secret_token_value_123" not in file.read_bytes(), file.name
