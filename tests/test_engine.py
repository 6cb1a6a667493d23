"""The engine outlives a run: several runs on one loaded, warm pipeline; its patches are named and removable."""

from __future__ import annotations

import json

import pytest
from conftest import FIRST_CALL, SAME_SETUP, assert_same_images, cold_graphs, image_bytes, tiny_config, write_config

from tpugen.config import load_config
from tpugen.engine import Engine, EngineSpec

pytestmark = pytest.mark.xla

SHAPE = {"height": 64, "width": 64, "batch_size": 1}


def resolved(tmp_path, run_id: str, **overrides):
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "outputs"), "run_id": run_id}, **overrides)
    return load_config(write_config(tmp_path / f"{run_id}.yaml", config))


def test_a_second_run_on_a_warm_engine_compiles_nothing_and_loads_nothing(tmp_path, monkeypatch):
    import torch_xla.debug.metrics as met

    import tpugen.engine.engine
    from tpugen.modes.single import run_single

    reads = []
    real_read = tpugen.engine.engine.read_shared
    monkeypatch.setattr(tpugen.engine.engine, "read_shared", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    first = resolved(tmp_path, "first", prompts=["a cat", "a dog"], **SHAPE)
    engine = Engine.open(EngineSpec.of(first))
    assert reads == [1]

    report = run_single(first, engine=engine)
    (warm,) = report["warmup"]
    assert warm["shape_key"] == "64x64 b1 cfg" and cold_graphs(warm) == FIRST_CALL
    # Where the compile time went, phase by phase, keyed like the graphs.
    assert set(warm["compile_seconds_per_phase"]) == set(warm["graphs_per_phase"])
    assert all(seconds >= 0 for seconds in warm["compile_seconds_per_phase"].values())
    assert abs(sum(warm["compile_seconds_per_phase"].values()) - warm["compile_seconds"]) < 1e-6
    compiled = warm["graphs_per_phase"]["text encoding"]  # 0 where this process compiled it before
    assert f"text encoding {compiled} (" in (tmp_path / "outputs" / "first" / "report.md").read_text()

    # Another run (other prompts, other seed, other step count) of the same shape, on the same engine.
    second = resolved(tmp_path, "second", prompts=["an owl", "a fox", "a bee"], seed=11, steps=4, **SHAPE)
    assert engine.accepts(second)
    compiles_before = met.metric_data("CompileTime")[0]
    report = run_single(second, engine=engine)
    assert met.metric_data("CompileTime")[0] == compiles_before  # the real XLA counter: 0 graphs compiled
    assert [(w["shape_key"], w.get("already_warm"), w["compiles"]) for w in report["warmup"]] == [
        ("64x64 b1 cfg", True, 0)
    ]
    assert report["compiles_after_warmup"] == 0 and report["images"] == 3
    assert reads == [1]  # the weights were read once, for both runs
    assert "already warm on this engine" in (tmp_path / "outputs" / "second" / "report.md").read_text()

    # A run of the first run's work on the used engine makes the first run's bytes: no state leaks between runs.
    again = resolved(tmp_path, "again", prompts=["a cat", "a dog"], **SHAPE)
    run_single(again, engine=engine)
    assert image_bytes(tmp_path / "outputs" / "again") != {}
    assert_same_images(tmp_path / "outputs" / "again", tmp_path / "outputs" / "first", SAME_SETUP)
    engine.close()


def test_an_engine_is_shared_only_by_runs_that_load_the_same_thing(tmp_path):
    base = resolved(tmp_path, "a")
    spec = EngineSpec.of(base)
    assert EngineSpec.of(resolved(tmp_path, "b", prompts=["x"], seed=3, steps=9)).key() == spec.key()
    assert EngineSpec.of(resolved(tmp_path, "c", execution={"strict_shapes": True})).key() == spec.key()
    assert EngineSpec.of(resolved(tmp_path, "d", model={"dtype": "bfloat16"})).key() != spec.key()
    assert EngineSpec.of(resolved(tmp_path, "e", execution={"backend": "cpu"})).key() != spec.key()


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux"])
def test_removing_every_hook_leaves_the_pipeline_as_loaded(tmp_path, model):
    import diffusers

    run = resolved(tmp_path, "h", model={"id": model}, execution={"backend": "cpu"})
    engine = Engine.open(EngineSpec.of(run))
    loaded = engine.loaded
    pipe = loaded.pipe
    denoiser = getattr(pipe, loaded.family.denoiser)
    expected = ["graph cut at the loop start"]
    if model == "tiny-flux":
        expected += ["timesteps at the denoiser's door", "timesteps on the host"]
    if hasattr(pipe.scheduler, "set_begin_index"):  # DDIM (tiny-sd's) has no begin index to set
        expected.append("scheduler starts at step 0")
    wraps_set_timesteps = len(expected) > 1
    # img2img's noising: a sigma scheduler's noise level as data (Flux's flow matching), DDIM's table kept on the host.
    sigmas = hasattr(pipe.scheduler, "sigmas")
    expected.append("noise level handed in as data" if sigmas else "scheduler tables stay on the host")
    assert loaded.hooks.names() == expected
    assert type(pipe) is not getattr(diffusers, type(pipe).__name__)
    assert ("set_timesteps" in vars(pipe.scheduler)) == wraps_set_timesteps
    assert {"add_noise", "scale_noise"} & set(vars(pipe.scheduler))

    loaded.hooks.remove_all()
    assert loaded.hooks.names() == []
    assert type(pipe) is getattr(diffusers, type(pipe).__name__)  # the pipeline's own class again
    assert "set_timesteps" not in vars(pipe.scheduler)  # the scheduler's own method again
    assert not {"add_noise", "scale_noise"} & set(vars(pipe.scheduler))
    assert not denoiser._forward_pre_hooks and not denoiser._forward_hooks


def test_the_report_says_where_compile_time_went(xla_run):
    report = json.loads((xla_run / "report.json").read_text())
    (warm,) = report["warmup"]
    assert list(warm["compile_seconds_per_phase"]) == list(warm["graphs_per_phase"])
    spent = warm["compile_seconds_per_phase"]
    assert spent["later denoising steps"] < spent["first denoising step"]  # nothing compiles after step 1
    markdown = (xla_run / "report.md").read_text()
    assert f"first denoising step 1 ({spent['first denoising step']:.2f} s)" in markdown
