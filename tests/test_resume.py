"""Nothing lost: a killed run resumes to exactly the files of an uninterrupted one; failures keep what finished."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    TPUGEN,
    cut_last_image,
    forked_tpugen,
    generate,
    image_bytes,
    run_cli,
    tiny_config,
    with_prompts_file,
    write_config,
)
from PIL import Image

import tpugen.outputs.png
from tpugen.engine import Engine
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.report import session_summary

pytestmark = pytest.mark.xla  # every test here runs a model (diffusers imports torch_xla)

KILL_PROMPTS = [
    f"prompt {i}: a {w} in the rain" for i, w in enumerate(["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu"])
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run the killed one must end up equal to (batch 1, so there are 8 batches)."""
    return generate(tmp_path_factory.mktemp("ref"), prompts=KILL_PROMPTS, batch_size=1, steps=20)


def test_sigterm_after_the_second_batch_then_resume_gives_the_same_files(reference, tmp_path):
    config = tiny_config(tmp_path, prompts=KILL_PROMPTS, batch_size=1, steps=20)
    path = write_config(tmp_path / "c.yaml", config)
    run_dir = tmp_path / "outputs" / "run"
    manifest = run_dir / "manifest.jsonl"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}

    started = time.perf_counter()
    tpugen = forked_tpugen()  # a process of its own, killed as the console script's would be
    proc = subprocess.Popen([tpugen, "generate", str(path), "--quiet"], stderr=subprocess.PIPE, text=True, env=env)
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
    resumed = subprocess.run([tpugen, "resume", str(run_dir), "--quiet"], capture_output=True, text=True, env=env)
    resume_seconds = time.perf_counter() - started
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True
    assert (report["images"], report["images_reused"]) == (len(KILL_PROMPTS), done)
    # The killed session's figures stay in the report beside the resumed one's.
    [killed] = report["earlier_sessions"]
    assert (killed["images"], killed["error"], len(killed["timed_phase"]["batches"])) == (
        done,
        "interrupted by SIGTERM",
        done,
    )
    assert "## Earlier sessions of this run (1;" in (run_dir / "report.md").read_text()
    assert image_bytes(run_dir) == image_bytes(reference)  # the same bytes, image for image
    assert [r["index"] for r in read_manifest(manifest)] == list(range(len(KILL_PROMPTS)))
    print(f"killed after {killed_after:.1f} s with {done} images; resume took {resume_seconds:.1f} s")


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
    report = json.loads((run_dir / "report.json").read_text())
    assert report["images_reused"] == len(KILL_PROMPTS) - 3
    first = json.loads((reference / "report.json").read_text())
    assert report["earlier_sessions"] == [session_summary(first)]


def test_resume_with_a_config_that_changes_images_is_refused(xla_run, tmp_path):
    config = tiny_config(tmp_path, steps=4, prompts=["something else"], output={"dir": str(tmp_path / "o")})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--resume", xla_run)
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --resume: the config differs from the run in {xla_run} in keys that change images: prompts, steps\n"
    )


def test_disk_full_keeps_finished_images_and_resume_completes(cpu_run, tmp_path, monkeypatch):
    real_write = tpugen.outputs.png.atomic_write_bytes
    pngs = []

    def fill_up_at_third_image(path, data):
        if path.suffix == ".png" and path.name != "grid.png":
            pngs.append(path)
            if len(pngs) == 3:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(tpugen.outputs.png, "atomic_write_bytes", fill_up_at_third_image)
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

    monkeypatch.setattr(tpugen.outputs.png, "atomic_write_bytes", real_write)  # space freed
    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert image_bytes(run_dir) == image_bytes(cpu_run)


def test_hostile_prompts_give_safe_files_and_exact_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    prompts = ["../../etc/passwd", '"; rm -rf ~ #', "x" * 10_000, "a fox 🦊 in the snow ❄️", "قطة على سجادة"]
    # Read as written (prompt_syntax plain: the 10,000 x's cut at 77 tokens by the pipeline); the web UI's reading
    # would refuse them as 134 chunks (tests/test_prompt_reading.py).
    run_dir = generate(tmp_path, prompts=prompts, batch_size=3, execution={"backend": "cpu"}, prompt_syntax="plain")
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


def files_and_times(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.iterdir())}


def test_resuming_a_complete_run_loads_nothing_and_rewrites_nothing(cpu_run, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(cpu_run, run_dir)
    before = files_and_times(run_dir)

    def no_loading(*args, **kwargs):
        raise AssertionError("a complete run must not load its model")

    monkeypatch.setattr(Engine, "open", no_loading)
    for command in (["resume", run_dir], ["generate", run_dir / "config.yaml", "--resume", run_dir]):
        result = run_cli(*command)
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines() == [
            f"{run_dir} is complete: 3 of 3 images; nothing to do",
            f"images: {run_dir}",
            f"report: {run_dir / 'report.md'}",
        ]
        assert files_and_times(run_dir) == before


def test_every_file_and_folder_gets_the_ordinary_mode(cpu_run):
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(cpu_run.stat().st_mode) == 0o777 & ~mask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in cpu_run.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~mask), modes


def test_resume_keeps_the_prompts_and_config_the_run_started_with(tmp_path):
    lines = ["a lighthouse", "a red fox", "an astronaut"]
    config = with_prompts_file(tmp_path, tiny_config(tmp_path, execution={"backend": "cpu"}), lines)
    path = write_config(tmp_path / "c.yaml", config)
    assert run_cli("generate", path, "--quiet").exit_code == 0
    run_dir = tmp_path / "outputs" / "run"
    reference = image_bytes(run_dir)
    cut_last_image(run_dir)
    (tmp_path / "p.txt").write_text("a lighthouse\na red fox\na different third line\nand a fourth\n")

    # The user's edited config makes other images: refused, naming the prompts.
    result = run_cli("generate", path, "--resume", run_dir, "--quiet")
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --resume: the config differs from the run in {run_dir} in keys that change images: "
        "prompts_file (its prompts)\n"
    )
    # The run's own config resumes with the prompts the run started with, whatever the file says now, and says
    # so in one line (before: nothing).
    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"warning: prompts_file: {(tmp_path / 'p.txt').resolve()} changed since the run started; its edits are not "
        "used: the run goes on with the 3 prompts it started with (kept in run.json)\n"
    )
    assert image_bytes(run_dir) == reference
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["index"] for r in records] == [0, 1, 2] and len({r["config_hash"] for r in records}) == 1
    assert json.loads((run_dir / "report.json").read_text())["images_planned"] == 3

    # An edit of the run's own config.yaml that changes images is refused too.
    cut_last_image(run_dir)
    config_yaml = run_dir / "config.yaml"
    config_yaml.write_text(
        config_yaml.read_text().replace("\nsteps: 3\n", "\nsteps: 4\n").replace("\nseed: 7\n", "\nseed: 8\n")
    )
    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --resume: the config differs from the run in {run_dir} in keys that change images: seed, steps\n"
    )


def test_manifest_lines_that_are_not_this_runs_records_are_named_and_ignored(cpu_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cpu_run, run_dir)
    reference = image_bytes(run_dir)
    cut_last_image(run_dir)
    first = read_manifest(run_dir / "manifest.jsonl")[0]
    with open(run_dir / "manifest.jsonl", "a") as manifest:
        manifest.write('[1, 2]\nnull\n{"file": "x.png"}\n')
        manifest.write(json.dumps({**first, "index": 99}) + "\n")  # a valid PNG, but no image of this plan
        manifest.write(json.dumps({**first, "index": 2}) + "\n")  # index 2's record must name index 2's file

    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: manifest.jsonl line 3: not an image record ([1, 2]); ignored",
        "warning: manifest.jsonl line 4: not an image record (null); ignored",
        "warning: manifest.jsonl line 5: no image index; ignored",
        "warning: manifest.jsonl line 6: image 99 is not in this run's plan (3 images); ignored",
        f"warning: manifest.jsonl line 7: image 2 is not {sorted(reference)[2]}; ignored",
    ]
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["images"], report["images_planned"], report["images_reused"]) == (3, 3, 2)
    assert image_bytes(run_dir) == reference
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1, 2]


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_a_model_that_cannot_load_leaves_no_run_and_says_why_in_one_line(tmp_path, mode):
    # A hub model tpugen knows (its family from tpugen's table), not in this machine's cache, offline.
    model = "stabilityai/stable-diffusion-xl-base-1.0"
    config = tiny_config(tmp_path, model={"id": model}, execution={"mode": mode, "cores": 2})
    if mode == "single":
        config["execution"].pop("cores")
    path = write_config(tmp_path / "c.yaml", config)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([TPUGEN, "generate", str(path), "--quiet"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"error: model.id: cannot load '{model}': offline: the hub cannot be reached and the model "
        "is not in the local cache (HF_HOME)\n"
    )
    assert not (tmp_path / "outputs" / "run").exists()
    # One it does not know cannot even be told a family of: refused at the door, before anything loads.
    config["model"]["id"] = "some-org/not-in-the-cache"
    proc = subprocess.run(
        [TPUGEN, "generate", str(write_config(path, config)), "--quiet"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: model.id: cannot tell which family 'some-org/not-in-the-cache' is: offline (HF_HUB_OFFLINE) and its "
        "model_index.json is not in the local cache (HF_HOME)\n"
    )
    assert not (tmp_path / "outputs" / "run").exists()
