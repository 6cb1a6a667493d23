"""Editing by reference (a prompt's reference_images): FLUX.2's references at the door, in the plan, in the records,
on XLA against diffusers' own pipelines, and what resume says when one changed."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import COMPILED_VS_EAGER, diffusers_remakes, run_cli, tiny_config, write_config
from PIL import Image


def _images(folder: Path, sizes: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, Path]:
    """Noise images of these (width, height) sizes, by name."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, (width, height) in sizes.items():
        made[name] = folder / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(made[name])
    return made


def _validate(tmp: Path, **overrides):
    config = tiny_config(tmp, **overrides)
    result = run_cli("validate", write_config(tmp / "c.yaml", config))
    return result


# ---------------------------------------------------------------- at the door


@pytest.mark.parametrize(
    ("model", "entry", "expected"),
    [
        (
            "tiny-sd",
            {"reference_images": ["a.png"]},
            "prompts[0].reference_images: Stable Diffusion 1.x/2.x models do not edit by reference images "
            "(FLUX.2 [klein], FLUX.2 [klein] distilled, FLUX.2 [klein] KV, FLUX.2 [dev], Qwen-Image-Edit Plus, "
            "Qwen-Image-Edit models do)",
        ),
        (
            "tiny-flux2-klein",
            {"reference_images": ["a.png"] * 5},
            "prompts[0].reference_images: 5 images; FLUX.2 [klein] models take at most 4",
        ),
        (
            "tiny-flux2-klein",
            {"reference_images": ["a.png"], "strength": 0.5},
            "prompts[0]: strength: a prompt with reference_images edits by reference (no init image, no strength); "
            "leave strength out",
        ),
        (
            "tiny-flux2",
            {"reference_images": ["a.png"], "init_image": "a.png"},
            "prompts[0]: init_image: a prompt with reference_images edits by reference (no init image, no "
            "strength); leave init_image out",
        ),
        ("tiny-flux2", {"reference_images": []}, "prompts[0]: reference_images must be a list of 1 to 10 paths"),
        ("tiny-flux2", {"reference_images": "a.png"}, "prompts[0]: reference_images must be a list of 1 to 10 paths"),
        ("tiny-flux2", {"reference_images": ["a.png", 3]}, "prompts[0]: reference_images must be a list of 1 to 10"),
        ("tiny-flux2", {"reference_images": ["a.png"] * 11}, "prompts[0]: reference_images must be a list of 1 to 10"),
        ("tiny-flux2", {"reference_images": ["../../gone.png"]}, "prompts[0]: reference_images[0]: '"),
        ("tiny-flux2", {"reference_images": ["a.png", "not-an-image.png"]}, "prompts[0]: reference_images[1]: '"),
        (
            "tiny-flux2",
            {"reference_images": ["a.png"], "height": 48},
            "prompts[0].reference_images: the image is 64x48 and its references are fitted to its size; an edit by "
            "reference needs at least 64 px a side",
        ),
    ],
)
def test_references_a_run_cannot_use_are_one_line_naming_them(tmp_path, model, entry, expected):
    _images(tmp_path, {"a": (64, 64)})
    (tmp_path / "not-an-image.png").write_bytes(b"GIF89a but not really")
    result = _validate(tmp_path, model={"id": model}, prompts=[{"prompt": "edit it", **entry}])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.stderr
    if "gone" in expected or "../../gone" in str(entry):
        assert "does not exist" in lines[0]
    if "not-an-image" in str(entry):
        assert "is not an image PIL can read" in lines[0]


def test_a_batch_holds_one_set_of_references_and_the_count_is_the_shape(tmp_path):
    from tpugen.config import load_config
    from tpugen.plan import plan_run

    made = _images(tmp_path, {"a": (64, 64), "b": (64, 64)})
    prompts = [
        {"prompt": "one", "reference_images": ["a.png"]},
        {"prompt": "two", "reference_images": ["b.png"]},
        {"prompt": "three", "reference_images": ["a.png"]},
        {"prompt": "four", "reference_images": ["a.png", "b.png"]},
        "five",
    ]
    config = tiny_config(tmp_path, model={"id": "tiny-flux2-klein"}, prompts=prompts, batch_size=2)
    plan = plan_run(load_config(write_config(tmp_path / "c.yaml", config)))
    assert [str(key) for key in plan.shape_keys] == [
        "64x64 b2 cfg edit 1 ref",
        "64x64 b2 cfg edit 2 refs",
        "64x64 b2 cfg",
    ]
    # The pipeline gives a call's references to every row: "one" and "three" share theirs, "two" is alone.
    assert [[item.prompt for item in batch.items] for batch in plan.batches] == [
        ["one", "three"],
        ["two"],
        ["four"],
        ["five"],
    ]
    first = plan.batches[0].items[0]
    assert first.task == "edit" and first.hires is None
    assert [image.path for image in first.references.images] == [str(made["a"].resolve())]


def test_the_config_hash_follows_the_references_content_not_their_place(tmp_path):
    from tpugen.config import load_config

    def hash_with(folder: Path, seed: int) -> str:
        _images(folder, {"a": (64, 64)}, seed=seed)
        prompts = [{"prompt": "edit", "reference_images": ["a.png"]}]
        config = tiny_config(folder, model={"id": "tiny-flux2-klein"}, prompts=prompts)
        return load_config(write_config(folder / "c.yaml", config)).config_hash

    plain = load_config(
        write_config(tmp_path / "p.yaml", tiny_config(tmp_path, model={"id": "tiny-flux2-klein"}, prompts=["edit"]))
    ).config_hash
    here, there, other = hash_with(tmp_path / "x", 0), hash_with(tmp_path / "y", 0), hash_with(tmp_path / "z", 1)
    assert here == there and here != other and here != plain


# ---------------------------------------------------------------- on XLA, against diffusers


def _diffusers_edits(model: str, run_dir: Path, references: dict[str, list]) -> dict[str, np.ndarray]:
    """Each image of the run made again by diffusers' own FLUX.2 pipeline on the CPU (no tpugen patch) from the
    same noise and the same references (PIL, as tpugen fitted them), by file name."""

    def arguments(pipe, family, record) -> dict:
        takes = inspect.signature(type(pipe).__call__).parameters  # Flux2KleinKVPipeline has no guidance
        guidance = {"guidance_scale": record["guidance_scale"]} if "guidance_scale" in takes else {}
        return {"image": references[record["prompt"]], **guidance}

    return diffusers_remakes(model, run_dir, arguments)


@pytest.mark.xla
@pytest.mark.cold_process  # its ~6,000 memory maps (two keys traced by dynamo) go with a child process
def test_flux2_klein_edits_by_reference_as_diffusers_does_and_resume_names_a_changed_one(tmp_path):
    """Three edits on FLUX.2 [klein] base (CFG on): two of one reference each (one shape, two batches: each its
    own references) and one of two (a reference wider than the image, cropped to it): one shape key a count,
    0 compiles after warmup, one host read a batch, diffusers' pixels within COMPILED_VS_EAGER, the references
    named by sha256 in the manifest and the PNG; then a changed reference stops `tpugen resume`, named."""
    from tpugen.engine.images import fit

    made = _images(tmp_path, {"a": (64, 64), "b": (64, 64), "wide": (96, 64)})
    prompts = [
        {"prompt": "the cat from image 1", "reference_images": ["a.png"]},
        {"prompt": "the dog", "reference_images": ["b.png"]},
        {"prompt": "both of them", "reference_images": ["a.png", "wide.png"]},
    ]
    config = tiny_config(
        tmp_path, model={"id": "tiny-flux2-klein"}, prompts=prompts, steps=2, guidance_scale=4.0, batch_size=2
    )
    config["compile"] = {"trace_once": True}
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert [w["shape_key"] for w in report["warmup"]] == ["64x64 b2 cfg edit 1 ref", "64x64 b2 cfg edit 2 refs"]
    assert report["compiles_after_warmup"] == 0
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1, 1, 1]

    sha = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in made.items()}
    records = {r["prompt"]: r for r in map(json.loads, (run_dir / "manifest.jsonl").read_text().splitlines())}
    assert records["the dog"]["reference_images_sha256"] == [sha["b"]]
    assert records["both of them"]["reference_images_sha256"] == [sha["a"], sha["wide"]]
    assert "strength" not in records["the dog"] and "init_image_sha256" not in records["the dog"]
    png = Image.open(run_dir / records["both of them"]["file"]).text
    assert json.loads(png["tpugen"])["reference_images_sha256"] == [sha["a"], sha["wide"]]
    assert f"Reference images: {sha['a'][:10]} {sha['wide'][:10]}, " in png["parameters"]

    def opened(name: str):
        with Image.open(made[name]) as image:
            return fit(image.convert("RGB"), 64, 64, 1)

    fitted = {prompt["prompt"]: [opened(Path(p).stem) for p in prompt["reference_images"]] for prompt in prompts}
    expected = _diffusers_edits("tiny-flux2-klein", run_dir, fitted)
    # The same edits with each image's references swapped for others (the two-reference one's order reversed):
    # the tiny random transformer heeds its references faintly (means of 0.013-0.019 / 255 apart), so each
    # image must also be far nearer its own references' edit than the swapped one's.
    others = {"the cat from image 1": "the dog", "the dog": "the cat from image 1"}
    swapped = {p: fitted[others[p]] if p in others else fitted[p][::-1] for p in fitted}
    elsewhere = _diffusers_edits("tiny-flux2-klein", run_dir, swapped)
    for name, edit in expected.items():
        ours = np.asarray(Image.open(run_dir / name).convert("RGB"), dtype=np.int16)
        apart = np.abs(ours - edit.astype(np.int16))
        assert int(apart.max()) <= COMPILED_VS_EAGER, name
        assert 10 * float(apart.mean()) < float(np.abs(ours - elsewhere[name].astype(np.int16)).mean()), name

    _images(tmp_path, {"wide": (96, 64)}, seed=5)  # another picture under the same name
    result = run_cli("resume", run_dir)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: {run_dir}: prompt 2's reference_images[1] {made['wide'].resolve()} changed since the run started "
        "(or is gone); put it back as it was, or start a new run"
    )


@pytest.mark.xla
@pytest.mark.parametrize("model", ["tiny-flux2", "tiny-flux2-klein-kv"])
def test_flux2_dev_and_klein_kv_edit_by_two_references_as_diffusers_does(tmp_path, model):
    """FLUX.2 [dev] (Flux2Pipeline: embedded guidance, no CFG) and [klein] KV (Flux2KleinKVPipeline: the
    references run at the first step alone, their keys and values kept for the later ones), lazily traced: one
    edit of two references, one shape key, 0 compiles after warmup, one host read, diffusers' pixels within
    COMPILED_VS_EAGER. ([klein] distilled is Flux2KleinPipeline without CFG: the test above's pipeline.)"""
    made = _images(tmp_path, {"a": (64, 64), "b": (64, 64)}, seed=3)
    prompts = [{"prompt": "image 1 in the style of image 2", "reference_images": ["a.png", "b.png"]}]
    config = tiny_config(tmp_path, model={"id": model}, prompts=prompts, steps=3, batch_size=1)
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert [w["shape_key"] for w in report["warmup"]] == ["64x64 b1 nocfg edit 2 refs"]
    assert report["compiles_after_warmup"] == 0
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1]
    references = [Image.open(made[name]).convert("RGB") for name in ("a", "b")]
    expected = _diffusers_edits(model, run_dir, {prompts[0]["prompt"]: references})
    swapped = _diffusers_edits(model, run_dir, {prompts[0]["prompt"]: references[::-1]})
    for name, edit in expected.items():
        ours = np.asarray(Image.open(run_dir / name).convert("RGB"), dtype=np.int16)
        apart = np.abs(ours - edit.astype(np.int16))
        assert int(apart.max()) <= COMPILED_VS_EAGER, name
        assert 10 * float(apart.mean()) < float(np.abs(ours - swapped[name].astype(np.int16)).mean()), name
