"""execution.sharding: spmd: the rule tables, the bad meshes, and real SPMD runs over 4 XLA:CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from conftest import OTHER_DEVICE_COUNT, assert_same_images, forked_python, generate, run_cli, tiny_config, write_config

from tpugen.errors import InputError
from tpugen.families import family as family_code
from tpugen.sharding import mesh_shape, plan_sharding


@pytest.fixture(scope="module")
def host_pipelines():
    """The built-in tiny pipelines on the host (no device): the rule tables only read names and shapes."""
    from diffusers import DiffusionPipeline

    from tpugen.tiny import builtin_path

    return {
        name: DiffusionPipeline.from_pretrained(str(builtin_path(name)))
        for name in ("tiny-flux", "tiny-sd3", "tiny-sd")
    }


# Each family's denoiser rules (tpugen.families), beside the text-encoder rules every family shares.
RULES = {
    name: family_code(family).denoiser_rules
    for name, family in [("tiny-flux", "flux"), ("tiny-sd3", "sd3"), ("tiny-sd", "sd")]
}


def _specs(plan, component: str) -> dict:
    return {p.parameter: p.spec for p in plan.parameters if p.component == component}


@pytest.mark.xla
def test_flux_rules_split_attention_and_mlp_pairs(host_pipelines):
    plan = plan_sharding(host_pipelines["tiny-flux"], 4, RULES["tiny-flux"])
    specs = _specs(plan, "transformer")
    block = "transformer_blocks.0."
    assert specs[block + "attn.to_q.weight"] == ("model", None)
    assert specs[block + "attn.to_q.bias"] == ("model",)
    assert specs[block + "attn.to_out.0.weight"] == (None, "model")
    assert block + "attn.to_out.0.bias" not in specs  # a row-wise layer's bias is added after the reduction
    assert specs[block + "ff_context.net.0.proj.weight"] == ("model", None)
    assert specs[block + "ff_context.net.2.weight"] == (None, "model")
    assert specs["single_transformer_blocks.1.proj_mlp.weight"] == ("model", None)
    assert specs["single_transformer_blocks.1.proj_out.weight"] == (None, "model")
    assert "proj_out.weight" not in specs and "x_embedder.weight" not in specs  # the ends stay whole
    # The small text encoders and the VAE are copied whole to every device.
    assert {p.component for p in plan.parameters} == {"transformer"}
    assert plan.components["text_encoder_2"]["decision"] == "replicated (under 2 GiB)"
    assert plan.components["vae"]["decision"] == "replicated"


@pytest.mark.xla
def test_text_encoders_are_split_from_a_size_up(host_pipelines):
    plan = plan_sharding(host_pipelines["tiny-sd3"], 2, RULES["tiny-sd3"], text_encoder_shard_bytes=0)
    t5 = _specs(plan, "text_encoder_3")
    assert t5["encoder.block.0.layer.0.SelfAttention.q.weight"] == ("model", None)
    assert t5["encoder.block.0.layer.0.SelfAttention.o.weight"] == (None, "model")
    clip = _specs(plan, "text_encoder")
    assert clip["text_model.encoder.layers.0.self_attn.v_proj.weight"] == ("model", None)
    assert clip["text_model.encoder.layers.0.self_attn.out_proj.weight"] == (None, "model")
    # The tiny CLIP's MLP is 37 wide: its fc1 and fc2 cannot split in 2, so they stay whole.
    assert "text_model.encoder.layers.0.mlp.fc1.weight" not in clip
    assert plan.components["text_encoder"]["uneven_layers"] == 10
    assert plan.components["transformer"]["split_layers"] > 0


@pytest.mark.xla
def test_uneven_layers_stay_whole_and_are_counted(host_pipelines):
    # tiny-sd's UNet is 32 and 64 wide: every layer splits over 2 devices, none over 3.
    assert plan_sharding(host_pipelines["tiny-sd"], 2, RULES["tiny-sd"]).components["unet"]["uneven_layers"] == 0
    three = plan_sharding(host_pipelines["tiny-sd"], 3, RULES["tiny-sd"])
    assert three.parameters == [] and three.components["unet"]["uneven_layers"] > 0
    assert plan_sharding(host_pipelines["tiny-sd"], 1, RULES["tiny-sd"]).parameters == []


@pytest.mark.parametrize(
    "data,model,devices,expected",
    [
        (1, 0, 4, (1, 4)),
        (2, 0, 4, (2, 2)),
        (2, 2, 4, (2, 2)),
        (3, 0, 4, "execution.mesh.data: 3 does not divide the 4 devices of this machine"),
        (
            2,
            4,
            4,
            "execution.mesh: data 2 x model 4 = 8 devices, but this machine has 4; "
            "the mesh must cover every device (model: 0 takes the rest)",
        ),
    ],
)
def test_mesh_shape(data, model, devices, expected):
    if isinstance(expected, str):
        with pytest.raises(InputError) as error:
            mesh_shape(data, model, devices)
        assert error.value.lines == [expected]
    else:
        assert mesh_shape(data, model, devices) == expected


@pytest.mark.parametrize(
    "execution,expected",
    [
        (
            {"backend": "cpu", "sharding": "spmd"},
            ["execution.sharding: spmd needs execution.backend: xla or jax, not cpu"],
        ),
        (
            {"backend": "cuda", "sharding": "spmd", "offload": "model"},
            [
                "execution.sharding: spmd needs execution.backend: xla or jax, not cuda",
                "execution.offload: model and execution.sharding: spmd exclude each other: split the model over the "
                "chips (spmd) or move it on and off one chip (offload), not both",
            ],
        ),
        (
            {"sharding": "spmd", "mode": "multi"},
            ["execution.mode: multi runs a replica per chip, and spmd one model over all chips; use mode: single"],
        ),
        ({"mesh": {"model": 2}}, ["execution.mesh: is used only with execution.sharding: spmd"]),
        (
            {"sharding": "spmd", "mesh": {"data": 4}},
            ["execution.mesh.data: 4 does not divide batch_size 2"],
        ),
        (
            {"sharding": "spmd", "cores": 4, "mesh": {"data": 2, "model": 4}},
            ["execution.mesh: data 2 x model 4 does not cover execution.cores: 4 devices exactly"],
        ),
        (
            {"sharding": "spmd", "cores": 6, "mesh": {"data": 4}},
            [
                "execution.mesh.data: 4 does not divide batch_size 2",
                "execution.mesh: data 4 x model (the rest) does not cover execution.cores: 6 devices exactly",
            ],
        ),
    ],
)
def test_bad_spmd_configs_fail_before_anything_loads(tmp_path, execution, expected):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution=execution))
    result = run_cli("generate", config, "--quiet")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {line}" for line in expected]
    assert not (tmp_path / "outputs").exists()


# One process, 4 XLA:CPU devices, SPMD on before XLA starts; the four runs share it (one mesh each).
_SPMD_RUNS = textwrap.dedent(
    """
    import sys
    from typer.testing import CliRunner
    import tpugen.sharding
    from tpugen.cli import app

    tpugen.sharding.TEXT_ENCODER_SHARD_BYTES = 0  # split the tiny text encoders too, to run those rules
    for config, run_id, data in [a.split(":") for a in sys.argv[1:]]:
        overrides = [f"output.run_id={run_id}", "execution.sharding=spmd", "execution.cores=4",
                     f"execution.mesh.data={data}"]
        result = CliRunner().invoke(app, ["generate", config, "--quiet", *overrides])
        assert result.exit_code == 0, result.output
    """
)


@pytest.mark.xla
def test_spmd_over_4_devices_gives_the_single_device_images(tmp_path):
    """tiny-flux and tiny-sd3, mesh model 4 and data 2 x model 2, against one device."""
    configs, reference = {}, {}
    for model in ("tiny-flux", "tiny-sd3"):
        base = tiny_config(tmp_path / model, model={"id": model}, steps=2, prompts=["a cat", "an owl"])
        reference[model] = generate(tmp_path / model, **{k: v for k, v in base.items() if k != "output"})
        configs[model] = write_config(tmp_path / model / "spmd.yaml", base)
    runs = [f"{configs[m]}:{m}-{mesh}:{data}" for m in configs for mesh, data in (("m4", 1), ("d2m2", 2))]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.run(
        [*forked_python(), "-c", _SPMD_RUNS, *runs], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for model in configs:
        for mesh, model_axis in (("m4", 4), ("d2m2", 2)):
            run = tmp_path / model / "outputs" / f"{model}-{mesh}"
            report = json.loads((run / "report.json").read_text())
            sharding = report["device"]["sharding"]
            assert sharding["mesh"] == {"data": 4 // model_axis, "model": model_axis}
            assert sharding["devices"] == 4
            # Every split the plan asked for is on the device, text encoders' included.
            assert sharding["split_tensors"] == sharding["split_tensors_verified"] > 0
            encoders = [c for name, c in sharding["components"].items() if name.startswith("text_encoder")]
            assert sum(c["split_layers"] for c in encoders) > 0
            assert report["compiles_after_warmup"] == 0 and report["images"] == 2
            assert "- SPMD: mesh data" in (run / "report.md").read_text()
            assert len(list(run.glob("[0-9]*.png"))) == 2
            assert_same_images(run, reference[model], OTHER_DEVICE_COUNT)
