"""Flux.1: double- and single-stream transformer blocks over packed 2x2 latents, CLIP and T5, no CFG."""

from __future__ import annotations

from dataclasses import dataclass

from tpugen.families.base import (
    TRANSFORMER_KEYS,
    UNET_KEYS,
    Builtin,
    FlashRoute,
    KnownModel,
    LoraSign,
    TransformerFamily,
    flow_transformer_call,
    keys_contain,
    keys_start,
)
from tpugen.families.components import CLIP_L, T5_XXL, VAE_16
from tpugen.families.controlnets import TransformerControlNets
from tpugen.sharding import ADALN, ATTENTION, COLUMN, FEED_FORWARD, ROW

FLUX_BLOCK_KEYS = LoraSign(
    "Flux's double- and single-stream block names",
    keys_contain("double_blocks", "single_blocks", "single_transformer_blocks"),
    implies=(TRANSFORMER_KEYS.evidence,),
)
# kohya's (sd-scripts') Flux files, which diffusers' Flux.1 and FLUX.2 loaders both read: lora_unet_ as a UNet's.
FLUX_KOHYA_KEYS = LoraSign(
    "kohya's Flux block names (lora_unet_double_blocks_*, lora_unet_single_blocks_*)",
    keys_start("lora_unet_double_blocks_", "lora_unet_single_blocks_"),
    implies=(UNET_KEYS.evidence, FLUX_BLOCK_KEYS.evidence),
)

_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
}


def _components(guidance_embeds: bool) -> dict:
    return {
        "text_encoder": ("CLIPTextModel", CLIP_L),
        "text_encoder_2": ("T5EncoderModel", T5_XXL),
        "transformer": ("FluxTransformer2DModel", {**_TRANSFORMER, "guidance_embeds": guidance_embeds}),
        "vae": ("AutoencoderKL", VAE_16),
    }


def _build(target):
    from tpugen.families.flux.tiny import build

    build(target)


def _build_controlnet(target):
    from tpugen.families.flux.tiny import build_controlnet

    build_controlnet(target)


def _build_deep(target):
    from tpugen.families.flux.tiny import build

    build(target, double_blocks=19, single_blocks=38)


@dataclass(frozen=True, kw_only=True)
class FluxControlNets(TransformerControlNets):
    """Flux.1's ControlNets: InstantX's and XLabs' layouts, one kind at a time."""

    def unsupported(self, config: dict) -> str | None:
        """A ControlNet-Union (InstantX's, with control modes: num_mode) needs a control type per unit, which no
        unit gives yet (diffusers raises without one)."""
        if config.get("num_mode"):
            return (
                "a ControlNet-Union (its config's num_mode) needs a control type per unit, which tpugen does not pass "
                "yet; use a ControlNet of one kind"
            )
        return None

    def mixed(self, configs: list[dict]) -> str | None:
        """XLabs' Flux.1 ControlNets take the control image as pixels through their input hint block
        (conditioning_embedding_channels), InstantX's as VAE latents: diffusers 0.42's Flux ControlNet pipelines
        prepare the control for every ControlNet as the first one takes it."""
        if len({bool(config.get("conditioning_embedding_channels")) for config in configs}) > 1:
            return (
                "XLabs' ControlNets (with an input hint block) and InstantX's (without) cannot run together: diffusers "
                "0.42's FluxMultiControlNetModel gives every ControlNet the first one's kind of control image"
            )
        return None


class Flux(TransformerFamily):
    name = "flux"
    title = "Flux.1 (schnell, dev)"
    pipeline_classes = ("FluxPipeline",)
    # The timestep in the latents' dtype, one per row, over 1000; no CFG batch (a guidance embedding instead).
    loop_call = flow_transformer_call()
    steps = 4
    # Flux.1 has no classifier-free guidance: schnell ignores guidance_scale, dev embeds it as a number.
    guidance_scale = 0.0
    cfg = False
    guidance_note = "no CFG; dev embeds guidance, schnell ignores it"
    negative_prompt = False
    max_sequence_length = 512  # T5 tokens
    patch = 2  # 2x2 patches of the latent packed into one token
    lora_signs = (TRANSFORMER_KEYS, FLUX_BLOCK_KEYS, FLUX_KOHYA_KEYS)
    builtins = (
        Builtin(
            "tiny-flux",
            "Flux.1-schnell architecture (double and single stream blocks, CLIP and T5) with tiny random weights; noise",
            1,
            _build,
        ),
        # Flux.1's real depth at a tiny width: what compile time (and scan_blocks) is measured on.
        Builtin(
            "tiny-flux-deep",
            "Flux.1's real depth (19 double + 38 single blocks) at a tiny width, for compile-time work; noise",
            1,
            _build_deep,
        ),
    )
    controlnet = FluxControlNets(
        model_class="FluxControlNetModel",
        image_argument="control_image",
        samples_control_first=True,
        multi_class="FluxMultiControlNetModel",
        multi_layout="controlnets",
        multi_layout_from_image="controlnets",
        builtins=(
            Builtin(
                "tiny-flux-controlnet",
                "a ControlNet for tiny-flux (Flux.1's ControlNet: one double- and one single-stream block) with tiny "
                "random weights, built offline: it steers, but toward nothing",
                1,
                _build_controlnet,
            ),
        ),
    )
    known_models = (
        KnownModel(
            "black-forest-labs/FLUX.1-schnell",
            note="not gated; ~34 GB in bfloat16 with T5: more than one v5e or v6e chip",
            components=_components(False),
        ),
        KnownModel(
            "black-forest-labs/FLUX.1-dev",
            steps=28,
            guidance_scale=3.5,
            note="gated (HF_TOKEN); ~34 GB in bfloat16 with T5: more than one chip",
            components=_components(True),
        ),
    )
    scan_attributes = {
        "transformer_blocks": ("encoder_hidden_states", "hidden_states"),
        "single_transformer_blocks": ("encoder_hidden_states", "hidden_states"),
    }
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
    # diffusers' TaylorSeer on FluxTransformer2DModel (CacheMixin); FluxPipeline sets the cache context.
    step_cache_refusal = None

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

    def upscale_latents(self, pipe, latents, height: int, width: int, to_height: int, to_width: int):
        # FluxImg2ImgPipeline takes 16-channel latents unpacked (it packs them itself).
        grid = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return super().upscale_latents(pipe, grid, height, width, to_height, to_width)

    def decode_upscaled(self, pipe, latents, height: int, width: int, device):
        # upscale_latents gives them unpacked: packed again, as decode takes the pipeline's own.
        batch, channels, rows, columns = latents.shape
        return self.decode(pipe, pipe._pack_latents(latents, batch, channels, rows, columns), height, width, device)


FAMILY = Flux()
