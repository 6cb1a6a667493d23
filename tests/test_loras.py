"""LoRAs fused into the weights: diffusers' images, the base model's graphs, switches that compile nothing, and
bad LoRAs refused in one line before anything loads."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import COMPILED_VS_EAGER, FIRST_CALL, cold_graphs, make_lora, run_cli, tiny_config, write_config
from PIL import Image

from tpugen import __version__
from tpugen.config import load_config
from tpugen.errors import InputError

SHAPE = {"height": 64, "width": 64, "batch_size": 1}
PROMPTS = ["a lighthouse at dawn", "a red fox in snow"]


def lora_config(tmp: Path, run_id: str, loras: list[dict], **overrides) -> dict:
    return tiny_config(
        tmp,
        prompts=PROMPTS,
        model={"id": "tiny-sd", "loras": loras},
        output={"dir": str(tmp / "outputs"), "run_id": run_id},
        **{**SHAPE, **overrides},
    )


def resolved(tmp: Path, run_id: str, loras: list[dict] = ()):
    return load_config(write_config(tmp / f"{run_id}.yaml", lora_config(tmp, run_id, list(loras))))


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8 : 8 + struct.unpack("<Q", data[:8])[0]]


def web_ui_hash(path: Path) -> str:
    """The web UI's short LoRA hash, computed here as its modules/hashes.py does (addnet_hash_safetensors): the
    sha256 of everything after the safetensors header, first 12 hex digits."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(data[8 + length :]).hexdigest()[:12]


def fake_lora(path: Path, keys: list[str], fill: float = 0.0) -> Path:
    """A safetensors file holding `keys` (4x4, all `fill`): enough for the checks made when a config is resolved."""
    from safetensors.numpy import save_file

    save_file({key: np.full((4, 4), fill, np.float32) for key in keys}, str(path))
    return path


# ---------------------------------------------------------------- bad input, when the config is resolved

SDXL_KEYS = [
    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight",
    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
    "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
]
FLUX_KEYS = ["transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"]
OK_KEYS = ["unet.down_blocks.1.attentions.0.proj_in.lora_A.weight"]

BAD_LORAS = [
    ("missing file", {"id": "none.safetensors"}, ["model.loras[0].id: '{tmp}/none.safetensors' does not exist"]),
    ("not safetensors", {"id": "notes.txt"}, ["model.loras[0].id: 'notes.txt' is not a .safetensors file"]),
    ("no LoRA keys", {"id": "weights.safetensors"}, ["model.loras[0].id: 'weights.safetensors' is not a LoRA"]),
    (
        "an SDXL LoRA on SD 1.x",
        {"id": "sdxl-style.safetensors"},
        [
            "model.loras[0].id: 'sdxl-style' is a LoRA for Stable Diffusion XL (its keys have SDXL UNet block names "
            "(lora_unet_input_blocks_*) and keys for a second text encoder (lora_te2_ or text_encoder_2)), and the "
            "model tiny-sd is Stable Diffusion 1.x/2.x"
        ],
    ),
    (
        "a Flux LoRA on SD 1.x",
        {"id": "flux-style.safetensors"},
        [
            "model.loras[0].id: 'flux-style' is a LoRA for Flux.1 (schnell, dev) or FLUX.2 [klein] or FLUX.2 [klein] "
            "distilled or FLUX.2 [klein] KV or FLUX.2 [dev] (its keys have Flux's double- and"
        ],
    ),
    ("negative scale", {"id": "ok.safetensors", "scale": -0.5}, ["model.loras[0].scale: must be from 0 to 4"]),
    ("absurd scale", {"id": "ok.safetensors", "scale": 12}, ["model.loras[0].scale: must be from 0 to 4"]),
    (
        "a pinned file that changed",
        {"id": "ok.safetensors", "sha256": "0" * 64},
        ["model.loras[0].sha256: 'ok.safetensors' has sha256 "],
    ),
    ("a folder of several", {"id": "folder"}, ["model.loras[0].weight_name: '{tmp}/folder' holds 2 .safetensors"]),
]


@pytest.mark.parametrize("entry,expected", [c[1:] for c in BAD_LORAS], ids=[c[0] for c in BAD_LORAS])
@pytest.mark.parametrize("command", ["validate", "generate"])
def test_a_bad_lora_is_one_line_and_exit_2_before_anything_loads(tmp_path, command, entry, expected):
    (tmp_path / "notes.txt").write_text("not a LoRA")
    fake_lora(tmp_path / "weights.safetensors", ["conv_in.weight"])
    fake_lora(tmp_path / "sdxl-style.safetensors", SDXL_KEYS)
    fake_lora(tmp_path / "flux-style.safetensors", FLUX_KEYS)
    fake_lora(tmp_path / "ok.safetensors", OK_KEYS)
    (tmp_path / "folder").mkdir()
    for name in ("a", "b"):
        fake_lora(tmp_path / "folder" / f"{name}.safetensors", OK_KEYS)
    path = write_config(tmp_path / "bad.yaml", lora_config(tmp_path, "bad", [entry]))

    result = run_cli(command, path)

    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: " + expected[0].replace("{tmp}", str(tmp_path))), line
    assert not (tmp_path / "outputs").exists()


FLUX_FAMILIES = {"flux", "flux2_klein", "flux2_klein_distilled", "flux2"}


@pytest.mark.parametrize(
    "keys,families,absent",
    [
        # kohya's Flux names start lora_unet_ as a UNet's do: both Flux loaders read them, no UNet family does.
        (["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "lora_unet_single_blocks_0_linear1.alpha"],
         FLUX_FAMILIES, {"sd", "sdxl", "zimage", "qwenimage"}),
        # FLUX.2's diffusers names have Flux.1's single_transformer_blocks; BFL's have its double_blocks.
        (["transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight"], FLUX_FAMILIES, {"sd3"}),
        (["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"], FLUX_FAMILIES, {"sd", "zimage"}),
        # Z-Image's and Qwen-Image's kohya files name their blocks lora_unet_*, each in a way of its own.
        (["lora_unet_layers_0_attention_to_q.lora_down.weight"], {"zimage"}, {"flux", "sd3", "sd", "qwenimage"}),
        (["lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight"], {"qwenimage"}, {"flux", "sd3", "sd"}),
        # An SD kohya file is for the UNet families only.
        (["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"], {"sd", "sdxl"}, {"flux", "zimage", "flux2"}),
        (["transformer.layers.0.attention.to_q.lora_A.weight"], {"zimage", "qwenimage", "flux2", "sd3"}, {"sd"}),
        (SDXL_KEYS, {"sdxl"}, {"sd", "flux2", "zimage", "qwenimage"}),
    ],
    ids=["kohya Flux", "FLUX.2 diffusers", "BFL Flux", "kohya Z-Image", "kohya Qwen-Image", "kohya SD", "Z-Image", "SDXL"],
)  # fmt: skip
def test_lora_keys_tell_the_families_they_can_be_for(keys, families, absent):
    from tpugen.config.loras import lora_families

    found, _ = lora_families(keys)
    assert families <= found and not absent & found, sorted(found)


def test_the_config_hash_follows_the_lora_set_its_scales_and_its_content(tmp_path):
    a, b = (
        fake_lora(tmp_path / "a.safetensors", OK_KEYS),
        fake_lora(tmp_path / "b.safetensors", FLUX_KEYS[:0] + OK_KEYS),
    )
    b.write_bytes(b.read_bytes()[:-4] + b"\1\0\0\0")  # other tensor data: another file

    def config_hash(loras: list[dict]) -> str:
        return resolved(tmp_path, "h", loras).config_hash

    plain = tiny_config(tmp_path, prompts=PROMPTS, output={"dir": str(tmp_path / "outputs"), "run_id": "h"}, **SHAPE)
    none = config_hash([])
    assert none == load_config(write_config(tmp_path / "plain.yaml", plain)).config_hash  # as before LoRAs existed
    hashes = {
        none,
        config_hash([{"id": "a.safetensors"}]),
        config_hash([{"id": "a.safetensors", "scale": 0.5}]),
        config_hash([{"id": "a.safetensors"}, {"id": "b.safetensors"}]),
    }
    assert len(hashes) == 4
    # The resolved config records each file's sha256, so content counts and a changed file is refused later.
    run = resolved(tmp_path, "h", [{"id": "a.safetensors"}, {"id": "b.safetensors"}])
    assert [lora.sha256 for lora in run.config.model.loras] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b)
    ]
    before = config_hash([{"id": "a.safetensors"}])
    fake_lora(a, OK_KEYS, fill=2)  # the same name, other content
    assert config_hash([{"id": "a.safetensors"}]) != before
    pinned = write_config(tmp_path / "pinned.yaml", {**plain, "model": run.config.model.model_dump()})
    fake_lora(b, OK_KEYS, fill=3)
    result = run_cli("validate", pinned)  # both files changed after the config recorded them
    assert result.exit_code == 2
    assert [line.split(" has sha256")[0] for line in result.stderr.splitlines()] == [
        "error: model.loras[0].sha256: 'a.safetensors'",
        "error: model.loras[1].sha256: 'b.safetensors'",
    ]


# ---------------------------------------------------------------- bad input the model's modules tell (xla)


@pytest.mark.xla
@pytest.mark.parametrize(
    "tensors,expected",
    [
        (
            {
                "unet.down_blocks.7.attentions.0.to_q.lora_A.weight": (4, 8),
                "unet.down_blocks.7.attentions.0.to_q.lora_B.weight": (8, 4),
            },
            "model.loras[0].id: 'odd': 1 of its 1 modules match no module of tiny-sd "
            "(e.g. unet.down_blocks.7.attentions.0.to_q); it is a LoRA for another model",
        ),
        (
            # An SDXL UNet LoRA in diffusers' names, which SD 1.x shares: only the widths give it away.
            {
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight": (4, 2048),
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_B.weight": (64, 4),
            },
            "model.loras[0].id: 'odd' is for another architecture than tiny-sd (Stable Diffusion 1.x/2.x): 1 of "
            "its 1 modules have other widths (e.g. unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k: "
            "2048 -> 64 in the LoRA, 32 -> 64 in the model); its cross-attention width says Stable Diffusion XL, and "
            "tiny-sd is Stable Diffusion 1.x/2.x (width 32)",
        ),
        (
            {"unet.down_blocks.1.attentions.0.proj_in.lora_A.weight": (4, 64), "unet.conv_in.weight": (32, 4, 3, 3)},
            "model.loras[0].id: 'odd' carries 1 whole tensors, not LoRA factors (e.g. unet.conv_in.weight); "
            "tpugen fuses lora_A/lora_B (kohya lora_down/lora_up) factors only",
        ),
    ],
    ids=["keys that match no module", "an SDXL UNet LoRA on SD 1.x, told by its widths", "whole weights"],
)
def test_a_lora_that_does_not_fit_the_model_is_refused_before_any_weights_are_read(
    tmp_path, monkeypatch, tensors, expected
):
    import tpugen.engine.engine
    from tpugen.tiny import builtin_path

    builtin_path("tiny-sd")  # built beforehand: building it prints the libraries' own warnings once
    monkeypatch.setattr(tpugen.engine.engine, "read_shared", lambda *a, **k: pytest.fail("weights were read"))
    from safetensors.numpy import save_file

    save_file({key: np.ones(shape, np.float32) for key, shape in tensors.items()}, str(tmp_path / "odd.safetensors"))
    path = write_config(tmp_path / "c.yaml", lora_config(tmp_path, "odd", [{"id": "odd.safetensors"}]))

    result = run_cli("generate", path, "--quiet")

    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {expected}"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
@pytest.mark.parametrize(
    "model,fmt,expected",
    [
        (
            "tiny-z-image",
            "kohya",
            "model.loras[0].id: 'sd-kohya' is a LoRA for Stable Diffusion 1.x/2.x or Stable Diffusion XL (its keys "
            "have UNet block names), and the model tiny-z-image is Z-Image",
        ),
        (
            "tiny-z-image",
            "peft",
            "model.loras[0].id: 'sd-peft' is a LoRA for Stable Diffusion 1.x/2.x or Stable Diffusion XL (its keys "
            "have UNet block names), and the model tiny-z-image is Z-Image",
        ),
        (
            "tiny-flux2-klein",
            "kohya",
            "model.loras[0].id: 'sd-kohya' is a LoRA for Stable Diffusion 1.x/2.x or Stable Diffusion XL (its keys "
            "have UNet block names), and the model tiny-flux2-klein is FLUX.2 [klein]",
        ),
    ],
    ids=["SD kohya on Z-Image", "SD peft on Z-Image", "SD kohya on FLUX.2 klein"],
)
def test_an_sd_lora_on_a_new_family_is_refused_in_one_line_before_any_weights_are_read(
    tmp_path, monkeypatch, model, fmt, expected
):
    import tpugen.engine.engine

    lora = make_lora(tmp_path / f"sd-{fmt}.safetensors", fmt, seed=1)  # builds tiny-sd's files if needed
    monkeypatch.setattr(tpugen.engine.engine, "read_shared", lambda *a, **k: pytest.fail("weights were read"))
    config = tiny_config(tmp_path, model={"id": model, "loras": [{"id": str(lora)}]}, prompts=PROMPTS, steps=2)

    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")

    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {expected}"]
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- fused, compiled, switched (xla)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loras")
    return {
        "kohya": make_lora(folder / "style-kohya.safetensors", "kohya", seed=1),
        "peft": make_lora(folder / "subject-peft.safetensors", "peft", seed=2),
    }


def diffusers_images(loras: list[tuple[Path, float]]) -> list[np.ndarray]:
    """The reference: diffusers' own pipeline on the CPU with the LoRAs loaded and fused by diffusers
    (load_lora_weights, fuse_lora), from tpugen's noise (one CPU generator per image, seeded seed + index)."""
    import torch
    from diffusers import StableDiffusionPipeline

    from tpugen.families import family as family_code
    from tpugen.tiny import builtin_path

    pipe = StableDiffusionPipeline.from_pretrained(str(builtin_path("tiny-sd")), safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    for number, (path, scale) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"a{number}")
        pipe.fuse_lora(lora_scale=scale, adapter_names=[f"a{number}"])
    images = []
    for index, prompt in enumerate(PROMPTS):
        generator = torch.Generator("cpu").manual_seed(7 + index)
        (latents,) = family_code("sd").noise(pipe, [generator], SHAPE["height"], SHAPE["width"])
        image = pipe(
            prompt=[prompt],
            negative_prompt=["blurry"],
            height=SHAPE["height"],
            width=SHAPE["width"],
            num_inference_steps=3,
            guidance_scale=7.5,
            latents=latents,
            generator=[generator],
            output_type="np",
        ).images[0]
        images.append((image * 255.0).round().clip(0, 255).astype(np.uint8))
    return images


def generate_all(engine, run) -> list[np.ndarray]:
    from tpugen.plan import plan_run

    return [pixels for batch in plan_run(run).batches for pixels in engine.generate(batch)]


def assert_close(images: list[np.ndarray], reference: list[np.ndarray], measured: dict, name: str) -> None:
    diffs = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(images, reference, strict=True)]
    measured[name] = (max(int(d.max()) for d in diffs), float(np.mean([d.mean() for d in diffs])))
    assert measured[name][0] <= COMPILED_VS_EAGER, measured[name]


@pytest.fixture(scope="module")
def warm_engine(lora_files, tmp_path_factory):
    """An engine opened with the kohya LoRA at 0.7 and warmed up at SHAPE: (engine, run, warmup entry, images)."""
    from tpugen.engine import Engine, EngineSpec
    from tpugen.plan import plan_run

    tmp = tmp_path_factory.mktemp("warm")
    run = resolved(tmp, "kohya", [{"id": str(lora_files["kohya"]), "scale": 0.7}])
    engine = Engine.open(EngineSpec.of(run))
    (entry,) = engine.warmup(plan_run(run))
    yield engine, run, entry, generate_all(engine, run)
    engine.close()


@pytest.fixture(scope="module")
def base_model(warm_engine, tmp_path_factory):
    """The base model (no LoRA) at SHAPE, opened after the LoRA engine warmed up: (warmup entry, images)."""
    from tpugen.engine import Engine, EngineSpec
    from tpugen.plan import plan_run

    run = resolved(tmp_path_factory.mktemp("base"), "base")
    engine = Engine.open(EngineSpec.of(run))
    (entry,) = engine.warmup(plan_run(run))
    images = generate_all(engine, run)
    engine.close()
    return entry, images


@pytest.mark.xla
def test_fused_loras_give_diffusers_images_with_the_base_models_graphs(warm_engine, base_model, lora_files):
    engine, run, entry, images = warm_engine
    # The LoRA engine needs the base model's three graphs for a shape key, no more (that they are the base model's
    # own graphs, a fresh process shows: test_a_lora_compiles_the_base_models_graphs_and_nothing_after_warmup).
    assert cold_graphs(entry) == FIRST_CALL, entry
    assert [lora.name for lora in engine.loras] == ["style-kohya"] and engine.loras_key == ((run.loras[0].sha256, 0.7),)
    measured: dict = {}
    assert_close(images, diffusers_images([(lora_files["kohya"], 0.7)]), measured, "kohya 0.7")
    # The base model at the same shape key then compiles nothing: its graphs are the ones the LoRA engine made.
    base_entry, base_images = base_model
    assert base_entry["compiles"] == 0 and cold_graphs(base_entry) == FIRST_CALL, base_entry
    assert all(np.abs(a.astype(int) - b).max() > 10 for a, b in zip(base_images, images, strict=True))
    print(f"warmup compiles with the LoRA {entry['compiles']}, base after it {base_entry['compiles']}; {measured}")


@pytest.mark.xla
def test_switching_loras_on_a_warm_engine_compiles_nothing_and_restores_the_base_exactly(
    warm_engine, base_model, lora_files, tmp_path
):
    import torch_xla.debug.metrics as met

    from tpugen.config.loras import resolve_lora
    from tpugen.config.schema import LoraConfig

    engine, run, _, kohya_images = warm_engine
    _, base_images = base_model  # from an engine that never had a LoRA
    peft = resolve_lora(LoraConfig(id=str(lora_files["peft"])), tmp_path)

    broken = resolve_lora(
        LoraConfig(id=str(make_lora(tmp_path / "nan.safetensors", "peft", seed=3, std=np.nan))), tmp_path
    )
    before = met.metric_data("CompileTime")[0]
    with pytest.raises(InputError, match="^model.loras: fusing 'nan' gives non-finite weights"):
        engine.use_loras([broken])  # refused on the host: the engine keeps its LoRA, and its twins stay clean
    assert engine.loras == run.loras
    switched = engine.use_loras([peft])
    peft_images = generate_all(engine, run)
    to_base = engine.use_loras([])
    restored = generate_all(engine, run)
    back = engine.use_loras(run.loras)
    again = generate_all(engine, run)
    assert met.metric_data("CompileTime")[0] == before  # the real XLA counter: nothing compiled across switches

    measured: dict = {}
    assert_close(peft_images, diffusers_images([(lora_files["peft"], 1.0)]), measured, "peft 1.0")
    assert all(np.abs(a.astype(int) - b).max() > 10 for a, b in zip(peft_images, kohya_images, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(restored, base_images, strict=True))  # bytes, not "close"
    assert all(np.array_equal(a, b) for a, b in zip(again, kohya_images, strict=True))
    assert engine.loras == run.loras and engine.use_loras(run.loras)["tensors"] == 0  # the same set: nothing moves
    # Both LoRAs change the same modules' weights, one tensor each (not their biases): each switch moves those,
    # and the host keeps a copy of their base values only, not of the model.
    modules = sum(key.endswith(".lora_A.weight") for key in json.loads(_header(lora_files["peft"])))
    assert switched["tensors"] == to_base["tensors"] == back["tensors"] == modules == 102
    model_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.pipe.unet.parameters())
    assert 0 < switched["host_copy_bytes"] < model_bytes
    print(f"switch seconds: {switched['seconds']:.3f}, {to_base['seconds']:.3f}, {back['seconds']:.3f}; {measured}")


@pytest.mark.xla
def test_images_manifest_and_report_name_each_lora_with_its_scale_and_hash(warm_engine, lora_files, tmp_path):
    import torch_xla.debug.metrics as met

    from tpugen.modes.single import run_single

    engine, *_ = warm_engine
    entries = [{"id": str(lora_files["kohya"]), "scale": 0.7}, {"id": str(lora_files["peft"]), "scale": 0.5}]
    run = resolved(tmp_path, "two", entries)
    assert engine.accepts(run)  # LoRAs do not decide which engine a run can use: the engine switches them
    before = met.metric_data("CompileTime")[0]
    report = run_single(run, engine=engine)  # the engine switches to the run's LoRAs itself
    assert met.metric_data("CompileTime")[0] == before and engine.loras == run.loras

    kohya, peft = (web_ui_hash(lora_files[name]) for name in ("kohya", "peft"))
    run_dir = tmp_path / "outputs" / "two"
    first = sorted(run_dir.glob("[0-9]*.png"))[0]
    parameters = Image.open(first).text["parameters"]
    assert parameters.splitlines()[-1].endswith(
        f', Model: tiny-sd, Lora hashes: "style-kohya: {kohya}, subject-peft: {peft}", Version: tpugen {__version__}'
    ), parameters
    # Given as absolute paths, they are named by their files (records never hold a path of this machine).
    expected = [
        {"name": "style-kohya", "id": "style-kohya.safetensors", "scale": 0.7, "hash": kohya,
         "sha256": hashlib.sha256(lora_files["kohya"].read_bytes()).hexdigest()},
        {"name": "subject-peft", "id": "subject-peft.safetensors", "scale": 0.5, "hash": peft,
         "sha256": hashlib.sha256(lora_files["peft"].read_bytes()).hexdigest()},
    ]  # fmt: skip
    assert json.loads(Image.open(first).text["tpugen"])["loras"] == expected
    manifest = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert [record["loras"] for record in manifest] == [expected, expected]
    assert report["model"]["loras"] == expected and json.loads((run_dir / "report.json").read_text())["model"]["loras"]
    assert f"style-kohya at 0.7 (hash {kohya}" in (run_dir / "report.md").read_text()


EDIT = "tiny-qwen-image-edit-plus"


def edit_entries(tmp: Path, model: str) -> dict:
    """What a config of `model` needs beyond tiny_config's: for the edit-only built-in, PROMPTS each editing one
    reference (a 64x64 noise image, ref.png beside the config), one prompt a batch; else nothing."""
    if model != EDIT:
        return {}
    rng = np.random.default_rng(4)
    tmp.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp / "ref.png")
    return {"prompts": [{"prompt": p, "reference_images": ["ref.png"]} for p in PROMPTS], "batch_size": 1}


@pytest.mark.xla
@pytest.mark.cold_process  # its counts are a first compile's: the base model's graphs, made by the LoRA run
@pytest.mark.parametrize(("model", "fmt"), [("tiny-sd", "kohya"), ("tiny-z-image", "peft"), (EDIT, "peft")])
def test_a_lora_compiles_the_base_models_graphs_and_nothing_after_warmup(model, fmt, tmp_path):
    # Through the whole run (SD 1.x, a 2026 family, and an edit by a reference): the LoRA fused on the host, its
    # graphs the base model's (the base run after it, in this process, compiles nothing at the same shape key) and
    # none after warmup.
    lora = make_lora(tmp_path / f"lora-{fmt}.safetensors", fmt, seed=6, model=model)
    reports, images = {}, {}
    for name, loras in (("lora", [{"id": str(lora), "scale": 0.8}]), ("base", [])):
        entries = {"prompts": PROMPTS, **edit_entries(tmp_path, model)}
        config = tiny_config(tmp_path, model={"id": model, "loras": loras}, steps=2, output={"run_id": name}, **entries)
        result = run_cli("generate", write_config(tmp_path / f"{name}.yaml", config), "--quiet")
        assert result.exit_code == 0, result.output
        run_dir = tmp_path / "outputs" / name
        reports[name] = json.loads((run_dir / "report.json").read_text())
        images[name] = [np.asarray(Image.open(p)) for p in sorted(run_dir.glob("[0-9]*.png"))]
    (warm,) = reports["lora"]["warmup"]
    assert warm["graphs_per_phase"] == FIRST_CALL
    assert warm["compiles"] == 3 and reports["lora"]["compiles_after_warmup"] == 0
    assert [entry["name"] for entry in reports["lora"]["model"]["loras"]] == [f"lora-{fmt}"]
    assert reports["base"]["warmup"][0]["compiles"] == 0 and reports["base"]["compiles_after_warmup"] == 0
    assert len(images["lora"]) == len(images["base"]) == 2
    diffs = [int(np.abs(a.astype(int) - b).max()) for a, b in zip(images["lora"], images["base"], strict=True)]
    assert min(diffs) > 10, diffs  # the LoRA is in the weights


# ---------------------------------------------------------------- SDXL and Flux (eager CPU: the weights are the point)


def _weights(pipe, components) -> dict[str, dict]:
    return {c: {k: v.detach().clone() for k, v in getattr(pipe, c).state_dict().items()} for c in components}


# The components each model's LoRA files name (the newer families' loaders take the transformer alone).
LORA_COMPONENTS = {
    "tiny-sdxl": ["unet", "text_encoder", "text_encoder_2"],
    "tiny-flux": ["transformer", "text_encoder"],
    **dict.fromkeys(["tiny-flux2-klein", "tiny-flux2", "tiny-z-image", "tiny-qwen-image", EDIT], ["transformer"]),
}


@pytest.mark.xla
@pytest.mark.parametrize(
    "model,fmt",
    [("tiny-sdxl", "peft"), ("tiny-sdxl", "kohya"), ("tiny-flux", "peft"), ("tiny-flux2-klein", "peft"),
     ("tiny-flux2", "peft"), ("tiny-z-image", "peft"), ("tiny-qwen-image", "peft"), (EDIT, "peft")],
)  # fmt: skip
def test_sdxl_and_flux_loras_fuse_every_component_as_diffusers_does_and_switch_back(tmp_path, model, fmt):
    # The image path is the one the SD tests check against diffusers; here, each family's LoRA files reach every
    # component they name (both CLIP encoders of SDXL, Flux's transformer), fused as diffusers' own
    # load_lora_weights + fuse_lora fuse them, and a switch to none restores the base weights exactly.
    from diffusers import DiffusionPipeline

    from tpugen.engine import Engine, EngineSpec
    from tpugen.tiny import builtin_path

    lora = make_lora(tmp_path / f"{model}-{fmt}.safetensors", fmt, seed=5, model=model)
    config = tiny_config(
        tmp_path,
        model={"id": model, "loras": [{"id": str(lora), "scale": 0.8}]},
        execution={"backend": "cpu"},
        **edit_entries(tmp_path, model),
    )
    run = load_config(write_config(tmp_path / "c.yaml", config))
    components = LORA_COMPONENTS[model]

    reference = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
    base = _weights(reference, components)
    reference.load_lora_weights(str(lora), adapter_name="a")
    reference.fuse_lora(lora_scale=0.8, adapter_names=["a"], components=components)
    reference.unload_lora_weights()
    fused = _weights(reference, components)

    engine = Engine.open(EngineSpec.of(run))
    try:
        ours = _weights(engine.loaded.pipe, components)
        modules = sum(key.endswith((".lora_A.weight", ".lora_down.weight")) for key in json.loads(_header(lora)))
        changes = 0
        for component in components:
            changed = [k for k in base[component] if not torch_equal(base[component][k], fused[component][k])]
            changes += len(changed)
            assert changed, f"diffusers changed nothing in {component}"
            assert ours[component].keys() == fused[component].keys()
            worst = max(float((ours[component][k] - fused[component][k]).abs().max()) for k in changed)
            print(f"{model} {fmt} {component}: {len(changed)} tensors fused, max difference {worst:.2e}")
            assert worst <= 1e-5, (component, worst)
            assert all(torch_equal(ours[component][k], base[component][k]) for k in base[component] if k not in changed)
        assert changes == modules  # every module the file names, one weight each
        engine.use_loras([])
        restored = _weights(engine.loaded.pipe, components)
        for component in components:
            assert all(torch_equal(restored[component][k], base[component][k]) for k in base[component])
    finally:
        engine.close()


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
