"""The tiny-sdxl built-in: SDXL's architecture (two CLIP encoders, text-time embeddings) with tiny random weights."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import TINY_UNET, clip_text_config, clip_tokenizer, save, save_tiny_controlnet, tiny_vae

TINY_SDXL_UNET = dict(
    TINY_UNET,
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    # 6 size/crop numbers embedded in 8 each, plus the second encoder's pooled projection (32)
    projection_class_embeddings_input_dim=80,
    cross_attention_dim=64,  # both encoders' hidden states side by side
)


def build(target: Path) -> None:
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = clip_tokenizer(scratch)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_SDXL_UNET)
    torch.manual_seed(1)
    vae = tiny_vae(4)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(clip_text_config(ids))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(clip_text_config(ids, projection_dim=32))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    save(pipe, target, scratch)


def build_controlnet(target: Path) -> None:
    """tiny-sdxl's ControlNet: its UNet's encoder, with the text-time embeddings, and random weights."""
    save_tiny_controlnet(TINY_SDXL_UNET, target, seed=4)
