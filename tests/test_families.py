"""Every family through the same patched runner: pixels against eager CPU, graphs, transfers, schedulers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import generate, run_cli, tiny_config, write_config
from PIL import Image

from tpugen.schedulers import SCHEDULER_NAMES

PROMPTS = ["a lighthouse at dawn", "a red fox in snow", "an astronaut on a horse"]
FAMILY_MODELS = ["tiny-sdxl", "tiny-sd3", "tiny-flux"]


def _family_run(tmp_path, model: str, backend: str):
    # Two batches, the second at another step count: neither may compile after warmup.
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"prompt": PROMPTS[0]}),
        json.dumps({"prompt": PROMPTS[1]}),
        json.dumps({"prompt": PROMPTS[2], "steps": 5}),
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    config = tiny_config(tmp_path, model={"id": model}, steps=3, execution={"backend": backend})
    del config["prompts"]
    config["prompts_file"] = "p.jsonl"
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    return tmp_path / "outputs" / "run"


@pytest.mark.xla
@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_family_on_xla_matches_eager_cpu_with_three_graphs_and_one_transfer_per_batch(model, tmp_path):
    xla = _family_run(tmp_path / "xla", model, "xla")
    cpu = _family_run(tmp_path / "cpu", model, "cpu")
    report = json.loads((xla / "report.json").read_text())
    assert [b["steps"] for b in report["timed_phase"]["batches"]] == [3, 5]
    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    phases = warm["graphs_per_phase"]
    assert (phases["text encoding"], phases["first denoising step"], phases["later denoising steps"]) == (1, 1, 0)
    # Decoding is 1 graph, or 0 when an earlier test in this process compiled the same VAE graph (tiny-sdxl's
    # VAE has tiny-sd's architecture; weights are data, so the graph is shared).
    assert phases["decoding"] in (0, 1) and warm["compiles"] == sum(phases.values()) <= 3
    # Per batch: text encoding, one execution per step, decoding; one read back to the host.
    assert [(b["executions"], b["transfers_to_host"]) for b in report["timed_phase"]["batches"]] == [(5, 1), (7, 1)]
    names = sorted(p.name for p in xla.glob("[0-9]*.png"))
    assert names == sorted(p.name for p in cpu.glob("[0-9]*.png")) and len(names) == 3
    for name in names:
        a = np.asarray(Image.open(xla / name), dtype=np.float64)
        b = np.asarray(Image.open(cpu / name), dtype=np.float64)
        assert np.abs(a - b).mean() <= 2.0, (model, name)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_scheduler_name_runs_two_steps_on_tiny_sd(name, tmp_path):
    run_dir = generate(
        tmp_path,
        model={"id": "tiny-sd", "scheduler": name},
        prompts=["a cat"],
        steps=2,
        batch_size=1,
        execution={"backend": "cpu"},
    )
    (png,) = run_dir.glob("[0-9]*.png")
    assert f"Sampler: {name}," in Image.open(png).text["parameters"]


def test_unknown_scheduler_lists_the_valid_names(tmp_path):
    result = run_cli("validate", write_config(tmp_path / "c.yaml", tiny_config(tmp_path)), "model.scheduler=DPM++ 3M")
    assert result.exit_code == 2
    assert (
        result.stderr
        == f"error: model.scheduler: unknown scheduler 'DPM++ 3M'; valid names: {', '.join(SCHEDULER_NAMES)}\n"
    )


def test_flow_matching_models_keep_their_scheduler(tmp_path):
    result = run_cli(
        "validate",
        write_config(tmp_path / "c.yaml", tiny_config(tmp_path, model={"id": "tiny-flux", "scheduler": "Euler"})),
    )
    assert result.exit_code == 2
    assert (
        result.stderr
        == "error: model.scheduler: Flux.1 (schnell, dev) models keep their own flow-matching scheduler; leave it unset\n"
    )


def test_family_defaults_fill_what_the_config_leaves_out(tmp_path):
    config = {"model": {"id": "black-forest-labs/FLUX.1-dev"}, "prompts": ["a cat"]}
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 0, result.output
    import yaml

    resolved = yaml.safe_load(result.stdout)
    assert (resolved["height"], resolved["width"], resolved["steps"], resolved["guidance_scale"]) == (
        1024,
        1024,
        28,
        3.5,
    )


def test_models_lists_builtins_and_families():
    result = run_cli("models")
    assert result.exit_code == 0
    for word in ("tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "StableDiffusionXLPipeline", "FluxPipeline"):
        assert word in result.stdout


def test_offline_hub_model_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = tiny_config(
        tmp_path, model={"id": "stabilityai/stable-diffusion-xl-base-1.0"}, execution={"backend": "cpu"}
    )
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: model.id: cannot load 'stabilityai/stable-diffusion-xl-base-1.0': offline")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_small_systems_solve_like_torch(n):
    import torch

    from tpugen.backends import solve_small

    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=g, dtype=torch.float64) + 3 * torch.eye(n, dtype=torch.float64)
    for b in (torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)):
        assert torch.allclose(solve_small(a, b), torch.linalg.solve(a, b), atol=1e-12)


@pytest.mark.xla
def test_unipc_reads_the_host_once_per_batch_on_xla(tmp_path):
    """UniPC solves a small linear system every step; on XLA that used to be 2 reads back to the host per step."""
    runs = {}
    for backend in ("xla", "cpu"):
        config = tiny_config(
            tmp_path / backend,
            model={"id": "tiny-sd", "scheduler": "UniPC"},
            prompts=["a lighthouse at dawn"],
            steps=3,
            guidance_scale=1.0,
            batch_size=1,
            execution={"backend": backend},
        )
        runs[backend] = generate(tmp_path / backend, **{k: v for k, v in config.items() if k != "output"})
    report = json.loads((runs["xla"] / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    assert report["xla_counters"]["timed_phase"]["transfers_to_host"] == report["batches"] == 1
    for name in sorted(p.name for p in runs["cpu"].glob("[0-9]*.png")):
        a = np.asarray(Image.open(runs["cpu"] / name), dtype=np.int16)
        b = np.asarray(Image.open(runs["xla"] / name), dtype=np.int16)
        assert np.abs(a - b).max() <= 2, name
