"""The tiny-sd3 built-in: SD 3's architecture (MMDiT, two CLIP encoders and T5) with tiny random weights."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import clip_text_config, clip_tokenizer, save, t5_encoder, t5_tokenizer, tiny_vae


def build(target: Path) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = clip_tokenizer(scratch)
    t5, t5_vocab = t5_tokenizer()
    torch.manual_seed(0)
    transformer = tiny_transformer(2)
    torch.manual_seed(1)
    vae = tiny_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(2)
    text_encoder = CLIPTextModelWithProjection(clip_text_config(ids, projection_dim=32))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(clip_text_config(ids, projection_dim=32))
    torch.manual_seed(4)
    text_encoder_3 = t5_encoder(t5_vocab, 32)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5,
    )
    save(pipe, target, scratch)


def tiny_transformer(layers: int, dual_attention_layers: tuple[int, ...] = ()):
    """A random SD3 (MMDiT) transformer at a tiny width; SD 3.5 Medium's first blocks have dual attention."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=layers,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,  # = T5's d_model, so CLIP's padded embeddings are not cropped
        pooled_projection_dim=64,  # both CLIP encoders' pooled projections side by side
        out_channels=4,
        dual_attention_layers=dual_attention_layers,
    )
