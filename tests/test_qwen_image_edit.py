"""Qwen-Image-Edit Plus and Qwen-Image-Edit: editing by reference images on XLA against diffusers' own
QwenImageEditPlusPipeline and QwenImageEditPipeline, their graphs and host reads, what validation refuses, and their
built-ins in `tpugen models`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import COMPILED_VS_EAGER, FIRST_CALL, cold_graphs, diffusers_remakes, run_cli, tiny_config, write_config
from PIL import Image

MODEL = "tiny-qwen-image-edit-plus"


def _images(folder: Path, names: str, seed: int = 0) -> dict[str, Path]:
    """64x64 noise images, by name."""
    rng = np.random.default_rng(seed)
    made = {}
    for name in names:
        made[name] = folder / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(made[name])
    return made


def _diffusers_edits(run_dir: Path, references: dict[str, list], monkeypatch, model: str) -> dict[str, np.ndarray]:
    """Each image of the run made again by diffusers' own pipeline of `model` on the CPU (no tpugen patch) from the
    same noise, references and negative prompt, its module's reference areas set to the model's (the family's
    call_globals: what tpugen's call uses), by file name."""
    import sys

    def set_areas(pipe) -> None:
        from tpugen.families import BUILTINS

        family = BUILTINS[model][1]
        for name, value in family.call_globals(pipe).items():
            monkeypatch.setattr(sys.modules[type(pipe).__module__], name, value)

    def arguments(pipe, family, record) -> dict:
        pictures = references[record["prompt"]]
        return {
            "image": pictures if family.max_references > 1 else pictures[0],  # QwenImageEditPipeline's is one
            "negative_prompt": record["negative_prompt"],  # tpugen's call gives its own, "" too: CFG
            "true_cfg_scale": record["guidance_scale"],
        }

    return diffusers_remakes(model, run_dir, arguments, prepare=set_areas)


@pytest.mark.xla
@pytest.mark.parametrize(
    ("model", "pictures"),
    [(MODEL, [["a.png", "b.png"], ["b.png", "a.png"]]), ("tiny-qwen-image-edit", [["a.png"], ["b.png"]])],
    ids=["plus-2-refs", "edit-1-ref"],
)
def test_qwen_image_edits_by_reference_as_diffusers_does(tmp_path, monkeypatch, model, pictures):
    """Two edits (one shape key; Plus: two references each, the second's the other way round; Qwen-Image-Edit:
    one each, another for the second), lazily traced: three graphs (text and references, one step, decoding), 0
    compiles after warmup, one host read and steps + 2 executions a batch, diffusers' pixels within
    COMPILED_VS_EAGER, and each image far nearer its own references' edit than the edit of the other's."""
    made = _images(tmp_path, "ab", seed=3)
    texts = ["the cat of picture 1 on the sofa of picture 2", "picture 1 in the style of picture 2"]
    prompts = [{"prompt": text, "reference_images": refs} for text, refs in zip(texts, pictures, strict=True)]
    config = tiny_config(tmp_path, model={"id": model}, prompts=prompts, steps=2, guidance_scale=4.0, batch_size=1)
    config["compile"] = {"trace_once": False}
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    (warm,) = report["warmup"]
    assert warm["shape_key"] == ("64x64 b1 cfg edit 2 refs" if model == MODEL else "64x64 b1 cfg edit 1 ref")
    assert cold_graphs(warm) == FIRST_CALL
    assert report["compiles_after_warmup"] == 0
    batches = report["timed_phase"]["batches"]
    assert [(b["executions"], b["transfers_to_host"]) for b in batches] == [(4, 1), (4, 1)]

    opened = {name: Image.open(path).convert("RGB") for name, path in made.items()}
    references = {p["prompt"]: [opened[Path(r).stem] for r in p["reference_images"]] for p in prompts}
    expected = _diffusers_edits(run_dir, references, monkeypatch, model)
    first, second = texts
    swapped = {first: references[second], second: references[first]}  # Plus: each's own the other way round
    swapped = _diffusers_edits(run_dir, swapped, monkeypatch, model)
    assert len(expected) == 2
    for name, edit in expected.items():
        ours = np.asarray(Image.open(run_dir / name).convert("RGB"), dtype=np.int16)
        apart = np.abs(ours - edit.astype(np.int16))
        assert int(apart.max()) <= COMPILED_VS_EAGER, name
        assert 10 * float(apart.mean()) < float(np.abs(ours - swapped[name].astype(np.int16)).mean()), name


@pytest.mark.parametrize(
    ("entry", "overrides", "expected"),
    [
        (
            {"reference_images": ["a.png"] * 4},
            {},
            "prompts[0].reference_images: 4 images; Qwen-Image-Edit Plus models take at most 3",
        ),
        (
            {"reference_images": ["a.png"], "strength": 0.5},
            {},
            "prompts[0]: strength: a prompt with reference_images edits by reference (no init image, no strength); "
            "leave strength out",
        ),
        (
            {},
            {},
            "prompts[0]: Qwen-Image-Edit Plus models: QwenImageEditPlusPipeline only edits, by reference images; "
            "give it reference_images",
        ),
        (
            {"reference_images": ["a.png"]},
            {"batch_size": 2},
            "batch_size: Qwen-Image-Edit Plus models: diffusers 0.42's QwenImageEditPlusPipeline takes one prompt a "
            "call; set batch_size: 1",
        ),
        (
            {"reference_images": ["a.png"] * 2},
            {"model": {"id": "tiny-qwen-image-edit"}},
            "prompts[0].reference_images: 2 images; Qwen-Image-Edit models take at most 1",
        ),
    ],
)
def test_what_qwen_image_edit_plus_cannot_run_is_one_line(tmp_path, entry, overrides, expected):
    _images(tmp_path, "a")
    prompts = [{"prompt": "edit it", **entry}]
    config = tiny_config(tmp_path, prompts=prompts, **{"model": {"id": MODEL}, "batch_size": 1, **overrides})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {expected}"], result.stderr


def test_qwen_image_edit_plus_validates_with_references_and_is_listed(tmp_path):
    _images(tmp_path, "ab")
    prompts = [{"prompt": "edit it", "reference_images": ["a.png", "b.png"]}]
    config = tiny_config(tmp_path, model={"id": MODEL}, prompts=prompts, batch_size=1)
    assert run_cli("validate", write_config(tmp_path / "c.yaml", config)).exit_code == 0
    result = run_cli("models")
    assert result.exit_code == 0
    listed = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    for model, name, pipeline in (
        (MODEL, "qwenimage_edit_plus", "QwenImageEditPlusPipeline"),
        ("tiny-qwen-image-edit", "qwenimage_edit", "QwenImageEditPipeline"),
    ):
        assert [words[:2] for words in listed if words[0] == model] == [[model, name]]
        assert [name, pipeline] in [words[:2] for words in listed]


def test_a_server_of_an_edit_only_family_warms_edits_only(tmp_path):
    """A server's config (`validate --serve`, as `tpugen serve` reads it) warming txt2img, the default task, for a
    family that only edits is one line before anything loads; with serve.tasks [edit] it is valid."""
    config = tiny_config(tmp_path, model={"id": MODEL}, batch_size=1)
    del config["prompts"]
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("validate", path, "--serve")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: serve.tasks: txt2img: Qwen-Image-Edit Plus models: QwenImageEditPlusPipeline only edits, by "
        "reference images; set serve.tasks: [edit]"
    ], result.stderr
    assert run_cli("validate", path, "--serve", "serve.tasks=[edit]").exit_code == 0
