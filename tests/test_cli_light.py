"""The CLI starts without the ML stack: --help, validate and plan never import torch_xla or diffusers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, tiny_config, write_config

ROOT = Path(__file__).parent.parent


def test_import_cli_loads_no_ml_stack_no_jax_and_no_ray():
    code = (
        "import sys, tpugen.cli; "
        "print(','.join(m for m in ('torch', 'torch_xla', 'jax', 'torchax', 'diffusers', 'transformers', 'ray') if m in sys.modules))"
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


def test_generate_plan_prints_what_plan_prints(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, batch_size=2))
    plan, generate = run_cli("plan", path), run_cli("generate", path, "--plan")
    assert plan.exit_code == generate.exit_code == 0, generate.output
    assert generate.stdout == plan.stdout and "fits one v5e chip" in generate.stdout  # the memory plan too
    assert not (tmp_path / "outputs").exists()


def test_plan_of_a_hub_model_starts_no_device_stack(tmp_path):
    code = (
        "import sys; from typer.testing import CliRunner; from tpugen.cli import app; "
        "result = CliRunner().invoke(app, ['plan', 'configs/flux-schnell.yaml']); "
        "print(result.exit_code, 'torch_xla' in sys.modules); print(result.stdout, file=sys.stderr)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    for attempt in ("cold", "warm"):  # the second plan reads the parameter counts tpugen kept
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**env, "TPUGEN_CACHE": str(tmp_path / "cache")},
        )
        assert proc.stdout.split() == ["0", "False"], (attempt, proc.stderr)
        assert "PJRT" not in proc.stderr and "transformer" in proc.stderr


def test_what_server_cannot_mean_is_refused_before_anything_is_sent(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    for url in ("localhost:7860", "notaurl", "http://127.0.0.1:x", "ftp://127.0.0.1:7860"):
        result = run_cli("generate", path, "--server", url)
        assert result.exit_code == 2, result.output
        assert result.stderr == f"error: --server: give the server's URL, like http://HOST:PORT; got {url!r}\n"
    result = run_cli("generate", path, "--server", "http://127.0.0.1:9", "--resume", tmp_path, "--skip-warmup")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: --resume: a server's runs are resumed on the server; leave --resume out with --server",
        "error: --skip-warmup: a server is warm already; leave it out with --server",
    ]
    assert not (tmp_path / "outputs").exists()


def test_plan_counts_the_largest_attention_matrix_beside_the_weights(tmp_path):
    """Weights of a few MB "fit"; at 4096x4096 one unfused attention layer of the tiny UNet needs 550 GB."""
    from tpugen import app
    from tpugen.config import load_config

    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, batch_size=2))
    assert app.plan(load_config(path)).fit == "fits"
    view = app.plan(load_config(path, ["height=4096", "width=4096"]))
    assert view.attention["gb"] == pytest.approx(4 * 8 * 65536**2 * 4 / 1e9)  # 2 rows, doubled by CFG
    assert view.fit == (
        f"does not fit: the weights ({view.memory.total_bytes / 1e9:.2f} GB) and the largest attention matrix "
        "(549.76 GB per layer) are over the v5e's 16 GB; use a smaller size or batch, or flash attention "
        "(compile.flash_attention)"
    )
    # What ControlNets hand the denoiser is held beside the weights too (tpugen.memory.controlnet_activations).
    small = app.plan(load_config(path))
    run = load_config(path)
    residuals = {"bytes": 20e9}
    assert app.attention_fit(small.memory, None, run.config.execution, flash_route=True, controlnets=residuals) == (
        f"does not fit: the weights ({small.memory.total_bytes / 1e9:.2f} GB) and the ControlNets' residuals "
        "(20.00 GB) are over the v5e's 16 GB; use a smaller size or batch"
    )
    assert (
        app.attention_fit(small.memory, None, run.config.execution, flash_route=True, controlnets={"bytes": 1e6})
        is None
    )


def test_every_execution_mode_is_one_mode_of_the_registry():
    import typing

    from tpugen.config.schema import ExecutionConfig
    from tpugen.modes import MODES

    modes = typing.get_args(ExecutionConfig.model_fields["mode"].annotation)
    assert sorted(MODES) == sorted(modes)
    assert all(mode.name == name and callable(mode.run) for name, mode in MODES.items())


def test_skip_warmup_in_multi_mode_is_refused_in_one_line(tmp_path):
    from conftest import run_cli, tiny_config, write_config

    config = tiny_config(tmp_path, execution={"mode": "multi", "backend": "cpu", "cores": 2})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--skip-warmup", "--quiet")
    assert result.exit_code == 2
    assert result.stderr == "error: --skip-warmup: execution.mode: multi warms every rank up first; leave it out\n"
    assert not (tmp_path / "outputs").exists()


def test_every_environment_variable_is_in_the_settings_and_the_docs():
    """The variables tpugen reads are listed once (tpugen.settings) and the docs' environment page (generated from
    it) names each of them; outside the settings and the device seam no module reads tpugen's or the hub's
    variables itself."""
    import re
    from pathlib import Path

    from tpugen.settings import VARIABLES

    root = Path(__file__).resolve().parent.parent
    table = root.joinpath("docs", "reference", "environment.md").read_text()
    assert {v.name for v in VARIABLES} <= set(re.findall(r"`([A-Z_]+)(?:=1)?`", table))
    own = ("TPUGEN_CACHE", "TPUGEN_DEBUG", "HF_HUB_OFFLINE", "HF_TOKEN")
    readers = [
        f"{path.relative_to(root)}:{n}"
        for path in (root / "tpugen").rglob("*.py")
        if path.name != "settings.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "environ" in line and any(f'"{name}"' in line for name in own)
    ]
    assert readers == []
