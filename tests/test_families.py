"""Every family through the same patched runner: pixels against eager CPU, graphs, transfers, schedulers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    COMPILED_VS_EAGER,
    FIRST_CALL,
    assert_same_images,
    cold_graphs,
    generate,
    plain_diffusers_images,
    run_cli,
    tiny_config,
    with_prompts_file,
    write_config,
)
from PIL import Image

from tpugen.schedulers import SCHEDULER_NAMES

PROMPTS = ["a lighthouse at dawn", "a red fox in snow", "an astronaut on a horse"]
FAMILY_MODELS = ["tiny-sdxl", "tiny-sd3", "tiny-flux"]


def _family_run(tmp_path, model: str, backend: str):
    # Two batches, the second at another step count: neither may compile after warmup.
    lines = [
        json.dumps({"prompt": PROMPTS[0]}),
        json.dumps({"prompt": PROMPTS[1]}),
        json.dumps({"prompt": PROMPTS[2], "steps": 5}),
    ]
    base = tiny_config(tmp_path, model={"id": model}, steps=3, execution={"backend": backend})
    config = with_prompts_file(tmp_path, base, lines, "p.jsonl")
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
    assert cold_graphs(warm) == FIRST_CALL
    assert warm["compiles"] <= 3  # fewer where this process compiled them before
    # Per batch: text encoding, one execution per step, decoding; one read back to the host.
    assert [(b["executions"], b["transfers_to_host"]) for b in report["timed_phase"]["batches"]] == [(5, 1), (7, 1)]
    assert len(list(xla.glob("[0-9]*.png"))) == 3
    assert_same_images(xla, cpu, COMPILED_VS_EAGER)


@pytest.fixture(scope="module")
def cpu_engine(tmp_path_factory):
    """One eager tiny-sd engine for the scheduler tests: switching schedulers needs no reload."""
    from tpugen.config import load_config
    from tpugen.engine import Engine, EngineSpec

    tmp = tmp_path_factory.mktemp("engine")
    run = load_config(write_config(tmp / "c.yaml", tiny_config(tmp, execution={"backend": "cpu"})))
    engine = Engine.open(EngineSpec.of(run))
    yield engine
    engine.close()


@pytest.mark.xla
@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_scheduler_name_selects_its_class_and_runs_two_steps(cpu_engine, name):
    from conftest import one_call, work_item

    from tpugen.schedulers import find_scheduler

    choice = find_scheduler(name)
    cpu_engine.loaded.use_scheduler(name)
    scheduler = cpu_engine.loaded.pipe.scheduler
    assert type(scheduler).__name__ == choice.class_name and cpu_engine.loaded.scheduler_name == name
    assert cpu_engine.scheduler_name == cpu_engine.loaded.default_scheduler  # runs still record the loaded one
    assert {key: scheduler.config[key] for key in choice.options} == choice.options
    (pixels,) = cpu_engine.generate(one_call(work_item()), scheduler=name)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0


@pytest.mark.xla
def test_a_configured_scheduler_is_the_pipelines_and_named_in_the_png(tmp_path):
    run_dir = generate(
        tmp_path,
        model={"id": "tiny-sd", "scheduler": "DPM++ 2M Karras"},
        prompts=["a cat"],
        steps=2,
        batch_size=1,
        execution={"backend": "cpu"},
    )
    (png,) = run_dir.glob("[0-9]*.png")
    assert "Sampler: DPM++ 2M Karras," in Image.open(png).text["parameters"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["model"]["scheduler"] == "DPM++ 2M Karras"


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
    first_words = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    for model in ("tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux-deep", *NEW_FAMILY_MODELS):
        assert first_words.count(model) == 1, model
    classes = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("  ") and "Pipeline" in line}
    assert {
        "StableDiffusionPipeline",
        "StableDiffusionXLPipeline",
        "StableDiffusion3Pipeline",
        "FluxPipeline",
        "Flux2Pipeline",
        "Flux2KleinPipeline",
        "ZImagePipeline",
        "QwenImagePipeline",
    } <= classes


@pytest.mark.xla
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

    from tpugen.backends.xla.patches import solve_small

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
    assert_same_images(runs["xla"], runs["cpu"], COMPILED_VS_EAGER)


# ---------------------------------------------------------------- the 2026 families against plain diffusers

NEW_FAMILY_MODELS = ["tiny-flux2-klein", "tiny-flux2-klein-distilled", "tiny-flux2", "tiny-z-image", "tiny-qwen-image"]
# Two prompts of very different lengths in one batch and a third alone (padded): the text is padded to a fixed
# length, so neither a length nor a step count compiles anything after warmup.
LENGTHS = ["a red cat", "a small blue dog riding a skateboard down a long hill at sunset, oil on canvas", "x"]


@pytest.mark.xla
@pytest.mark.parametrize("model", NEW_FAMILY_MODELS)
def test_new_family_has_three_graphs_one_transfer_and_diffusers_pixels(model, tmp_path):
    import numpy as np

    config = tiny_config(tmp_path, model={"id": model}, prompts=LENGTHS, steps=3, batch_size=2)
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    report = json.loads((run_dir / "report.json").read_text())
    (warm,) = report["warmup"]
    assert cold_graphs(warm) == FIRST_CALL  # models that share a VAE (FLUX.2's built-ins) share its decoding graph
    assert report["compiles_after_warmup"] == 0
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1, 1]
    reference = plain_diffusers_images(model, run_dir)
    assert len(reference) == 3
    for name, expected in reference.items():
        ours = np.asarray(Image.open(run_dir / name).convert("RGB"), dtype=np.int16)
        assert int(np.abs(ours - expected.astype(np.int16)).max()) <= COMPILED_VS_EAGER, name


# ---------------------------------------------------------------- what a failed load says


def _hub_error(cls, status: int):
    """One of huggingface_hub's own errors, as it raises them for a hub answer of `status`."""
    import httpx

    return cls(f"{status} Client Error", response=httpx.Response(status, request=httpx.Request("GET", "https://hub/x")))


def test_a_gated_model_without_any_token_says_to_log_in(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    from tpugen.models import hub_failure

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert hub_failure(_hub_error(GatedRepoError, 403)) == (
        "gated on the hub and no token is set (accept the licence on the model page, then `hf auth login` or set "
        "HF_TOKEN)"
    )
    # A user who ran `hf auth login` has a token without HF_TOKEN: the account is what lacks access.
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_saved_by_login")
    assert hub_failure(_hub_error(GatedRepoError, 403)) == (
        "gated on the hub and your token's account has no access (accept the licence on the model page)"
    )


def test_hub_errors_are_told_by_their_type(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError, RepositoryNotFoundError

    from tpugen.models import hub_failure

    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub_failure(_hub_error(RemoteEntryNotFoundError, 404), what="file", file="w.safetensors") == (
        "the repo has no file 'w.safetensors'"
    )
    assert hub_failure(_hub_error(RepositoryNotFoundError, 404)) == (
        "no such model on the hub (or it is private: `hf auth login` or set HF_TOKEN)"
    )
    assert hub_failure(LocalEntryNotFoundError("not cached")) == (
        "offline: the hub cannot be reached and the model is not in the local cache (HF_HOME)"
    )
    wrapped = RuntimeError("load failed")
    wrapped.__cause__ = _hub_error(RepositoryNotFoundError, 401)
    assert hub_failure(wrapped).startswith("no such model on the hub")
    assert hub_failure(ValueError("bad weights")) == "ValueError: bad weights"


@pytest.mark.xla
def test_a_local_folder_that_fails_to_load_offline_says_its_own_reason(tmp_path, monkeypatch):
    import shutil

    from tpugen.tiny import builtin_path

    folder = tmp_path / "broken"
    shutil.copytree(builtin_path("tiny-sd"), folder)
    (folder / "unet" / "config.json").write_text("{not json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_config(tmp_path, model={"id": str(folder)}, execution={"backend": "cpu"})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: model.id: cannot load '{folder}': ")
    assert "offline" not in line and "hub" not in line, line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
def test_the_first_screen_of_the_demo_is_tpugens_own(tmp_path):
    """A fresh cache builds tiny-sd first: nothing of the libraries' own (save_pretrained's progress bar,
    transformers' missing-torchvision notices) reaches the screen."""
    import os
    import subprocess

    from conftest import TPUGEN

    config = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    proc = subprocess.run(
        [TPUGEN, "generate", str(config), f"output.dir={tmp_path / 'out'}", "prompts=[a cat]", "steps=2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PJRT_DEVICE": "CPU", "TPUGEN_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    screen = proc.stdout + proc.stderr
    for foreign in ("Writing model shards", "torchvision", "it/s]", "Loading pipeline components"):
        assert foreign not in screen, (foreign, screen)
    assert proc.stderr.lstrip().startswith("loading tiny-sd onto xla"), proc.stderr[:300]
