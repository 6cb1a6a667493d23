"""Flux.1: double- and single-stream transformer blocks over packed 2x2 latents, CLIP and T5, no CFG."""

from __future__ import annotations

from tpugen.families.base import FamilyCode, FlashRoute
from tpugen.sharding import ADALN, ATTENTION, COLUMN, FEED_FORWARD, ROW


class Flux(FamilyCode):
    name = "flux"
    denoiser = "transformer"
    scan_attributes = ("transformer_blocks", "single_transformer_blocks")
    denoiser_rules = {
        "FluxTransformer2DModel": ATTENTION
        + FEED_FORWARD
        + ADALN
        + [
            (r"^single_transformer_blocks\.\d+\.proj_mlp$", COLUMN),
            (r"^single_transformer_blocks\.\d+\.proj_out$", ROW),
            (r"^single_transformer_blocks\.\d+\.norm\.linear$", COLUMN),
        ]
    }
    # diffusers 0.42 keeps Flux's timesteps on the device, so every step's value is baked into its graph.
    timesteps_on_host = True
    # Flux's own processors on diffusers' "_native_xla" attention backend: the kernel for every attention, at any
    # size, but with no SPMD partition spec (diffusers 0.42 ignores the one it is given).
    flash_attention = FlashRoute(("transformer",), is_flux=True, takes_partition_spec=False)

    def noise(self, pipe, generators, height: int, width: int) -> list:
        """Flux's latents are packed: 2x2 patches of a 16-channel latent become one token of 64 channels."""
        import torch

        scale = pipe.vae_scale_factor
        channels = pipe.transformer.config.in_channels // 4
        h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
        noise = [torch.randn((1, channels, h, w), generator=g, dtype=torch.float32) for g in generators]
        return [pipe._pack_latents(n, 1, channels, h, w) for n in noise]

    def vae_latents(self, pipe, latents, height: int, width: int):
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return super().vae_latents(pipe, latents, height, width)
