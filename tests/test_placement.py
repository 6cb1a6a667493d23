"""Models bigger than a chip without SPMD: whole components on different devices, or offloaded to the host."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from conftest import (
    OTHER_DEVICE_COUNT,
    SAME_SETUP,
    assert_same_images,
    forked_python,
    generate,
    run_cli,
    tiny_config,
    write_config,
)

from tpugen.errors import InputError
from tpugen.placement import assign_components

GB = 1e9


def test_greedy_placement_puts_the_biggest_first_on_the_freest_chip():
    sizes = {"transformer": 24 * GB, "text_encoder_2": 9 * GB, "text_encoder": 0.25 * GB, "vae": 0.17 * GB}
    # FLUX.1-dev in bfloat16 over four 32 GB chips: the transformer alone on one, T5 on the next, and so on.
    assert assign_components(sizes, [32 * GB] * 4) == {
        "text_encoder": 2,
        "text_encoder_2": 1,
        "transformer": 0,
        "vae": 3,
    }
    # Two chips: the small ones join T5, which leaves more room than the transformer's chip.
    assert assign_components(sizes, [32 * GB] * 2) == {
        "text_encoder": 1,
        "text_encoder_2": 1,
        "transformer": 0,
        "vae": 1,
    }


def test_explicit_placement_is_kept_and_the_rest_placed_around_it():
    sizes = {"unet": 3 * GB, "text_encoder": 1 * GB, "vae": 0.2 * GB}
    assert assign_components(sizes, [16 * GB, 16 * GB], {"unet": 1}) == {"text_encoder": 0, "unet": 1, "vae": 0}


@pytest.mark.parametrize(
    "sizes,capacities,explicit,expected",
    [
        (
            {"unet": 1 * GB, "vae": 1 * GB},
            [16 * GB, 16 * GB],
            {"vae": 2, "text_encoder_9": 0},
            [
                "execution.placement.vae: chip 2 does not exist; this machine has 2 (0 to 1)",
                "execution.placement.text_encoder_9: the model has no such component (it has unet, vae)",
            ],
        ),
        (
            {"transformer": 24 * GB, "text_encoder_2": 9 * GB},
            [16 * GB, 16 * GB],
            None,
            [
                "execution.placement: chip 0 would hold transformer (28.8 GB with headroom) but has 16 GB; no "
                "placement over 2 chips fits: use execution.sharding: spmd or execution.offload: model"
            ],
        ),
    ],
)
def test_impossible_placements_name_the_problem(sizes, capacities, explicit, expected):
    with pytest.raises(InputError) as error:
        assign_components(sizes, capacities, explicit)
    assert error.value.lines == expected


@pytest.mark.parametrize(
    "execution,expected",
    [
        ({"backend": "cpu", "placement": "auto"}, ["execution.placement: needs execution.backend: xla, not cpu"]),
        (
            {"placement": {"unet": -1}},
            [
                "execution.placement: must be none, auto, or a mapping of component to chip index such as "
                "{text_encoder: 1, unet: 0}, got {'unet': -1}"
            ],
        ),
        (
            {"placement": {"unet": 0}, "offload": "model"},
            ["execution.placement: and execution.offload: model exclude each other; choose one way to use the chips"],
        ),
        (
            {"placement": "auto", "mode": "multi"},
            ["execution.placement: and execution.mode: multi exclude each other; choose one way to use the chips"],
        ),
        (
            {"placement": "auto", "sharding": "spmd"},
            ["execution.placement: and execution.sharding: spmd exclude each other; choose one way to use the chips"],
        ),
        (
            {"offload": "model", "backend": "cpu"},
            ["execution.offload: model moves components onto an accelerator; the cpu backend has none"],
        ),
    ],
)
def test_bad_placement_configs(tmp_path, execution, expected):
    result = run_cli("generate", write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution=execution)))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {line}" for line in expected]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
def test_a_model_that_fits_no_chip_stops_before_its_weights_load(tmp_path):
    config = tiny_config(tmp_path, execution={"placement": "auto", "chip_memory_gb": 0.0001})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2, result.output
    last = result.stderr.splitlines()[-1]  # a library may warn on stderr the first time it is imported
    assert last.startswith("error: execution.placement: chip 0 would hold unet, vae, text_encoder (0.00")
    assert last.endswith(
        "but has 0.0001 GB; no placement over 1 chips fits: use execution.sharding: spmd or execution.offload: model"
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
def test_offload_on_xla_gives_the_same_images_without_recompiles(tmp_path, xla_run):
    run = generate(tmp_path, execution={"offload": "model"})
    report = json.loads((run / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    # Weights go back to the host after each component has run: many more reads than the one per batch.
    assert report["xla_counters"]["timed_phase"]["transfers_to_host"] > 10 * report["batches"]
    phases = report["warmup"][0]["device_memory_per_phase"]
    assert set(phases) == {"text encoding", "first denoising step", "later denoising steps", "decoding"}
    assert "Device memory per phase: n/a (GetAllocatorStats is not supported)" in (run / "report.md").read_text()
    assert_same_images(run, xla_run, SAME_SETUP)


# Placement needs 2 devices, fixed when XLA starts: its runs get a process of their own.
_PLACED_RUNS = textwrap.dedent(
    """
    import sys
    from typer.testing import CliRunner
    from tpugen.cli import app

    config = sys.argv[1]
    for run_id, placement in [("auto", ["execution.placement=auto"]),
                              ("explicit", ["execution.placement={unet: 1, vae: 1}"]),
                              ("missing", ["execution.placement={vae: 2}"])]:
        result = CliRunner().invoke(app, ["generate", config, "--quiet", f"output.run_id={run_id}",
                                          "execution.cores=2", *placement])
        print(run_id, result.exit_code, result.stderr.strip())
    """
)


@pytest.mark.xla
def test_components_on_two_devices_give_the_single_device_images(tmp_path, xla_run):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.run(
        [*forked_python(), "-c", _PLACED_RUNS, str(config)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.rstrip() for line in proc.stdout.splitlines()] == [
        "auto 0",
        "explicit 0",
        "missing 2 error: execution.placement.vae: chip 2 does not exist; this machine has 2 (0 to 1)",
    ]
    assert not (tmp_path / "outputs" / "missing").exists()
    expected = {
        "auto": {"text_encoder": "xla:1", "unet": "xla:0", "vae": "xla:1"},
        "explicit": {"text_encoder": "xla:0", "unet": "xla:1", "vae": "xla:1"},
    }
    for run_id, placement in expected.items():
        run = tmp_path / "outputs" / run_id
        report = json.loads((run / "report.json").read_text())
        assert report["device"]["placement"] == placement
        assert report["compiles_after_warmup"] == 0
        assert "- placement: text_encoder on" in (run / "report.md").read_text()
        assert_same_images(run, xla_run, OTHER_DEVICE_COUNT)


def test_out_of_memory_advice_follows_the_config():
    from tpugen.config import ExecutionConfig
    from tpugen.memory import is_out_of_memory, out_of_memory_advice

    assert is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer: 2.1G"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not is_out_of_memory(RuntimeError("shapes cannot be multiplied")) and not is_out_of_memory(MemoryError())
    plan = "; `tpugen plan CONFIG` shows each component's size against the chip"
    assert out_of_memory_advice(ExecutionConfig(), 1, "bfloat16") == (
        "try execution.offload: model (one component on the chip at a time); execution.sharding: spmd (split the "
        "weights over the VM's chips); execution.placement: auto (components on different chips)" + plan
    )
    spmd = ExecutionConfig(sharding="spmd", mesh={"data": 2})
    assert out_of_memory_advice(spmd, 4, "float32") == (
        "try model.dtype: bfloat16 (half the bytes of float32); a smaller execution.mesh.data, so more chips split "
        "each weight; a smaller batch_size" + plan
    )
    assert out_of_memory_advice(ExecutionConfig(offload="model"), 1, "bfloat16") == (
        "try a bigger chip (execution.chip)" + plan
    )


@pytest.mark.parametrize(
    "target,running",
    [("transformers.CLIPTextModel.forward", "text encoders"), ("diffusers.UNet2DConditionModel.forward", "unet")],
)
@pytest.mark.xla
def test_out_of_memory_on_the_device_names_the_component(tmp_path, monkeypatch, target, running):
    import importlib

    module_name, class_name, method = target.rsplit(".", 2)
    owner = getattr(importlib.import_module(module_name), class_name)

    def exhausted(*args, **kwargs):
        raise RuntimeError("Bad StatusOr access: RESOURCE_EXHAUSTED: Error allocating device buffer: 15.8G")

    monkeypatch.setattr(owner, method, exhausted)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution={"backend": "cpu"}))
    result = run_cli("generate", config, "--quiet")
    assert result.exit_code == 1, result.output
    first = [line for line in result.stderr.splitlines() if line.startswith("error: ")][0]
    assert first == (
        f"error: out of memory on the device while the {running} ran (64x64 b2 cfg): try model.dtype: bfloat16 "
        "(half the bytes of float32); execution.offload: model (one component on the chip at a time); "
        "execution.sharding: spmd (split the weights over the VM's chips); execution.placement: auto (components "
        "on different chips); a smaller batch_size; `tpugen plan CONFIG` shows each component's size against the chip"
    )
