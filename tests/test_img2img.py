"""Images in: img2img and inpainting from a run config's prompts, against diffusers' own pipelines on the CPU."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json

import numpy as np
import pytest
from conftest import WorkItemRow, generate_in_new_process, reference_negative, run_cli, tiny_config, write_config
from PIL import Image

from tpugen.families import BUILTINS

# Uncached tiny pipelines on XLA:CPU hold 2/255 of diffusers' eager CPU images (the families' tests); so do these.
WITHIN = 2
# One batch holds the three img2img prompts below.
BATCH = 5


def _inputs(tmp_path, width: int = 64, height: int = 64) -> None:
    """init.png (noise with a red square), mask.png (white right half: repaint it), wide.png (another size),
    mirrored.png (init.png mirrored)."""
    rng = np.random.default_rng(0)
    pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = (220, 30, 30)
    Image.fromarray(pixels).save(tmp_path / "init.png")
    mask = np.zeros((height, width), np.uint8)
    mask[:, width // 2 :] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    Image.fromarray(pixels).resize((width + 32, height)).save(tmp_path / "wide.png")
    Image.fromarray(pixels[:, ::-1]).save(tmp_path / "mirrored.png")


@functools.cache
def _loaded(model: str):
    from diffusers import DiffusionPipeline

    from tpugen.tiny import builtin_path

    return DiffusionPipeline.from_pretrained(str(builtin_path(model)))


def _reference(model: str, record: dict, tmp_path) -> np.ndarray:
    """The image diffusers' own img2img or inpaint pipeline makes on the CPU (eager, no tpugen patch) from the
    record's prompt, seed and input images."""
    import torch
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    base = _loaded(model)
    auto = AutoPipelineForInpainting if "mask_image_sha256" in record else AutoPipelineForImage2Image
    pipe = auto.from_pipe(base)
    pipe.set_progress_bar_config(disable=True)
    by_content = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in tmp_path.glob("*.png")}
    image = Image.open(by_content[record["init_image_sha256"]]).convert("RGB")
    # Fitted to the run's size as resize_mode 0 does (SDXL's img2img pipeline takes the image's own size).
    size = (record["width"], record["height"])
    arguments = {"image": image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)}
    if "mask_image_sha256" in record:
        arguments["mask_image"] = Image.open(tmp_path / "mask.png").convert("L")
    # The family's own call arguments (its negative prompt, Qwen-Image's true CFG), as plain_diffusers_images
    # passes them, less tpugen's fixed text length.
    arguments["guidance_scale"] = record["guidance_scale"]
    arguments.update(reference_negative(BUILTINS[model][1], record))
    row = WorkItemRow(record["negative_prompt"])
    for key, value in BUILTINS[model][1].call_arguments(pipe, [row], record["guidance_scale"]).items():
        if key != "max_sequence_length":
            arguments[key] = value[0] if isinstance(value, list) else value
    accepted = inspect.signature(type(pipe).__call__).parameters
    with torch.no_grad():
        image = pipe(
            prompt=record["prompt"],
            strength=record["strength"],
            height=record["height"],
            width=record["width"],
            num_inference_steps=record["steps"],
            generator=torch.Generator("cpu").manual_seed(record["seed"]),
            output_type="np",
            **{key: value for key, value in arguments.items() if key in accepted},
        ).images[0]
    return (image * 255).round().clip(0, 255).astype(np.uint8)


def _largest_difference(run_dir, model: str, tmp_path) -> dict[str, int]:
    out = {}
    for line in (run_dir / "manifest.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "strength" not in record:
            continue
        made = np.asarray(Image.open(run_dir / record["file"]).convert("RGB"), np.int16)
        out[record["file"]] = int(np.abs(made - _reference(model, record, tmp_path).astype(np.int16)).max())
    return out


@pytest.mark.xla
def test_img2img_and_inpainting_on_xla_are_diffusers_own_with_no_compile_after_warmup(tmp_path):
    _inputs(tmp_path)
    prompts = [
        {"prompt": "a red square", "init_image": "init.png", "strength": 0.6},
        "a lighthouse at dawn",
        {"prompt": "a blue square", "init_image": "init.png", "strength": 0.6, "seed": 11},
        {"prompt": "repaint the right", "init_image": "init.png", "mask_image": "mask.png", "strength": 0.8},
        {"prompt": "a red square", "init_image": "mirrored.png", "strength": 0.6, "seed": 7},
    ]
    # In a process of its own: the counts below are what each shape key compiles after the ones before it in
    # this run, which only a fresh compile cache tells.
    proc, run_dir = generate_in_new_process(tmp_path, prompts=prompts, steps=5, batch_size=BATCH)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())

    assert report["compiles_after_warmup"] == 0
    # One batch per task (a call has one strength and one kind of pipeline), each its own shape key.
    warm = {entry["shape_key"]: entry["graphs_per_phase"] for entry in report["warmup"]}
    assert list(warm) == [f"64x64 b{BATCH} cfg img2img", f"64x64 b{BATCH} cfg", f"64x64 b{BATCH} cfg inpaint"]
    # img2img: the image's encoding joins the text's, one graph; its steps are txt2img's step graph, so the
    # txt2img key after it compiles its text encoding alone. Inpainting blends the masked image in each step but
    # the last (one step graph more), its encoding one graph.
    assert warm[f"64x64 b{BATCH} cfg img2img"] == {
        "text encoding": 1,
        "first denoising step": 1,
        "later denoising steps": 0,
        "decoding": 1,
    }
    assert warm[f"64x64 b{BATCH} cfg"] == {
        "text encoding": 1,
        "first denoising step": 0,
        "later denoising steps": 0,
        "decoding": 0,
    }
    assert warm[f"64x64 b{BATCH} cfg inpaint"]["later denoising steps"] == 1
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1, 1, 1]

    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    sha256 = hashlib.sha256((tmp_path / "init.png").read_bytes()).hexdigest()
    assert [r.get("strength") for r in records] == [0.6, None, 0.6, 0.8, 0.6] and records[0]["seed"] == 7
    assert records[0]["init_image_sha256"] == sha256 and "mask_image_sha256" in records[3]
    png = Image.open(run_dir / records[0]["file"])
    assert ", Denoising strength: 0.6," in png.text["parameters"]
    assert "Denoising strength" not in Image.open(run_dir / records[1]["file"]).text["parameters"]

    differences = _largest_difference(run_dir, "tiny-sd", tmp_path)
    assert len(differences) == 4 and max(differences.values()) <= WITHIN, differences

    # The image is really used: the same prompt and seed from the mirrored image make another image (by 2.05/255
    # on average, measured: the tiny random VAE keeps little of what it encodes; tiny-shapes can tell more).
    first, mirrored = (
        np.asarray(Image.open(run_dir / r["file"]).convert("RGB"), np.int16) for r in (records[0], records[4])
    )
    assert np.abs(first - mirrored).mean() > 1

    # resume refuses a run whose input image changed since it started, naming it; nothing is written.
    Image.open(tmp_path / "wide.png").save(tmp_path / "init.png")
    before = sorted(p.name for p in run_dir.iterdir())
    result = run_cli("resume", run_dir)
    assert (
        result.exit_code == 2
        and "prompt 0's init_image" in result.stderr
        and "changed since the run started" in result.stderr
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before


# The other families diffusers 0.42 has an img2img pipeline for, at the size and batch tests/test_families.py
# runs them (their step and decoding graphs are then shared: the img2img key compiles its encoding alone).
OTHER_FAMILIES = ["tiny-flux", "tiny-sdxl", "tiny-sd3", "tiny-z-image", "tiny-qwen-image"]


@pytest.mark.xla
@pytest.mark.parametrize("model", OTHER_FAMILIES)
def test_img2img_of_the_other_families_is_diffusers_own(model, tmp_path):
    _inputs(tmp_path)
    prompts = [{"prompt": "a red square", "init_image": "init.png", "strength": 0.7}]
    config = tiny_config(tmp_path, model={"id": model}, prompts=prompts, steps=4)
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    assert warm["shape_key"].endswith(" img2img") and warm["graphs_per_phase"]["later denoising steps"] == 0
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1]
    differences = _largest_difference(run_dir, model, tmp_path)
    assert len(differences) == 1 and max(differences.values()) <= WITHIN, differences


def test_bad_input_images_are_one_line_each(tmp_path):
    _inputs(tmp_path)
    (tmp_path / "text.png").write_text("not an image")
    Image.new("RGB", (8200, 8)).save(tmp_path / "huge.png")
    cases = [
        ({"prompt": "a", "init_image": "gone.png"}, "prompts[0]: init_image: ", "gone.png' does not exist"),
        ({"prompt": "a", "init_image": "text.png"}, "prompts[0]: init_image: ", "is not an image PIL can read"),
        ({"prompt": "a", "init_image": "huge.png"}, "prompts[0]: init_image: ", "8200x8; at most 8192 pixels a side"),
        (
            {"prompt": "a", "init_image": "init.png", "mask_image": "text.png"},
            "prompts[0]: mask_image: ",
            "not an image",
        ),
        ({"prompt": "a", "init_image": "init.png", "strength": 0}, "prompts[0]: strength must be", "got 0"),
        ({"prompt": "a", "init_image": "init.png", "strength": 1.5}, "prompts[0]: strength must be", "at most 1"),
        ({"prompt": "a", "strength": 0.5}, "prompts[0]: strength is for a prompt with an init_image", ""),
        ({"prompt": "a", "mask_image": "mask.png"}, "prompts[0]: mask_image is for a prompt with an init_image", ""),
        ({"prompt": "a", "init_image": "init.png", "resize_mode": 3}, "prompts[0]: resize_mode must be one of 0", ""),
    ]
    for entry, start, words in cases:
        path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, prompts=[entry]))
        result = run_cli("validate", path)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, (entry, result.output)
        assert result.stderr.startswith(f"error: {start}") and words in result.stderr, (entry, result.stderr)
    assert not (tmp_path / "outputs").exists()


def test_the_hash_names_input_images_by_content(tmp_path):
    from tpugen.config import load_config

    _inputs(tmp_path)
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "init.png").write_bytes((tmp_path / "init.png").read_bytes())

    def hash_of(image: str, strength: float = 0.5) -> str:
        entry = {"prompt": "a", "init_image": image, "strength": strength}
        return load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path, prompts=[entry]))).config_hash

    text_only = load_config(write_config(tmp_path / "t.yaml", tiny_config(tmp_path, prompts=["a"]))).config_hash
    assert hash_of("init.png") == hash_of("moved/init.png")  # where the image is does not name the images
    assert hash_of("init.png") != hash_of("wide.png") and hash_of("init.png") != hash_of("init.png", 0.6)
    # A config without images hashes as it did before prompts could have them.
    assert (
        text_only
        == load_config(write_config(tmp_path / "t2.yaml", tiny_config(tmp_path, prompts=[{"prompt": "a"}]))).config_hash
    )


def test_images_are_fitted_as_the_web_ui_resize_modes_do():
    from tpugen.engine.images import fit

    wide = Image.new("RGB", (128, 64), (0, 0, 255))
    wide.paste((255, 0, 0), (0, 0, 32, 64))  # a red band on the left
    assert fit(wide, 64, 64, 0).size == (64, 64)
    cropped = np.asarray(fit(wide, 64, 64, 1))
    assert cropped.shape == (64, 64, 3) and cropped[:, :, 0].max() < 30  # the middle kept: the red band cut away
    filled = np.asarray(fit(wide, 64, 64, 2))
    # Scaled to fit (64x32, centred), the bands above and below filled by its first and last rows.
    assert filled.shape == (64, 64, 3) and (filled[:, :8, 0] > 200).all() and (filled[:, 40:, 2] > 200).all()
