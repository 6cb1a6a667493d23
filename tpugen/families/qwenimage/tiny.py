"""The tiny-qwen-image built-in: Qwen-Image's architecture (a Qwen2.5-VL text encoder, the MMDiT transformer, the
5-D VAE) with tiny random weights, at the shapes of diffusers' own test of the pipeline."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import qwen_tokenizer, save_transformer_controlnet

# The system prompt QwenImagePipeline wraps every prompt in, up to the user's text (prompt_template_encode).
TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
# The pipeline drops this many tokens (prompt_template_encode_start_idx): the prefix above in the real tokenizer.
TEMPLATE_TOKENS = 34
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def build(target: Path) -> None:
    from diffusers import QwenImagePipeline

    # Merges for the template's words make its prefix exactly the 34 tokens the pipeline drops.
    tokenizer = template_tokenizer("tiny-qwen-image", TEMPLATE_PREFIX, TEMPLATE_TOKENS)
    QwenImagePipeline(**components(tokenizer), tokenizer=tokenizer).save_pretrained(target)


def template_tokenizer(name: str, prefix: str, tokens: int, *, exact: bool = True):
    """Qwen's byte-level tokenizer with merges for the words of a pipeline's template, so that its `prefix` is
    the `tokens` tokens the pipeline drops (prompt_template_encode_start_idx), as in the real tokenizer; or, not
    `exact`, at least that many (a pipeline that drops fewer than its prefix keeps the prefix's last tokens)."""
    tokenizer, _ = qwen_tokenizer(SPECIAL_TOKENS, words_of=prefix, chat_template=None)
    made = len(tokenizer(prefix).input_ids)
    if made < tokens or (exact and made != tokens):
        raise RuntimeError(f"{name}: the template prefix is {made} tokens, the pipeline drops {tokens}")
    return tokenizer


def components(tokenizer) -> dict:
    """Qwen-Image's transformer, VAE, text encoder (with its vision tower) and scheduler at tiny sizes, from fixed
    seeds, for a tokenizer of SPECIAL_TOKENS (the edit pipelines share them)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    torch.manual_seed(0)
    transformer = tiny_transformer()
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(
        base_dim=12,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],  # the real VAE downsamples by 8; this one by 4
        latents_mean=[0.1, -0.2, 0.05, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    torch.manual_seed(2)
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision_config = {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=vision_config,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    ).eval()
    # Qwen-Image's own scheduler config: resolution-dependent exponential shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        num_train_timesteps=1000,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler, "text_encoder": text_encoder}


def tiny_transformer(**config):
    """The built-ins' QwenImageTransformer2DModel (2 blocks, width 48), from torch's current seed; `config` changes
    its config (zero_cond_t=True: Qwen-Image-Edit-2511's)."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        **{
            "patch_size": 2,
            "in_channels": 16,  # 4 latent channels in 2x2 patches
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 3,
            "joint_attention_dim": 16,  # the text encoder's width
            "guidance_embeds": False,
            "axes_dims_rope": (8, 4, 4),
            **config,
        }
    )


def build_controlnet(target: Path) -> None:
    """tiny-qwen-image's ControlNet (diffusers' QwenImageControlNetModel, one block, started from the tiny
    transformer's weights as diffusers' from_transformer does): its control image enters as VAE latents."""
    import torch
    from diffusers import QwenImageControlNetModel

    torch.manual_seed(0)
    transformer = tiny_transformer()  # tiny-qwen-image's own (seed 0)
    torch.manual_seed(4)
    controlnet = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=1, attention_head_dim=16, num_attention_heads=3
    )
    save_transformer_controlnet(controlnet, target)
