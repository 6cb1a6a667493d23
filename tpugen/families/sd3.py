"""Stable Diffusion 3 and 3.5: an MMDiT transformer, two CLIP encoders and T5, flow matching."""

from __future__ import annotations

from tpugen.families.base import FamilyCode, FlashRoute
from tpugen.sharding import ADALN, ATTENTION, FEED_FORWARD


class StableDiffusion3(FamilyCode):
    name = "sd3"
    denoiser = "transformer"
    # The joint blocks; the last one differs (context_pre_only) and stays outside the stack; SD 3.5's blocks
    # with and without dual attention form separate stacks.
    scan_attributes = ("transformer_blocks",)
    denoiser_rules = {"SD3Transformer2DModel": ATTENTION + FEED_FORWARD + ADALN}
    # diffusers 0.42 leaves SD3's timesteps on the host and hands them to the transformer, which fails on XLA.
    timesteps_on_host = True
    # enable_xla_flash_attention puts XLAFlashAttnProcessor2_0 in place of SD3's JointAttnProcessor2_0, and that
    # processor ignores the joint text stream (add_q_proj, ...): on tiny-sd3 the next layer fails with
    # "Shapes are not compatible for broadcasting" (measured, diffusers 0.42.1). So SD3 keeps its own attention.
    flash_attention = FlashRoute(
        (), unsupported="diffusers 0.42 has no XLA flash-attention processor for SD3's joint attention"
    )
