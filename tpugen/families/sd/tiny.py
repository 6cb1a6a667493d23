"""The tiny-sd built-in: SD 1.x's architecture with tiny random weights."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import TINY_UNET, clip_text_config, clip_tokenizer, save, save_tiny_controlnet, tiny_vae


def build(target: Path) -> None:
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = clip_tokenizer(scratch)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        **TINY_UNET,
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    torch.manual_seed(1)
    vae = tiny_vae(4)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(clip_text_config(ids))
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    save(pipe, target, scratch)


def build_controlnet(target: Path) -> None:
    """tiny-sd's ControlNet: its UNet's encoder with random weights."""
    save_tiny_controlnet(dict(TINY_UNET, cross_attention_dim=32, attention_head_dim=8), target, seed=3)
