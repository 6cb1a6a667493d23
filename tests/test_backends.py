"""The other backends: torch.compile on the CPU for real; TorchTPU and CUDA through their seams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import generate, run_cli, tiny_config, write_config
from PIL import Image

from tpugen.backends import TorchTpuBackend
from tpugen.errors import InputError
from tpugen.pipeline import CompileSpec, apply_compile, compile_spec


@pytest.mark.parametrize(
    "backend,torch_compile,mode,offload,component,expected",
    [
        ("torch_tpu", False, "eager", False, "transformer", None),
        ("torch_tpu", False, "defer_and_fuse", False, "transformer", None),
        ("torch_tpu", False, "compile", False, "transformer", CompileSpec("transformer", "compile", "tpu")),
        (
            "torch_tpu",
            False,
            "compile",
            True,
            "transformer",
            CompileSpec("transformer", "compile_repeated_blocks", "tpu"),
        ),
        ("torch_tpu", False, "compile", False, "unet", CompileSpec("unet", "compile", "tpu")),
        ("cpu", True, "eager", False, "unet", CompileSpec("unet", "compile", "inductor")),
        ("cuda", True, "eager", True, "transformer", CompileSpec("transformer", "compile_repeated_blocks", "inductor")),
        ("cuda", False, "eager", False, "unet", None),
        ("xla", True, "eager", False, "unet", None),
    ],
)
def test_compile_spec(backend, torch_compile, mode, offload, component, expected):
    spec = compile_spec(backend, torch_compile=torch_compile, tpu_mode=mode, offload=offload, component=component)
    assert spec == expected


class Recorder:
    """A stand-in pipeline that records what tpugen does to it (the TorchTPU calls cannot run here)."""

    def __init__(self):
        self.calls = []
        recorder = self

        class Component:
            def __init__(self, name):
                self.name = name

            def compile(self, **kwargs):
                recorder.calls.append((f"{self.name}.compile", kwargs))

            def compile_repeated_blocks(self, **kwargs):
                recorder.calls.append((f"{self.name}.compile_repeated_blocks", kwargs))

        self.transformer = Component("transformer")

    def to(self, device):
        self.calls.append(("to", device))

    def enable_model_cpu_offload(self, device=None):
        self.calls.append(("enable_model_cpu_offload", device))


@pytest.fixture
def fake_torch_tpu(monkeypatch):
    """A torch_tpu module on a machine that claims a TPU: what tpugen imports and checks, recorded."""
    import torch

    module = types.ModuleType("torch_tpu")
    monkeypatch.setitem(sys.modules, "torch_tpu", module)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: types.SimpleNamespace(type="tpu"))
    return module


@pytest.mark.parametrize(
    "offload,expected",
    [
        (False, [("to", "tpu"), ("transformer.compile", {"backend": "tpu", "fullgraph": True, "dynamic": False})]),
        (
            True,
            [
                ("enable_model_cpu_offload", "tpu"),
                ("transformer.compile_repeated_blocks", {"backend": "tpu", "fullgraph": True, "dynamic": False}),
            ],
        ),
    ],
)
def test_torch_tpu_compile_mode_makes_the_guides_calls(fake_torch_tpu, offload, expected):
    backend = TorchTpuBackend("compile")
    pipe = Recorder()
    backend.place(pipe, offload=offload)
    apply_compile(
        pipe,
        compile_spec(backend.name, torch_compile=False, tpu_mode="compile", offload=offload, component="transformer"),
    )
    assert pipe.calls == expected
    assert backend.describe()["torch_tpu_mode"] == "compile"


def test_torch_tpu_eager_moves_to_tpu_and_compiles_nothing(fake_torch_tpu):
    backend = TorchTpuBackend("eager")
    pipe = Recorder()
    backend.place(pipe)
    apply_compile(
        pipe, compile_spec(backend.name, torch_compile=False, tpu_mode="eager", offload=False, component="transformer")
    )
    assert pipe.calls == [("to", "tpu")]
    assert backend.describe()["environment"] == {}


def test_defer_and_fuse_refuses_to_start_without_its_variable(fake_torch_tpu, monkeypatch):
    monkeypatch.delenv("TORCH_TPU_DEFER_AND_FUSE", raising=False)
    with pytest.raises(Exception, match="TORCH_TPU_DEFER_AND_FUSE=1 must be set before torch is imported"):
        TorchTpuBackend("defer_and_fuse")
    monkeypatch.setenv("TORCH_TPU_DEFER_AND_FUSE", "1")
    assert TorchTpuBackend("defer_and_fuse").describe()["environment"] == {"TORCH_TPU_DEFER_AND_FUSE": "1"}


def test_no_tpu_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tpu", types.ModuleType("torch_tpu"))
    with pytest.raises(InputError, match="^execution.backend: torch_tpu found no TPU on this machine$"):
        TorchTpuBackend("eager")


def test_torch_tpu_not_installed_names_the_extra(tmp_path):
    config = tiny_config(tmp_path, execution={"backend": "torch_tpu"})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: execution.backend: torch_tpu is not installed; install tpugen[torchtpu] in a venv of its own "
        "(TorchTPU needs torch >= 2.11, torch_xla needs 2.9)\n"
    )
    assert not (tmp_path / "outputs").exists()


def test_defer_and_fuse_is_set_before_torch_is_imported(tmp_path):
    config = tiny_config(tmp_path, execution={"backend": "torch_tpu", "torch_tpu": {"mode": "defer_and_fuse"}})
    path = write_config(tmp_path / "c.yaml", config)
    # An audit hook sees the first `import torch` of the process that tpugen runs in, and the variable then.
    code = (
        "import os, sys\n"
        "seen = []\n"
        "sys.addaudithook(lambda e, a: seen.append(os.environ.get('TORCH_TPU_DEFER_AND_FUSE')) "
        "if e == 'import' and a[0] == 'torch' and not seen else None)\n"
        "from tpugen.cli import app\n"
        f"try:\n    app(['generate', {str(path)!r}, '--quiet'])\n"
        "except SystemExit as exit:\n    print('exit', exit.code)\n"
        "print('torch imported with', seen[:1])\n"
    )
    # A torch_tpu that, like the real one, imports torch when it is imported.
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "torch_tpu.py").write_text("import torch\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_DEFER_AND_FUSE"}
    env["PYTHONPATH"] = str(tmp_path / "fake")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.stdout.splitlines()[-2:] == ["exit 2", "torch imported with ['1']"], proc.stderr
    assert proc.stderr == "error: execution.backend: torch_tpu found no TPU on this machine\n"


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    config = tiny_config(tmp_path, execution={"backend": "cuda"})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2
    assert (
        result.stderr == "error: execution.backend: cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)\n"
    )


def test_cpu_torch_compile_compiles_in_warmup_only_and_matches_eager(cpu_run, tmp_path):
    run_dir = generate(tmp_path, execution={"backend": "cpu"}, compile={"torch_compile": True})
    report = json.loads((run_dir / "report.json").read_text())
    (warm,) = report["warmup"]
    assert warm["compiles"] >= 1 and warm["graphs_per_phase"]["first denoising step"] >= 1
    assert report["compiles_after_warmup"] == 0
    assert [b["compiles"] for b in report["timed_phase"]["batches"]] == [0, 0]
    for png in sorted(cpu_run.glob("[0-9]*.png")):
        a = np.asarray(Image.open(run_dir / png.name), dtype=np.float64)
        b = np.asarray(Image.open(png), dtype=np.float64)
        assert np.abs(a - b).mean() <= 2.0, png.name


def test_compile_options_are_checked_against_the_backend(tmp_path):
    config = tiny_config(tmp_path, compile={"torch_compile": True}, execution={"backend": "xla"})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: compile.torch_compile: is for the cpu and cuda backends; xla compiles through torch_xla, "
        "and torch_tpu compiles with execution.torch_tpu.mode: compile",
    ]
