"""Stable Diffusion 3 and 3.5: an MMDiT transformer, two CLIP encoders and T5, flow matching."""

from __future__ import annotations

from tpugen.families.base import (
    SECOND_TEXT_ENCODER,
    THIRD_TEXT_ENCODER,
    TRANSFORMER_KEYS,
    Builtin,
    FlashRoute,
    KnownModel,
    LoopCall,
    TransformerFamily,
)
from tpugen.families.components import CLIP_G, CLIP_L, T5_XXL, VAE_16
from tpugen.sharding import ADALN, ATTENTION, FEED_FORWARD

CLIP_TOKENS = 77  # SD3 joins its CLIP embeddings (77 tokens) and the T5 tokens into one text sequence

_SD35 = {
    "in_channels": 16,
    "out_channels": 16,
    "patch_size": 2,
    "sample_size": 128,
    "attention_head_dim": 64,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 2048,
    "qk_norm": "rms_norm",
}
_ENCODERS = {
    "text_encoder": ("CLIPTextModelWithProjection", CLIP_L),
    "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_G),
    "text_encoder_3": ("T5EncoderModel", T5_XXL),
}


def _build(target):
    from tpugen.families.sd3.tiny import build

    build(target)


class StableDiffusion3(TransformerFamily):
    name = "sd3"
    title = "Stable Diffusion 3 / 3.5"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    # The transformer takes the latents and the timestep by keyword, the timestep expanded to its rows as they are.
    loop_call = LoopCall(
        sample="hidden_states", timestep="timestep", timestep_rows=True, scales_input=False, noising="scale_noise"
    )
    step_cache_refusal = "diffusers 0.42 has no step cache for it: SD3Transformer2DModel has no enable_cache"
    steps = 28
    guidance_scale = 7.0
    max_sequence_length = 256  # T5 tokens
    extra_text_tokens = CLIP_TOKENS
    lora_signs = (TRANSFORMER_KEYS, SECOND_TEXT_ENCODER, THIRD_TEXT_ENCODER)
    builtins = (
        Builtin(
            "tiny-sd3", "SD 3 architecture (MMDiT, two CLIP encoders and T5) with tiny random weights; noise", 1, _build
        ),
    )
    known_models = (
        KnownModel(
            "stabilityai/stable-diffusion-3.5-medium",
            steps=40,
            guidance_scale=4.5,
            note="fits one v6e chip",
            components={
                **_ENCODERS,
                "transformer": (
                    "SD3Transformer2DModel",
                    {
                        **_SD35,
                        "num_layers": 24,
                        "num_attention_heads": 24,
                        "caption_projection_dim": 1536,
                        "pos_embed_max_size": 384,
                        "dual_attention_layers": list(range(13)),
                    },
                ),
                "vae": ("AutoencoderKL", VAE_16),
            },
        ),
        KnownModel(
            "stabilityai/stable-diffusion-3.5-large",
            steps=28,
            guidance_scale=3.5,
            note="~27 GB in bfloat16 with T5: more than one v6e chip once activations count",
            components={
                **_ENCODERS,
                "transformer": (
                    "SD3Transformer2DModel",
                    {
                        **_SD35,
                        "num_layers": 38,
                        "num_attention_heads": 38,
                        "caption_projection_dim": 2432,
                        "pos_embed_max_size": 192,
                    },
                ),
                "vae": ("AutoencoderKL", VAE_16),
            },
        ),
    )
    # The joint blocks; the last one differs (context_pre_only) and stays outside the stack; SD 3.5's blocks
    # with and without dual attention form separate stacks.
    scan_attributes = {"transformer_blocks": ("encoder_hidden_states", "hidden_states")}
    denoiser_rules = {"SD3Transformer2DModel": ATTENTION + FEED_FORWARD + ADALN}
    # diffusers 0.42 leaves SD3's timesteps on the host and hands them to the transformer, which fails on XLA.
    timesteps_on_host = True
    # enable_xla_flash_attention puts XLAFlashAttnProcessor2_0 in place of SD3's JointAttnProcessor2_0, and that
    # processor ignores the joint text stream (add_q_proj, ...): on tiny-sd3 the next layer fails with
    # "Shapes are not compatible for broadcasting" (measured, diffusers 0.42.1). So SD3 keeps its own attention.
    flash_attention = FlashRoute(
        (), unsupported="diffusers 0.42 has no XLA flash-attention processor for SD3's joint attention"
    )


FAMILY = StableDiffusion3()
