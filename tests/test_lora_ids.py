"""A LoRA is named by its id as the config gave it and by its content, never by a path on this machine: the
config hash and a resume's checks keep when the folder holding the config, its LoRAs and the outputs moves; images,
reports and the server's replies carry no machine path; pod-run ships the files its workers need."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from conftest import FAKES, make_lora, run_cli, write_config
from PIL import Image

from tpugen.config import dump_config, load_config
from tpugen.errors import InputError

# Keys a LoRA for SD 1.x has: enough for every check made when a config is resolved (no model is read).
UNET_KEYS = ["unet.down_blocks.1.attentions.0.proj_in.lora_A.weight"]


def fake_lora(path: Path, fill: float = 0.0) -> Path:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: np.full((4, 4), fill, np.float32) for key in UNET_KEYS}, str(path))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def project(root: Path, config_dir: str = ".", loras: list[dict] | None = None, **changes) -> Path:
    """A project folder: a config in `config_dir`, its LoRA in loras/ beside the config, outputs/ at the root (as
    output.dir: outputs reads it, from the root as working directory). Returns the config's path."""
    folder = root / config_dir
    fake_lora(folder / "loras" / "style.safetensors")
    config = {
        "model": {"id": "tiny-sd", "dtype": "float32", "loras": loras or [{"id": "loras/style.safetensors"}]},
        "prompts": ["a red fox"],
        "height": 64,
        "width": 64,
        "steps": 2,
        "seed": 7,
        "output": {"dir": "outputs", "run_id": "r1"},
        **changes,
    }
    return write_config(folder / "run.yaml", config)


def test_a_resolved_config_keeps_each_lora_id_as_the_config_gave_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = fake_lora(tmp_path / "elsewhere" / "other.safetensors", fill=1)
    path = project(tmp_path / "proj", loras=[{"id": "loras/style.safetensors"}, {"id": str(elsewhere)}])

    run = load_config(path)

    assert [lora.id for lora in run.config.model.loras] == ["loras/style.safetensors", str(elsewhere)]
    # The path a load reads is the Lora record's, absolute; the config pins each file by its content.
    assert [lora.path for lora in run.loras] == [str(tmp_path / "proj" / "loras" / "style.safetensors"), str(elsewhere)]
    assert run.config.model.loras[0].sha256 == sha256(tmp_path / "proj" / "loras" / "style.safetensors")
    shown = run_cli("validate", path)
    assert shown.exit_code == 0, shown.output
    (lora,) = [entry for entry in yaml.safe_load(shown.stdout)["model"]["loras"] if "style" in entry["id"]]
    assert lora["id"] == "loras/style.safetensors", shown.stdout


@pytest.mark.parametrize("config_dir", [".", "configs"], ids=["config at the root", "configs/ beside outputs/"])
def test_the_config_hash_and_the_resume_checks_keep_when_the_project_folder_moves(tmp_path, monkeypatch, config_dir):
    from tpugen.engine.session import RunSession
    from tpugen.outputs.run_record import check_resumable, load_run

    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    before = load_config(project(tmp_path / "proj", config_dir))
    monkeypatch.chdir(tmp_path / "proj")
    session = RunSession.create(load_config(Path(config_dir) / "run.yaml"))  # run.json and config.yaml, no model
    assert session.run_dir == tmp_path / "proj" / "outputs" / "r1"
    monkeypatch.chdir(tmp_path)
    shutil.move(tmp_path / "proj", tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    run_dir = tmp_path / "moved" / "outputs" / "r1"

    again = load_config(Path(config_dir) / "run.yaml")
    assert again.config_hash == before.config_hash
    assert check_resumable(again, run_dir) is None  # generate CONFIG --resume RUN_DIR: nothing differs
    # tpugen resume RUN_DIR: the run's own config.yaml finds the LoRA where the moved config's folder has it.
    own = load_run(run_dir)
    assert own.loras[0].path == str(tmp_path / "moved" / config_dir / "loras" / "style.safetensors")
    assert own.config.model.loras[0].id == "loras/style.safetensors"
    assert own.config_hash == before.config_hash and check_resumable(own, run_dir) is None
    # An absolute id moves nothing in the hash either: the hash counts a LoRA by its content and scale.
    absolute = [{"id": str(tmp_path / "moved" / config_dir / "loras" / "style.safetensors")}]
    assert load_config(project(tmp_path / "abs", config_dir, loras=absolute)).config_hash == before.config_hash


def test_a_runs_own_config_far_from_the_config_it_started_from_finds_the_file_this_machine_found(tmp_path, monkeypatch):
    from tpugen.config import resolve
    from tpugen.engine.session import RunSession

    # What a torchrun rank resolves (tpugen.modes.rank): the run's config, in a run directory nowhere near the
    # config, from a working directory nowhere near either.
    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    path = project(tmp_path / "a" / "b" / "proj", "configs/sub", output={"dir": str(tmp_path / "out"), "run_id": "r1"})
    run = load_config(path)
    session = RunSession.create(run)

    copy = resolve(json.loads(run.config.model_dump_json()), base_dir=session.run_dir)

    assert copy.loras[0].path == run.loras[0].path and copy.config_hash == run.config_hash
    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "another-machine"))
    with pytest.raises(InputError, match=r"^model.loras\[0\].id: no file 'loras/style.safetensors' with sha256 "):
        resolve(json.loads(run.config.model_dump_json()), base_dir=session.run_dir)


def test_a_copy_of_the_same_bytes_under_another_name_does_not_rename_a_runs_lora(tmp_path, monkeypatch):
    from tpugen.config import resolve
    from tpugen.engine.session import RunSession

    # Another config used the same bytes as style-kohya.safetensors: this machine remembers that file for the
    # sha256. The run, its folder moved, still finds its own style.safetensors, and its records keep the name.
    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "cache"))
    path = project(tmp_path / "proj")
    monkeypatch.chdir(tmp_path / "proj")
    run = load_config(path)
    session = RunSession.create(run)
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "elsewhere" / "style-kohya.safetensors"
    other.parent.mkdir()
    shutil.copy(run.loras[0].path, other)
    assert load_config(write_config(tmp_path / "other.yaml", {**yaml.safe_load(path.read_text()), "model": {
        "id": "tiny-sd", "loras": [{"id": str(other)}]}})).loras[0].name == "style-kohya"  # fmt: skip
    shutil.move(tmp_path / "proj", tmp_path / "moved")
    moved_run = tmp_path / "moved" / session.run_dir.relative_to(tmp_path / "proj")

    copy = resolve(json.loads(run.config.model_dump_json()), base_dir=moved_run)

    assert copy.loras[0].name == "style" and copy.loras[0].path == str(
        tmp_path / "moved" / "loras" / "style.safetensors"
    )


def test_a_runs_lora_that_is_gone_is_one_line_naming_its_id_and_the_sha256_it_needs(tmp_path, monkeypatch):
    from tpugen.engine.session import RunSession

    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    run = load_config(project(tmp_path))
    RunSession.create(run)
    (tmp_path / "loras" / "style.safetensors").rename(tmp_path / "kept.safetensors")

    result = run_cli("resume", tmp_path / "outputs" / "r1", "--quiet")

    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"error: model.loras[0].id: no file 'loras/style.safetensors' with sha256 {run.loras[0].sha256} near the run"
    ), line
    assert line.endswith(f"resume with that config: tpugen generate CONFIG --resume {tmp_path / 'outputs' / 'r1'}")
    # A file of the same name with other content is not taken for it.
    fake_lora(tmp_path / "loras" / "style.safetensors", fill=5)
    assert run_cli("resume", tmp_path / "outputs" / "r1", "--quiet").stderr.splitlines() == [line]


def test_records_name_a_lora_by_its_id_or_its_file_name_never_a_machine_path(tmp_path, monkeypatch):
    from tpugen.outputs.png import png_bytes

    monkeypatch.chdir(tmp_path)
    elsewhere = fake_lora(tmp_path / "elsewhere" / "other.safetensors", fill=1)
    run = load_config(project(tmp_path / "proj", loras=[{"id": "loras/style.safetensors"}, {"id": str(elsewhere)}]))

    records = [lora.record() for lora in run.loras]

    assert [(r["name"], r["id"]) for r in records] == [
        ("style", "loras/style.safetensors"),
        ("other", "other.safetensors"),
    ]
    assert [r["sha256"] for r in records] == [lora.sha256 for lora in run.config.model.loras]
    record = {"prompt": "a fox", "steps": 2, "scheduler": "DDIM", "guidance_scale": 7.5, "seed": 7, "width": 64,
              "height": 64, "model": "tiny-sd", "loras": records, "tpugen_version": "0"}  # fmt: skip
    with Image.open(__import__("io").BytesIO(png_bytes(Image.new("RGB", (8, 8)), record))) as image:
        assert str(tmp_path) not in image.text["tpugen"] and str(tmp_path) not in image.text["parameters"]


# ---------------------------------------------------------------- the server


def fake_service(lora_dir: Path):
    """What Service.lora_named, lora_files, run_configs.run_loras, image_record and the /loras route read of a
    service."""
    from tpugen.config.schema import CompileConfig
    from tpugen.modes.serve.service import Service

    model = SimpleNamespace(id="tiny-sd", dtype="float32")
    service = SimpleNamespace(
        serve=SimpleNamespace(lora_dir=str(lora_dir)),
        run=SimpleNamespace(family="sd", config=SimpleNamespace(model=model, compile=CompileConfig())),
        engines=[SimpleNamespace(loaded=SimpleNamespace(default_scheduler="DDIM"), model_label="tiny-sd")],
    )
    service.lora_files = lambda: Service.lora_files(service)
    return service


def test_the_servers_replies_name_a_lora_by_its_name_not_by_a_path_in_its_lora_dir(tmp_path):
    from tpugen.modes.serve import a1111
    from tpugen.modes.serve.replies import image_record
    from tpugen.modes.serve.run_configs import run_loras
    from tpugen.modes.serve.service import Service
    from tpugen.plan import ImageWork

    lora_dir = tmp_path / "srv" / "loras"
    fake_lora(lora_dir / "style.safetensors")
    service = fake_service(lora_dir)

    lora = Service.lora_named(service, "style", 0.7)  # <lora:style:0.7>
    image = ImageWork(prompt="a cat", negative_prompt="", seed=3, steps=2, guidance_scale=7.5, height=64, width=64,
                      loras=(lora,))  # fmt: skip
    (record,) = image_record(service, image)["loras"]
    assert (record["name"], record["id"], record["scale"]) == ("style", "style.safetensors", 0.7)
    assert lora.path == str(lora_dir / "style.safetensors")  # what loading reads
    listed = a1111.loras(SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(service=service))))
    assert [(entry["name"], entry["path"]) for entry in listed] == [("style", "style.safetensors")]
    # A run sent to /v1/runs names its LoRAs by name, and an unknown name is refused by name.
    assert run_loras([{"id": "style", "scale": 0.7}], service.serve) == [{"scale": 0.7, "id": "style.safetensors"}]
    with pytest.raises(InputError) as refused:
        run_loras([{"id": "nope"}], service.serve)
    assert refused.value.lines == ["model.loras[0].id: no LoRA 'nope' in serve.lora_dir (it has: style)"]


# ---------------------------------------------------------------- pod-run


def test_pod_run_ships_each_local_lora_file_and_the_workers_config_names_it_beside_itself(tmp_path, monkeypatch):
    from tpugen.config.loras import shipped_loras

    monkeypatch.chdir(tmp_path)
    run = load_config(project(tmp_path / "proj"))
    config = run.config.model_copy(deep=True)  # pod-run's copy, which it ships

    files = shipped_loras(config, run.loras)

    assert files == [tmp_path / "proj" / "loras" / "style.safetensors"]
    assert [(lora.id, lora.sha256) for lora in config.model.loras] == [("style.safetensors", run.loras[0].sha256)]
    assert run.config.model.loras[0].id == "loras/style.safetensors"  # the run's own config is not changed
    # A worker: the shipped config and the shipped file side by side, and the run's config hash.
    worker = tmp_path / "worker" / "tpugen-pod" / "r1"
    worker.mkdir(parents=True)
    (worker / "config.yaml").write_text(dump_config(config))
    shutil.copyfile(files[0], worker / files[0].name)
    shipped = load_config(worker / "config.yaml")
    assert shipped.config_hash == run.config_hash and shipped.loras[0].sha256 == run.loras[0].sha256
    assert str(tmp_path / "proj") not in dump_config(config)


def test_pod_run_refuses_lora_files_it_cannot_ship_by_name(tmp_path, monkeypatch):
    from tpugen.config.loras import shipped_loras

    monkeypatch.chdir(tmp_path)
    fake_lora(tmp_path / "proj" / "b" / "style.safetensors", fill=2)
    fake_lora(tmp_path / "proj" / "my style $(x).safetensors", fill=3)
    loras = [{"id": "loras/style.safetensors"}, {"id": "b/style.safetensors"}, {"id": "my style $(x).safetensors"}]
    run = load_config(project(tmp_path / "proj", loras=loras))
    with pytest.raises(InputError) as refused:
        shipped_loras(run.config.model_copy(deep=True), run.loras)
    assert refused.value.lines == [
        "model.loras[1].id: pod-run ships LoRA files side by side, and model.loras[0] is a file named "
        "'style.safetensors' too; rename one",
        "model.loras[2].id: pod-run ships LoRA files by name, and 'my style $(x).safetensors' holds characters a "
        "shell reads (use letters, digits, '.', '_' and '-'); rename the file",
    ]


def test_pod_run_dry_run_ships_the_lora_file_beside_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKES}:{Path(sys.executable).parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_POD_ROOT", str(tmp_path / "pod"))
    monkeypatch.setenv("FAKE_POD_LOG", str(tmp_path / "gcloud.log"))
    monkeypatch.chdir(tmp_path)
    path = project(tmp_path / "proj", output={"dir": str(tmp_path / "out"), "run_id": "podrun"})

    result = run_cli("pod-run", path, "--tpu", "t", "--zone", "us-east5-b", "--workers", "2", "--dry-run")

    assert result.exit_code == 0, result.output
    shipped = [
        shlex.split(line)[5:7] for line in result.stdout.splitlines() if " scp " in line and "--recurse" not in line
    ]
    assert [str(tmp_path / "proj" / "loras" / "style.safetensors"), "t:tpugen-pod/podrun/style.safetensors"] in shipped


# ---------------------------------------------------------------- a whole run (xla)


@pytest.mark.xla
def test_a_runs_images_and_report_carry_no_machine_path_and_it_resumes_after_a_move(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "proj"
    elsewhere = make_lora(tmp_path / "other.safetensors", "peft", seed=2)
    loras = [{"id": "loras/style.safetensors", "scale": 0.8}, {"id": str(elsewhere), "scale": 0.5}]
    project(root, loras=loras)
    make_lora(root / "loras" / "style.safetensors", "kohya", seed=1)  # a real one for the run
    monkeypatch.chdir(root)
    made = run_cli("generate", "run.yaml", "--quiet")
    assert made.exit_code == 0, made.output
    run_dir = root / "outputs" / "r1"
    (png,) = run_dir.glob("[0-9]*.png")
    first = png.read_bytes()
    text = Image.open(png).text

    expected = [("style", "loras/style.safetensors", 0.8, sha256(root / "loras" / "style.safetensors")),
                ("other", "other.safetensors", 0.5, sha256(elsewhere))]  # fmt: skip
    assert [(r["name"], r["id"], r["scale"], r["sha256"]) for r in json.loads(text["tpugen"])["loras"]] == expected
    assert str(tmp_path) not in text["tpugen"] + text["parameters"]
    (line,) = (run_dir / "manifest.jsonl").read_text().splitlines()
    assert str(tmp_path) not in json.dumps(json.loads(line)["loras"])
    report = json.loads((run_dir / "report.json").read_text())
    assert [(r["name"], r["id"], r["scale"], r["sha256"]) for r in report["model"]["loras"]] == expected
    assert all(str(tmp_path) not in row for row in (run_dir / "report.md").read_text().splitlines() if "LoRA" in row)

    # The folder moves; the run's own config.yaml still finds the relative one, and the resume makes the same bytes.
    monkeypatch.chdir(tmp_path)
    shutil.move(root, tmp_path / "moved")
    moved = tmp_path / "moved" / "outputs" / "r1"
    png = moved / png.name
    png.unlink()
    (moved / "manifest.jsonl").write_text("")
    resumed = run_cli("resume", moved, "--quiet")
    assert resumed.exit_code == 0, resumed.output
    again = Image.open(png)
    assert json.loads(again.text["tpugen"]) == json.loads(text["tpugen"])  # the same record, field by field
    assert again.text == text
    pixels = [np.asarray(image.convert("RGB"), dtype=np.int16) for image in (again, Image.open(io.BytesIO(first)))]
    assert int(np.abs(pixels[0] - pixels[1]).max()) == 0, int(np.abs(pixels[0] - pixels[1]).max())
    assert png.read_bytes() == first
