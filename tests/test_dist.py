"""Multi mode through torchrun: real rank processes on the CPU (gloo), and TorchTPU's path with a fake torch_tpu."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import (
    FAKES,
    OTHER_DEVICE_COUNT,
    TPUGEN,
    assert_same_images,
    failing_rank_env,
    generate,
    run_cli,
    sigterm_after_a_rank_image,
    tiny_config,
    write_config,
)

from tpugen.config import load_config
from tpugen.modes.multi import rank_environment, torchrun_command
from tpugen.modes.rank import DIST_BACKENDS, RankBarriers
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import image_filename


def reference_names(reference: Path, indices: list[int]) -> list[str]:
    names = sorted(p.name for p in reference.glob("[0-9]*.png"))
    return [names[i] for i in indices]


def test_torchrun_command_and_environment(tmp_path):
    assert torchrun_command(2, Path("/runs/r"), python="py") == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tpugen.modes.rank",
        "/runs/r",
    ]
    assert {name: b.process_group for name, b in DIST_BACKENDS.items()} == {
        "torch_tpu": "tpu_dist",
        "cuda": "nccl",
        "cpu": "gloo",
    }

    def env(mode, base, **execution):
        config = tiny_config(tmp_path, execution={"mode": "multi", **execution, "torch_tpu": {"mode": mode}})
        return rank_environment(load_config(write_config(tmp_path / "c.yaml", config)), 2, base, host_cores=4)

    cache = str(Path(os.environ["TPUGEN_CACHE"]) / "torch_tpu")  # TorchTPU's persistent cache, on by default
    assert env("defer_and_fuse", {"A": "1"}, backend="torch_tpu") == {
        "A": "1",
        "TORCH_TPU_DEFER_AND_FUSE": "1",
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": cache,
        "OMP_NUM_THREADS": "2",
    }
    assert env("eager", {}, backend="torch_tpu") == {
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": cache,
        "OMP_NUM_THREADS": "2",
    }
    assert env("defer_and_fuse", {"OMP_NUM_THREADS": "3"}, backend="cpu", cores=2) == {"OMP_NUM_THREADS": "3"}


def test_a_failing_rank_passes_the_barriers_it_owes(monkeypatch):
    import torch.distributed as dist

    calls, broken = [], []

    def barrier():
        calls.append("barrier")
        if broken:
            raise RuntimeError("the group is broken: a rank died")

    monkeypatch.setattr(dist, "barrier", barrier)
    barriers = RankBarriers()
    barriers.abort(RuntimeError("before joining the group"))
    assert calls == []  # no group yet: nothing to pass
    barriers.joined = True
    assert barriers.meet("warmed") is True and barriers.meet("done") is True  # the end is no barrier
    assert calls == ["barrier"]
    barriers.abort(RuntimeError("failed while warming up"))  # owes "timed phase"
    assert calls == ["barrier", "barrier"]
    barriers.abort(RuntimeError("again"))
    assert calls == ["barrier", "barrier"]
    fresh = RankBarriers()
    fresh.joined = True
    fresh.abort(KeyboardInterrupt())  # a second signal: stop at once, wait for nobody
    assert calls == ["barrier", "barrier"]
    broken.append(True)
    assert RankBarriers().meet("timed phase") is False  # a dead rank broke the group: nobody waits on


@pytest.mark.xla
def test_two_cpu_rank_processes_make_the_images_of_one(cpu_run, tmp_path):
    run_dir = generate(tmp_path, execution={"backend": "cpu", "mode": "multi", "cores": 2})
    assert_same_images(run_dir, cpu_run, OTHER_DEVICE_COUNT)
    # The same files as a single-process run: no launch file, log, rank results or rank manifests left.
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(p.name for p in cpu_run.iterdir())
    records = read_manifest(run_dir / "manifest.jsonl")
    single = read_manifest(cpu_run / "manifest.jsonl")
    assert [(r["index"], r["seed"], r["file"]) for r in records] == [(r["index"], r["seed"], r["file"]) for r in single]
    assert [r["rank"] for r in records] == [0, 1, 0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["mode"] == "multi" and report["images"] == 3
    assert [(r["rank"], r["images"], r["batches"], r["error"]) for r in report["ranks"]] == [
        (0, 2, 1, None),
        (1, 1, 1, None),
    ]
    assert len({r["pid"] for r in report["ranks"]} | {os.getpid()}) == 3  # a process of its own per rank
    assert report["launcher"]["tool"] == "torchrun" and report["launcher"]["process_group"] == "gloo"
    assert report["launcher"]["command"][1:] == torchrun_command(2, run_dir)[1:]
    assert report["device"]["backend"] == "cpu" and report["topology"]["world_size"] == 2
    assert report["counters_scope"] == "one process per rank: every count is that rank's own"
    markdown = (run_dir / "report.md").read_text()
    assert "## Ranks (2)" in markdown and "Launched by torchrun: 2 processes in a gloo process group" in markdown


@pytest.mark.xla
def test_torch_tpu_ranks_take_one_chip_each_in_a_tpu_dist_group(cpu_run, tmp_path):
    """A fake torch_tpu (tests/fakes) whose "tpu" is the host CPU and whose "tpu_dist" is gloo, in every
    process of the run: the parent's chip count, torchrun and its ranks. Rank 0 fails after its first image."""
    log = tmp_path / "torch_tpu.jsonl"
    config = tiny_config(
        tmp_path,
        batch_size=1,
        execution={"backend": "torch_tpu", "mode": "multi", "torch_tpu": {"mode": "defer_and_fuse"}},
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_DEFER_AND_FUSE"}
    env.update(FAKE_TORCH_TPU_LOG=str(log), FAKE_TORCH_TPU_CHIPS="2", **failing_rank_env(0, str(FAKES)))
    # A cache of its own: both ranks build the built-in model, before their process group exists (inside one,
    # transformers saves weights on rank 0 only).
    env["TPUGEN_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [TPUGEN, "generate", str(write_config(tmp_path / "c.yaml", config)), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    run_dir = tmp_path / "outputs" / "run"
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: rank 0: RuntimeError: failed on purpose after its first batch (TPUGEN_TEST_FAIL_RANK=0)"
    assert lines[-1] == f"error: resume with: tpugen resume {run_dir}"
    # Rank 0 made image 0 and failed before image 2; rank 1 made image 1: the images of a one-process cpu run.
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0, 1]
    assert_same_images(run_dir, cpu_run, OTHER_DEVICE_COUNT, reference_names(cpu_run, [0, 1]))
    assert list((tmp_path / "cache" / "models").glob("tiny-sd-*/text_encoder/model.safetensors"))

    events = [json.loads(line) for line in log.read_text().splitlines()]
    imports = [e for e in events if e["event"] == "import"]
    # The chip count (execution.cores: 0) and the two ranks; each saw the variable before importing torch.
    assert sorted(str(e["local_rank"]) for e in imports) == ["0", "1", "None"]
    assert all(e["TORCH_TPU_DEFER_AND_FUSE"] == "1" and not e["torch_already_imported"] for e in imports)
    chips = sorted((e["local_rank"], e["index"]) for e in events if e["event"] == "set_device_index")
    assert chips == [("0", 0), ("1", 1)]
    groups = sorted((e["backend"], e["rank"], e["size"]) for e in events if e["event"] == "process_group")
    assert groups == [("tpu_dist", 0, 2), ("tpu_dist", 1, 2)]

    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"].startswith("rank 0: RuntimeError")
    assert report["launcher"]["process_group"] == "tpu_dist" and report["launcher"]["processes"] == 2
    assert report["launcher"]["environment"]["TORCH_TPU_DEFER_AND_FUSE"] == "1"
    assert report["device"]["device"] == "tpu" and report["device"]["torch_tpu_mode"] == "defer_and_fuse"
    assert [(r["rank"], r["images"], r["error"] is None) for r in report["ranks"]] == [(0, 1, False), (1, 1, True)]


@pytest.mark.parametrize(
    "execution,fake,expected",
    [
        (
            {"backend": "cpu", "cores": 0},
            False,
            "error: execution.cores: mode multi on backend cpu starts that many rank processes; set it above 0",
        ),
        (
            {"backend": "torch_tpu"},
            False,
            "error: execution.backend: torch_tpu is not installed; install tpugen[torchtpu] in a venv of its own "
            "(TorchTPU needs torch >= 2.11, torch_xla needs 2.9)",
        ),
        (
            {"backend": "torch_tpu", "cores": 4},
            True,
            "error: execution.cores: 4 asked for, and execution.backend: torch_tpu sees 2 devices",
        ),
    ],
    ids=["cpu with cores 0", "torch_tpu not installed", "more cores than chips"],
)
def test_bad_multi_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, execution, fake, expected):
    if fake:
        monkeypatch.setenv("PYTHONPATH", str(FAKES))
        monkeypatch.setenv("FAKE_TORCH_TPU_CHIPS", "2")
    config = tiny_config(tmp_path, execution={"mode": "multi", **execution})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert (result.exit_code, result.stderr.splitlines()) == (2, [expected])
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
def test_sigterm_reaches_every_rank_process_and_resume_finishes_the_run(tmp_path):
    prompts = [f"a small {w}" for w in ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu", "ant", "cod"]]
    config = tiny_config(
        tmp_path, prompts=prompts, batch_size=1, steps=8, execution={"backend": "cpu", "mode": "multi", "cores": 2}
    )
    run_dir = tmp_path / "outputs" / "run"
    proc = subprocess.Popen(
        [TPUGEN, "generate", str(write_config(tmp_path / "c.yaml", config)), "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = sigterm_after_a_rank_image(proc, run_dir, 120)
    assert proc.returncode == 143, stderr
    assert stderr.splitlines()[-1] == f"error: resume with: tpugen resume {run_dir}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"] == "interrupted by SIGTERM"
    # Each rank process got the signal and stopped between batches, leaving its result.
    assert [(r["rank"], r["error"]) for r in report["ranks"]] == [
        (0, "interrupted by SIGTERM"),
        (1, "interrupted by SIGTERM"),
    ]
    kept = [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")]
    assert 1 <= len(kept) < len(prompts)
    assert sorted(p.name for p in run_dir.iterdir() if not p.name[0].isdigit()) == [
        "config.yaml",
        "grid.png",
        "manifest.jsonl",
        "report.json",
        "report.md",
        "run.json",
    ]

    result = run_cli("resume", run_dir, "--quiet")
    assert result.exit_code == 0, result.output
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [(r["index"], r["file"]) for r in records] == [
        (i, image_filename(i, 7 + i, p)) for i, p in enumerate(prompts)
    ]
    assert sorted(p.name for p in run_dir.glob("[0-9]*.png")) == [r["file"] for r in records]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is True and report["images_reused"] == len(kept)
    assert sum(r["images"] for r in report["ranks"]) == len(prompts) - len(kept)
