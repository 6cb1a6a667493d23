"""The CLI starts without the ML stack: --help, validate and plan never import torch_xla or diffusers."""

from __future__ import annotations

import subprocess
import sys

from conftest import run_cli, tiny_config, write_config


def test_import_cli_loads_no_ml_stack():
    code = (
        "import sys, tpugen.cli; "
        "print(','.join(m for m in ('torch', 'torch_xla', 'diffusers', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.exit_code == 0
    for command in ("generate", "validate", "plan"):
        assert command in result.stdout


def test_plan_prints_shape_keys_without_loading_a_model(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, batch_size=2))
    result = run_cli("plan", path, "height=96")
    assert result.exit_code == 0, result.output
    assert "96x64 b2 cfg" in result.stdout
    assert "3 images in 2 batches" in result.stdout
    assert not (tmp_path / "outputs").exists()
