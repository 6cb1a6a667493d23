"""compile.trace_once: the denoiser traced once per shape key by dynamo, the same pixels as recording it every step,
a fallback that says why, and the host's and the device's milliseconds per step in every report."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import (
    OTHER_GRAPH,
    SAME_SETUP,
    Recording,
    assert_same_images,
    forked_tpugen,
    run_cli,
    tiny_config,
    write_config,
)

from tpugen.backends.base import TRACE_ONCE_FALSE
from tpugen.backends.xla.trace import OFFLOAD, PLACEMENT, SCAN, SPMD, STEP_CACHE, trace_once_reason
from tpugen.config import load_config
from tpugen.outputs.report import host_bound, step_times

# One small shape for every run here: 64x64, batch 1, 3 steps (CFG on).
SMALL = {"height": 64, "width": 64, "batch_size": 1, "steps": 3, "prompts": ["a cat", "a dog"]}


# ---------------------------------------------------------------- planning (no device)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ({}, None),
        ({"setting": False}, TRACE_ONCE_FALSE),
        ({"step_cache": True}, STEP_CACHE),
        ({"offload": True}, OFFLOAD),
        ({"placed": True}, PLACEMENT),
        ({"spmd": True}, SPMD),
        ({"scanned": True}, SCAN),
        ({"setting": False, "spmd": True}, TRACE_ONCE_FALSE),  # the config's own false is the reason given
    ],
)
def test_where_trace_once_applies_and_why_not(asked, expected):
    flags = {"setting": True, "step_cache": False, "offload": False, "placed": False, "spmd": False, "scanned": False}
    flags.update(asked)
    setting = flags.pop("setting")
    assert trace_once_reason(setting, **flags) == expected


def test_trace_once_defaults_on_and_leaves_the_config_hash_as_it_was(tmp_path):
    config = tiny_config(tmp_path)
    config.pop("compile")  # the suite's tiny_config turns trace_once off; a user's config leaves it out
    on = load_config(write_config(tmp_path / "on.yaml", config))
    off = load_config(write_config(tmp_path / "off.yaml", {**config, "compile": {"trace_once": False}}))
    assert on.config.compile.trace_once is True and off.config.compile.trace_once is False
    # true, the default, is left out of the hash (a run made before the key existed keeps its hash, which
    # tests/test_step_cache.py pins for its config); false is another way of running, so another hash.
    explicit = load_config(write_config(tmp_path / "explicit.yaml", {**config, "compile": {"trace_once": True}}))
    assert explicit.config_hash == on.config_hash != off.config_hash
    result = run_cli("validate", write_config(tmp_path / "bad.yaml", {**config, "compile": {"trace_once": "maybe"}}))
    assert result.exit_code == 2 and "compile.trace_once" in result.output


def test_plan_says_whether_the_denoiser_is_traced_once(tmp_path):
    from tpugen.app import planned_trace
    from tpugen.families import family

    config = tiny_config(tmp_path)
    config.pop("compile")
    on = load_config(write_config(tmp_path / "on.yaml", config)).config
    assert planned_trace(on, family("sd")).startswith("trace once: on (unet traced by dynamo once per shape key)")
    assert (
        planned_trace(
            on.model_copy(update={"execution": on.execution.model_copy(update={"backend": "cpu"})}), family("sd")
        )
        is None
    )
    cached = {**config, "model": {"id": "tiny-flux"}, "compile": {"step_cache": {"method": "magcache"}}}
    cached["compile"]["step_cache"]["mag_ratios"] = "flux"
    result = run_cli("plan", write_config(tmp_path / "cache.yaml", cached))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"trace once: off, the transformer is recorded every step -- {' '.join(STEP_CACHE.split())}" in said
    # TaylorSeer's hooks are traced with the step (tests/test_step_cache.py runs it).
    cached["compile"]["step_cache"] = {"method": "taylorseer"}
    result = run_cli("plan", write_config(tmp_path / "taylorseer.yaml", cached))
    assert result.exit_code == 0, result.output
    assert "trace once: off" not in " ".join(result.output.split())


def test_the_report_says_when_the_host_sets_the_pace():
    rows = [
        {"steps": 4, "host_ms_per_step": 10.0, "device_ms_per_step": 2.0},
        {"steps": 2, "host_ms_per_step": 40.0, "device_ms_per_step": 5.0},
        {"steps": 3, "host_ms_per_step": None, "device_ms_per_step": None},  # a batch that measured nothing
    ]
    # The host's: the median of 4 x 10 and 2 x 40 (each batch's median once per step); the device's: the mean.
    assert step_times(rows) == {"host_ms_per_step": 10.0, "device_ms_per_step": 3.0}
    assert step_times([]) == {"host_ms_per_step": None, "device_ms_per_step": None}
    assert host_bound(10.0, 3.0) == "host-bound: the host needs 10.00 ms per step, the device 3.00 ms"
    assert host_bound(2.0, 3.0) is None and host_bound(None, 3.0) is None and host_bound(4.0, None) is None


def test_report_md_shows_both_figures_and_the_warning():
    from tpugen.outputs.report import RunReport, render_markdown

    report = RunReport(
        run_id="r",
        run_dir="/tmp/r",
        complete=True,
        device={
            "backend": "xla",
            "device_kind": "TPU v6e",
            "trace_once": {
                "state": "off",
                "setting": True,
                "component": "unet",
                "how": None,
                "reason": STEP_CACHE,
                "failed_attempt": None,
            },
        },
        timed_phase={"host_ms_per_step": 41.5, "device_ms_per_step": 3.5, "batches": []},
    )
    text = render_markdown(report)
    assert f"- trace once: off, the unet was recorded every step -- {STEP_CACHE}" in text
    assert "host ms per denoising step (recording and handing it to the device; median): 41.50" in text
    assert "device ms per step (its graphs' execution, at most the loop's time; mean): 3.50" in text
    assert "- **host-bound: the host needs 41.50 ms per step, the device 3.50 ms**" in text


# ---------------------------------------------------------------- on XLA:CPU


def _run(tmp_path, run_id: str, *args: str, **overrides):
    config = tiny_config(
        tmp_path, output={"dir": str(tmp_path / "outputs"), "run_id": run_id}, **{**SMALL, **overrides}
    )
    result = run_cli("generate", write_config(tmp_path / f"{run_id}.yaml", config), *args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / run_id
    return result, run_dir, json.loads((run_dir / "report.json").read_text())


class _Finished:
    def __init__(self, proc) -> None:
        self.output = proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    """tiny-sd's run traced once and the same run recorded every step, side by side. The traced run has a process
    of its own: dynamo keeps what it traced for the code of the UNet's forward, so in a process that traced the
    same shape before it traces nothing and its graph counts are not a first run's."""
    tmp = tmp_path_factory.mktemp("both")
    config = tiny_config(tmp, output={"dir": str(tmp / "outputs"), "run_id": "traced"}, **SMALL)
    config["compile"]["trace_once"] = True
    proc = subprocess.run(
        [forked_tpugen(), "generate", str(write_config(tmp / "traced.yaml", config))],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    assert proc.returncode == 0, proc.stderr
    traced_dir = tmp / "outputs" / "traced"
    traced = _Finished(proc), traced_dir, json.loads((traced_dir / "report.json").read_text())
    lazy = _run(tmp, "lazy", compile={"trace_once": False})
    return traced, lazy


@pytest.mark.xla
def test_traced_once_gives_the_pixels_of_recording_every_step(both_ways):
    (result, traced_dir, traced), (_, lazy_dir, lazy) = both_ways
    assert "trace once: on (unet traced by dynamo once per shape key)" in result.output
    assert traced["device"]["trace_once"]["state"] == "on" and lazy["device"]["trace_once"]["state"] == "off"
    assert lazy["device"]["trace_once"]["reason"] == TRACE_ONCE_FALSE
    # The same computation as one lazy graph or as three (before the denoiser, it, after it): bit for bit here.
    assert_same_images(traced_dir, lazy_dir, SAME_SETUP)
    for report in (traced, lazy):
        assert report["compiles_after_warmup"] == 0
        counters = report["xla_counters"]["timed_phase"]
        assert counters["transfers_to_host"] == report["batches"]  # one read back to the host per batch
    (warm,) = traced["warmup"]
    (lazy_warm,) = lazy["warmup"]
    # The lazy run shares this process: graphs it looked up in the compile cache, compiled or found, are what a
    # fresh process compiles in its first step.
    assert lazy_warm["graphs_run_per_phase"]["first denoising step"] == 1
    assert warm["graphs_run_per_phase"]["first denoising step"] == 3, warm
    # Traced once, the step is three graphs: the work before the denoiser (cut at its door), the denoiser as
    # dynamo traced it, and the work after it (CFG and the scheduler's step) cut where the step ends.
    assert warm["graphs_per_phase"]["first denoising step"] == 3, warm
    # Graph executions in the timed phase: lazily 1 per step, traced 3, plus text encoding and decoding per batch.
    steps = SMALL["steps"] * traced["batches"]
    assert lazy["xla_counters"]["timed_phase"]["executions"] == steps + 2 * lazy["batches"]
    assert traced["xla_counters"]["timed_phase"]["executions"] == 3 * steps + 2 * traced["batches"]


@pytest.mark.xla
def test_every_report_has_the_host_and_device_time_per_step(both_ways):
    for _, run_dir, report in both_ways:
        timed = report["timed_phase"]
        assert timed["host_ms_per_step"] > 0 and timed["device_ms_per_step"] > 0
        for batch in timed["batches"]:
            assert batch["host_ms_per_step"] > 0 and batch["device_ms_per_step"] > 0
        text = (run_dir / "report.md").read_text()
        assert f"median): {timed['host_ms_per_step']:.2f}; device ms per step" in text
        assert ("host-bound:" in text) == (timed["host_ms_per_step"] >= timed["device_ms_per_step"])


@pytest.mark.xla
def test_a_step_cache_falls_back_to_recording_every_step_and_says_why_at_load(tmp_path):
    """MagCache's hooks decide from tensors (a graph break for dynamo): the denoiser is recorded every step, said at
    load. (TaylorSeer's are traced with the step: tests/test_step_cache.py.)"""
    from tpugen.engine import Engine, EngineSpec

    config = tiny_config(
        tmp_path,
        model={"id": "tiny-flux"},
        compile={"trace_once": True, "step_cache": {"method": "magcache", "mag_ratios": "flux"}},
        guidance_scale=0.0,
    )
    run = load_config(write_config(tmp_path / "cache.yaml", config))
    said = Recording()
    engine = Engine.open(EngineSpec.of(run), display=said)
    try:
        # The way the config runs, not a surprise: said as the load goes, not as a warning.
        assert f"trace once: off, the transformer is recorded every step -- {STEP_CACHE}" in said.phases
        assert not [w for w in said.warnings if "trace once" in w]
        assert engine.describe()["trace_once"]["reason"] == STEP_CACHE
        assert "trace once" not in engine.loaded.hooks.names()
    finally:
        engine.close()


@pytest.mark.xla
def test_a_denoiser_dynamo_cannot_trace_falls_back_in_the_run_and_says_so(tmp_path, monkeypatch):
    """A real graph break inside the UNet (torch._dynamo.graph_break in its first convolution's forward) at the
    second of two sizes only: the first size traces once, dynamo refuses the second, that call goes on recording the
    UNet every step, the first size is warmed again that way, and the run's images are those of trace_once: false."""
    import torch._dynamo

    from tpugen.engine import engine as engine_module

    real_open = engine_module.Engine.open.__func__

    def open_with_a_break(cls, spec, **kwargs):
        engine = real_open(cls, spec, **kwargs)
        conv_in = engine.loaded.pipe.unet.conv_in
        own = conv_in.forward

        def forward(sample, *args, **kw):
            if sample.shape[-1] == 10:  # latents of an 80-pixel width: decided when dynamo traces the shape
                torch._dynamo.graph_break()
            return own(sample, *args, **kw)

        conv_in.forward = forward
        return engine

    sizes = {"sizes": [[64, 64], [64, 80]], "height": None, "width": None}
    _, lazy_dir, _ = _run(tmp_path, "lazy", **sizes)
    monkeypatch.setattr(engine_module.Engine, "open", classmethod(open_with_a_break))
    result, run_dir, report = _run(tmp_path, "broken", compile={"trace_once": True}, **sizes)
    trace = report["device"]["trace_once"]
    assert trace["state"] == "off" and trace["reason"].startswith("dynamo could not trace the unet: "), trace
    assert trace["failed_attempt"]["input"] == "2x4x8x10"  # the CFG batch of the 64x80 latents
    assert "trace once: off, the unet is recorded every step -- dynamo could not trace the unet" in result.output
    warmed = [(w["shape_key"], w.get("again_traced_lazily", False)) for w in report["warmup"]]
    assert warmed == [("64x64 b1 cfg", False), ("64x80 b1 cfg", False), ("64x64 b1 cfg", True)]
    assert report["compiles_after_warmup"] == 0
    assert_same_images(run_dir, lazy_dir, SAME_SETUP)
    markdown = (run_dir / "report.md").read_text()
    assert "| 64x64 b1 cfg (again, recorded every step: the trace failed) |" in markdown
    assert "- trace once: off, the unet was recorded every step -- dynamo could not trace the unet: " in markdown


@pytest.mark.xla
def test_removing_the_hook_gives_the_unet_its_own_forward_back(tmp_path):
    from tpugen.engine import Engine, EngineSpec

    run = load_config(write_config(tmp_path / "h.yaml", tiny_config(tmp_path, compile={"trace_once": True})))
    engine = Engine.open(EngineSpec.of(run))
    unet = engine.loaded.pipe.unet
    assert "forward" in vars(unet) and engine.loaded.hooks.names().count("trace once") == 1
    engine.loaded.hooks.remove("trace once")
    assert "forward" not in vars(unet) and not unet._forward_pre_hooks
    engine.close()


# Every family's tiny built-in (tiny-sd is both_ways's): traced once, or the fallback said, and the same pixels.
FAMILY_MODELS = [
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    "tiny-flux2-klein",
    "tiny-flux2",
    "tiny-z-image",
    "tiny-qwen-image",
]


@pytest.mark.xla
@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_every_family_traces_once_with_the_pixels_of_recording_every_step(model, tmp_path):
    shape = {"model": {"id": model}, "steps": 2, "prompts": ["a cat"]}
    _, traced_dir, traced = _run(tmp_path, "traced", compile={"trace_once": True}, **shape)
    _, lazy_dir, lazy = _run(tmp_path, "lazy", **shape)
    trace = traced["device"]["trace_once"]
    assert trace["state"] == "on", trace  # no family's denoiser breaks dynamo's graph
    assert traced["compiles_after_warmup"] == 0 and lazy["compiles_after_warmup"] == 0
    assert traced["xla_counters"]["timed_phase"]["transfers_to_host"] == traced["batches"]

    # Graph executions per step (exact whatever this process compiled before): recorded every step, 1; traced
    # once, the denoiser's graph and the step's work after it, and the work before it where a step does some
    # there (the CFG batch, the input's scaling). Plus text encoding and decoding, one each per batch.
    def per_step(report) -> float:
        executions = report["xla_counters"]["timed_phase"]["executions"]
        return (executions - 2 * report["batches"]) / (2 * report["batches"])

    assert per_step(lazy) == 1 and per_step(traced) in (2, 3), (per_step(lazy), per_step(traced))
    assert_same_images(traced_dir, lazy_dir, OTHER_GRAPH)


@pytest.mark.xla
def test_a_switched_lora_is_what_the_traced_step_uses(tmp_path):
    """LoRAs are switched by giving the live weights new device data: the traced graph takes the weights as
    inputs, so it must use the new data without compiling (a weight baked into the graph would keep the old)."""
    from conftest import make_lora

    from tpugen.engine import Engine, EngineSpec
    from tpugen.plan import plan_run

    def images(engine, run):
        return [pixels for batch in plan_run(run).batches for pixels in engine.generate(batch)]

    lora = make_lora(tmp_path / "style.safetensors", "kohya", seed=1)
    base = {**SMALL, "prompts": ["a cat"]}
    fused = tiny_config(tmp_path, model={"id": "tiny-sd", "loras": [{"id": str(lora), "scale": 0.8}]}, **base)
    plain = tiny_config(tmp_path, compile={"trace_once": True}, **base)
    fused_lazy = load_config(write_config(tmp_path / "fused.yaml", fused))
    traced_run = load_config(write_config(tmp_path / "plain.yaml", plain))

    lazy_engine = Engine.open(EngineSpec.of(fused_lazy))  # the LoRA fused at load, recorded every step
    expected = images(lazy_engine, fused_lazy)
    lazy_engine.close()

    engine = Engine.open(EngineSpec.of(traced_run))
    try:
        assert engine.backend.trace_once.on
        engine.warmup(plan_run(traced_run))
        without = images(engine, traced_run)
        before = engine.backend.counters().compiles
        engine.use_loras(fused_lazy.loras)
        switched = images(engine, traced_run)
        engine.use_loras([])
        back = images(engine, traced_run)
        assert engine.backend.counters().compiles == before  # switching compiled nothing
        assert engine.backend.trace_once.on
    finally:
        engine.close()
    assert all(np.abs(a.astype(int) - b).max() > 10 for a, b in zip(switched, without, strict=True))
    for ours, theirs in zip(switched, expected, strict=True):
        assert int(np.abs(ours.astype(int) - theirs).max()) <= OTHER_GRAPH
    assert all(np.array_equal(a, b) for a, b in zip(back, without, strict=True))


@pytest.mark.xla
def test_a_server_traces_once_and_shows_the_step_times_in_its_metrics(tmp_path):
    """A warm `tpugen serve` with trace_once: true answers the web UI's txt2img with the image a lazy run of the
    same request makes, compiles nothing after warmup, and its /metrics carry the host's and device's ms per step."""
    import base64
    import io

    import httpx
    import yaml
    from PIL import Image
    from serve_support import AUTH, KEY, running_server, serve_config, txt2img, wait_ready

    path = serve_config(tmp_path, sizes=[[64, 64]])
    config = yaml.safe_load(path.read_text())
    config["compile"]["trace_once"] = True
    config["batch_size"] = 1
    write_config(path, config)
    with running_server(path, tmp_path / "runs", KEY) as (url, service):
        wait_ready(url)
        assert all(engine.backend.trace_once.on for engine in service.engines)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            reply = txt2img(client, prompt="a cat", seed=3)
            metrics = client.get("/metrics").text
    assert "tpugen_compiles_after_warmup_total 0.0" in metrics
    for name in ("tpugen_host_ms_per_step", "tpugen_device_ms_per_step"):
        (line,) = [line for line in metrics.splitlines() if line.startswith(name + " ")]
        assert float(line.split()[1]) > 0, line
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply["images"][0]))).convert("RGB"), dtype=np.int16)
    _, lazy_dir, _ = _run(tmp_path, "lazy", prompts=["a cat"], seed=3)
    (lazy_png,) = sorted(lazy_dir.glob("[0-9]*.png"))
    lazy = np.asarray(Image.open(lazy_png).convert("RGB"), dtype=np.int16)
    assert int(np.abs(served - lazy).max()) <= SAME_SETUP


@pytest.mark.xla
def test_img2img_inpainting_and_hires_fix_trace_once_with_the_pixels_of_recording_every_step(tmp_path):
    """The img2img and inpaint pipelines share the loaded UNet (so its trace), and hires fix's second pass is the
    UNet at twice the size: one run of all three, traced once and not, the same images, nothing compiled after."""
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "init.png")
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (32, 0, 64, 64))
    mask.save(tmp_path / "mask.png")
    prompts = [
        {"prompt": "a red square", "init_image": str(tmp_path / "init.png"), "strength": 0.7},
        {
            "prompt": "repaint the right",
            "init_image": str(tmp_path / "init.png"),
            "mask_image": str(tmp_path / "mask.png"),
        },
        "a cat",
    ]
    work = {"prompts": prompts, "steps": 4, "height": 32, "width": 32, "hires": {"scale": 2, "steps": 2}}
    _, traced_dir, traced = _run(tmp_path, "traced", compile={"trace_once": True}, **work)
    _, lazy_dir, lazy = _run(tmp_path, "lazy", **work)
    assert traced["device"]["trace_once"]["state"] == "on"
    assert traced["compiles_after_warmup"] == 0 and lazy["compiles_after_warmup"] == 0
    assert sorted(w["shape_key"] for w in traced["warmup"]) == sorted(w["shape_key"] for w in lazy["warmup"])
    assert len(list(traced_dir.glob("[0-9]*.png"))) == 3
    assert_same_images(traced_dir, lazy_dir, OTHER_GRAPH)
