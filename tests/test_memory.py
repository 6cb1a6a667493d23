"""Memory planning: component sizes without weights, and the fits / offload / shard verdict per chip."""

from __future__ import annotations

import pytest
from conftest import run_cli, tiny_config, write_config

from tpugen.memory import KNOWN_COMPONENTS, directory_parameters, meta_parameters, plan_memory


@pytest.fixture(scope="module")
def flux_dev():
    return meta_parameters(KNOWN_COMPONENTS["black-forest-labs/FLUX.1-dev"])


def test_meta_counts_match_the_published_sizes(flux_dev):
    sdxl = meta_parameters({"unet": KNOWN_COMPONENTS["stabilityai/stable-diffusion-xl-base-1.0"]["unet"]})
    published = [(flux_dev["transformer"], 11.9e9), (flux_dev["text_encoder_2"], 4.7e9), (sdxl["unet"], 2.6e9)]
    for counted, expected in published:
        assert abs(counted - expected) / expected <= 0.02, (counted, expected)


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
