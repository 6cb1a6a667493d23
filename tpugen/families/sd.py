"""Stable Diffusion 1.x and 2.x: a UNet over 4-channel latents, one CLIP text encoder, CFG."""

from __future__ import annotations

from tpugen.families.base import FamilyCode


class StableDiffusion(FamilyCode):
    """Everything in FamilyCode is SD's own behaviour."""

    name = "sd"
