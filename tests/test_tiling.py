"""Seamless tiling (the web UI's tiling): which convolutions pad circularly and for how long, why that makes a tiled
image (the denoiser and the VAE commute with shifts, as if the latent were a torus), and where it is planned,
refused and written down. The served images and their graphs: tests/test_serve_tiling.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import tiny_config, write_config

from tpugen.config import load_config
from tpugen.engine.tiling import circular_padding, padded_convolutions
from tpugen.errors import InputError
from tpugen.outputs.png import a1111_parameters
from tpugen.plan import ShapeKey, plan_run

TRANSFORMER_REFUSAL = (
    "Flux.1 (schnell, dev) models: the transformer has no padded convolution (its patch embedding pads nothing), "
    "so only the VAE would wrap round and the image would not tile; tiling is built for UNet models "
    "(SD 1.x/2.x, SDXL)"
)


def _layers():
    import torch

    nn = torch.nn
    inner = nn.Sequential(nn.Conv2d(2, 2, 3, padding=(0, 1)), nn.ReLU())
    reflect = nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1),  # padded: switched
        nn.Conv2d(2, 2, 1),  # padding 0: left alone (circular would add a pad of nothing)
        nn.Conv2d(2, 2, 3, padding="same"),  # switched
        nn.Conv2d(2, 2, 1, padding="valid"),  # left alone
        nn.ConvTranspose2d(2, 2, 3, padding=1),  # not a Conv2d (the web UI switches Conv2d alone)
        inner,  # nested: its Conv2d pads one side, switched
        reflect,  # switched, and given back its own mode
        nn.Linear(8, 8),
    )
    return model, [model[0], model[2], inner[0], reflect]


def test_circular_padding_switches_exactly_the_padded_convolutions_and_restores_them():
    import torch

    model, padded = _layers()
    before = {id(m): getattr(m, "padding_mode", None) for m in model.modules()}
    assert padded_convolutions([model, model[5]]) == padded  # each layer once, in order
    x = torch.randn(1, 2, 8, 8)
    with torch.no_grad():
        zeros = model[0](x)
        with circular_padding([model]) as switched:
            assert switched == 4
            assert [m.padding_mode for m in padded] == ["circular"] * 4
            assert model[1].padding_mode == model[3].padding_mode == model[4].padding_mode == "zeros"
            # What circular means in torch: the convolution of the input padded by wrapping round.
            wrapped = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="circular")
            expected = torch.nn.functional.conv2d(wrapped, model[0].weight, model[0].bias)
            assert torch.allclose(model[0](x), expected)
            assert not torch.allclose(model[0](x), zeros)
        assert {id(m): getattr(m, "padding_mode", None) for m in model.modules()} == before
        assert torch.equal(model[0](x), zeros)

    seen = []

    def failing_call():
        with circular_padding([model]):
            seen.append(padded[-1].padding_mode)
            raise RuntimeError("the call failed")

    with pytest.raises(RuntimeError, match="the call failed"):
        failing_call()
    assert seen == ["circular"]
    assert {id(m): getattr(m, "padding_mode", None) for m in model.modules()} == before
    assert padded[-1].padding_mode == "reflect"


@pytest.mark.xla  # diffusers imports torch_xla whenever it is installed (the models run eagerly on the CPU)
def test_circular_padding_makes_the_unet_and_the_vae_commute_with_shifts():
    """Translation equivariance: with every padded convolution circular, the tiny-sd UNet's output for a latent
    shifted by k pixels (rolled round) is its output for the latent, shifted by k; the VAE decodes a shifted
    latent to the image shifted by 8k. No pixel is then at an edge: denoising runs on a torus, whatever noise it
    starts from, so the image's right edge continues into its left one and its bottom into its top: it tiles.
    With zero padding the edges are edges, and the shifts do not commute."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from tpugen.tiny import builtin_path

    root = builtin_path("tiny-sd")
    unet = UNet2DConditionModel.from_pretrained(str(root / "unet")).eval()
    vae = AutoencoderKL.from_pretrained(str(root / "vae")).eval()
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 8, 16, generator=generator)  # a 64x128 image
    text = torch.randn(1, 77, unet.config.cross_attention_dim, generator=generator)
    # The UNet halves the latent once (two levels): shifts by even pixels commute with its downsampling.
    shift = (2, 6)

    def roll(tensor, scale: int = 1):
        return torch.roll(tensor, shifts=(shift[0] * scale, shift[1] * scale), dims=(-2, -1))

    def denoise(tensor):
        return unet(tensor, 500, encoder_hidden_states=text).sample

    def decode(tensor):
        return vae.decode(tensor).sample

    def gaps() -> tuple[float, float]:
        with torch.no_grad():
            step = (denoise(roll(latents)) - roll(denoise(latents))).abs().max().item()
            image = (decode(roll(latents)) - roll(decode(latents), 8)).abs().max().item()
        return step, image

    with circular_padding([unet, vae]) as switched:
        tiled = gaps()
    assert switched == len(padded_convolutions([unet])) + len(padded_convolutions([vae])) == 28 + 39
    plain = gaps()
    assert tiled[0] < 1e-4 and tiled[1] < 1e-4, tiled
    assert plain[0] > 1e-2 and plain[1] > 1e-2, plain


# ---------------------------------------------------------------- config, plan, refusals, records (no device)


def test_tiling_is_a_run_config_key_and_its_own_shape_key(tmp_path):
    path = write_config(tmp_path / "run.yaml", tiny_config(tmp_path, batch_size=1))
    plain = load_config(path)
    tiled = load_config(path, ["tiling=true"])  # the command line's key=value override
    assert not plain.config.tiling and tiled.config.tiling
    assert tiled.config_hash != plain.config_hash
    shapes = {batch.shape for batch in plan_run(tiled).batches}
    assert shapes == {ShapeKey(height=64, width=64, batch_size=1, cfg=True, tiling=True)}
    assert [str(shape) for shape in shapes] == ["64x64 b1 cfg tiled"]
    assert all(item.tiling for item in plan_run(tiled).items)
    assert not any(batch.shape.tiling for batch in plan_run(plain).batches)
    with pytest.raises(InputError) as refused:
        load_config(path, ["tiling=yes please"])
    assert refused.value.lines[0].startswith("tiling:")


def test_tiling_is_refused_for_transformer_families_in_configs_and_requests(tmp_path):
    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service
    from tpugen.plan import ImageWork

    config = tiny_config(tmp_path, model={"id": "tiny-flux"}, tiling=True, serve={"tiling": True})
    with pytest.raises(InputError) as refused:
        load_config(write_config(tmp_path / "run.yaml", config))
    assert refused.value.lines == [f"tiling: {TRANSFORMER_REFUSAL}", f"serve.tiling: {TRANSFORMER_REFUSAL}"]

    server = tiny_config(tmp_path, model={"id": "tiny-flux"}, serve={"new_shapes": "compile"})
    del server["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", server), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    floor = ImageWork(prompt="a floor", negative_prompt="", seed=1, steps=4, guidance_scale=0.0, height=64, width=64)
    with pytest.raises(InputError) as request:
        service.check([replace(floor, tiling=True)])
    assert request.value.lines == [f"tiling: {TRANSFORMER_REFUSAL}"]
    service.check([floor])  # untiled: fine


def test_a_tiled_image_says_so_in_its_parameters_as_the_web_ui_writes_it():
    record = {
        "prompt": "a tiled floor",
        "negative_prompt": "",
        "steps": 20,
        "scheduler": "DDIM",
        "guidance_scale": 7.5,
        "seed": 42,
        "width": 512,
        "height": 512,
        "model": "tiny-sd",
        "tpugen_version": "0.1.0",
    }
    assert a1111_parameters({**record, "tiling": True}).splitlines()[-1] == (
        "Steps: 20, Sampler: DDIM, CFG scale: 7.5, Seed: 42, Size: 512x512, Model: tiny-sd, Tiling: True, "
        "Version: tpugen 0.1.0"
    )
    assert "Tiling" not in a1111_parameters(record)
