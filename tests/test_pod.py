"""Whole pods, with a fake gcloud that runs each worker's command on this machine."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    FORKED_TPUGEN,
    OTHER_DEVICE_COUNT,
    annotator_weights,
    forked_tpugen,
    generate,
    run_cli,
    save_disc,
    tiny_config,
    write_config,
)
from PIL import Image

from tpugen.config import PodConfig
from tpugen.engine.topology import pod_position
from tpugen.errors import InputError
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import image_filename

FAKES = Path(__file__).parent / "fakes"
PROMPTS = [f"a painted {w}" for w in ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu", "ant"]]
PROMPTS.append('"; touch pwned; echo "')
NAMES = [image_filename(i, 7 + i, p) for i, p in enumerate(PROMPTS)]


@pytest.fixture
def fake_pod(request, tmp_path, monkeypatch):
    """A fake pod whose workers run `tpugen` as forked_tpugen: each a process of its own, without its imports
    (the zygote started for the tests that run workers, the xla ones)."""
    root = tmp_path / "pod"
    forked = Path(forked_tpugen() if request.node.get_closest_marker("xla") else FORKED_TPUGEN).parent
    monkeypatch.setenv("PATH", f"{forked}:{FAKES}:{Path(sys.executable).parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_POD_ROOT", str(root))
    monkeypatch.setenv("FAKE_POD_LOG", str(tmp_path / "gcloud.log"))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    return root


def calls(tmp_path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "gcloud.log").read_text().splitlines()]


@pytest.mark.parametrize(
    "pod,env,expected",
    [
        (PodConfig(worker_index=2, num_workers=4), {"TPU_WORKER_ID": "1"}, (2, 4)),
        (PodConfig(num_workers=4), {"TPU_WORKER_ID": "3"}, (3, 4)),
        (PodConfig(num_workers=4), {"CLOUD_TPU_TASK_ID": "1"}, (1, 4)),
        (PodConfig(num_workers=4), {}, (2, 4)),  # torch_xla's host index
        (PodConfig(), {"TPU_WORKER_ID": "0"}, (0, 1)),
    ],
)
def test_worker_position(pod, env, expected):
    assert pod_position(pod, env, host_index=lambda: 2) == expected


def test_worker_position_out_of_range():
    with pytest.raises(InputError, match="worker index 5 is not below the worker count 4"):
        pod_position(PodConfig(num_workers=4), {"TPU_WORKER_ID": "5"})


def dry_run(path: Path):
    """`tpugen pod-run PATH --dry-run` on a two-worker pod: what it prints, nothing run."""
    return run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--dry-run")


def test_a_jsonl_prompts_images_are_shipped_by_content_in_one_folder(tmp_path, fake_pod):
    import hashlib

    from tpugen.config.images import shipped_images

    photo, mask = tmp_path / "photo.png", tmp_path / "masks" / "mask.PNG"
    mask.parent.mkdir()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(photo)
    Image.new("L", (64, 64), 255).save(mask, format="PNG")
    lines = [
        {"prompt": "a cat", "init_image": "photo.png", "mask_image": "masks/mask.PNG"},
        {"prompt": "a dog", "init_image": str(photo)},  # the same image by its absolute path: one copy
        {"prompt": "a plain one"},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    del config["prompts"]
    config["prompts_file"] = "p.jsonl"
    for run_id in ("podrun", "inline"):
        if run_id == "inline":  # the same prompts in the config: shipped the same way
            config["prompts"], config["output"]["run_id"] = lines, "inline"
            del config["prompts_file"]
        result = dry_run(write_config(tmp_path / "c.yaml", config))
        assert result.exit_code == 0, result.output
        # One copy of the whole folder (none left from an earlier try), removed on each worker once its run
        # ends so that gathering brings no input back.
        staging, remote = tmp_path / "out" / run_id / ".pod-staging", f"tpugen-pod/{run_id}"
        copies = [line for line in result.output.splitlines() if "/.pod-staging/images" in line]
        assert copies == [
            f"gcloud compute tpus tpu-vm scp --recurse {staging}/images t:{remote}/images --worker=all "
            "--zone=us-east5-b"
        ], result.output
        assert f"--command=mkdir -p {remote} && rm -rf {remote}/images" in result.output
        assert result.output.count("rm -rf images; tail") == 2

    def name(file: Path) -> str:
        return f"image-{hashlib.sha256(file.read_bytes()).hexdigest()[:16]}.png"

    shipped, files = shipped_images(lines, tmp_path, {}, "images")
    assert shipped == [
        {"prompt": "a cat", "init_image": f"images/{name(photo)}", "mask_image": f"images/{name(mask)}"},
        {"prompt": "a dog", "init_image": f"images/{name(photo)}"},
        {"prompt": "a plain one"},
    ]
    assert files == {name(photo): photo, name(mask): mask} and lines[0]["init_image"] == "photo.png"
    # The sha256 the config's check read names the file: it is not read again.
    shipped, files = shipped_images(lines[1:2], tmp_path, {str(photo.resolve()): "f" * 64}, "images")
    assert shipped[0]["init_image"] == f"images/image-{'f' * 16}.png" and files == {f"image-{'f' * 16}.png": photo}


def test_local_controlnets_and_the_annotator_weights_a_run_reads_are_shipped_once_and_keep_the_hash(tmp_path, fake_pod):
    from safetensors.numpy import save_file

    from tpugen.config import load_config

    folder = tmp_path / "models" / "my-canny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "ControlNetModel"}))
    save_file({"weight": np.zeros(4, np.float32)}, str(folder / "diffusion_pytorch_model.safetensors"))
    annotators = tmp_path / "annotators"
    annotators.mkdir()
    for name in ("ControlNetHED.pth", "sk_model.pth", "sk_model2.pth"):  # the run reads the first alone
        (annotators / name).write_bytes(name.encode())
    save_disc(tmp_path / "disc.png")
    model = {"id": "tiny-sd", "controlnets": [{"id": "./models/my-canny"}], "annotators_dir": "annotators"}
    prompts = [{"prompt": "a cat", "control_image": "disc.png", "control_module": "softedge_hed"}]
    config = tiny_config(tmp_path, model=model, prompts=prompts, output={"dir": str(tmp_path / "out"), "run_id": "p"})
    result = dry_run(write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 0, result.output
    remote, tail = "tpugen-pod/p", "--worker=all --zone=us-east5-b"
    assert (
        f"--command=mkdir -p {remote} && rm -rf {remote}/images && rm -rf {remote}/models && mkdir -p "
        f"{remote}/models/annotators {remote}/models/controlnets"
    ) in result.output
    copies = [line for line in result.output.splitlines() if "t:tpugen-pod/p/models/" in line]
    assert copies == [
        f"gcloud compute tpus tpu-vm scp --recurse {folder} t:{remote}/models/controlnets/my-canny {tail}",
        f"gcloud compute tpus tpu-vm scp {annotators}/ControlNetHED.pth t:{remote}/models/annotators/"
        f"ControlNetHED.pth {tail}",
    ], result.output
    assert result.output.count("rm -rf images models; tail") == 2  # gone once each worker's run ends

    # What a worker reads: the folder beside its config, under the name records give it; the same config hash.
    shipped = tmp_path / "worker"
    shutil.copytree(folder, shipped / "models" / "controlnets" / "my-canny")
    shutil.copytree(annotators, shipped / "models" / "annotators")
    save_disc(shipped / "disc.png")
    worker = {**config, "model": {**model, "controlnets": [{"id": "./models/controlnets/my-canny"}]}}
    worker["model"]["annotators_dir"] = "models/annotators"
    here = load_config(tmp_path / "c.yaml").config_hash
    assert load_config(write_config(shipped / "c.yaml", worker)).config_hash == here
    (shipped / "models" / "annotators" / "ControlNetHED.pth").write_bytes(b"other weights")
    assert load_config(shipped / "c.yaml").config_hash != here  # weights the run reads count by content
    (shipped / "models" / "annotators" / "ControlNetHED.pth").write_bytes(b"ControlNetHED.pth")
    assert load_config(shipped / "c.yaml").config_hash == here
    # Another checkpoint of the same ControlNet (same names and shapes, other values) is another hash.
    other = shipped / "models" / "controlnets" / "my-canny" / "diffusion_pytorch_model.safetensors"
    save_file({"weight": np.ones(4, np.float32)}, str(other))
    assert load_config(shipped / "c.yaml").config_hash != here

    # A run none of whose prompts reads an annotator ships no weights, and the workers' config names no folder.
    from tpugen.config.controls import shipped_models

    plain = load_config(write_config(tmp_path / "plain.yaml", {**config, "prompts": ["a cat"]}))
    shipped_config = plain.config.model_copy(deep=True)
    assert shipped_models(shipped_config, plain.prompts, "models") == [(folder, "models/controlnets/my-canny")]
    assert shipped_config.model.annotators_dir is None
    assert shipped_config.model.controlnets[0].id == "./models/controlnets/my-canny"

    # Two ControlNet folders of one name cannot sit side by side: one line, nothing run.
    (tmp_path / "other" / "my-canny").mkdir(parents=True)
    shutil.copy(folder / "config.json", tmp_path / "other" / "my-canny")
    config["model"]["controlnets"] = [{"id": "./models/my-canny"}, {"id": "./other/my-canny"}]
    config["prompts"] = [{"prompt": "a cat", "control_image": ["disc.png", "disc.png"]}]
    result = dry_run(write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: model.controlnets[1].id: pod-run ships ControlNet folders side by side, and model.controlnets[0] is "
        "a folder named 'my-canny' too; rename one"
    ), result.stderr


def test_an_image_changed_since_the_check_is_one_line_and_nothing_reaches_a_worker(tmp_path, fake_pod, monkeypatch):
    import tpugen.modes.pod.run as pod_run

    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    Image.new("RGB", (64, 64), (200, 10, 10)).save(tmp_path / "photo.png")
    prompts = [{"prompt": "a cat", "init_image": "photo.png"}]
    config = tiny_config(tmp_path, prompts=prompts, output={"dir": str(tmp_path / "out"), "run_id": "p"})
    path = write_config(tmp_path / "c.yaml", config)
    real_copy = shutil.copyfile

    def copy_of_a_changed_file(source, target):  # the file as it is after the check read it
        real_copy(source, target)
        if Path(target).name.startswith("image-"):
            Path(target).write_bytes(b"changed")

    monkeypatch.setattr(pod_run.shutil, "copyfile", copy_of_a_changed_file)
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: {str(tmp_path / 'photo.png')!r} changed since the config was checked; run pod-run again"
    )
    assert not (tmp_path / "gcloud.log").exists() and not (tmp_path / "out" / "p" / ".pod-staging").exists()


def test_dry_run_prints_every_command_and_runs_none(tmp_path, fake_pod):
    (tmp_path / "p.txt").write_text("a cat\n")
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    del config["prompts"]
    config["prompts_file"] = "p.txt"
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli(
        "pod-run",
        path,
        "--tpu",
        "my-tpu",
        "--zone",
        "us-east5-b",
        "--project",
        "my-proj",
        "--workers",
        "2",
        "--dry-run",
        "steps=4",
    )
    assert result.exit_code == 0, result.output
    staging = tmp_path / "out" / "podrun" / ".pod-staging"
    tail = ["--zone=us-east5-b", "--project=my-proj"]

    def worker(i: int) -> str:  # pod-run tells each worker its index: none is left to guess it
        return (
            f"cd tpugen-pod/podrun && {{ tpugen generate config.yaml --quiet execution.pod.worker_index={i} "
            "execution.pod.num_workers=2 output.dir=. "
            "output.run_id=run $([ -f run/config.yaml ] && echo --resume run) > worker.log 2>&1; status=$?; "
            "echo $status > worker.status; tail -n 5 worker.log; "
            "exit $status; }"
        )

    expected = [
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "ssh",
            "my-tpu",
            "--worker=all",
            "--command=mkdir -p tpugen-pod/podrun",
            *tail,
        ],
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            f"{staging}/config.yaml",
            "my-tpu:tpugen-pod/podrun/config.yaml",
            "--worker=all",
            *tail,
        ],
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            f"{staging}/prompts.txt",
            "my-tpu:tpugen-pod/podrun/prompts.txt",
            "--worker=all",
            *tail,
        ],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--worker=0", f"--command={worker(0)}", *tail],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--worker=1", f"--command={worker(1)}", *tail],
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            "--recurse",
            "my-tpu:tpugen-pod/podrun",
            f"{tmp_path}/out/podrun/.worker-0.gathering",
            "--worker=0",
            *tail,
        ],
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            "--recurse",
            "my-tpu:tpugen-pod/podrun",
            f"{tmp_path}/out/podrun/.worker-1.gathering",
            "--worker=1",
            *tail,
        ],
    ]
    assert result.stdout.splitlines() == [shlex.join(c) for c in expected]
    assert not (tmp_path / "gcloud.log").exists() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("single"), prompts=PROMPTS)


@pytest.mark.xla
def test_three_worker_pod_makes_each_image_once_like_one_chip(single, tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "3")
    config = tiny_config(tmp_path, prompts=PROMPTS, output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    result = run_cli(
        "pod-run", write_config(tmp_path / "c.yaml", config), "--tpu", "t", "--zone", "us-east5-b", "--quiet"
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "out" / "podrun"

    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["index"] for r in records] == list(range(10))
    assert [r["worker"] for r in records] == [i % 3 for i in range(10)]
    for record, name in zip(records, NAMES, strict=True):
        assert record["file"] == f"worker-{record['worker']}/run/{name}"
        a = np.asarray(Image.open(run_dir / record["file"]), dtype=np.int16)
        b = np.asarray(Image.open(single / name), dtype=np.int16)
        assert np.abs(a - b).max() <= OTHER_DEVICE_COUNT, name
    assert len(list(run_dir.glob("worker-*/run/[0-9]*.png"))) == 10

    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["workers"] == 3 and report["images"] == 10
    assert [(w["worker"], w["images"], w["exit_status"]) for w in report["per_worker"]] == [
        (0, 4, 0),
        (1, 3, 0),
        (2, 3, 0),
    ]
    assert report["pod_images_per_second"] > 0
    # Built like every run's report: the workers' warmups, batches and counters in one place.
    assert [w["worker"] for w in report["warmup"]] == [0, 1, 2]
    assert len(report["timed_phase"]["batches"]) == 6 and report["compiles_after_warmup"] == 0
    markdown = (run_dir / "report.md").read_text()
    assert "pod images per second" in markdown and "## Workers (3)" in markdown

    # The describe call counted the workers; the prompt with shell syntax ran nothing anywhere.
    assert calls(tmp_path)[0] == ["compute", "tpus", "tpu-vm", "describe", "t", "--format=json", "--zone=us-east5-b"]
    assert not any("pwned" in " ".join(c) for c in calls(tmp_path))
    assert not list(tmp_path.rglob("pwned")) and not Path("pwned").exists()


@pytest.mark.xla
def test_a_jax_pod_run_twice_compiles_nothing_on_any_worker_the_second_time(tmp_path, fake_pod, monkeypatch):
    """execution.backend: jax on a fake pod of two workers: each worker is a JAX process with its persistent cache
    (the workers' default, as pod-run leaves cache.dir to them); run again, no worker compiles anything, every
    program read back, and each image is made once, as the first run made it. At 80x80, a size no other test
    runs, so the first run finds nothing in the tests' shared cache."""
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    reports = []
    for run_id in ("first", "second"):
        config = tiny_config(
            tmp_path,
            prompts=PROMPTS[:4],
            height=80,
            width=80,
            execution={"backend": "jax"},
            output={"dir": str(tmp_path / "out"), "run_id": run_id},
        )
        path = write_config(tmp_path / f"{run_id}.yaml", config)
        result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--quiet")
        assert result.exit_code == 0, result.output
        reports.append(json.loads((tmp_path / "out" / run_id / "report.json").read_text()))
    first, second = reports
    assert sum(w["compiles"] for w in first["warmup"]) > 0 and first["persistent_cache"]["misses"] > 0
    assert [(w["worker"], w["compiles"]) for w in second["warmup"]] == [(0, 0), (1, 0)]
    assert second["persistent_cache"]["misses"] == 0 and second["persistent_cache"]["hits"] > 0
    assert second["complete"] and second["images"] == 4 and second["compiles_after_warmup"] == 0
    made = {
        run_id: {r["index"]: r["file"] for r in read_manifest(tmp_path / "out" / run_id / "manifest.jsonl")}
        for run_id in ("first", "second")
    }
    assert sorted(made["second"]) == [0, 1, 2, 3]
    for index, file in made["second"].items():
        a = np.asarray(Image.open(tmp_path / "out" / "second" / file), dtype=np.int16)
        b = np.asarray(Image.open(tmp_path / "out" / "first" / made["first"][index]), dtype=np.int16)
        assert np.abs(a - b).max() <= 1, file  # the programs read back are the ones compiled


@pytest.mark.xla
def test_a_pod_ships_each_prompts_images_and_its_controlnet_runs_on_every_worker(tmp_path, fake_pod, monkeypatch):
    """Control images (and init images) relative to the config reach every worker beside the shipped config,
    named by content, and so do a local ControlNet folder and the annotator weights the prompts read; the images
    are one chip's."""
    from tpugen.tiny import builtin_path

    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    prompts = [
        {"prompt": "a painted cat", "control_image": "disc.png"},
        {"prompt": "a painted dog", "control_image": "disc.png", "control_module": "softedge_hed"},
    ]
    annotators = annotator_weights(tmp_path / "annotators")
    model = {"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet"}], "annotators_dir": str(annotators)}
    for folder in (tmp_path / "single", tmp_path / "pod-config"):
        folder.mkdir()
        save_disc(folder / "disc.png")
    one_chip = generate(tmp_path / "single", prompts=prompts, batch_size=1, model=model)
    # The pod's ControlNet: the built-in's files in a folder of the same name beside the config.
    shutil.copytree(builtin_path("tiny-sd-controlnet"), tmp_path / "pod-config" / "tiny-sd-controlnet")
    model = {**model, "controlnets": [{"id": "./tiny-sd-controlnet"}]}
    # The prompts in a .jsonl file, which is shipped rewritten (inline prompts: the dry-run test above).
    lines = "".join(json.dumps(prompt) + "\n" for prompt in prompts)
    (tmp_path / "pod-config" / "prompts.jsonl").write_text(lines)
    config = tiny_config(tmp_path, batch_size=1, model=model, output={"dir": str(tmp_path / "out"), "run_id": "p"})
    del config["prompts"]
    config["prompts_file"] = "prompts.jsonl"
    result = run_cli(
        "pod-run",
        write_config(tmp_path / "pod-config" / "c.yaml", config),
        "--tpu",
        "t",
        "--zone",
        "us-east5-b",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "out" / "p"
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [(r["index"], r["worker"]) for r in records] == [(0, 0), (1, 1)]
    assert [r["controlnet_units"][0]["module"] for r in records] == ["none", "softedge_hed"]
    assert {r["controlnet_units"][0]["controlnet"] for r in records} == {"tiny-sd-controlnet"}
    for record in records:
        made = np.asarray(Image.open(run_dir / record["file"]).convert("RGB"), np.int16)
        name = record["file"].rsplit("/", 1)[-1]
        expected = np.asarray(Image.open(one_chip / name).convert("RGB"), np.int16)
        assert np.abs(made - expected).max() <= OTHER_DEVICE_COUNT, name
    # One copy of the images' folder (both prompts name one image) beside the config every worker got, which
    # names it by content; each worker removed it once its run ended, so nothing came back with the gathering.
    copies = [c for c in calls(tmp_path) if c[:5] == ["compute", "tpus", "tpu-vm", "scp", "--recurse"]]
    assert [Path(c[5]).name for c in copies if "--worker=all" in c] == ["images", "tiny-sd-controlnet"], copies
    hed = [c for c in calls(tmp_path) if c[:4] == ["compute", "tpus", "tpu-vm", "scp"] and "ControlNetHED.pth" in c[4]]
    assert len(hed) == 1 and not any("sk_model" in " ".join(c) for c in calls(tmp_path))  # what the run reads
    disc = f"images/image-{hashlib.sha256((tmp_path / 'single' / 'disc.png').read_bytes()).hexdigest()[:16]}.png"
    for worker in (0, 1):
        [shipped_prompts] = (fake_pod / f"worker-{worker}").glob("*/*/prompts.jsonl")
        assert disc in shipped_prompts.read_text() and 'disc.png"' not in shipped_prompts.read_text()
        assert not list((fake_pod / f"worker-{worker}").rglob("image-*"))
        assert not list((fake_pod / f"worker-{worker}").rglob("*.safetensors"))  # the models' folder removed too
    assert not list(run_dir.rglob("image-*"))


@pytest.mark.xla
def test_a_failed_worker_is_named_and_the_others_are_gathered(tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    monkeypatch.setenv("FAKE_POD_BREAK_WORKER", "1")
    config = tiny_config(tmp_path, prompts=PROMPTS[:4], output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    result = run_cli(
        "pod-run", write_config(tmp_path / "c.yaml", config), "--tpu", "t", "--zone", "us-east5-b", "--workers", "2"
    )
    run_dir = tmp_path / "out" / "podrun"
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]  # after the progress
    assert lines[0].startswith("error: worker 1 failed (exit status 2): error: ")
    assert "malformed YAML" in lines[0]
    assert lines[1] == f"error: 2 images from the other workers and the pod report are in {run_dir}"
    assert sorted(p.name for p in run_dir.glob("worker-0/run/[0-9]*.png")) == [NAMES[0], NAMES[2]]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["failed_workers"] == [1]


def test_a_failed_step_names_the_worker_and_what_gcloud_printed(tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    monkeypatch.setenv("FAKE_POD_READ_ONLY_WORKER", "1")
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    result = run_cli(
        "pod-run", write_config(tmp_path / "c.yaml", config), "--tpu", "t", "--zone", "us-east5-b", "--quiet"
    )
    assert result.exit_code == 1
    assert result.stderr == (
        "error: gcloud compute tpus tpu-vm ssh t failed on worker 1: mkdir: cannot create directory: "
        "Read-only file system\n"
    )


def test_missing_gcloud_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: gcloud not found: install the Google Cloud CLI (https://cloud.google.com/sdk) and log in\n"
    )


@pytest.mark.xla
def test_bucket_output_is_uploaded_by_the_workers_with_the_pod_report(tmp_path, fake_pod, monkeypatch):
    scratch = _scratch(tmp_path, monkeypatch)
    gcs = tmp_path / "gcs"
    monkeypatch.setenv("FAKE_GCS_ROOT", str(gcs))
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    config = tiny_config(tmp_path, prompts=PROMPTS[:3], output={"dir": "gs://my-bucket/runs", "run_id": "podrun"})
    path = write_config(tmp_path / "c.yaml", config)
    dry = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--dry-run")
    assert dry.exit_code == 0, dry.output
    *_, last_gather, report_upload = dry.stdout.splitlines()
    assert last_gather.endswith(f"gs://my-bucket/runs/podrun/worker-1 {scratch}/tpugen-pod-RANDOM/podrun/")
    merged = f"{scratch}/tpugen-pod-RANDOM/podrun"
    assert report_upload == (  # the last step, printed too
        f"gcloud storage cp {merged}/report.json {merged}/report.md {merged}/manifest.jsonl gs://my-bucket/runs/podrun/"
    )
    assert not list(scratch.iterdir()) and not (tmp_path / "gcloud.log").exists()

    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--quiet")
    assert result.exit_code == 0, result.output
    assert not list(scratch.iterdir())  # the downloaded copies are gone once the pod report is uploaded
    assert result.stdout.splitlines()[-1] == "report: gs://my-bucket/runs/podrun/report.md"
    run = gcs / "my-bucket" / "runs" / "podrun"
    assert sorted(p.relative_to(run).as_posix() for p in run.glob("worker-*/run/[0-9]*.png")) == [
        f"worker-0/run/{NAMES[0]}",
        f"worker-0/run/{NAMES[2]}",
        f"worker-1/run/{NAMES[1]}",
    ]
    report = json.loads((run / "report.json").read_text())
    assert report["complete"] is True and report["images"] == 3
    assert [r["file"] for r in read_manifest(run / "manifest.jsonl")] == [
        f"worker-0/run/{NAMES[0]}",
        f"worker-1/run/{NAMES[1]}",
        f"worker-0/run/{NAMES[2]}",
    ]
    assert not (tmp_path / "outputs").exists()


def test_a_worker_without_tpu_worker_id_that_fails_uploads_into_its_own_folder(tmp_path, fake_pod, monkeypatch):
    # On a TPU VM, gcloud ssh sets no TPU_WORKER_ID: a worker that failed before its report used to upload
    # into worker-0/, over worker 0's status and log. Nothing here compiles: worker 0 never runs (preempted)
    # and worker 1's config is broken.
    monkeypatch.setenv("FAKE_GCS_ROOT", str(tmp_path / "gcs"))
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    monkeypatch.setenv("FAKE_POD_NO_WORKER_ID", "all")
    monkeypatch.setenv("FAKE_POD_PREEMPT_WORKER", "0")
    monkeypatch.setenv("FAKE_POD_BREAK_WORKER", "1")
    _scratch(tmp_path, monkeypatch)
    config = tiny_config(tmp_path, prompts=PROMPTS[:2], output={"dir": "gs://my-bucket/runs", "run_id": "podrun"})
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--quiet")
    assert result.exit_code == 1
    run = tmp_path / "gcs" / "my-bucket" / "runs" / "podrun"
    assert sorted(p.name for p in run.glob("worker-*")) == ["worker-1"]
    assert (run / "worker-1" / "worker.status").read_text() == "2\n"
    lines = result.stderr.splitlines()
    assert lines[0] == (
        "error: worker 0 failed (not gathered: ERROR: gs://my-bucket/runs/podrun/worker-0 matched no objects or files)"
    )
    assert lines[1].startswith("error: worker 1 failed (exit status 2): error: config.yaml: malformed YAML")
    ssh = sorted(c for c in calls(tmp_path) if c[3] == "ssh" and " generate " in c[6])  # started at once
    assert [c[5] for c in ssh] == ["--worker=0", "--worker=1"]
    assert all(f"execution.pod.worker_index={i} " in c[6] for i, c in enumerate(ssh))


def test_generate_refuses_a_bucket(tmp_path):
    config = tiny_config(tmp_path, output={"dir": "gs://my-bucket/runs"})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == (
        "error: output.dir: gs:// destinations are written by tpugen pod-run's workers; give a local directory\n"
    )


@pytest.mark.xla
def test_resume_a_pod_run_after_a_failed_worker(tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    monkeypatch.setenv("FAKE_POD_BREAK_WORKER", "1")
    config = tiny_config(tmp_path, prompts=PROMPTS[:4], output={"dir": str(tmp_path / "out"), "run_id": "podrun"})
    path = write_config(tmp_path / "c.yaml", config)
    assert run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--quiet").exit_code == 1

    monkeypatch.delenv("FAKE_POD_BREAK_WORKER")  # the broken worker is repaired
    result = run_cli(
        "pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--quiet", "--resume", "podrun"
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "out" / "podrun"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["images"] == 4
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1, 2, 3]
    # Worker 0 had finished its share: it loaded nothing and kept its report as it was.
    assert "run is complete: 2 of 2 images; nothing to do" in (run_dir / "worker-0" / "worker.log").read_text()
    worker0 = json.loads((run_dir / "worker-0" / "run" / "report.json").read_text())
    assert worker0["images_reused"] == 0 and worker0["images_this_session"] == 2

    # Resuming the complete pod run calls no worker and rewrites nothing.
    before = (len(calls(tmp_path)), (run_dir / "report.json").read_bytes(), (run_dir / "report.md").read_bytes())
    result = run_cli(
        "pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--quiet", "--resume", "podrun"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"{run_dir} is complete: 4 of 4 images; nothing to do"]
    assert (
        len(calls(tmp_path)),
        (run_dir / "report.json").read_bytes(),
        (run_dir / "report.md").read_bytes(),
    ) == before


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.xla
def test_resume_keeps_the_images_of_a_worker_that_lost_its_disk(tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    output = {"dir": str(tmp_path / "out"), "run_id": "podrun"}
    config = tiny_config(tmp_path, prompts=PROMPTS[:4], steps=2, output=output)
    args = [
        "pod-run",
        write_config(tmp_path / "c.yaml", config),
        "--tpu",
        "t",
        "--zone",
        "us-east5-b",
        "--workers",
        "2",
    ]
    monkeypatch.setenv("FAKE_POD_BREAK_WORKER", "1")  # worker 0 finishes its share, worker 1 does not
    assert run_cli(*args, "--quiet").exit_code == 1
    run_dir = tmp_path / "out" / "podrun"
    mine = [run_dir / "worker-0" / "run" / NAMES[i] for i in (0, 2)]

    # Worker 0 comes back with a fresh disk and fails at once: its new copy holds no images.
    shutil.rmtree(fake_pod / "worker-0")
    monkeypatch.setenv("FAKE_POD_BREAK_WORKER", "0")
    result = run_cli(*args, "--quiet", "--resume", str(run_dir))  # the run directory's path names it too
    assert result.exit_code == 1
    assert result.stderr.startswith("error: worker 0 failed (exit status 2): ")
    assert all(p.is_file() for p in mine)
    assert (run_dir / "worker-0" / "worker.status").read_text() == "2\n"  # the newer copy's status
    assert [r["index"] for r in read_manifest(run_dir / "worker-0" / "run" / "manifest.jsonl")] == [0, 2]
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1, 2, 3]

    # Then it is preempted while it runs: nothing can be gathered from it, and its earlier copy stays.
    monkeypatch.delenv("FAKE_POD_BREAK_WORKER")
    monkeypatch.setenv("FAKE_POD_PREEMPT_WORKER", "0")
    before = _files(run_dir / "worker-0")
    result = run_cli(*args, "--quiet", "--resume", "podrun")
    assert result.exit_code == 1
    assert _files(run_dir / "worker-0") == before
    assert (
        f"error: worker 0: gathering failed (scp: t:tpugen-pod/podrun: No such file or directory); "
        f"its earlier copy is kept in {run_dir / 'worker-0'}"
    ) in result.stderr.splitlines()
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1, 2, 3]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["images"] == 4 and report["gather_failed_workers"] == [0]
    assert (
        "- gathering failed for workers [0]; earlier copies kept for workers [0]" in (run_dir / "report.md").read_text()
    )
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # no temporary folders left


@pytest.mark.parametrize("kind", ["elsewhere", "up", "not a pod run"])
def test_resume_takes_a_pod_run_under_output_dir_only(tmp_path, fake_pod, monkeypatch, kind):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "worker-0").mkdir(parents=True)
    (elsewhere / "worker-0" / "keep.txt").write_text("mine")
    plain = tmp_path / "out" / "plain"  # a `tpugen generate` run, not a pod run
    plain.mkdir(parents=True)
    (plain / "manifest.jsonl").write_text("{}\n")
    value, expected = {
        "elsewhere": (
            str(elsewhere),
            f"error: --resume: {elsewhere} is not a pod run directly under output.dir ({tmp_path / 'out'}); "
            "give its RUN_ID",
        ),
        "up": ("../../x", f"error: --resume: '../../x' is not a run id: {RUN_ID_RULE}"),
        "not a pod run": (
            "plain",
            f"error: --resume: {plain} is not a pod run directory (no pod report.json or worker-N folders)",
        ),
    }[kind]
    config = tiny_config(tmp_path, prompts=PROMPTS[:2], output={"dir": str(tmp_path / "out")})
    path = write_config(tmp_path / "c.yaml", config)
    before = _files(tmp_path)
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--resume", value)
    assert result.exit_code == 2
    assert result.stderr == expected + "\n"
    assert not (tmp_path / "gcloud.log").exists()
    assert _files(tmp_path) == before and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plain"]


UNSAFE = "a $(touch pwned) `touch pwned`"
RUN_ID_RULE = "use 1 to 128 ASCII letters, digits, '.', '_' or '-', not starting with '.' or '-'"
REMOTE_DIR_RULE = (
    "use ASCII letters, digits, '.', '_', '-' and '/' (after an optional leading ~/), with no '..' part "
    "and no leading '-'"
)


@pytest.mark.parametrize(
    "options,expected",
    [
        ([f"output.run_id={UNSAFE}"], f"error: output.run_id: {RUN_ID_RULE}"),
        (["--resume", UNSAFE], f"error: --resume: {UNSAFE!r} is not a run id: {RUN_ID_RULE}"),
        (["--remote-dir", f"pods/{UNSAFE}"], f"error: --remote-dir: 'pods/{UNSAFE}' is not allowed: {REMOTE_DIR_RULE}"),
        (["--remote-dir", "pods/../../up"], f"error: --remote-dir: 'pods/../../up' is not allowed: {REMOTE_DIR_RULE}"),
    ],
)
def test_unsafe_run_ids_and_remote_dirs_are_refused_before_any_gcloud_call(
    tmp_path, fake_pod, monkeypatch, options, expected
):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    config = tiny_config(tmp_path, prompts=PROMPTS[:2], output={"dir": str(tmp_path / "out")})
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", *options)
    assert result.exit_code == 2
    assert result.stderr == expected + "\n"
    assert not (tmp_path / "gcloud.log").exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("*pwned*")) and not Path("pwned").exists()


@pytest.mark.xla
def test_remote_tpugen_and_remote_dir_under_the_workers_home(tmp_path, fake_pod, monkeypatch):
    monkeypatch.setenv("FAKE_POD_WORKERS", "2")
    real = forked_tpugen()
    for i in range(2):
        wrapper = fake_pod / f"worker-{i}" / "venv" / "bin" / "tpugen"
        wrapper.parent.mkdir(parents=True)
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(real))} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{FAKES}:/usr/bin:/bin")  # only the wrapper can run tpugen on the workers
    config = tiny_config(tmp_path, prompts=PROMPTS[:2], steps=2, output={"dir": str(tmp_path / "out"), "run_id": "r"})
    result = run_cli(
        "pod-run",
        write_config(tmp_path / "c.yaml", config),
        *["--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--quiet"],
        *["--remote-tpugen", "~/venv/bin/tpugen", "--remote-dir", "~/pods"],
    )
    assert result.exit_code == 0, result.output
    assert [r["file"] for r in read_manifest(tmp_path / "out" / "r" / "manifest.jsonl")] == [
        f"worker-0/run/{NAMES[0]}",
        f"worker-1/run/{NAMES[1]}",
    ]
    assert (fake_pod / "worker-1" / "pods" / "r" / "run" / NAMES[1]).is_file()
    assert not list(fake_pod.glob("worker-*/~"))


def _scratch(tmp_path, monkeypatch) -> Path:
    """A TMPDIR of the test's own, so that anything tpugen leaves in it shows."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    return scratch


@pytest.mark.parametrize("upload_fails", [False, True])
def test_a_failed_bucket_run_leaves_its_scratch_folder_only_when_the_report_upload_failed(
    tmp_path, fake_pod, monkeypatch, upload_fails
):
    scratch = _scratch(tmp_path, monkeypatch)
    gcs = tmp_path / "gcs"
    monkeypatch.setenv("FAKE_GCS_ROOT", str(gcs))
    monkeypatch.setenv("FAKE_POD_WORKERS", "1")
    monkeypatch.setenv("FAKE_POD_PREEMPT_WORKER", "0")  # no worker runs, so nothing is compiled
    if upload_fails:
        (gcs / "my-bucket" / "runs").mkdir(parents=True)
        (gcs / "my-bucket" / "runs" / "podrun").write_text("a file where the run's folder goes")
    config = tiny_config(tmp_path, prompts=PROMPTS[:2], output={"dir": "gs://my-bucket/runs", "run_id": "podrun"})
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "1", "--quiet")
    assert result.exit_code == 1
    if upload_fails:
        [kept] = scratch.iterdir()
        assert result.stderr.splitlines()[-1] == (
            f"error: uploading the pod report to gs://my-bucket/runs/podrun failed; it is in {kept / 'podrun'}"
        )
        assert (kept / "podrun" / "report.json").is_file()
    else:
        assert result.stderr.splitlines()[-1] == (
            "error: 0 images from the other workers and the pod report are in gs://my-bucket/runs/podrun"
        )
        assert (gcs / "my-bucket" / "runs" / "podrun" / "report.json").is_file()
        assert not list(scratch.iterdir())


@pytest.mark.parametrize(
    "option,value,expected",
    [
        ("--tpu", "--command=touch pwned", "--tpu: '--command=touch pwned' is not a TPU name"),
        ("--tpu", "pod:other", "--tpu: 'pod:other' is not a TPU name"),
        ("--zone", "us-east5-b --project=x", "--zone: 'us-east5-b --project=x' is not a zone (like us-east5-b)"),
        ("--project", "-x", "--project: '-x' is not a project id"),
    ],
)
def test_gcloud_names_that_would_be_flags_or_move_a_path_are_refused(tmp_path, fake_pod, option, value, expected):
    args = {"--tpu": "my-pod", "--zone": "us-east5-b", **{option: value}}
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, output={"dir": str(tmp_path / "out")}))
    result = run_cli("pod-run", path, *[x for pair in args.items() for x in pair], "--workers", "2", "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {expected}") and len(result.stderr.splitlines()) == 1
    assert result.stdout == "" and not (tmp_path / "gcloud.log").exists()


@pytest.mark.parametrize("recorded", ["run.json", "report.json only"])
def test_a_resume_with_a_config_that_changes_images_is_refused_before_any_worker_runs(tmp_path, fake_pod, recorded):
    # Each worker refuses it in its own folder, but a worker that lost its disk would start afresh with it
    # and the pod manifest would mix two configs' images.
    from tpugen.config import load_config
    from tpugen.files import write_json
    from tpugen.outputs.run_record import write_run_record

    output = {"dir": str(tmp_path / "out"), "run_id": "podrun"}
    first = load_config(write_config(tmp_path / "a.yaml", tiny_config(tmp_path, prompts=PROMPTS[:2], output=output)))
    run_dir = tmp_path / "out" / "podrun"
    (run_dir / "worker-0").mkdir(parents=True)
    if recorded == "run.json":
        write_run_record(run_dir, first, "podrun")
    else:  # a pod run from before pod-run wrote run.json: its pod report names the config hash
        write_json(run_dir / "report.json", {"tpugen_pod_report": 1, "config_hash": first.config_hash})
    changed = write_config(tmp_path / "b.yaml", tiny_config(tmp_path, prompts=["a tree", "a boat"], output=output))
    before = _files(tmp_path / "out")
    result = run_cli("pod-run", changed, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--resume", "podrun")
    assert result.exit_code == 2
    if recorded == "run.json":
        expected = f"--resume: the config differs from the pod run in {run_dir} in keys that change images: prompts"
    else:
        expected = f"--resume: the pod run in {run_dir} was made by config hash {first.config_hash}, and this config"
    assert result.stderr.startswith(f"error: {expected}")
    assert not (tmp_path / "gcloud.log").exists() and _files(tmp_path / "out") == before
    same = run_cli("pod-run", tmp_path / "a.yaml", "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--dry-run")
    assert same.exit_code == 0, same.output  # the config the run was made with passes


def test_a_pod_run_whose_images_are_gone_is_not_complete(tmp_path):
    from tpugen.config import load_config
    from tpugen.files import write_json
    from tpugen.modes.pod.resume import _already_complete

    run = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path, prompts=PROMPTS[:2])))
    run_dir = tmp_path / "pod"
    (run_dir / "worker-0" / "run").mkdir(parents=True)
    files = [f"worker-0/run/{name}" for name in NAMES[:2]]
    (run_dir / "manifest.jsonl").write_text(
        "".join(json.dumps({"index": i, "file": f}) + "\n" for i, f in enumerate(files))
    )
    write_json(run_dir / "report.json", {"complete": True, "images": 2})
    assert _already_complete(run, run_dir) is None  # a complete report and manifest, but no images
    for name in files:
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(run_dir / name)
    assert _already_complete(run, run_dir)["already_complete"] is True


def test_a_fold_cut_short_is_finished_and_leaves_no_image_unlisted(tmp_path, monkeypatch):
    import os

    from tpugen.modes.pod import gather

    def worker_copy(folder: Path, indices: list[int]) -> None:
        (folder / "run").mkdir(parents=True)
        for i in indices:
            (folder / "run" / NAMES[i]).write_bytes(f"image {i}".encode())
        lines = "".join(json.dumps({"index": i, "file": NAMES[i]}) + "\n" for i in indices)
        (folder / "run" / "manifest.jsonl").write_text(lines)

    local_run = tmp_path / "podrun"
    folder = local_run / "worker-0"
    worker_copy(folder, [0])  # the earlier copy
    worker_copy(gather.gathering_folder(local_run, 0), [2, 4])  # a fresh disk's copy: images 2 and 4 only
    moved, real_replace = [], os.replace

    def crash_after_one(source, target):
        if moved:
            raise KeyboardInterrupt  # the fold is cut short after one file
        moved.append(target)
        real_replace(source, target)

    monkeypatch.setattr(gather.os, "replace", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        gather.adopt_gathered(gather.gathering_folder(local_run, 0), folder)
    monkeypatch.setattr(gather.os, "replace", real_replace)
    assert [r["index"] for r in read_manifest(folder / "run" / "manifest.jsonl")] == [0]  # image 2 moved, unlisted
    assert gather.folding_folder(local_run, 0).exists() and not gather.gathering_folder(local_run, 0).exists()

    gather.fold_in(gather.folding_folder(local_run, 0), folder)  # what the next gather of worker 0 does first
    assert [r["index"] for r in read_manifest(folder / "run" / "manifest.jsonl")] == [0, 2, 4]
    assert sorted(p.name for p in (folder / "run").glob("0*")) == sorted(NAMES[i] for i in (0, 2, 4))
    assert not gather.folding_folder(local_run, 0).exists()
