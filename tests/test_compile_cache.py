"""The persistent compile cache, measured across two processes on XLA:CPU (where it cannot hit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config, write_config

pytestmark = pytest.mark.xla


def _generate_in_new_process(config_path: Path, run_id: str) -> dict:
    tpugen = Path(sys.executable).parent / "tpugen"
    proc = subprocess.run(
        [str(tpugen), "generate", str(config_path), "--quiet", f"output.run_id={run_id}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads((config_path.parent / "outputs" / run_id / "report.json").read_text())


def test_cache_writes_entries_but_a_new_cpu_process_cannot_load_them(tmp_path):
    cache_dir = tmp_path / "xla-cache"
    config = tiny_config(
        tmp_path, prompts=["one"], batch_size=1, steps=1, cache={"enabled": True, "dir": str(cache_dir)}
    )
    path = write_config(tmp_path / "c.yaml", config)

    first = _generate_in_new_process(path, "first")
    cache = first["persistent_cache"]
    assert cache["enabled"] is True and cache["dir"] == str(cache_dir / "cpu-process0")
    assert (cache["hits"], cache["misses"], cache["load_failures"]) == (0, 3, 0)
    assert len(list((cache_dir / "cpu-process0").iterdir())) == 3

    second = _generate_in_new_process(path, "second")
    cache = second["persistent_cache"]
    # XLA:CPU cannot deserialize executables: every entry fails to load and compiles again. Reported as such.
    assert (cache["hits"], cache["misses"], cache["load_failures"]) == (0, 0, 3)
    assert second["warmup"][0]["compiles"] == 3
    assert "entries that could not be loaded" in (tmp_path / "outputs" / "second" / "report.md").read_text()


def test_auto_leaves_the_cache_off_on_cpu_and_says_why(xla_run):
    report = json.loads((xla_run / "report.json").read_text())
    cache = report["persistent_cache"]
    assert cache["enabled"] is False and cache["dir"] is None
    assert cache["note"].startswith("off: XLA:CPU cannot load serialized executables")
