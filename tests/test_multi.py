"""All chips of a VM, on XLA:CPU with CPU_NUM_DEVICES=4: each image once, the same as on one chip."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import (
    OTHER_DEVICE_COUNT,
    assert_same_images,
    failing_rank_env,
    forked_tpugen,
    generate,
    generate_in_new_process,
    save_disc,
    sigterm_after_a_rank_image,
    tiny_config,
    write_config,
)
from PIL import Image

from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import image_filename
from tpugen.plan import plan_run, shard
from tpugen.plan import plan_share as rank_plan

PROMPTS = [f"a small {w}" for w in ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu", "ant", "cod"]]
NAMES = [image_filename(i, 7 + i, p) for i, p in enumerate(PROMPTS)]


def test_sharding_is_round_robin_by_global_index(tmp_path):
    from tpugen.config import load_config

    run = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path, prompts=PROMPTS, batch_size=2)))
    items = plan_run(run).items
    shares = [[i.index for i in shard(items, 4, r)] for r in range(4)]
    assert shares == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    plan = rank_plan(run, 4, 2)
    assert [([i.index for i in b.items], b.padding) for b in plan.batches] == [([2, 6], 0)]
    assert [([i.index for i in b.items], b.padding) for b in rank_plan(run, 4, 0).batches] == [([0, 4], 0), ([8], 1)]
    assert [b.items for b in rank_plan(run, 4, 0, frozenset({0, 4})).batches] == [rank_plan(run, 4, 0).batches[1].items]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("single"), prompts=PROMPTS)


@pytest.mark.xla
def test_four_devices_make_each_image_once_like_one_chip(single, tmp_path):
    """Each rank's UNet traced once (compile.trace_once, the default: tiny_config turns it off), the images those
    of one device recording every step."""
    proc, run_dir = generate_in_new_process(
        tmp_path, prompts=PROMPTS, execution={"mode": "multi", "cores": 4}, compile={"trace_once": True}
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run_dir.glob("[0-9]*.png")) == NAMES
    assert sorted(p.name for p in run_dir.iterdir() if not p.name[0].isdigit()) == [
        "config.yaml",
        "grid.png",
        "manifest.jsonl",
        "report.json",
        "report.md",
        "run.json",
    ]
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["index"] for r in records] == list(range(10))
    assert [r["rank"] for r in records] == [i % 4 for i in range(10)]
    assert_same_images(run_dir, single, OTHER_DEVICE_COUNT)
    # The PNGs say what made each image, never how the run was executed.
    assert all("rank" not in json.loads(Image.open(run_dir / name).text["tpugen"]) for name in NAMES)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["mode"] == "multi"
    assert [(r["rank"], r["images"], r["error"]) for r in report["ranks"]] == [
        (0, 3, None),
        (1, 3, None),
        (2, 2, None),
        (3, 2, None),
    ]
    # One rank compiled the 6 graphs of a call traced once (text encoding; the first step's three: before the
    # UNet, the UNet as dynamo traced it, after it; the one the later steps add; decoding); the other three found
    # them in the process's cache.
    assert sorted(r["warmup_compiles"] for r in report["ranks"]) == [0, 0, 0, 6]
    assert report["device"]["trace_once"]["state"] == "on"
    assert report["compiles_after_warmup"] == 0
    assert report["topology"]["world_size"] == 4
    assert report["images"] == 10
    assert "4 ranks are threads of one process" in report["counters_scope"]
    assert "## Ranks (4)" in (run_dir / "report.md").read_text()


@pytest.mark.xla
def test_a_failing_rank_is_named_and_the_others_keep_their_images(tmp_path):
    proc, run_dir = generate_in_new_process(
        tmp_path, env=failing_rank_env(2), prompts=PROMPTS, batch_size=1, execution={"mode": "multi", "cores": 4}
    )
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: rank 2: RuntimeError: failed on purpose after its first batch (TPUGEN_TEST_FAIL_RANK=2)"
    # Rank 2 made image 2 before failing; its image 6 is missing; every other rank finished.
    expected = [n for i, n in enumerate(NAMES) if i != 6]
    assert sorted(p.name for p in run_dir.glob("[0-9]*.png")) == expected
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"].startswith("rank 2: RuntimeError")
    assert lines[-1] == f"error: resume with: tpugen resume {run_dir}"


@pytest.mark.xla
def test_sigterm_stops_every_rank_after_its_batch_and_resume_finishes(tmp_path):
    reference = generate(tmp_path / "reference", prompts=PROMPTS, batch_size=1, steps=8)
    config = tiny_config(tmp_path, prompts=PROMPTS, batch_size=1, steps=8, execution={"mode": "multi", "cores": 4})
    path = write_config(tmp_path / "c.yaml", config)
    run_dir = tmp_path / "outputs" / "run"
    tpugen = forked_tpugen()
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.Popen([tpugen, "generate", str(path), "--quiet"], stderr=subprocess.PIPE, text=True, env=env)
    stderr = sigterm_after_a_rank_image(proc, run_dir, 300)
    assert proc.returncode == 143, stderr
    assert stderr.splitlines()[-1] == f"error: resume with: tpugen resume {run_dir}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"] == "interrupted by SIGTERM"
    kept = [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")]
    assert 1 <= len(kept) < 10 and not list(run_dir.glob("manifest.rank*"))

    resumed = subprocess.run([tpugen, "resume", str(run_dir), "--quiet"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(10))
    assert json.loads((run_dir / "report.json").read_text())["images_reused"] == len(kept)
    assert_same_images(run_dir, reference, OTHER_DEVICE_COUNT)


@pytest.mark.xla
def test_controlnet_units_on_two_ranks_make_the_images_of_one_chip(tmp_path):
    """ControlNet in multi mode: each rank (a thread of one process, a device of its own) runs the ControlNets
    beside its denoiser, its scales kept on its own device, and reads each of its prompts' control images."""
    save_disc(tmp_path / "disc.png")
    prompts = [
        {"prompt": "a small cat", "control_image": str(tmp_path / "disc.png")},
        {"prompt": "a small dog", "control_image": str(tmp_path / "disc.png"), "control_module": "invert"},
        {"prompt": "a small owl", "control_image": str(tmp_path / "disc.png"), "control_scale": 0.5},
    ]
    model = {"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet"}]}
    one_chip = generate(tmp_path / "single", prompts=prompts, batch_size=1, model=model)
    proc, run_dir = generate_in_new_process(
        tmp_path / "multi", prompts=prompts, batch_size=1, model=model, execution={"mode": "multi", "cores": 2}
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_images(run_dir, one_chip, OTHER_DEVICE_COUNT)
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [(r["index"], r["rank"]) for r in records] == [(0, 0), (1, 1), (2, 0)]
    assert [r["controlnet_units"][0]["module"] for r in records] == ["none", "invert", "none"]
    assert [r["controlnet_units"][0]["scale"] for r in records] == [1.0, 1.0, 0.5]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["compiles_after_warmup"] == 0
    # Each rank warmed the controlled key; one compiled its 3 graphs (the ControlNet inside the step's), the other
    # found them in the process's cache.
    warm = sorted((w["rank"], w["shape_key"], w["compiles"]) for w in report["warmup"])
    assert [(rank, key) for rank, key, _ in warm] == [
        (0, "64x64 b1 cfg 1 controlnet"),
        (1, "64x64 b1 cfg 1 controlnet"),
    ]
    assert sorted(compiles for _, _, compiles in warm) == [0, 3]
