"""Memory planning: component sizes without weights, and the fits / offload / shard verdict per chip."""

from __future__ import annotations

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
def flux_dev():
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


def test_plan_prints_the_memory_table_offline(tmp_path):
    config = tiny_config(tmp_path, model={"id": "black-forest-labs/FLUX.1-schnell", "dtype": "bfloat16"})
    result = run_cli("plan", write_config(tmp_path / "c.yaml", config), "--chip", "v6e")
    assert result.exit_code == 0, result.output
    assert "offload" in result.stdout and "transformer" in result.stdout and "23.78" in result.stdout
    text = " ".join(result.stdout.split())  # rich wraps long lines
    assert (
        "this config (the whole model on each chip): model.id: black-forest-labs/FLUX.1-schnell needs 40.5 GB" in text
    )


def test_plan_says_how_many_chips_the_shipped_flux_config_needs():
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
