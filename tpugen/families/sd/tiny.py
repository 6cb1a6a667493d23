"""The tiny-sd built-in: SD 1.x's architecture with tiny random weights."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import TINY_UNET, clip_text_config, clip_tokenizer, save, tiny_vae


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
    """tiny-sd's ControlNet: its UNet's encoder (ControlNetModel.from_unet, zero convolutions out) with random
    weights, its conditioning embedding downsampling by 8 as the VAE does."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_UNET, cross_attention_dim=32, attention_head_dim=8)
    torch.manual_seed(3)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16))
    # Zero convolutions would make it a no-op: small random ones make a test see that it steers.
    with torch.no_grad():
        for block in [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block]:
            block.weight.normal_(0, 0.05)
        controlnet.controlnet_cond_embedding.conv_out.weight.normal_(0, 0.05)
    controlnet.save_pretrained(target, safe_serialization=True)
