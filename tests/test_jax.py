"""execution.backend: jax: every family's whole denoising loop as one compiled call on JAX (its CPU here), against
eager PyTorch on the CPU and torch_xla; every sampler in one call; compiles read back by the next process; a LoRA
switch that compiles nothing; a warm server; and what it does not run yet, refused in one line."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    COMPILED_VS_EAGER,
    assert_same_images,
    generate_in_new_process,
    make_lora,
    run_cli,
    tiny_config,
    write_config,
)
from PIL import Image

from tpugen.config import load_config
from tpugen.schedulers import SCHEDULER_NAMES

# Every family's tiny built-in (tiny-sd: the tests after), with the tasks its pipelines have: img2img and
# inpainting prompts join the txt2img one where the family runs them, and an edit by reference where it edits
# (FLUX.2 [klein] KV's are refused on jax: test_what_jax_does_not_run_yet_is_refused_in_one_line).
FAMILY_TASKS = {
    "tiny-sdxl": ("txt2img", "img2img", "inpaint"),
    "tiny-sd3": ("txt2img", "img2img"),
    "tiny-flux": ("txt2img", "img2img", "inpaint"),
    "tiny-flux2": ("txt2img", "edit"),
    "tiny-flux2-klein": ("txt2img",),
    "tiny-flux2-klein-distilled": ("txt2img", "edit"),
    "tiny-flux2-klein-kv": ("txt2img",),
    "tiny-z-image": ("txt2img",),
    "tiny-qwen-image": ("txt2img",),
    "tiny-qwen-image-edit-plus": ("edit",),
}
PHASES = {"text encoding", "denoising loop", "decoding"}
# Importing torchax names torch's privateuse1 device "jax" for the whole process (and torch then reports it as an
# accelerator, which diffusers' offload and TorchTPU's device then trip on): each test that runs JAX does so in a
# child process of its own (tests/conftest.py: cold_process), so no other test shares its process.
JAX_PROCESS = pytest.mark.cold_process


def _images(tmp: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    init, mask = tmp / "init.png", tmp / "mask.png"
    Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8)).save(init)
    half = np.zeros((64, 64), np.uint8)
    half[:, 32:] = 255
    Image.fromarray(half).save(mask)
    return init, mask


def _prompts(tmp: Path, tasks) -> list:
    init, mask = _images(tmp)
    made = {
        "txt2img": "a lighthouse at dawn",
        "img2img": {"prompt": "a red square", "init_image": str(init), "strength": 0.6},
        "inpaint": {"prompt": "repaint", "init_image": str(init), "mask_image": str(mask), "strength": 0.8},
        "edit": {"prompt": "the square in the style of the mask", "reference_images": [str(init), str(mask)]},
    }
    return [made[task] for task in tasks]


def _run(tmp: Path, backend: str, **overrides) -> tuple[Path, dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tmp, execution={"backend": backend}, **overrides)
    result = run_cli("generate", write_config(tmp / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = Path(config["output"]["dir"]) / config["output"]["run_id"]
    return run_dir, json.loads((run_dir / "report.json").read_text())


def _assert_whole_loops(report: dict) -> None:
    """Every call ran its loop as one call; nothing compiled after warmup; per batch, every program's output read
    back to the host but the loop's, whose latents stay on the device for decoding."""
    loop = report["device"]["denoising_loop"]
    assert loop["step_by_step"] == [] and loop["one_call"] >= len(report["timed_phase"]["batches"]), loop
    assert report["compiles_after_warmup"] == 0
    for entry in report["warmup"]:
        assert set(entry["graphs_per_phase"]) == PHASES
    for batch in report["timed_phase"]["batches"]:
        assert batch["compiles"] == 0 and batch["executions"] == batch["transfers_to_host"] + 1, batch


@pytest.mark.xla
@JAX_PROCESS
def test_tiny_sd_on_jax_matches_eager_cpu_and_torch_xla(tmp_path, xla_run, cpu_run):
    run_dir, report = _run(tmp_path, "jax")
    _assert_whole_loops(report)
    assert report["device"]["backend"] == "jax" and report["device"]["device_kind"].startswith("CPU")
    assert_same_images(run_dir, cpu_run, COMPILED_VS_EAGER)
    assert_same_images(run_dir, xla_run, COMPILED_VS_EAGER)
    # The host hands each batch's loop over in one call: its share of a step is far below a lazy step's.
    assert all(b["host_ms_per_step"] < 5 for b in report["timed_phase"]["batches"])


@pytest.mark.xla
@JAX_PROCESS
@pytest.mark.parametrize("model", sorted(FAMILY_TASKS))
def test_every_family_runs_its_loop_as_one_call_and_matches_eager_cpu(model, tmp_path):
    overrides = {
        "model": {"id": model},
        "prompts": _prompts(tmp_path, FAMILY_TASKS[model]),
        "steps": 2,
        "batch_size": 1,
        "negative_prompt": "",
    }
    jax_dir, report = _run(tmp_path / "jax", "jax", **overrides)
    cpu_dir, _ = _run(tmp_path / "cpu", "cpu", **overrides)
    _assert_whole_loops(report)
    assert len(report["warmup"]) == len(FAMILY_TASKS[model])
    assert_same_images(jax_dir, cpu_dir, COMPILED_VS_EAGER)


@pytest.mark.xla
@JAX_PROCESS
def test_sd_img2img_and_both_kinds_of_inpainting_match_eager_cpu(tmp_path):
    """A 4-channel UNet inpaints by blending the init image back in after every update; a 9-channel one is given
    the mask and the masked image at every step: both within the one call."""
    import torch
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    from tpugen.tiny import builtin_path

    pipe = DiffusionPipeline.from_pretrained(str(builtin_path("tiny-sd")))
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(**{**dict(pipe.unet.config), "in_channels": 9})
    nine = tmp_path / "tiny-sd-inpainting"
    pipe.save_pretrained(nine)
    init, mask = _images(tmp_path)
    for model, prompts in (
        ("tiny-sd", _prompts(tmp_path, ("img2img", "inpaint"))),
        (str(nine), [{"prompt": "repaint", "init_image": str(init), "mask_image": str(mask), "strength": 1.0}]),
    ):
        overrides = {"model": {"id": model}, "prompts": prompts, "batch_size": 1, "steps": 4}
        where = tmp_path / Path(model).name
        jax_dir, report = _run(where / "jax", "jax", **overrides)
        cpu_dir, _ = _run(where / "cpu", "cpu", **overrides)
        _assert_whole_loops(report)
        assert_same_images(jax_dir, cpu_dir, COMPILED_VS_EAGER)


class Engines(dict):
    """A tiny-sd engine on jax and one on eager PyTorch, opened when first asked for: a cold_process test's parent
    sets its fixtures up too, and must not import torchax."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp

    def __missing__(self, backend: str):
        from tpugen.config import load_config
        from tpugen.engine import Engine, EngineSpec

        config = tiny_config(self.tmp, execution={"backend": backend}, batch_size=1)
        self[backend] = Engine.open(EngineSpec.of(load_config(write_config(self.tmp / f"{backend}.yaml", config))))
        return self[backend]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    opened = Engines(tmp_path_factory.mktemp("jax-engines"))
    yield opened
    for engine in opened.values():
        engine.close()


def _batch(steps: int = 4):
    from conftest import one_call, work_item

    return one_call(work_item(negative_prompt="blurry", steps=steps))


@pytest.mark.xla
@JAX_PROCESS
def test_convolutions_equal_torch_and_run_channels_last_inside_a_loop():
    """On JAX's CPU tpugen's 2-D convolution is channels-last (XLA:CPU keeps a loop body's convolutions in the
    layout they come in, and its fast kernel takes channels-last only); any stride, padding, dilation and groups
    equal torch's, and a 1-D one (torchax's own) too."""
    import jax
    import torch

    from tpugen.backends.jax.runtime import process_runtime

    env = process_runtime().env
    torch.manual_seed(0)

    def on_jax(function, *tensors):
        with env:
            return env.t2j_iso(function(*(env.j2t_iso(t) for t in tensors)))

    x = torch.randn(2, 8, 9, 9)
    for case in ({"padding": 1}, {"stride": 2}, {"padding": 2, "dilation": 2}, {"padding": 1, "groups": 4}):
        weight, bias = torch.randn(8, 8 // case.get("groups", 1), 3, 3), torch.randn(8)
        expected = torch.nn.functional.conv2d(x, weight, bias, **case).numpy()
        conv = functools.partial(torch.nn.functional.conv2d, **case)
        got = jax.jit(lambda a, w, b, conv=conv: on_jax(conv, a, w, b))(x.numpy(), weight.numpy(), bias.numpy())
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, err_msg=str(case))
    line, kernel = torch.randn(2, 4, 16), torch.randn(6, 4, 3)
    got = jax.jit(lambda a, w: on_jax(functools.partial(torch.nn.functional.conv1d, padding=1), a, w))(
        line.numpy(), kernel.numpy()
    )
    np.testing.assert_allclose(np.asarray(got), torch.nn.functional.conv1d(line, kernel, padding=1), atol=1e-4)

    weight = torch.randn(8, 8, 3, 3) * 0.1

    def loop(a, w, steps):
        def step(_, y):
            return jax.numpy.tanh(on_jax(functools.partial(torch.nn.functional.conv2d, padding=1), y, w))

        return jax.lax.fori_loop(0, steps, step, a)

    compiled = jax.jit(loop).lower(x.numpy(), weight.numpy(), np.int32(3)).compile()
    convolutions = [line for line in compiled.as_text().splitlines() if " convolution(" in line]
    assert convolutions and all("dim_labels=b01f_01io->b01f" in line for line in convolutions), convolutions
    expected = x
    for _ in range(3):
        expected = torch.tanh(torch.nn.functional.conv2d(expected, weight, padding=1))
    np.testing.assert_allclose(np.asarray(compiled(x.numpy(), weight.numpy(), np.int32(3))), expected, atol=1e-4)


@pytest.mark.xla
@JAX_PROCESS
def test_every_sampler_runs_as_one_call_and_matches_diffusers(engines):
    jax, cpu = engines["jax"], engines["cpu"]
    for name in SCHEDULER_NAMES:
        for steps in (3, 5):  # a new step count compiles nothing for a sampler that draws no noise
            before = jax.backend.counters()
            (mine,) = jax.generate(_batch(steps), scheduler=name)
            after = jax.backend.counters()
            assert jax.loaded.step_by_step is None, (name, jax.loaded.step_by_step)
            (theirs,) = cpu.generate(_batch(steps), scheduler=name)
            apart = int(np.abs(mine.astype(int) - theirs.astype(int)).max())
            assert apart <= COMPILED_VS_EAGER, (name, steps, apart)
            if steps == 5:
                assert (after - before).compiles == 0, name


@pytest.mark.xla
@JAX_PROCESS
def test_a_lora_switch_compiles_nothing_on_jax(engines, tmp_path):
    from tpugen.config.loras import resolve_lora
    from tpugen.config.schema import LoraConfig

    jax, cpu = engines["jax"], engines["cpu"]
    (base,) = jax.generate(_batch())
    path = make_lora(tmp_path / "style.safetensors", "kohya", seed=1)
    lora = resolve_lora(LoraConfig(id=str(path), scale=0.8), tmp_path, family="sd")
    before = jax.backend.counters()
    moved = jax.use_loras([lora])
    (styled,) = jax.generate(_batch())
    assert (jax.backend.counters() - before).compiles == 0 and moved["tensors"] > 0
    cpu.use_loras([lora])
    (theirs,) = cpu.generate(_batch())
    assert int(np.abs(styled.astype(int) - theirs.astype(int)).max()) <= COMPILED_VS_EAGER
    assert int(np.abs(styled.astype(int) - base.astype(int)).max()) > 10  # the LoRA changed the image
    jax.use_loras([])
    cpu.use_loras([])
    (again,) = jax.generate(_batch())
    assert np.array_equal(again, base)


@pytest.mark.xla
@JAX_PROCESS
def test_warmup_fills_the_cache_that_the_next_process_reads_back(tmp_path):
    cache = tmp_path / "jax-cache"
    overrides = {"execution": {"backend": "jax"}, "cache": {"dir": str(cache)}, "prompts": ["a cat"]}
    config = write_config(tmp_path / "w.yaml", tiny_config(tmp_path, **overrides))
    import subprocess

    from conftest import forked_tpugen

    warm = subprocess.run(
        [forked_tpugen(), "warmup", str(config), "--quiet"], capture_output=True, text=True, timeout=600
    )
    assert warm.returncode == 0, warm.stderr
    assert any(cache.iterdir())
    proc, run_dir = generate_in_new_process(tmp_path / "second", **overrides)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    (entry,) = report["warmup"]
    graphs = sum(entry["graphs_run_per_phase"].values())
    assert graphs == 3 and entry["compiles"] == 0  # text encoding, the loop, decoding: each read back
    assert entry["persistent_cache_hits"] == graphs and entry["persistent_cache_misses"] == 0
    assert report["persistent_cache"]["hits"] == graphs and report["compiles_after_warmup"] == 0
    # The loop and the decode read whole from tpugen's store (not traced either); the text encoder from JAX's cache
    assert report["device"]["compile_cache"]["whole_programs_read_back"] == 2
    assert report["device"]["compile_cache"]["whole_programs_unreadable"] == 0
    stored = sorted((cache / "tpugen-programs").iterdir())
    assert [p.name.split("-")[0] for p in stored] == ["denoiser_loop", "sd_decode"], stored

    # A stored program that cannot be read is a miss, said once: traced and compiled again, the run unharmed
    for path in stored:
        path.write_bytes(b"not a program")
    proc, run_dir = generate_in_new_process(tmp_path / "third", **overrides)
    assert proc.returncode == 0, proc.stderr
    assert "a stored JAX program could not be read" in proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["device"]["compile_cache"]["whole_programs_unreadable"] == 2
    assert report["device"]["compile_cache"]["whole_programs_read_back"] == 0
    assert report["persistent_cache"]["load_failures"] == 2 and report["compiles_after_warmup"] == 0
    assert all(path.read_bytes() != b"not a program" for path in stored)  # stored again

    # What was stored again (JAX's own cache held the same programs) runs in the next process: XLA:CPU cannot
    # serialize again an executable read from JAX's cache, so the store compiles its programs afresh
    proc, run_dir = generate_in_new_process(tmp_path / "fourth", **overrides)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["device"]["compile_cache"]["whole_programs_read_back"] == 2
    assert report["persistent_cache"]["hits"] == 3 and report["compiles_after_warmup"] == 0


@pytest.mark.xla
def test_a_stored_program_is_found_only_by_what_its_trace_reads():
    """The store's key holds every submodule's plain attributes: a changed scale, attention processor or config
    value is another program (a miss), the same module built again is the same program."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor, SlicedAttnProcessor

    from tpugen.backends.jax.store import module_description
    from tpugen.families.parts import TINY_UNET

    def unet():
        torch.manual_seed(0)
        return UNet2DConditionModel(**TINY_UNET, cross_attention_dim=32, attention_head_dim=8)

    first, again = unet(), unet()
    assert module_description(first) == module_description(again)
    changed = unet()
    changed.down_blocks[0].resnets[0].output_scale_factor = 0.5
    assert module_description(changed) != module_description(first)
    changed = unet()
    changed.set_attn_processor(AttnProcessor())
    assert module_description(changed) != module_description(first)
    changed = unet()
    changed.register_to_config(sample_size=16)
    assert module_description(changed) != module_description(first)
    # an attention processor's own settings, a hook, a tensor that is not a weight: each is another key
    one, two = unet(), unet()
    one.set_attn_processor(SlicedAttnProcessor(1))
    two.set_attn_processor(SlicedAttnProcessor(2))
    assert module_description(one) != module_description(two)
    hooked = unet()
    hooked.mid_block.register_forward_pre_hook(functools.partial(lambda scale, module, args: None, 2.0))
    assert module_description(hooked) != module_description(first)
    held = unet()
    held.time_proj.extra = torch.ones(3, dtype=torch.bfloat16)
    other = unet()
    other.time_proj.extra = torch.zeros(3, dtype=torch.bfloat16)
    assert module_description(held) != module_description(other)


@pytest.mark.xla
def test_mode_multi_is_one_program_over_every_device_and_makes_the_images_one_device_makes(tmp_path):
    """Four JAX CPU devices (XLA_FLAGS, as on a TPU VM's four chips): mode multi splits each call's rows over a
    data-parallel mesh in one process; the same files as mode single, within 1/255, nothing compiled after warmup.
    Each side is a `tpugen generate` of its own (this test process imports no JAX)."""
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    common = {"steps": 3, "batch_size": 4, "prompts": [f"a shape {n}" for n in range(6)]}
    runs = {}
    for mode in ("single", "multi"):
        execution = {"backend": "jax", "mode": mode}
        proc, run_dir = generate_in_new_process(tmp_path / mode, env=devices, execution=execution, **common)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = run_dir, json.loads((run_dir / "report.json").read_text())
    (single_dir, single), (multi_dir, multi) = runs["single"], runs["multi"]
    assert (single["device"]["devices"], multi["device"]["devices"], multi["device"]["mesh"]) == (1, 4, {"data": 4})
    _assert_whole_loops(multi)
    assert [b["images"] for b in multi["timed_phase"]["batches"]] == [4, 2]  # 6 images: each made once
    assert_same_images(multi_dir, single_dir, 1)
    # A call whose rows do not split over the devices, and more devices than JAX has: one line each, before loading.
    for tag, changes, message in (
        ("odd", {"batch_size": 3}, "batch_size: 3 rows a call cannot be split over 4 devices"),
        ("many", {"execution": {"backend": "jax", "mode": "multi", "cores": 8}}, "execution.cores: 8 devices asked"),
    ):
        settings = {"execution": {"backend": "jax", "mode": "multi"}, **common, **changes}
        proc, _ = generate_in_new_process(tmp_path / tag, env=devices, **settings)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.xla
@pytest.mark.parametrize("model", ["tiny-sdxl", "tiny-flux"])
def test_spmd_splits_the_big_weights_over_a_model_axis_and_makes_eager_pytorchs_images(model, tmp_path):
    """execution.sharding: spmd on jax, four JAX CPU devices as a data 2 x model 2 mesh: the families' rule tables
    split the denoiser's linear layers over the model axis (the report counts what the arrays carry), each call's
    rows over the data axis; the images are eager PyTorch's within 2/255, nothing compiled after warmup."""
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    common = {"model": {"id": model}, "steps": 2, "batch_size": 2, "prompts": ["a lighthouse", "a fox"]}
    common["negative_prompt"] = ""
    execution = {"backend": "jax", "sharding": "spmd", "mesh": {"data": 2, "model": 2}}
    proc, run_dir = generate_in_new_process(tmp_path / "spmd", env=devices, execution=execution, **common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    sharding = report["device"]["sharding"]
    assert report["device"]["mesh"] == {"data": 2, "model": 2} and report["device"]["devices"] == 4
    assert sharding["split_tensors"] == sharding["split_tensors_verified"] > 0, sharding
    _assert_whole_loops(report)
    cpu_dir, _ = _run(tmp_path / "cpu", "cpu", **common)
    assert_same_images(run_dir, cpu_dir, COMPILED_VS_EAGER)


@pytest.mark.xla
@pytest.mark.parametrize(
    ("model", "upscaler"), [("tiny-sd", "latent"), ("tiny-z-image", "lanczos"), ("tiny-qwen-image", "lanczos")]
)
def test_a_hires_fix_on_jax_runs_both_loops_as_one_call_and_makes_xlas_images(model, upscaler, tmp_path):
    """Hires fix on jax: the first pass's loop, then the second's at the larger size (img2img), each one call;
    the latent upscale reads the first loop's latents back once, lanczos decodes them. The second size is a second
    trace of the denoiser in one process: what a module keeps of one trace (Qwen-Image's cached RoPE frequencies,
    Z-Image's rotary tables) must not reach the next. Within 2/255 of backend xla, nothing compiled after warmup."""
    common = {
        "model": {"id": model},
        "prompts": ["a lighthouse"],
        "negative_prompt": "",
        "steps": 2,
        "batch_size": 1,
        "hires": {"scale": 1.5, "steps": 1, "strength": 0.6, "upscaler": upscaler},
    }
    proc, jax_dir = generate_in_new_process(
        tmp_path / "jax", env={"JAX_PLATFORMS": "cpu"}, execution={"backend": "jax"}, **common
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((jax_dir / "report.json").read_text())
    loop = report["device"]["denoising_loop"]
    assert loop["step_by_step"] == [] and loop["one_call"] == 4  # two passes, in warmup and in the timed phase
    assert report["compiles_after_warmup"] == 0
    xla_dir, _ = _run(tmp_path / "xla", "xla", **common)
    assert_same_images(jax_dir, xla_dir, COMPILED_VS_EAGER)


CONTROLS = Path(__file__).resolve().parent.parent / "configs" / "controls"


def _controlled(model: str) -> dict:
    """A config's ControlNet part for `model` on either backend: tiny-sd with two ControlNets (each unit with its
    own scale and window; a txt2img, an img2img and an inpainting prompt, each with both units), tiny-flux with
    one (a unit that sits out the last steps, and a prompt without one), tiny-qwen-image with one under true CFG
    (a negative prompt: the conditional call's residuals go to both calls)."""
    circle, square, triangle = (
        str(CONTROLS / f"{n}.png") for n in ("circle-top-left", "square-centre", "triangle-left")
    )
    if model == "tiny-sd":
        both = {"control_image": [circle, square], "control_scale": [1.0, 0.3]}
        prompts = [
            {
                "prompt": "two units",
                **both,
                "control_scale": [0.8, 0.5],
                "control_start": [0.0, 0.3],
                "control_end": [0.5, 1.0],
            },
            {"prompt": "img2img", "init_image": triangle, "strength": 0.7, **both},
            {"prompt": "inpaint", "init_image": triangle, "mask_image": square, "strength": 1.0, **both},
        ]
        return {
            "model": {"id": model, "controlnets": [{"id": "tiny-sd-controlnet"}] * 2},
            "prompts": prompts,
            "steps": 4,
        }
    unit = {"prompt": "a circle", "control_image": circle, "control_scale": 0.8}
    if model == "tiny-flux":
        prompts = [{**unit, "control_end": 0.6}, "no unit"]
        return {"model": {"id": model, "controlnets": [{"id": "tiny-flux-controlnet"}]}, "prompts": prompts, "steps": 3}
    return {
        "model": {"id": model, "controlnets": [{"id": "tiny-qwen-image-controlnet"}]},
        "prompts": [unit],
        "steps": 3,
        "negative_prompt": "blurry",
    }


@pytest.mark.xla
@JAX_PROCESS
@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux", "tiny-qwen-image"])
def test_controlnets_run_inside_the_whole_loop_and_make_xlas_images(model, tmp_path):
    """ControlNets on jax: each called beside the denoiser inside the one loop call, its conditioning scale per
    call from the units' scales and windows; the pipeline's own first ControlNet call (made before the loop is
    handed over) computes nothing (one execution a batch beyond its reads). Within 2/255 of backend xla, nothing
    compiled after warmup."""
    common = {"batch_size": 1, "guidance_scale": 4.0, "negative_prompt": "", **_controlled(model)}
    jax_dir, report = _run(tmp_path / "jax", "jax", **common)
    _assert_whole_loops(report)
    assert report["device"]["denoising_loop"]["one_call"] == 2 * len(common["prompts"])
    xla_dir, _ = _run(tmp_path / "xla", "xla", **common)
    assert_same_images(jax_dir, xla_dir, COMPILED_VS_EAGER)


@pytest.mark.xla
@JAX_PROCESS
@pytest.mark.parametrize(
    "step_cache",
    [
        {"method": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1},
        {"method": "magcache", "mag_ratios": "flux", "threshold": 0.5, "retention_ratio": 0.2},
    ],
    ids=["taylorseer", "magcache"],
)
def test_a_step_cache_runs_inside_the_whole_loop_and_makes_xlas_images(step_cache, tmp_path):
    """diffusers' step-cache hooks on jax: the loop traced call by call, the hooks deciding at each call which
    blocks run (a program per step count: prompts of 4 and 6 steps, each warmed), diffusers' own images on xla
    within 2/255 (measured 0/255 apart; MagCache's skips move the image by up to 10/255), the same steps full and
    cached, nothing compiled after warmup."""
    common = {
        "model": {"id": "tiny-flux"},
        "prompts": [{"prompt": "a lighthouse", "steps": 4}, {"prompt": "a fox", "steps": 6}],
        "batch_size": 1,
        "compile": {"trace_once": True, "step_cache": step_cache},
    }
    jax_dir, report = _run(tmp_path / "jax", "jax", **common)
    _assert_whole_loops(report)
    assert [w["shape_key"] for w in report["warmup"]] == ["64x64 b1 nocfg"] * 2  # one per step count
    xla_dir, xla_report = _run(tmp_path / "xla", "xla", **common)
    assert_same_images(jax_dir, xla_dir, COMPILED_VS_EAGER)
    steps = [{k: b[k] for k in ("steps_full", "steps_cached")} for b in report["timed_phase"]["batches"]]
    assert steps == [{k: b[k] for k in ("steps_full", "steps_cached")} for b in xla_report["timed_phase"]["batches"]]
    assert sum(s["steps_cached"] for s in steps) > 0, steps


def test_plan_of_a_jax_config_says_how_its_loops_and_attention_run(tmp_path):
    config = write_config(tmp_path / "p.yaml", tiny_config(tmp_path, execution={"backend": "jax"}))
    result = run_cli("plan", config)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "denoising loop: the whole loop as one compiled call per batch (lax.fori_loop on JAX)" in text
    assert "flash attention: off -- backend jax runs JAX's Pallas flash-attention kernel on a TPU only" in text


@pytest.mark.xla
@JAX_PROCESS
def test_pallas_flash_attention_in_interpret_mode_makes_plain_attentions_images(tmp_path):
    """TPUGEN_PALLAS_INTERPRET=1 runs JAX's Pallas TPU flash-attention kernel in Pallas's interpret mode on the CPU:
    at 256x256 the tiny UNet's self-attentions (256 tokens) and the VAE's take it, the rest (77 text tokens, 64
    image tokens) run plain; the report says so; the images within 2/255 of plain attention's (measured 1/255)."""
    common = {"prompts": ["a lighthouse"], "height": 256, "width": 256, "steps": 2, "batch_size": 1}
    proc, kernel_dir = generate_in_new_process(
        tmp_path / "kernel",
        env={"JAX_PLATFORMS": "cpu", "TPUGEN_PALLAS_INTERPRET": "1"},
        execution={"backend": "jax"},
        **common,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    device = json.loads((kernel_dir / "report.json").read_text())["device"]
    assert device["flash_attention"]["state"] == "on"
    attention = device["attention"]
    assert attention["kernel"] == "pallas flash_attention (interpret mode)", attention
    assert attention["calls_traced_with_kernel"] > 0 and attention["calls_traced_plain"] > 0, attention
    plain_dir, plain = _run(tmp_path / "plain", "jax", **common)
    assert plain["device"]["attention"] == {"kernel": None}
    # The kernel is the named hook a call that fails with it takes off (Engine._call_with_flash): plain attention,
    # and nothing traced with the kernel kept.
    from tpugen.backends.jax.runtime import process_runtime
    from tpugen.engine import Engine, EngineSpec

    os.environ["TPUGEN_PALLAS_INTERPRET"] = "1"
    try:
        config = tiny_config(tmp_path / "hook", execution={"backend": "jax"}, **common)
        engine = Engine.open(EngineSpec.of(load_config(write_config(tmp_path / "hook.yaml", config))))
    finally:
        del os.environ["TPUGEN_PALLAS_INTERPRET"]
    try:
        assert process_runtime().kernel is not None and "flash attention" in engine.loaded.hooks.names()
        engine.loaded.hooks.remove("flash attention")
        assert process_runtime().kernel is None and engine.backend._loops._programs == {}
    finally:
        engine.close()
    assert plain["device"]["flash_attention"]["state"] == "off"
    assert_same_images(kernel_dir, plain_dir, COMPILED_VS_EAGER)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"execution": {"offload": "model"}}, "execution.offload: model is not built on execution.backend: jax yet"),
        ({"tiling": True}, "tiling: seamless tiling is not built on execution.backend: jax yet"),
        (
            {"compile": {"step_cache": {"method": "pyramid_attention_broadcast"}}, "model": {"id": "tiny-flux"}},
            "compile.step_cache.method: pyramid_attention_broadcast on execution.backend: jax: its hooks read the "
            "pipeline's current timestep at every call",
        ),
        (
            {"model": {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}]}},
            "model.controlnets: ControlNet on execution.backend: jax: Z-Image models: ZImageControlNetPipeline lends "
            "its ControlNet the transformer's embedders and refiners as it is made",
        ),
        (
            {"model": {"id": "tiny-flux2-klein-kv"}, "serve": {"tasks": ["txt2img", "edit"]}},
            "serve.tasks: edits by reference on execution.backend: jax: FLUX.2 [klein] KV models: "
            "Flux2KleinKVPipeline runs the references through the transformer at the first step alone",
        ),
    ],
)
def test_what_jax_does_not_run_yet_is_refused_in_one_line(tmp_path, overrides, message):
    config = tiny_config(tmp_path, **overrides)
    config["execution"]["backend"] = "jax"
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if message in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_a_flux2_klein_kv_edit_by_reference_is_refused_on_jax(tmp_path):
    _images(tmp_path)
    config = tiny_config(
        tmp_path,
        model={"id": "tiny-flux2-klein-kv"},
        execution={"backend": "jax"},
        prompts=[{"prompt": "edit it", "reference_images": [str(tmp_path / "init.png")]}],
    )
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == (
        "error: prompts[0].reference_images: edits by reference on execution.backend: jax: FLUX.2 [klein] KV "
        "models: Flux2KleinKVPipeline runs the references through the transformer at the first step alone and "
        "keeps their attention keys and values in its processors for the later steps, which a whole loop does "
        "not carry yet; execution.backend: xla runs them\n"
    )


@pytest.mark.xla
@JAX_PROCESS
def test_a_flux2_klein_edit_by_two_references_on_jax_makes_xlas_images(tmp_path):
    """FLUX.2 [klein] base (CFG on) edits by one reference and by two: each loop one call, the references' tokens
    joined to the latents' at every step; within 2/255 of backend xla, nothing compiled after warmup."""
    init, mask = _images(tmp_path)
    common = {
        "model": {"id": "tiny-flux2-klein"},
        "prompts": [
            {"prompt": "the square", "reference_images": [str(init)]},
            {"prompt": "the square in the style of the mask", "reference_images": [str(init), str(mask)]},
        ],
        "steps": 3,
        "guidance_scale": 4.0,
        "batch_size": 1,
    }
    jax_dir, report = _run(tmp_path / "jax", "jax", **common)
    _assert_whole_loops(report)
    assert [w["shape_key"] for w in report["warmup"]] == ["64x64 b1 cfg edit 1 ref", "64x64 b1 cfg edit 2 refs"]
    xla_dir, _ = _run(tmp_path / "xla", "xla", **common)
    assert_same_images(jax_dir, xla_dir, COMPILED_VS_EAGER)


@pytest.mark.xla
@JAX_PROCESS
def test_a_jax_server_answers_webuiapi_and_openai_warm_and_refuses_what_jax_lacks_with_a_422(tmp_path, cpu_run):
    """A warm tiny-sd server on jax with a ControlNet: webuiapi's txt2img and img2img and openai's images.generate
    answer with the images eager PyTorch makes, webuiapi's ControlNet unit steers its image inside the whole loop,
    0 compiles after warmup; tiling and a unit naming a ControlNet not loaded are each a 422 naming them, and the
    server goes on serving."""
    import openai
    import webuiapi
    import yaml
    from serve_support import AUTH, BASE, KEY, metric, running_server, serve_config, wait_ready

    path = serve_config(tmp_path, tasks=["txt2img", "img2img"], schedulers=["Euler a"], batch_window_ms=0)
    config = yaml.safe_load(path.read_text())
    config["execution"] = {"backend": "jax"}
    config["model"]["controlnets"] = [{"id": "tiny-sd-controlnet"}]
    write_config(path, config)
    init, _ = _images(tmp_path)
    record = json.loads((cpu_run / "manifest.jsonl").read_text().splitlines()[0])
    with running_server(path, tmp_path / "runs", KEY) as (url, service):
        wait_ready(url, seconds=300)
        host, port = url.removeprefix("http://").split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port), username="tpugen", password=KEY)
        made = api.txt2img(prompt=record["prompt"], seed=record["seed"], sampler_name="DDIM", **_webui(BASE))
        expected = np.asarray(Image.open(cpu_run / record["file"]).convert("RGB"))
        assert int(np.abs(np.asarray(made.image.convert("RGB"), dtype=int) - expected).max()) <= COMPILED_VS_EAGER
        ancestral = api.txt2img(prompt="a cat", seed=5, sampler_name="Euler a", **_webui(BASE))
        assert ancestral.info["sampler_name"] == "Euler a"
        edited = api.img2img(images=[Image.open(init)], prompt="a red square", denoising_strength=0.6, **_webui(BASE))
        assert edited.image.size == (64, 64)
        unit = webuiapi.ControlNetUnit(image=Image.open(CONTROLS / "circle-top-left.png"), model="tiny-sd-controlnet")
        # A fresh alwayson_scripts each call: webuiapi's txt2img keeps the units in its default mapping otherwise.
        steered = api.txt2img(
            prompt=record["prompt"], seed=record["seed"], controlnet_units=[unit], alwayson_scripts={}, **_webui(BASE)
        )
        plain = api.txt2img(prompt=record["prompt"], seed=record["seed"], alwayson_scripts={}, **_webui(BASE))
        apart = np.abs(np.asarray(steered.image, dtype=int) - np.asarray(plain.image, dtype=int))
        assert steered.image.size == (64, 64) and apart.mean() > 1, apart.mean()
        ai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert len(ai.images.generate(prompt="a dog", n=2, size="64x64", response_format="b64_json").data) == 2
        with httpx_client(url, AUTH) as client:
            asks = {"seamless tiling": {"tiling": True}}
            for what, extra in asks.items():
                refused = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a cat", **extra})
                assert refused.status_code == 422, (what, refused.text)
                assert f"{what} is not built on execution.backend: jax yet" in " ".join(refused.json()["detail"])
            # The extension's control modes but Balanced are not built on jax yet: one line.
            moded = {"image": _b64(init), "model": "tiny-sd-controlnet", "control_mode": 1}
            refused = client.post(
                "/sdapi/v1/txt2img",
                json={**BASE, "prompt": "a cat", "alwayson_scripts": {"controlnet": {"args": [moded]}}},
            )
            assert refused.status_code == 422 and refused.json()["detail"] == [
                "a ControlNet unit's control mode but Balanced, or its advanced_weighting, is not built on "
                "execution.backend: jax yet; execution.backend: xla runs it"
            ], refused.text
            # A ControlNet unit naming one the server has not loaded.
            unit = {"alwayson_scripts": {"controlnet": {"args": [{"image": _b64(init), "model": "anything"}]}}}
            refused = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a cat", **unit})
            assert refused.status_code == 422 and "is not loaded on this server" in refused.text
            again = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a cat"})
            assert again.status_code == 200, again.text
        assert metric(url, "tpugen_compiles_after_warmup_total") == 0
        assert service.engines[0].loop_summary()["step_by_step"] == []


def _webui(base: dict) -> dict:
    return {
        "negative_prompt": base["negative_prompt"],
        "steps": base["steps"],
        "cfg_scale": base["cfg_scale"],
        "width": base["width"],
        "height": base["height"],
    }


def _b64(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


def httpx_client(url: str, headers: dict):
    import httpx

    return httpx.Client(base_url=url, headers=headers, timeout=120)


@pytest.mark.xla
def test_a_jax_server_in_mode_multi_serves_one_program_over_every_device(tmp_path, cpu_run):
    """`tpugen serve` on jax with execution.mode: multi over two JAX CPU devices: one engine whose program splits
    each batch over both, fed from the one queue; concurrent requests answer with the images eager PyTorch makes,
    nothing compiled after warmup, the device's time per step measured (one engine, its own counts)."""
    import subprocess
    import threading

    import httpx
    import yaml
    from conftest import PROMPTS, forked_tpugen
    from serve_support import BASE, decode, free_port, metric, pixels, serve_config, wait_ready

    from tpugen.outputs.png import image_filename

    path = serve_config(tmp_path, batch_window_ms=0)
    config = yaml.safe_load(path.read_text())
    config["execution"] = {"backend": "jax", "mode": "multi", "cores": 2}
    write_config(path, config)
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    answers = {}
    with open(log, "w") as out:
        command = [forked_tpugen(), "serve", str(path), "--port", str(port)]
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, seconds=300, proc=proc)

            def ask(i: int) -> None:
                body = {**BASE, "prompt": PROMPTS[i], "seed": 7 + i}
                answers[i] = httpx.post(f"{url}/sdapi/v1/txt2img", json=body, timeout=120)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            compiled = metric(url, "tpugen_compiles_after_warmup_total")
            device_ms = metric(url, "tpugen_device_ms_per_step")
        finally:
            proc.terminate()
            assert proc.wait(120) == 0
    assert "ready, 1 device loop(s) on 2 device(s)" in log.read_text()
    assert compiled == 0 and device_ms > 0
    for i, answer in answers.items():
        assert answer.status_code == 200, answer.text
        reference = Image.open(cpu_run / image_filename(i, 7 + i, PROMPTS[i]))
        assert int(np.abs(pixels(decode(answer.json()["images"][0])) - pixels(reference)).max()) <= COMPILED_VS_EAGER
