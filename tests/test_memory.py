"""Memory planning: component sizes without weights, and the fits / offload / shard verdict per chip."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, tiny_config, write_config

from tpugen.config import ModelConfig
from tpugen.memory import directory_parameters, memory_plan_for, plan_memory
from tpugen.models import ModelSource


def counts_of(hub_id: str) -> dict[str, int]:
    """Parameters per component from configs on the meta device, as `tpugen plan` counts them (the model
    classes are built in a process of their own, so this one imports no torch_xla)."""
    plan = memory_plan_for(ModelSource("hub", hub_id), ModelConfig(id=hub_id), device_free=True)
    assert plan.source == "configs on the meta device"
    return {c.name: c.parameters for c in plan.components}


@pytest.fixture(scope="module")
def flux_dev(known_models_counted):
    return counts_of("black-forest-labs/FLUX.1-dev")


def test_meta_counts_match_the_published_sizes(flux_dev):
    sdxl = counts_of("stabilityai/stable-diffusion-xl-base-1.0")
    published = [(flux_dev["transformer"], 11.9e9), (flux_dev["text_encoder_2"], 4.7e9), (sdxl["unet"], 2.6e9)]
    for counted, expected in published:
        assert abs(counted - expected) / expected <= 0.02, (counted, expected)


@pytest.mark.xla
def test_safetensors_headers_count_what_loading_finds(tmp_path):
    from diffusers import DiffusionPipeline

    from tpugen.tiny import builtin_path

    path = builtin_path("tiny-sd")
    pipe = DiffusionPipeline.from_pretrained(path)
    loaded = {n: sum(p.numel() for p in getattr(pipe, n).parameters()) for n in ("unet", "vae", "text_encoder")}
    assert directory_parameters(path) == loaded


@pytest.mark.parametrize(
    "chip,verdict,chips",
    [("v5e", "shard", 3), ("v6e", "offload", 2), ("v5p", "fits", 1)],
)
def test_flux_dev_verdict_per_chip(flux_dev, chip, verdict, chips):
    plan = plan_memory(flux_dev, dtype="bfloat16", chip=chip, chip_gb=None, source="configs on the meta device")
    assert (plan.verdict, plan.chips_needed) == (verdict, chips)
    assert [c.name for c in plan.components][0] == "transformer"
    assert round(plan.total_bytes / 1e9, 1) == 33.7


def test_plan_prints_the_memory_table_offline(tmp_path, known_models_counted):
    config = tiny_config(tmp_path, model={"id": "black-forest-labs/FLUX.1-schnell", "dtype": "bfloat16"})
    result = run_cli("plan", write_config(tmp_path / "c.yaml", config), "--chip", "v6e")
    assert result.exit_code == 0, result.output
    assert "offload" in result.stdout and "transformer" in result.stdout and "23.78" in result.stdout
    text = " ".join(result.stdout.split())  # rich wraps long lines
    assert (
        "this config (the whole model on each chip): model.id: black-forest-labs/FLUX.1-schnell needs 40.5 GB" in text
    )


def test_plan_says_how_many_chips_the_shipped_flux_config_needs(known_models_counted):
    from pathlib import Path

    config = Path(__file__).resolve().parent.parent / "configs" / "flux-schnell.yaml"
    text = " ".join(run_cli("plan", config).stdout.split())
    assert "this config (execution.sharding: spmd, mesh data 1 x model the rest): fits a VM of 4 chips or more" in text
    text = " ".join(run_cli("plan", config, "--chip", "v6e").stdout.split())
    assert "fits a VM of 2 chips or more" in text


@pytest.mark.parametrize(
    "execution,devices,expected",
    [
        ({}, 1, "model.id: flux needs 40.5 GB with headroom, more than one v5e chip (16 GB): "),
        (
            {"offload": "model"},
            1,
            "execution.offload: transformer alone needs 28.6 GB with headroom, more than one "
            "v5e chip (16 GB): split it with execution.sharding: spmd",
        ),
        ({"sharding": "spmd"}, 4, None),  # transformer and T5 split in 4, the CLIP and the VAE whole: 10.5 GB
        (
            {"sharding": "spmd", "mesh": {"data": 2}},
            4,
            "execution.sharding: flux split over 2 chips still needs "
            "20.5 GB on one v5e chip (16 GB); it needs about 3 chips on the model axis",
        ),
        ({"placement": "auto"}, 2, None),
    ],
)
def test_fit_problem_per_way_of_running(flux_dev, execution, devices, expected):
    from tpugen.config import ExecutionConfig
    from tpugen.memory import fit_problem

    plan = plan_memory(flux_dev, dtype="bfloat16", chip="v5e", chip_gb=None, source="configs on the meta device")
    problem = fit_problem(plan, ExecutionConfig(**execution), devices, "flux")
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem


@pytest.mark.xla
def test_a_model_too_big_for_the_named_chip_stops_before_its_weights_load(tmp_path):
    config = tiny_config(tmp_path, execution={"chip_memory_gb": 0.0001})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2, result.output
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: model.id: tiny-sd needs 0.00") and "more than one v5e chip (0.0001 GB): " in last
    assert not (tmp_path / "outputs").exists()


def _safetensors(path, header_length: int, size: int):
    """A file whose first 8 bytes say `header_length`, `size` bytes long (sparse: nothing else written)."""
    import struct

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", header_length))
        handle.truncate(size)
    return path


@pytest.mark.parametrize(
    "header_length,size,why",
    [
        (300_000_000, 400_000_000, "its header length says 300000000 bytes, over the format's 100 MB limit"),
        (2**63, 16, f"its header length says {2**63} bytes, over the format's 100 MB limit"),
        (1000, 100, "its header length says 1000 bytes, more than the file's 100 bytes hold"),
        (0, 8, "its header length says 0 bytes, too short for a JSON header"),
        (4, 12, "its header is not the JSON of tensor shapes"),  # four zero bytes
        (None, 5, "5 bytes, shorter than its 8-byte header length"),
    ],
    ids=["300MB-header", "2**63-header", "past-the-end", "empty-header", "not-json", "no-length"],
)
def test_a_corrupt_safetensors_header_is_one_error_naming_the_file(tmp_path, header_length, size, why):
    # Before: the header's length was trusted, so the first case read 300 MB (a corrupt multi-GB file, gigabytes)
    # and each case ended in a JSONDecodeError or struct.error that named no file.
    from tpugen.errors import InputError
    from tpugen.memory import safetensors_parameters

    path = tmp_path / "w.safetensors"
    if header_length is None:
        path.write_bytes(b"\0" * size)
    else:
        _safetensors(path, header_length, size)
    with pytest.raises(InputError) as caught:
        safetensors_parameters(path)
    assert caught.value.lines == [f"{path}: corrupt safetensors file ({why})"]


def test_plan_of_a_model_with_a_corrupt_weights_file_says_which_file(tmp_path):
    import json

    model = tmp_path / "model"
    (model / "unet").mkdir(parents=True)
    (model / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]})
    )
    weights = _safetensors(model / "unet" / "diffusion_pytorch_model.safetensors", 300_000_000, 400_000_000)
    result = run_cli("plan", write_config(tmp_path / "c.yaml", tiny_config(tmp_path, model={"id": str(model)})))
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: {weights}: corrupt safetensors file (its header length says 300000000 bytes, over the format's "
        "100 MB limit)\n"
    )


def test_a_hub_model_in_the_local_cache_is_sized_from_its_safetensors_headers(tmp_path, monkeypatch):
    """Any hub model, not only those tpugen keeps configs for: its snapshot's headers, no weights read."""
    import huggingface_hub.constants
    import numpy as np
    from safetensors.numpy import save_file

    from tpugen.memory import hub_parameters

    snapshot = tmp_path / "hub" / "models--someorg--custom-sd" / "snapshots" / ("0" * 40)
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        # What SD 1.5's own index lists and holds no weights of: a safety checker left out, an image processor.
        "safety_checker": [None, None],
        "feature_extractor": ["transformers", "CLIPImageProcessor"],
    }
    sizes = {"unet": (300, 1000), "vae": (10, 100), "text_encoder": (20, 50)}
    for name, shape in sizes.items():
        (snapshot / name).mkdir(parents=True)
        save_file({"w": np.zeros(shape, np.float16)}, str(snapshot / name / "model.safetensors"))
    (snapshot / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "hub" / "models--someorg--custom-sd" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--custom-sd" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    counts, how = hub_parameters("someorg/custom-sd")
    assert counts == {"unet": 300_000, "vae": 1_000, "text_encoder": 1_000}
    assert how == "safetensors headers (the local Hugging Face cache)"
    # And `tpugen plan` sizes it so, its family read from the same model_index.json.
    from tpugen import app
    from tpugen.config import load_config

    config = {"model": {"id": "someorg/custom-sd", "dtype": "bfloat16"}, "prompts": ["a cat"]}
    run = load_config(write_config(tmp_path / "c.yaml", config))
    view = app.plan(run)
    assert (run.family, run.config.height) == ("sd", 512)
    assert {c.name: c.parameters for c in view.memory.components} == counts
    assert view.memory.source == "safetensors headers (the local Hugging Face cache)"
    assert run_cli("plan", write_config(tmp_path / "c.yaml", config)).exit_code == 0


def test_the_counting_process_runs_offline_and_is_stopped_after_its_time(monkeypatch):
    """`tpugen plan` counts a model whose classes it must build in a process of its own: that process never
    reaches the hub (the parent reads the hub's headers itself) and is stopped, with one line, when it overruns."""
    import subprocess

    import tpugen.memory as memory

    source = ModelSource("hub", "black-forest-labs/FLUX.1-dev")
    monkeypatch.setattr(memory, "COUNT_SECONDS", 0.05)  # far below a Python start that imports tpugen
    with pytest.raises(RuntimeError) as caught:
        memory._counted_apart(source, None, None)
    assert str(caught.value) == (
        "counting the model's parameters took longer than 0.05 s (in a process of its own, offline) and was stopped"
    )

    seen = {}
    real_run = subprocess.run

    def run(command, **kwargs):
        seen.update(kwargs)
        return real_run(command, **kwargs)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(memory, "COUNT_SECONDS", 300.0)
    monkeypatch.setattr(subprocess, "run", run)
    counts, how = memory._counted_apart(source, None, None)
    assert seen["env"]["HF_HUB_OFFLINE"] == "1" and seen["timeout"] == 300.0
    assert how == "configs on the meta device" and counts["transformer"] > 11e9
