"""LoRAs in the config: bad LoRAs refused in one line before anything loads, and the config hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, tiny_config, write_config

from tpugen.config import load_config

# A shape key no other test compiles (tests/ uses 64x64, 72x64, 80x64, 96x64), so counts are exact here.
SHAPE = {"height": 64, "width": 80, "batch_size": 1}
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
        ["model.loras[0].id: 'flux-style' is a LoRA for Flux.1 (schnell, dev) (its keys have Flux's double- and"],
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
