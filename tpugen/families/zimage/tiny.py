"""The tiny-z-image built-in: Z-Image's architecture (a Qwen3 text encoder, the single-stream DiT with its noise
and context refiners, Flux's 16-channel VAE) with tiny random weights, at the shapes of diffusers' own test."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import qwen_tokenizer


def build(target: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer, vocab_size = qwen_tokenizer()
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=16,  # the text encoder's width
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 32, 32],  # the real model's text axis: captions of up to 512 tokens need it
    )
    with torch.no_grad():  # learned padding embeddings: random, not zero, so a wrong mask shows
        transformer.x_pad_token.copy_(torch.randn_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.randn_like(transformer.cap_pad_token))
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 16, 16, 16],  # four levels: the VAE downsamples by 8, as the real one
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(2)
    text_encoder = Qwen3Model(
        Qwen3Config(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=vocab_size,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )
    # Z-Image's own scheduler config: a fixed shift of 3.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    ZImagePipeline(
        transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer
    ).save_pretrained(target)


def build_controlnet(target: Path) -> None:
    """tiny-z-image's ControlNet (diffusers' ZImageControlNetModel in the layout of the published 2.1 ones: control
    blocks beside the refiner and beside both main layers, a 33-channel control input of which the VAE latents fill
    16): its own blocks only, since the pipeline lends it the transformer's embedders and refiners
    (ZImageControlNetModel.from_transformer). Its zero projections are made small and random so that it steers."""
    import torch
    from diffusers import ZImageControlNetModel

    torch.manual_seed(4)
    controlnet = ZImageControlNetModel(
        control_layers_places=[0, 1],
        control_refiner_layers_places=[0],
        control_in_dim=33,
        add_control_noise_refiner="control_noise_refiner",
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        dim=32,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
    )
    with torch.no_grad():
        for block in [*controlnet.control_layers, *controlnet.control_noise_refiner]:
            for projection in (getattr(block, "before_proj", None), block.after_proj):
                if projection is not None:
                    projection.weight.normal_(0, 0.05)
    controlnet.save_pretrained(target, safe_serialization=True)
