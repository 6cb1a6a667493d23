"""Stable Diffusion 1.x and 2.x: a UNet over 4-channel latents, one CLIP text encoder, CFG."""

from __future__ import annotations

from tpugen.families.base import Builtin, Family, KnownModel
from tpugen.families.components import CLIP_H, CLIP_L, VAE_4
from tpugen.families.controlnets import ControlNets


def _build(target):
    from tpugen.families.sd.tiny import build

    build(target)


def _build_shapes(target):
    from tpugen.families.sd.shapes.build import build

    build(target)


def _build_controlnet(target):
    from tpugen.families.sd.tiny import build_controlnet

    build_controlnet(target)


def _build_shapes_controlnet(target):
    from tpugen.families.sd.shapes.build import build_controlnet

    build_controlnet(target)


class StableDiffusion(Family):
    """Everything in Family is SD's own behaviour; this adds its models."""

    builtins = (
        Builtin(
            "tiny-sd", "SD 1.x architecture with tiny random weights, built offline; its images are noise", 1, _build
        ),
        Builtin(
            "tiny-shapes",
            "SD 1.x architecture with trained weights that ship with tpugen; draws what it is told, not noise: "
            "'a red circle on a blue background' (6 colours; circle, square, triangle)",
            1,
            _build_shapes,
            steps=20,
            guidance_scale=4.0,
        ),
    )
    controlnet = ControlNets(
        builtins=(
            Builtin(
                "tiny-sd-controlnet",
                "a ControlNet for tiny-sd with tiny random weights, built offline: it steers, but toward nothing",
                1,
                _build_controlnet,
            ),
            Builtin(
                "tiny-shapes-controlnet",
                "a ControlNet for tiny-shapes, trained here, that ships with tpugen: a white shape on black (64x64) "
                "places the shape the prompt asks for",
                1,
                _build_shapes_controlnet,
            ),
        )
    )
    known_models = (
        KnownModel(
            "stable-diffusion-v1-5/stable-diffusion-v1-5",
            note="fits one v5e chip",
            components={
                "text_encoder": ("CLIPTextModel", CLIP_L),
                "unet": ("UNet2DConditionModel", {"cross_attention_dim": 768, "attention_head_dim": 8}),
                "vae": ("AutoencoderKL", VAE_4),
            },
        ),
        KnownModel(
            "stabilityai/stable-diffusion-2-1",
            size=768,
            note="fits one v5e chip",
            components={
                "text_encoder": ("CLIPTextModel", CLIP_H),
                "unet": (
                    "UNet2DConditionModel",
                    {"cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20], "use_linear_projection": True},
                ),
                "vae": ("AutoencoderKL", VAE_4),
            },
        ),
    )


FAMILY = StableDiffusion()
