"""compile.flash_attention: the decision, the SPMD partition spec, the attention-matrix estimate, and on XLA:CPU
the model's own attention under auto and the fallback that never costs a run under true."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import SAME_SETUP, Recording, assert_same_images, forked_python, run_cli, tiny_config, write_config

from tpugen.backends.xla.flash import NO_JAX, NO_SPMD_SPEC, flash_partition_spec, flash_reason
from tpugen.families import family as family_code
from tpugen.memory import (
    AttentionSize,
    attention_calls,
    attention_summary,
    kernel_calls_text,
    kernel_reach,
    kernel_route_text,
    largest_attention,
)
from tpugen.plan import ShapeKey

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SD3_REASON = "diffusers 0.42 has no XLA flash-attention processor for SD3's joint attention"


# ---------------------------------------------------------------- pure: decision, spec, estimate


@pytest.mark.parametrize(
    "setting,family,tpu,jax,spmd,expected",
    [
        ("auto", "sd", False, False, False, "not a TPU"),
        ("auto", "sd", True, False, False, NO_JAX),
        ("auto", "sdxl", True, True, False, None),
        ("auto", "sd", True, True, True, None),  # the UNet's processor takes the partition spec
        ("auto", "flux", True, True, False, None),
        ("auto", "flux", True, True, True, NO_SPMD_SPEC),  # diffusers 0.42 gives Flux's kernel none
        (True, "flux", True, True, True, None),  # true tries it anyway
        (True, "sd", False, False, False, None),  # true tries it off a TPU too: the warmup decides
        (True, "sd3", True, True, False, SD3_REASON),
        ("auto", "sd3", True, True, False, SD3_REASON),
        (False, "flux", True, True, False, "compile.flash_attention: false"),
    ],
)
def test_flash_attention_goes_on_only_where_it_can(setting, family, tpu, jax, spmd, expected):
    route = family_code(family).flash_attention
    assert flash_reason(setting, route, tpu=tpu, jax=jax, spmd=spmd) == expected


def test_each_family_routes_its_denoiser():
    routes = {name: family_code(name).flash_attention for name in ("sd", "sdxl", "sd3", "flux")}
    assert {name: r.components for name, r in routes.items()} == {
        "sd": ("unet",),
        "sdxl": ("unet",),
        "sd3": (),
        "flux": ("transformer",),
    }
    assert [(r.is_flux, r.takes_partition_spec, r.min_tokens) for r in routes.values()] == [
        (False, True, 4096),
        (False, True, 4096),
        (False, True, 0),
        (True, False, 0),
    ]


@pytest.mark.parametrize(
    "data,model,heads,expected",
    [
        (1, 4, {8}, (None, "model", None, None)),  # tiny-sd's UNet over a model axis of 4: 2 heads per chip
        (2, 2, {8}, ("data", "model", None, None)),  # rows over data, heads over model
        (4, 1, {8}, ("data", None, None, None)),  # pure data parallel: every chip has every head
        (1, 1, {8}, (None, None, None, None)),
        (1, 4, {5, 10, 20}, (None, None, None, None)),  # SD 2.1's 5 heads do not split in 4: whole
        (2, 2, {5, 10, 20}, ("data", None, None, None)),
        (1, 8, {24}, (None, "model", None, None)),  # Flux.1's 24 heads over 8 chips
        (1, 16, {24}, (None, None, None, None)),
    ],
)
def test_the_spmd_partition_spec_follows_the_mesh(data, model, heads, expected):
    assert flash_partition_spec(data, model, heads) == expected


SD15_UNET = {"attention_head_dim": 8}  # tpugen's config of SD 1.5's UNet: diffusers' default blocks
SDXL_UNET = {
    "attention_head_dim": [5, 10, 20],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
}
FLUX = {"num_attention_heads": 24}
SD35_MEDIUM = {"num_attention_heads": 24, "patch_size": 2}


@pytest.mark.parametrize(
    "family,config,shapes,text,expected",
    [
        # SD 1.5 at 512x512, batch 4 with CFG: 8 rows x 8 heads x 64*64 tokens.
        (
            "sd",
            SD15_UNET,
            [ShapeKey(height=512, width=512, batch_size=4, cfg=True)],
            0,
            AttentionSize("unet", 4096, 8, 8, 2),
        ),
        # SDXL's first attention is one level down: 1024/16 = 64 tokens a side, 10 heads there.
        (
            "sdxl",
            SDXL_UNET,
            [ShapeKey(height=1024, width=1024, batch_size=4, cfg=True)],
            0,
            AttentionSize("unet", 4096, 10, 8, 2),
        ),
        # Flux at 1024x1024: 64*64 packed latent tokens and 512 T5 tokens, no CFG.
        (
            "flux",
            FLUX,
            [ShapeKey(height=1024, width=1024, batch_size=4, cfg=False)],
            512,
            AttentionSize("transformer", 4608, 24, 4, 2),
        ),
        # SD 3.5 Medium: 64*64 patches, 77 CLIP and 256 T5 tokens.
        (
            "sd3",
            SD35_MEDIUM,
            [ShapeKey(height=1024, width=1024, batch_size=1, cfg=True)],
            256,
            AttentionSize("transformer", 4429, 24, 2, 2),
        ),
        # The biggest over a run's shape keys.
        (
            "sd",
            SD15_UNET,
            [
                ShapeKey(height=512, width=512, batch_size=4, cfg=True),
                ShapeKey(height=768, width=512, batch_size=1, cfg=True),
                ShapeKey(height=512, width=512, batch_size=8, cfg=False),
            ],
            0,
            AttentionSize("unet", 4096, 8, 8, 2),
        ),
    ],
)
def test_largest_attention_per_family(family, config, shapes, text, expected):
    denoiser = family_code(family).denoiser
    found = largest_attention(
        family_code(family), config, shapes, component=denoiser, dtype="bfloat16", vae_scale=8, text_tokens=text
    )
    assert found == expected
    assert expected.bytes == expected.rows * expected.heads * expected.tokens**2 * 2


def test_the_attention_note_says_whether_the_matrix_is_held():
    sd15 = AttentionSize("unet", 4096, 8, 8, 2)
    off = attention_summary(sd15, flash_on=False, min_tokens=4096)
    assert (off["materialised"], off["gb"]) == (True, 8 * 8 * 4096**2 * 2 / 1e9)
    assert off["note"] == (
        "attention: unet's largest attention matrix is 2.15 GB per layer (8 rows x 8 heads x 4096^2 tokens x 2 bytes)"
    )
    on = attention_summary(sd15, flash_on=True, min_tokens=4096)
    assert on["materialised"] is False
    assert on["note"] == (
        "flash attention: no full attention matrix (unet's largest attention, 8 rows x 8 heads x 4096^2 tokens "
        "x 2 bytes, would be 2.15 GB unfused)"
    )
    # Below diffusers' threshold the processor falls back to plain SDPA, kernel or not.
    small = attention_summary(AttentionSize("unet", 1024, 8, 2, 2), flash_on=True, min_tokens=4096)
    assert small["materialised"] is True
    assert small["note"].endswith("; flash attention is on, but diffusers runs the kernel only from 4096 tokens")


TINY_SD_UNET = {  # tiny-sd's UNet (tpugen/tiny.py): attention at one level of two, 2 layers per block
    "attention_head_dim": 8,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 2,
    "transformer_layers_per_block": 1,
}
SDXL_BASE_UNET = {
    **SDXL_UNET,
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10],
}
FLUX_DEV = {**FLUX, "num_layers": 19, "num_single_layers": 38}


@pytest.mark.parametrize(
    "family,config,size,text,expected",
    [
        # tiny-sd: 6 transformer layers (2 down, 1 mid, 3 up) at 1/16 of the image, each a self- and a
        # cross-attention; 64x64 gives 16 tokens, and 1024x1024 the 4096 its self-attentions need.
        ("sd", TINY_SD_UNET, 64, 0, (0, 12)),
        ("sd", TINY_SD_UNET, 1024, 0, (6, 12)),
        # SD 1.5: 16 layers; at 512x512 the top level's 2 down and 3 up self-attentions have 64*64 tokens.
        ("sd", SD15_UNET, 512, 0, (5, 32)),
        ("sd", SD15_UNET, 1024, 0, (10, 32)),
        # SDXL: 70 layers, of which the 10 of the first attention level reach 4096 tokens at 1024x1024.
        ("sdxl", SDXL_BASE_UNET, 1024, 0, (10, 140)),
        # Flux: every block's joint attention goes to the kernel, at any size.
        ("flux", FLUX_DEV, 64, 512, (57, 57)),
    ],
)
def test_attention_calls_per_step_that_reach_the_kernel(family, config, size, text, expected):
    code = family_code(family)
    calls = attention_calls(code, config, size, size, vae_scale=8, text_tokens=text)
    assert (kernel_reach(calls, code.flash_attention.min_tokens), len(calls)) == expected


def test_the_count_of_kernel_calls_per_size_and_its_words():
    shapes = [
        ShapeKey(height=64, width=64, batch_size=1, cfg=True),
        ShapeKey(height=64, width=64, batch_size=2, cfg=True),
        ShapeKey(height=1024, width=1024, batch_size=1, cfg=True),
    ]
    found = largest_attention(
        family_code("sd"), TINY_SD_UNET, shapes, component="unet", dtype="float32", vae_scale=8, text_tokens=0
    )
    assert found.kernel_calls == ((64, 64, 0, 12), (1024, 1024, 6, 12))
    # Query and key tokens, call by call: a self-attention over the 4x4 latent of the attention level, then a
    # cross-attention over the 77 CLIP tokens (which never reach the threshold).
    calls = attention_calls(family_code("sd"), TINY_SD_UNET, 64, 64, vae_scale=8, text_tokens=0)
    assert calls == [(16, 16), (16, 77)] * 6
    # No count where the family has no route (SD3 keeps its own attention).
    assert attention_calls(family_code("sd3"), SD35_MEDIUM, 64, 64, vae_scale=8, text_tokens=333) is None
    assert kernel_calls_text(found.kernel_calls[:1], 4096) == (
        "0 of 12 attention calls per step at 64x64 reach the kernel's 4096 tokens"
    )
    assert kernel_calls_text(found.kernel_calls, 4096) == (
        "0 of 12 attention calls per step at 64x64, 6 of 12 at 1024x1024 reach the kernel's 4096 tokens"
    )
    assert kernel_calls_text(((64, 64, 57, 57),), 0) == "57 of 57 attention calls per step at 64x64 use the kernel"
    assert kernel_route_text(12, 4096) == ", for those of its 12 attention calls per step that have 4096 tokens or more"
    assert kernel_route_text(57, 0) == ", for all 57 of its attention calls per step"
    summary = attention_summary(found, flash_on=True, min_tokens=4096)
    assert (summary["kernel_min_tokens"], summary["kernel_calls"][1]) == (
        4096,
        {"height": 1024, "width": 1024, "reach": 6, "calls": 12},
    )


def test_plan_says_whether_flash_attention_is_on_and_what_attention_holds(monkeypatch, known_models_counted):
    # The shipped Flux config (its counts are kept after the first plan of it in a session).
    text = " ".join(run_cli("plan", CONFIGS / "flux-schnell.yaml").stdout.split())
    assert "flash attention: off -- not a TPU" in text
    assert (
        "attention: transformer's largest attention matrix is 4.08 GB per layer "
        "(4 rows x 24 heads x 4608^2 tokens x 2 bytes)"
    ) in text
    # As a TPU VM plans it (`true` does not ask for jax, which this machine lacks).
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    text = " ".join(run_cli("plan", CONFIGS / "flux-schnell.yaml", "compile.flash_attention=true").stdout.split())
    assert "flash attention: on (transformer), unless the kernel fails at warmup" in text
    assert (
        "flash attention: no full attention matrix (transformer's largest attention, 4 rows x 24 heads x 4608^2 "
        "tokens x 2 bytes, would be 4.08 GB unfused)"
    ) in text


# ---------------------------------------------------------------- XLA:CPU: auto and the fallback


def _resolved(tmp_path: Path, run_id: str, **overrides):
    from tpugen.config import load_config

    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "outputs"), "run_id": run_id}, **overrides)
    return load_config(write_config(tmp_path / f"{run_id}.yaml", config))


def _processors(denoiser) -> dict:
    """Each attention processor of a model: its class and the attention backend it dispatches to."""
    return {
        name: (type(p).__name__, getattr(p, "_attention_backend", None)) for name, p in denoiser.attn_processors.items()
    }


@pytest.mark.xla
@pytest.mark.parametrize("model,processor", [("tiny-sd", "AttnProcessor2_0"), ("tiny-flux", "FluxAttnProcessor")])
def test_auto_off_a_tpu_leaves_every_attention_processor_as_loaded(tmp_path, model, processor):
    from tpugen.engine import Engine, EngineSpec
    from tpugen.engine.pipeline import read_from_disk
    from tpugen.families import family as family_code

    run = _resolved(tmp_path, "auto", model={"id": model})
    family = family_code(run.family)
    as_loaded = _processors(getattr(read_from_disk(run.config.model, run.model_source, family)[0], family.denoiser))
    display = Recording()
    engine = Engine.open(EngineSpec.of(run), display=display)
    denoiser = getattr(engine.loaded.pipe, family.denoiser)
    assert _processors(denoiser) == as_loaded
    assert set(as_loaded.values()) == {(processor, None)}
    assert "flash attention" not in engine.loaded.hooks.names()
    assert engine.describe()["flash_attention"] == {
        "state": "off",
        "setting": "auto",
        "components": [family.denoiser],
        "reason": "not a TPU",
        "partition_spec": None,
        "failed_attempt": None,
    }
    assert display.phases == [f"loading {model} onto xla"] and display.warnings == []  # simply off: not said
    engine.close()


@pytest.mark.xla
def test_the_report_says_flash_attention_is_off_off_a_tpu(xla_run):
    assert "\n- flash attention: off -- not a TPU\n" in (xla_run / "report.md").read_text()
    report = json.loads((xla_run / "report.json").read_text())
    assert report["device"]["flash_attention"]["state"] == "off"
    assert report["memory"]["attention"]["materialised"] is True


@pytest.mark.xla
# torch_xla's Pallas path imports torchax, which names torch's privateuse1 device "jax" for the whole process.
@pytest.mark.cold_process
def test_true_on_xla_cpu_falls_back_and_makes_the_images_of_a_run_without_it(tmp_path):
    """XLA:CPU cannot run Pallas kernels (jax is installed beside torch_xla for backend jax, and refuses them on
    the CPU): Flux's attention (which calls the kernel at every size) fails in the warmup call, the model's own
    processors come back, and the run finishes."""
    from tpugen.engine import Engine, EngineSpec
    from tpugen.modes.single import run_single

    shape = {"model": {"id": "tiny-flux"}, "steps": 2, "prompts": ["a cat", "an owl"]}
    forced = _resolved(tmp_path, "forced", compile={"flash_attention": True}, **shape)
    display = Recording()
    engine = Engine.open(EngineSpec.of(forced), display=display)
    transformer = engine.loaded.pipe.transformer
    assert "flash attention" in engine.loaded.hooks.names()
    assert {backend for _, backend in _processors(transformer).values()} == {"_native_xla"}

    report = run_single(forced, engine=engine, display=display)

    # The model's own processors again, on their own (class default) attention backend.
    assert "flash attention" not in engine.loaded.hooks.names()
    assert set(_processors(transformer).values()) == {("FluxAttnProcessor", None)}
    assert all("_attention_backend" not in vars(p) for p in transformer.attn_processors.values())
    flash = report["device"]["flash_attention"]
    reason = "ValueError: Only interpret mode is supported on CPU backend."
    assert (flash["state"], flash["setting"], flash["components"], flash["reason"]) == (
        "off",
        True,
        ["transformer"],
        reason,
    )
    assert flash["failed_attempt"]["shape_key"] == "64x64 b2 nocfg"
    assert display.warnings == [f"flash attention: off -- {reason}"]  # said once, as a warning under true
    assert report["compiles_after_warmup"] == 0 and report["images"] == 2
    run_dir = tmp_path / "outputs" / "forced"
    markdown = (run_dir / "report.md").read_text()
    assert f"\n- flash attention: off -- {reason}\n" in markdown
    assert json.loads((run_dir / "report.json").read_text())["device"]["flash_attention"] == flash
    engine.close()

    # The same run without it, on an engine of its own in this process: the same pixels, bit for bit.
    plain = _resolved(tmp_path, "plain", compile={"flash_attention": False}, **shape)
    run_single(plain, engine=Engine.open(EngineSpec.of(plain)))
    assert_same_images(run_dir, tmp_path / "outputs" / "plain", SAME_SETUP)


@pytest.mark.xla
def test_the_report_counts_the_attention_calls_that_reach_the_kernel(tmp_path):
    """tiny-sd at 64x64 with flash attention forced: no attention has diffusers' 4096 tokens, so the kernel is
    never called (nor needed: the run finishes with it on here) and the line says so (before: `on (unet)`)."""
    from tpugen.engine import Engine, EngineSpec
    from tpugen.modes.single import run_single

    forced = _resolved(tmp_path, "small", compile={"flash_attention": True}, steps=2, prompts=["a cat"], batch_size=1)
    display = Recording()
    engine = Engine.open(EngineSpec.of(forced), display=display)
    assert display.phases == [
        "loading tiny-sd onto xla",
        "flash attention: on (unet), for those of its 12 attention calls per step that have 4096 tokens or more",
    ]
    report = run_single(forced, engine=engine, display=display)
    engine.close()
    assert report["device"]["flash_attention"]["state"] == "on"
    markdown = (tmp_path / "outputs" / "small" / "report.md").read_text()
    line = "- flash attention: on (unet), 0 of 12 attention calls per step at 64x64 reach the kernel's 4096 tokens"
    assert f"\n{line}\n" in markdown


_SPMD_OPEN = textwrap.dedent(
    """
    import json, sys
    from tpugen.config import load_config
    from tpugen.engine import Engine, EngineSpec

    engine = Engine.open(EngineSpec.of(load_config(sys.argv[1])))
    import torch_xla.distributed.spmd as xs

    specs = {repr(getattr(p, "partition_spec", "none")) for p in engine.loaded.pipe.unet.attn_processors.values()}
    mesh = xs.get_global_mesh()
    print(json.dumps({"flash": engine.describe()["flash_attention"], "processors": sorted(specs),
                      "mesh": list(mesh.mesh_shape), "axes": list(mesh.axis_names)}))
    """
)


@pytest.mark.xla
def test_under_spmd_the_unets_processors_get_the_meshs_partition_spec(tmp_path):
    """tiny-sd on a data 2 x model 2 mesh of 4 XLA:CPU devices, flash attention forced: every attention processor
    of the UNet holds the spec, and the kernel's mesh is set (no warmup: the kernel itself cannot run here)."""
    config = tiny_config(
        tmp_path,
        execution={"backend": "xla", "sharding": "spmd", "cores": 4, "mesh": {"data": 2, "model": 2}},
        compile={"flash_attention": True},
    )
    path = write_config(tmp_path / "spmd.yaml", config)
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    proc = subprocess.run(
        [*forked_python(), "-c", _SPMD_OPEN, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["flash"]["state"] == "on" and found["flash"]["partition_spec"] == ["data", "model", None, None]
    assert found["processors"] == ["('data', 'model', None, None)"]
    assert (found["mesh"], found["axes"]) == ([2, 2], ["data", "model"])
