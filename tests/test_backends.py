"""The other backends: torch.compile on the CPU for real; TorchTPU and CUDA through their seams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import (
    COMPILED_VS_EAGER,
    FAKES,
    TPUGEN,
    assert_same_images,
    cut_last_image,
    generate,
    run_cli,
    tiny_config,
    write_config,
)

from tpugen.backends.compile import CompileSpec, compile_spec
from tpugen.backends.torch_tpu import TorchTpuBackend
from tpugen.config import CompileConfig
from tpugen.engine.hooks import Hooks
from tpugen.errors import InputError
from tpugen.families import family as family_code


@pytest.mark.parametrize(
    "backend,torch_compile,mode,offload,expected",
    [
        ("torch_tpu", False, "eager", False, None),
        ("torch_tpu", False, "defer_and_fuse", False, None),
        ("torch_tpu", False, "compile", False, CompileSpec("compile", "tpu")),
        ("torch_tpu", False, "compile", True, CompileSpec("compile_repeated_blocks", "tpu")),
        ("cpu", True, "eager", False, CompileSpec("compile", "inductor")),
        ("cuda", True, "eager", True, CompileSpec("compile_repeated_blocks", "inductor")),
        ("cuda", False, "eager", False, None),
        ("xla", True, "eager", False, None),
    ],
)
def test_compile_spec(backend, torch_compile, mode, offload, expected):
    assert compile_spec(backend, torch_compile=torch_compile, tpu_mode=mode, offload=offload) == expected


class Recorder:
    """A stand-in pipeline that records what tpugen does to it (the TorchTPU calls cannot run here)."""

    def __init__(self):
        import torch

        self.calls = []
        recorder = self

        class Denoiser(torch.nn.Module):
            def compile(self, **kwargs):
                recorder.calls.append(("transformer.compile", kwargs))

            def compile_repeated_blocks(self, **kwargs):
                recorder.calls.append(("transformer.compile_repeated_blocks", kwargs))

        self.transformer = Denoiser()

    def to(self, device):
        self.calls.append(("to", device))

    def enable_model_cpu_offload(self, device=None):
        self.calls.append(("enable_model_cpu_offload", device))


@pytest.fixture
def fake_torch_tpu(monkeypatch):
    """tests/fakes/torch_tpu, the one TorchTPU fake, installed in this process for one test and undone."""
    import importlib.util

    monkeypatch.setenv("FAKE_TORCH_TPU_MANUAL", "1")
    spec = importlib.util.spec_from_file_location("torch_tpu", FAKES / "torch_tpu" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("FAKE_TORCH_TPU_MANUAL")
    monkeypatch.setitem(sys.modules, "torch_tpu", module)
    module.install(monkeypatch.setattr)
    return module


def torch_tpu_backend(mode: str, offload: bool = False) -> TorchTpuBackend:
    return TorchTpuBackend(
        mode, compile_spec=compile_spec("torch_tpu", torch_compile=False, tpu_mode=mode, offload=offload)
    )


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
def test_torch_tpu_compile_mode_makes_the_guides_calls(fake_torch_tpu, offload, expected, monkeypatch):
    import tpugen.backends.torch_tpu

    swapped = []
    monkeypatch.setattr(
        tpugen.backends.torch_tpu, "use_plain_attention", lambda module, hooks: swapped.append(module) or {}
    )
    backend = torch_tpu_backend("compile", offload)
    pipe, flux, hooks = Recorder(), family_code("flux"), Hooks()
    backend.place(pipe, offload=offload, family=flux)
    backend.prepare_on_device(pipe, flux, CompileConfig(), hooks)
    assert pipe.calls == expected
    assert swapped == [pipe.transformer]  # the plain attention processors first (tested on a real UNet below)
    assert hooks.names() == ["torch.compile"]
    assert backend.describe()["torch_tpu_mode"] == "compile"


def test_torch_tpu_eager_moves_to_tpu_and_compiles_nothing(fake_torch_tpu):
    backend = torch_tpu_backend("eager")
    pipe, hooks = Recorder(), Hooks()
    backend.place(pipe, offload=False, family=family_code("flux"))
    backend.prepare_on_device(pipe, family_code("flux"), CompileConfig(), hooks)
    assert pipe.calls == [("to", "tpu")] and hooks.names() == []
    assert backend.describe()["environment"] == {}


@pytest.mark.xla
def test_plain_attention_replaces_sdpa_processors_and_its_removal_restores_them():
    from diffusers import DiffusionPipeline
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from tpugen.backends.torch_tpu import use_plain_attention
    from tpugen.tiny import builtin_path

    unet = DiffusionPipeline.from_pretrained(str(builtin_path("tiny-sd"))).unet
    before = {name: type(p) for name, p in unet.attn_processors.items()}
    assert set(before.values()) == {AttnProcessor2_0}
    hooks = Hooks()
    counts = use_plain_attention(unet, hooks)
    assert counts == {"AttnProcessor2_0 -> AttnProcessor": len(before)}
    assert {type(p) for p in unet.attn_processors.values()} == {AttnProcessor}
    hooks.remove_all()
    assert {name: type(p) for name, p in unet.attn_processors.items()} == before


def test_defer_and_fuse_refuses_to_start_without_its_variable(fake_torch_tpu, monkeypatch):
    monkeypatch.delenv("TORCH_TPU_DEFER_AND_FUSE", raising=False)
    with pytest.raises(Exception, match="TORCH_TPU_DEFER_AND_FUSE=1 must be set before torch is imported"):
        TorchTpuBackend("defer_and_fuse")
    monkeypatch.setenv("TORCH_TPU_DEFER_AND_FUSE", "1")
    assert TorchTpuBackend("defer_and_fuse").describe()["environment"] == {"TORCH_TPU_DEFER_AND_FUSE": "1"}


def test_no_tpu_is_one_line(monkeypatch):
    # An installed torch_tpu on a machine without a TPU registers no "tpu" device (FACTS.md).
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


@pytest.mark.xla
@pytest.mark.parametrize("command", ["generate", "warmup", "resume"])
def test_every_command_sets_defer_and_fuse_before_torch_is_imported(tmp_path, command):
    config = tiny_config(
        tmp_path,
        prompts=["a cat"],
        steps=2,
        execution={"backend": "torch_tpu", "torch_tpu": {"mode": "defer_and_fuse"}},
    )
    path = write_config(tmp_path / "c.yaml", config)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_DEFER_AND_FUSE"}
    env["PYTHONPATH"] = str(FAKES)  # the fake TorchTPU, like the real one, imports torch when it is imported
    run_dir = tmp_path / "outputs" / "run"
    arguments = {
        "generate": ["generate", str(path)],
        "warmup": ["warmup", str(path)],
        "resume": ["resume", str(run_dir)],
    }
    if command == "resume":  # a run that stopped before its only image
        made = subprocess.run([TPUGEN, "generate", str(path), "--quiet"], capture_output=True, text=True, env=env)
        assert made.returncode == 0, made.stderr
        cut_last_image(run_dir)
    # An audit hook sees the first `import torch` of the process that tpugen runs in, and the variable then. A
    # warmup's process ends there (what it would go on to do is a generate's, checked whole above and below).
    code = (
        "import os, sys\n"
        "seen = []\n"
        "def hook(event, args):\n"
        "    if event != 'import' or args[0] != 'torch' or seen:\n"
        "        return\n"
        "    seen.append(os.environ.get('TORCH_TPU_DEFER_AND_FUSE'))\n"
        f"    if {command == 'warmup'!r}:\n"
        "        print('stopped at the import'); print('torch imported with', seen); sys.stdout.flush(); os._exit(0)\n"
        "sys.addaudithook(hook)\n"
        "from tpugen.cli import app\n"
        f"try:\n    app({[*arguments[command], '--quiet']!r})\n"
        "except SystemExit as exit:\n    print('exit', exit.code)\n"
        "print('torch imported with', seen[:1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    ended = "stopped at the import" if command == "warmup" else "exit 0"
    assert proc.stdout.splitlines()[-2:] == [ended, "torch imported with ['1']"], proc.stderr
    if command != "warmup":
        report = json.loads((run_dir / "report.json").read_text())
        assert report["complete"] and report["device"]["environment"] == {
            "TORCH_TPU_DEFER_AND_FUSE": "1",
            # TorchTPU's persistent cache is on by default, in tpugen's cache
            "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": str(Path(os.environ["TPUGEN_CACHE"]) / "torch_tpu"),
        }


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    config = tiny_config(tmp_path, execution={"backend": "cuda"})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2
    assert (
        result.stderr == "error: execution.backend: cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)\n"
    )


@pytest.mark.xla
def test_cpu_torch_compile_compiles_in_warmup_only_and_matches_eager(cpu_run, tmp_path):
    run_dir = generate(tmp_path, execution={"backend": "cpu"}, compile={"torch_compile": True})
    report = json.loads((run_dir / "report.json").read_text())
    (warm,) = report["warmup"]
    assert warm["compiles"] >= 1 and warm["graphs_per_phase"]["first denoising step"] >= 1
    assert report["compiles_after_warmup"] == 0
    assert [b["compiles"] for b in report["timed_phase"]["batches"]] == [0, 0]
    assert_same_images(run_dir, cpu_run, COMPILED_VS_EAGER)


def test_compile_options_are_checked_against_the_backend(tmp_path):
    config = tiny_config(tmp_path, compile={"torch_compile": True}, execution={"backend": "xla"})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: compile.torch_compile: is for the cpu and cuda backends; xla compiles through torch_xla, "
        "and torch_tpu compiles with execution.torch_tpu.mode: compile",
    ]


@pytest.mark.xla
def test_torch_tpu_keeps_its_persistent_cache_where_cache_dir_says(tmp_path):
    """TorchTPU reads its compiled programs back across processes (torch_xla 2.9 cannot on a TPU): tpugen sets
    TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT before torch is imported, and the report gives the cache's counts."""
    log = tmp_path / "torch_tpu.log"
    config = tiny_config(
        tmp_path,
        prompts=["a cat"],
        steps=2,
        batch_size=1,
        execution={"backend": "torch_tpu"},
        cache={"dir": str(tmp_path / "compiled")},
    )
    path = write_config(tmp_path / "c.yaml", config)
    env = {**os.environ, "PYTHONPATH": str(FAKES), "FAKE_TORCH_TPU_LOG": str(log)}
    env.pop("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", None)
    proc = subprocess.run([TPUGEN, "generate", str(path), "--quiet"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    imports = [json.loads(line) for line in log.read_text().splitlines() if '"import"' in line]
    assert imports[0]["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == str(tmp_path / "compiled")
    assert not imports[0]["torch_already_imported"]
    report = json.loads((tmp_path / "outputs" / "run" / "report.json").read_text())
    assert report["device"]["compile_cache"] == {
        "enabled": True,
        "dir": str(tmp_path / "compiled"),
        "stats": {"hits": 0, "requests": 0},
        "note": "on",
    }


def test_a_gs_cache_is_for_jax_and_torch_tpu_only(tmp_path):
    config = tiny_config(tmp_path, cache={"dir": "gs://bucket/cache"})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == (
        "error: cache.dir: 'gs://bucket/cache': a gs:// cache is for execution.backend: jax or torch_tpu; "
        "torch_xla's cache is a local directory\n"
    )
    for backend in ("torch_tpu", "jax"):
        config["execution"] = {"backend": backend}
        assert run_cli("validate", write_config(tmp_path / "c.yaml", config)).exit_code == 0
