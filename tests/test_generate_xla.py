"""End to end on XLA:CPU: real compiles, real counters, real files, pixels compared across backends."""

from __future__ import annotations

import json

import pytest
from conftest import (
    COMPILED_VS_EAGER,
    PROMPTS,
    assert_same_images,
    generate,
    run_cli,
    tiny_config,
    with_prompts_file,
    write_config,
)
from PIL import Image

from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import image_filename

pytestmark = pytest.mark.xla

STEPS = 3
EXPECTED_FILES = [image_filename(i, 7 + i, p) for i, p in enumerate(PROMPTS)]


def test_run_directory_holds_images_manifest_config_and_reports(xla_run):
    names = sorted(p.name for p in xla_run.iterdir())
    assert names == sorted(
        EXPECTED_FILES + ["config.yaml", "grid.png", "manifest.jsonl", "report.json", "report.md", "run.json"]
    )
    assert Image.open(xla_run / "grid.png").size == (128, 128)  # 3 images in a 2x2 sheet of 64 px cells


def test_png_chunks_round_trip(xla_run):
    image = Image.open(xla_run / EXPECTED_FILES[1])
    assert image.size == (64, 64)
    assert image.text["parameters"] == (
        f"{PROMPTS[1]}\nNegative prompt: blurry\n"
        "Steps: 3, Sampler: DDIM, CFG scale: 7.5, Seed: 8, Size: 64x64, Model: tiny-sd, Version: tpugen 0.1.0"
    )
    record = json.loads(image.text["tpugen"])
    assert {k: record[k] for k in ("index", "seed", "prompt", "negative_prompt", "steps", "batch", "file")} == {
        "index": 1,
        "seed": 8,
        "prompt": PROMPTS[1],
        "negative_prompt": "blurry",
        "steps": STEPS,
        "batch": 0,
        "file": EXPECTED_FILES[1],
    }


def test_manifest_has_one_line_per_image(xla_run):
    records = read_manifest(xla_run / "manifest.jsonl")
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["file"] for r in records] == EXPECTED_FILES
    assert [r["batch"] for r in records] == [0, 0, 1]
    assert all(r["latency_seconds"] > 0 and r["scheduler"] == "DDIM" and r["model"] == "tiny-sd" for r in records)
    assert [(r["height"], r["width"], r["guidance_scale"]) for r in records] == [(64, 64, 7.5)] * 3


def test_report_counts_compiles_executions_and_transfers(xla_run):
    report = json.loads((xla_run / "report.json").read_text())
    assert report["complete"] is True
    assert report["images"] == 3 and report["batches"] == 2 and report["padding_rows"] == 1
    assert report["device"]["backend"] == "xla" and report["device"]["device_kind"] == "CPU"
    assert report["versions"]["torch_xla"] == "2.9.0"
    # The first run of the session compiles 3 graphs: text encoding, one denoising step (the first step
    # included), and decoding with the conversion to pixels.
    assert [(w["shape_key"], w["compiles"]) for w in report["warmup"]] == [("64x64 b2 cfg", 3)]
    assert report["warmup"][0]["graphs_per_phase"] == {
        "text encoding": 1,
        "first denoising step": 1,
        "later denoising steps": 0,
        "decoding": 1,
    }
    assert report["compiles_after_warmup"] == 0
    assert report["recompiles"] == []
    counters = report["xla_counters"]["timed_phase"]
    # Per batch: text encoding + one graph per step + decoding; one read back to the host.
    assert counters["executions"] == 2 * (STEPS + 2)
    assert counters["transfers_to_host"] == 2
    assert [(b["compiles"], b["transfers_to_host"]) for b in report["timed_phase"]["batches"]] == [(0, 1), (0, 1)]
    timed = report["timed_phase"]
    assert timed["per_image_seconds"]["p50"] > 0 and timed["images_per_second"] > 0
    assert timed["seconds_per_step"] > 0 and report["model_load_seconds"] > 0
    assert "compiles after warmup: 0" in (xla_run / "report.md").read_text()


def test_xla_matches_eager_cpu(xla_run, cpu_run):
    report = json.loads((cpu_run / "report.json").read_text())
    assert report["xla_counters"] is None and report["compiles_after_warmup"] is None
    assert_same_images(xla_run, cpu_run, COMPILED_VS_EAGER)


def test_same_seed_same_image_at_batch_size_1_and_4(xla_run, tmp_path):
    for batch_size in (1, 4):
        run_dir = generate(tmp_path / f"b{batch_size}", batch_size=batch_size)
        report = json.loads((run_dir / "report.json").read_text())
        assert report["shape_keys"] == [f"64x64 b{batch_size} cfg"]
        assert report["compiles_after_warmup"] == 0
        # Another batch size is another graph (other sums); each image still depends only on its own seed.
        assert_same_images(run_dir, xla_run, COMPILED_VS_EAGER)


def test_per_prompt_steps_and_guidance_do_not_recompile(xla_run, tmp_path):
    lines = ['{"prompt": "a", "steps": 5}', '{"prompt": "b", "steps": 2, "guidance_scale": 3.0}', '{"prompt": "c"}']
    config = with_prompts_file(tmp_path, tiny_config(tmp_path), lines, "p.jsonl")
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "outputs" / "run" / "report.json").read_text())
    assert report["batches"] == 3  # each call needs one step count and one guidance value
    assert report["shape_keys"] == ["64x64 b2 cfg"]
    assert report["compiles_after_warmup"] == 0
    assert [b["steps"] for b in report["timed_phase"]["batches"]] == [5, 2, 3]


def test_existing_run_directory_is_not_overwritten(xla_run):
    config_path = xla_run / "config.yaml"
    before = {p.name: p.stat().st_mtime_ns for p in xla_run.iterdir()}
    result = run_cli("generate", config_path, "--quiet")
    assert result.exit_code == 2
    assert result.stderr == f"error: output.run_id: {xla_run} already exists and is not empty; choose another run_id\n"
    assert {p.name: p.stat().st_mtime_ns for p in xla_run.iterdir()} == before


def test_two_sizes_at_batch_4_compile_only_the_planned_shape_keys(xla_run, tmp_path):
    prompts = [f"prompt number {i}" for i in range(10)]
    run_dir = generate(tmp_path, prompts=prompts, batch_size=4, sizes=[[64, 64], [96, 64]], height=None, width=None)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["shape_keys"] == ["64x64 b4 cfg", "96x64 b4 cfg"]
    assert [w["shape_key"] for w in report["warmup"]] == report["shape_keys"]
    assert report["images"] == 20 and report["padding_rows"] == 4
    assert report["compiles_after_warmup"] == 0
    assert sorted(p.name for p in run_dir.glob("*.png") if p.name != "grid.png") == sorted(
        image_filename(i, 7 + i, prompts[i // 2]) for i in range(20)
    )
    assert Image.open(run_dir / image_filename(1, 8, prompts[0])).size == (64, 96)  # width x height


def test_strict_shapes_stops_at_a_compile_after_warmup(xla_run, tmp_path):
    # --skip-warmup claims the compile cache is warm; 80x64 at batch 1 has never been compiled here.
    config = tiny_config(tmp_path, height=80, batch_size=1, prompts=["one", "two"])
    result = run_cli(
        "generate", write_config(tmp_path / "c.yaml", config), "--quiet", "--skip-warmup", "--strict-shapes"
    )
    run_dir = tmp_path / "outputs" / "run"
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: strict shapes: batch 0 (80x64 b1 cfg) compiled 3 graphs after warmup; its images were not written",
        f"error: 0 new images, the manifest and report.json are in {run_dir}",
    ]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"].startswith("strict shapes: batch 0")
    assert report["recompiles"] == [{"batch": 0, "shape_key": "80x64 b1 cfg", "compiles": 3}]
    assert list(run_dir.glob("*.png")) == []
