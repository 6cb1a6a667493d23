"""A family is one folder found by one registry; a pipeline is read by what its model_index.json says it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, tiny_config, write_config

from tpugen.families import BUILTINS, FAMILIES, KNOWN_MODELS, family_for_class
from tpugen.families.base import Family

PACKAGE = Path(__file__).resolve().parent.parent / "tpugen" / "families"


def test_every_family_is_a_folder_in_the_registry():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    # Every family is defined in a folder of its own family's (FLUX.2's folder holds [dev] and [klein]).
    assert sorted({type(f).__module__.rsplit(".", 1)[-1] for f in FAMILIES.values()}) == folders
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name
        assert type(family).__module__.startswith("tpugen.families.")
        # Each built-in and known model belongs to exactly one family, and each class to one.
        for cls in family.pipeline_classes:  # FLUX.2 [klein]'s base and distilled share a class, told by a flag
            assert any(family_for_class(cls, index) is family for index in ({}, {"is_distilled": True}))
    assert sum(len(f.builtins) for f in FAMILIES.values()) == len(BUILTINS)
    assert sum(len(f.known_models) for f in FAMILIES.values()) == len(KNOWN_MODELS)


def test_nothing_outside_the_families_compares_a_family_name():
    """The engine, memory, LoRA, plan, scan and sharding code ask the family; none names one."""
    names = "|".join(FAMILIES)
    import re

    pattern = re.compile(rf"""(family(\.name)?|run\.family|spec\.family)\s*(==|!=|not in|in)\s*[("']+({names})\b""")
    offenders = []
    for path in (PACKAGE.parent).rglob("*.py"):
        if PACKAGE in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) or re.search(rf"""==\s*["']({names})["']""", line):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == []


def _pipeline_folder(tmp_path: Path, class_name: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.1"}))
    return folder


def test_a_local_pipeline_of_a_class_no_family_covers_is_refused_at_the_door(tmp_path):
    folder = _pipeline_folder(tmp_path, "WanPipeline")
    config = tiny_config(tmp_path, model={"id": str(folder)})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: model.id: '{folder}' is a WanPipeline; tpugen knows Stable Diffusion 1.x/2.x (")
    assert "Flux.1 (schnell, dev) (FluxPipeline)" in line
    assert not (tmp_path / "outputs").exists()


def test_a_local_pipeline_is_read_by_its_class(tmp_path):
    folder = _pipeline_folder(tmp_path, "StableDiffusionXLPipeline")
    config = tiny_config(tmp_path, model={"id": str(folder)})
    del config["height"], config["width"], config["steps"], config["guidance_scale"]
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert (resolved["height"], resolved["width"], resolved["steps"], resolved["guidance_scale"]) == (
        1024,
        1024,
        30,
        5.0,
    )


def _in_hub_cache(cache: Path, repo: str, index: dict) -> None:
    """What huggingface_hub leaves in its cache after downloading one file of `repo`."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text(json.dumps(index))


def test_a_hub_id_outside_the_table_is_read_from_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    _in_hub_cache(cache, "stabilityai/sdxl-turbo", {"_class_name": "StableDiffusionXLPipeline"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_config(tmp_path, model={"id": "stabilityai/sdxl-turbo"})
    del config["height"], config["width"], config["steps"]
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert (resolved["height"], resolved["steps"], resolved["model"]["watermark"]) == (1024, 30, False)


def test_a_hub_id_that_cannot_be_read_offline_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_config(tmp_path, model={"id": "some-org/some-model"})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: model.id: cannot tell which family 'some-org/some-model' is: offline (HF_HUB_OFFLINE) and its "
        "model_index.json is not in the local cache (HF_HOME)"
    )


@pytest.mark.parametrize(
    "class_name,expected",
    [("FluxPipeline", "flux"), ("StableDiffusion3Pipeline", "sd3"), ("StableDiffusionPipeline", "sd")],
)
def test_the_loaded_class_is_checked_against_the_family(class_name, expected):
    from types import SimpleNamespace

    from tpugen.engine.engine import _check_class
    from tpugen.errors import RunError

    spec = SimpleNamespace(model=SimpleNamespace(id="m", custom_pipeline=None))
    pipe = type(class_name, (), {})()
    _check_class(spec, pipe, FAMILIES[expected])  # its own family: fine
    other = next(f for name, f in FAMILIES.items() if name != expected)
    with pytest.raises(RunError) as caught:
        _check_class(spec, pipe, other)
    assert caught.value.lines[0].startswith(f"model.id: 'm' is a {class_name}; tpugen knows ")


def test_a_report_that_cannot_be_built_still_leaves_report_json(tmp_path):
    from tpugen.engine.session import RunSession
    from tpugen.errors import RunError

    session = RunSession.__new__(RunSession)
    session.run_dir = tmp_path

    def broken(error):
        raise AttributeError("'Flux2KleinPipeline' object has no attribute 'unet'")

    with pytest.raises(RunError):
        session.fail(ValueError("boom"), 0, broken)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {
        "complete": False,
        "error": "ValueError: boom",
        "report_error": "AttributeError: 'Flux2KleinPipeline' object has no attribute 'unet'",
        "run_dir": str(tmp_path),
    }


def test_a_distilled_klein_folder_is_read_as_distilled(tmp_path):
    """FLUX.2 [klein]'s distilled models are told by their model_index.json's is_distilled: 4 steps, no CFG."""
    folder = tmp_path / "model"
    folder.mkdir()
    index = {"_class_name": "Flux2KleinPipeline", "is_distilled": True}
    (folder / "model_index.json").write_text(json.dumps(index))
    config = tiny_config(tmp_path, model={"id": str(folder)})
    del config["height"], config["width"], config["steps"], config["guidance_scale"]
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert (resolved["steps"], resolved["guidance_scale"]) == (4, 1.0)
    index["is_distilled"] = False
    (folder / "model_index.json").write_text(json.dumps(index))
    resolved = yaml.safe_load(run_cli("validate", write_config(tmp_path / "c.yaml", config)).output)
    assert (resolved["steps"], resolved["guidance_scale"]) == (50, 4.0)
    assert not FAMILIES["flux2_klein_distilled"].uses_cfg(4.0) and FAMILIES["flux2_klein"].uses_cfg(4.0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_familys_refusals_of_an_images_work_are_its_own_words_whoever_asks(name):
    # Run configs (rules, resolve, hires) and a server's admission all ask Family.refusals, through an image's
    # work where they have one (ImageWork.refusals): one place puts the family's words together.
    from dataclasses import replace

    from tpugen.config.hires import HiresFix
    from tpugen.config.images import ImageSource
    from tpugen.plan import ImageWork

    family = FAMILIES[name]
    title = f"{family.title} models"
    plain = ImageWork(prompt="a", negative_prompt="", seed=0, steps=2, guidance_scale=1.0, height=64, width=64)
    source = ImageSource(init_image="i.png", init_image_sha256="0" * 64, strength=0.5)
    asked = {
        "image": replace(plain, source=source),
        "tiling": replace(plain, tiling=True),
        "clip_skip": replace(plain, clip_skip=2),
        "hires": replace(plain, hires=HiresFix(2.0, 2, 0.5, "latent")),
    }
    why = {
        "image": family.img2img_refusal,
        "tiling": family.tiling_refusal,
        "clip_skip": family.clip_skip_refusal,
        "hires": family.img2img_refusal,
    }
    for part, work in asked.items():
        refused = work.refusals(family)
        assert refused.get(part) == (f"{title}: {why[part]}" if why[part] else None), (part, refused)
    refused = asked["hires"].refusals(family)
    latent = f"latent for {title}: {family.latent_upscale_refusal}"
    assert refused.get("hires.upscaler") == (
        latent if family.latent_upscale_refusal and "hires" not in refused else None
    )
    # An image without references is a txt2img's, which an edit-only family refuses.
    assert plain.refusals(family).get("txt2img") == (
        f"{title}: {family.txt2img_refusal}" if family.txt2img_refusal else None
    )
