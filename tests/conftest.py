"""Shared fixtures: one tiny-sd build and one set of XLA:CPU compiles for the whole session."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# Before anything imports torch_xla: tests always run on XLA:CPU, with a cache of their own.
os.environ["PJRT_DEVICE"] = "CPU"
os.environ.setdefault("TPUGEN_CACHE", tempfile.mkdtemp(prefix="tpugen-test-cache-"))

import pytest  # noqa: E402
import yaml  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tpugen.cli import app  # noqa: E402

PROMPTS = [
    "a lighthouse on a cliff at dawn, oil painting",
    "a red fox in fresh snow",
    "an astronaut riding a horse",
]


def tiny_config(tmp: Path, **overrides) -> dict:
    """The smallest config that still exercises batching, padding, CFG and negative prompts."""
    config = {
        "model": {"id": "tiny-sd", "dtype": "float32"},
        "prompts": list(PROMPTS),
        "negative_prompt": "blurry",
        "height": 64,
        "width": 64,
        "steps": 3,
        "guidance_scale": 7.5,
        "seed": 7,
        "batch_size": 2,
        "execution": {"backend": "xla"},
        "output": {"dir": str(tmp / "outputs"), "run_id": "run"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def generate(tmp: Path, **overrides) -> Path:
    """Run `tpugen generate` in this process on a tiny config; returns the run directory."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tmp, **overrides)
    path = write_config(tmp / "run.yaml", config)
    result = run_cli("generate", path, "--quiet")
    assert result.exit_code == 0, result.output
    return Path(config["output"]["dir"]) / config["output"]["run_id"]


@pytest.fixture(scope="session")
def xla_run(tmp_path_factory) -> Path:
    """The reference XLA run: 3 prompts at batch 2 (one padded batch), 3 steps, CFG on."""
    return generate(tmp_path_factory.mktemp("xla"))


@pytest.fixture(scope="session")
def cpu_run(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("cpu"), execution={"backend": "cpu"})


def sigterm_after_a_rank_image(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """Wait until some rank has written a manifest line, send SIGTERM, and return stderr once it exits."""
    deadline = time.perf_counter() + timeout
    while not any(p.stat().st_size for p in run_dir.glob("manifest.rank*.jsonl")):
        assert proc.poll() is None and time.perf_counter() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout)[1]
