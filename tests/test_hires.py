"""Hires fix from a run config: a first pass, an upscale, an img2img pass at the larger size, against diffusers'
own pipelines on the CPU."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from conftest import cold_graphs, run_cli, tiny_config, write_config
from PIL import Image

from tpugen.config.hires import HiresFix

# Uncached tiny pipelines on XLA:CPU hold 2/255 of diffusers' eager CPU images (the families' tests); so do these.
WITHIN = 2


@functools.cache
def _plain(model: str):
    from diffusers import DiffusionPipeline

    from tpugen.tiny import builtin_path

    pipe = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(model: str, record: dict) -> np.ndarray:
    """The image diffusers' own pipelines make on the CPU (eager, no tpugen patch): the text-to-image pipeline
    from tpugen's noise for the seed, its latents scaled up bilinearly (or its own decoded image resized with
    Lanczos), then the family's img2img pipeline at the larger size."""
    import torch
    from diffusers import AutoPipelineForImage2Image

    from tpugen.families import BUILTINS

    family = BUILTINS[model][1]
    pipe = _plain(model)
    hires = record["hires"]
    height, width = record["height"], record["width"]
    generator = torch.Generator("cpu").manual_seed(record["seed"])
    (noise,) = family.noise(pipe, [generator], height, width)
    common = {"prompt": record["prompt"], "guidance_scale": record["guidance_scale"]}
    if record["negative_prompt"] and family.negative_prompt:
        common["negative_prompt"] = record["negative_prompt"]
    first = {"height": height, "width": width, "num_inference_steps": record["steps"], "latents": noise}
    with torch.no_grad():
        if hires["upscaler"] == "latent":
            latents = pipe(**common, **first, generator=generator, output_type="latent").images
            if model == "tiny-flux":  # packed 2x2 patches: the img2img pipeline takes them unpacked
                latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
            size = (hires["height"] // pipe.vae_scale_factor, hires["width"] // pipe.vae_scale_factor)
            image = torch.nn.functional.interpolate(latents, size=size, mode="bilinear", antialias=False)
            if hires["strength"] == 0:  # the upscale alone: the scaled latents decoded, as the pipeline decodes
                config = pipe.vae.config
                decoded = pipe.vae.decode(image / config.scaling_factor + (config.shift_factor or 0.0)).sample
                out = (decoded / 2 + 0.5).clamp(0, 1)[0].permute(1, 2, 0).numpy()
                return (out * 255).round().clip(0, 255).astype(np.uint8)
        else:
            made = pipe(**common, **first, generator=generator, output_type="pil").images[0]
            image = made.resize((hires["width"], hires["height"]), Image.Resampling.LANCZOS)
            if hires["strength"] == 0:  # the upscale alone: the first pass's image resized
                return np.asarray(image.convert("RGB"))
        second = AutoPipelineForImage2Image.from_pipe(pipe)
        second.set_progress_bar_config(disable=True)
        out = second(
            **common,
            image=image,
            strength=hires["strength"],
            height=hires["height"],
            width=hires["width"],
            # The web UI's rule: `steps` run, on a schedule stretched to steps / strength.
            num_inference_steps=math.ceil(hires["steps"] / hires["strength"]),
            generator=torch.Generator("cpu").manual_seed(record["seed"]),
            output_type="np",
        ).images[0]
    return (out * 255).round().clip(0, 255).astype(np.uint8)


# (model, upscaler, base size): base and second-pass sizes (twice the base) at batch 2 that no test before it
# compiles, so the graph counts of both passes are exact (64x64 b2, the tests' default, would share the second
# pass's step and decoding graphs). Flux.1's sides are multiples of 16.
CASES = [("tiny-sd", "latent", 40), ("tiny-sd", "lanczos", 24), ("tiny-flux", "latent", 48)]


@pytest.mark.xla
@pytest.mark.parametrize(("model", "upscaler", "side"), CASES)
def test_hires_fix_on_xla_is_diffusers_own_with_both_sizes_warm(model, upscaler, side, tmp_path):
    hires = {"scale": 2, "steps": 4, "strength": 0.5, "upscaler": upscaler}
    config = tiny_config(
        tmp_path,
        model={"id": model},
        prompts=["a red fox in snow", "a lighthouse at dawn", "a bowl of fruit"],
        height=side,
        width=side,
        steps=3,
        batch_size=2,
        hires=hires,
    )
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())

    # One shape key, both passes in it: every graph compiled in warmup, none after, one read back per batch
    # (two with lanczos: the first pass's pixels go to the host to be resized).
    label = f"{side}x{side} b2 {'cfg' if model == 'tiny-sd' else 'nocfg'} hires x2 {upscaler}"
    (warm,) = report["warmup"]
    assert warm["shape_key"] == label
    graphs = cold_graphs(warm)  # whatever this process compiled before (Flux.1's text encoding at batch 2, say)
    first = {"text encoding": 1, "first denoising step": 1, "later denoising steps": 0}
    if upscaler == "lanczos":
        first["first-pass decoding"] = 1
    second = {"hires text encoding": 1, "hires first denoising step": 1, "hires later denoising steps": 0}
    assert graphs == {**first, **second, "decoding": 1}, graphs
    assert report["compiles_after_warmup"] == 0
    batches = report["timed_phase"]["batches"]
    assert [b["shape_key"] for b in batches] == [label, label]
    assert [b["transfers_to_host"] for b in batches] == [2 if upscaler == "lanczos" else 1] * 2

    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    for record in records:
        assert record["hires"] == {**hires, "scale": 2.0, "height": 2 * side, "width": 2 * side}
        png = Image.open(run_dir / record["file"])
        assert png.size == (2 * side, 2 * side)
        name = "Latent" if upscaler == "latent" else "Lanczos"
        assert (
            f"Size: {side}x{side}, Model: {model}, Denoising strength: 0.5, Hires upscale: 2, Hires steps: 4, "
            f"Hires upscaler: {name}," in png.text["parameters"]
        )
        made = np.asarray(png.convert("RGB"), np.int16)
        difference = int(np.abs(made - _reference(model, record).astype(np.int16)).max())
        assert difference <= WITHIN, (record["file"], difference)


def test_what_hires_fix_cannot_do_is_one_line_each(tmp_path):
    Image.new("RGB", (64, 64), (128, 128, 128)).save(tmp_path / "init.png")

    def validate(model: str = "tiny-sd", **overrides) -> str:
        config = tiny_config(tmp_path, model={"id": model}, **overrides)
        result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
        assert result.exit_code == 2, result.output
        return result.stderr

    hires = {"scale": 2}
    assert validate(hires={"scale": 1}) == "error: hires.scale: must be greater than 1, got 1\n"
    assert validate(hires={"scale": 8}) == "error: hires.scale: must be less than or equal to 4, got 8\n"
    assert (
        validate(hires={"upscaler": "esrgan"}) == "error: hires.upscaler: must be 'latent' or 'lanczos', got 'esrgan'\n"
    )
    assert validate(hires={"strength": -0.1}) == "error: hires.strength: must be greater than or equal to 0, got -0.1\n"
    text = validate("tiny-flux", hires=hires, compile={"step_cache": {"method": "taylorseer"}})
    assert "hires: compile.step_cache.method: taylorseer runs for txt2img only" in text
    text = validate("tiny-qwen-image", hires=hires)
    assert "hires.upscaler: latent for Qwen-Image models: QwenImageImg2ImgPipeline encodes pixels" in text
    assert "FLUX.2 [klein] models: diffusers 0.42 has no img2img for FLUX.2" in validate(
        "tiny-flux2-klein", hires=hires
    )
    # Lanczos for Qwen-Image passes, and a config without hires hashes as it did before hires existed.
    config = tiny_config(tmp_path, model={"id": "tiny-qwen-image"}, hires={"upscaler": "lanczos"})
    assert run_cli("validate", write_config(tmp_path / "q.yaml", config)).exit_code == 0


def test_hires_fix_is_for_the_text_only_prompts_of_a_run(tmp_path):
    from tpugen.config import load_config
    from tpugen.plan import plan_run

    Image.new("RGB", (64, 64), (128, 128, 128)).save(tmp_path / "init.png")
    Image.new("L", (64, 64), 255).save(tmp_path / "mask.png")
    prompts = [
        "a fox",
        {"prompt": "a cat", "init_image": "init.png"},
        {"prompt": "a dog", "init_image": "init.png", "mask_image": "mask.png"},
    ]
    config = tiny_config(tmp_path, prompts=prompts, hires={"scale": 1.5, "upscaler": "lanczos"}, steps=6)
    plan = plan_run(load_config(write_config(tmp_path / "c.yaml", config)))
    assert [(str(b.shape), b.hires) for b in plan.batches] == [
        ("64x64 b2 cfg hires x1.5 lanczos", HiresFix(1.5, 6, 0.7, "lanczos")),
        ("64x64 b2 cfg img2img", None),
        ("64x64 b2 cfg inpaint", None),
    ]
    assert HiresFix(1.5, 6, 0.7, "lanczos").size(64, 64, 8) == (96, 96)
    assert HiresFix(1.5, 6, 0.7, "latent").size(72, 40, 16) == (96, 48)  # floored to the family's multiple


def test_the_second_pass_runs_its_steps_on_a_schedule_of_steps_over_strength():
    # diffusers' Stable Diffusion img2img runs int(n x strength) of n steps: ceil(steps / strength) runs `steps`.
    for steps in (1, 2, 3, 4, 10, 20, 37):
        for strength in (0.05, 0.3, 0.5, 0.7, 0.75, 0.999, 1.0):
            n = HiresFix(2.0, steps, strength).schedule_steps
            assert int(n * strength) == steps, (steps, strength, n)
    assert HiresFix(2.0, 1, 0.7).schedule_steps == 2  # one step run, never none (SD-Turbo's single step)
    assert HiresFix(1.4999999, 4, 0.5).shape_label != HiresFix(1.5, 4, 0.5).shape_label


def test_a_family_without_img2img_refuses_init_images_and_img2img_tasks(tmp_path):
    Image.new("RGB", (64, 64), (128, 128, 128)).save(tmp_path / "init.png")
    prompts = [{"prompt": "a fox", "init_image": "init.png"}]
    config = tiny_config(tmp_path, model={"id": "tiny-flux2-klein"}, prompts=prompts, serve={"tasks": ["img2img"]})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    why = "FLUX.2 [klein] models: diffusers 0.42 has no img2img for FLUX.2 (its image input is a reference to edit"
    assert result.stderr.splitlines() == [
        f"error: prompts[0].init_image: {why} from, with no strength)",
        f"error: serve.tasks: img2img for {why} from, with no strength)",
    ]


@pytest.mark.xla
@pytest.mark.parametrize(
    ("model", "upscaler"), [("tiny-sd", "latent"), ("tiny-sd", "lanczos"), ("tiny-flux", "latent")]
)
def test_hires_fix_at_denoising_strength_0_is_the_upscale_alone(model, upscaler, tmp_path):
    """The web UI's hires fix with denoising_strength 0 runs no second pass: the first pass upscaled (latent: its
    latents scaled up and decoded; lanczos: its image resized), which is diffusers' own first pass so treated.
    Before: refused (strength must be above 0)."""
    hires = {"scale": 2, "steps": 4, "strength": 0.0, "upscaler": upscaler}
    config = tiny_config(
        tmp_path, model={"id": model}, prompts=["a red fox in snow"], height=32, width=32, steps=3, hires=hires
    )
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    assert not [phase for phase in cold_graphs(warm) if phase.startswith("hires ")]  # no second pass ran
    (record,) = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    png = Image.open(run_dir / record["file"])
    assert png.size == (64, 64) and "Denoising strength: 0.0, Hires upscale: 2" in png.text["parameters"]
    made = np.asarray(png.convert("RGB"), np.int16)
    difference = int(np.abs(made - _reference(model, record).astype(np.int16)).max())
    assert difference <= WITHIN, difference
