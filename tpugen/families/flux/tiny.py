"""The tiny-flux built-ins: Flux.1-schnell's architecture with tiny random weights, at two depths."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import (
    clip_text_config,
    clip_tokenizer,
    save,
    save_transformer_controlnet,
    t5_encoder,
    t5_tokenizer,
    tiny_vae,
)


def tiny_transformer(double_blocks: int, single_blocks: int):
    """Flux.1's transformer at a tiny width (random weights from the current torch seed)."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=double_blocks,
        num_single_layers=single_blocks,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,  # like FLUX.1-schnell
        axes_dims_rope=[4, 4, 8],
    )


def build(target: Path, double_blocks: int = 2, single_blocks: int = 2) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = clip_tokenizer(scratch)
    t5, t5_vocab = t5_tokenizer()
    torch.manual_seed(0)
    transformer = tiny_transformer(double_blocks, single_blocks)
    torch.manual_seed(1)
    vae = tiny_vae(4, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(clip_text_config(ids))
    torch.manual_seed(3)
    text_encoder_2 = t5_encoder(t5_vocab, 32)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5,
        transformer=transformer,
    )
    save(pipe, target, scratch)


def build_controlnet(target: Path) -> None:
    """tiny-flux's ControlNet (diffusers' FluxControlNetModel, one double- and one single-stream block, started from
    the tiny transformer's weights as diffusers' from_transformer does): its control image enters as VAE latents."""
    import torch
    from diffusers import FluxControlNetModel

    torch.manual_seed(0)
    transformer = tiny_transformer(2, 2)  # tiny-flux's own (seed 0)
    torch.manual_seed(4)
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2
    )
    save_transformer_controlnet(controlnet, target)
