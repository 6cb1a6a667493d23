"""The tiny FLUX.2 built-ins: [klein] (a Qwen3 text encoder; base with CFG, and distilled) and [dev] (a Mistral 3
text encoder and its Pixtral processor), both on FLUX.2's transformer and VAE at a tiny width. The text encoders
have as many layers as the pipelines' default `text_encoder_out_layers` need ((9, 18, 27) and (10, 20, 30))."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.parts import QWEN_SPECIAL_TOKENS, byte_symbols, qwen_tokenizer

LATENT_CHANNELS = 4  # the real VAE has 32 (128 in the transformer after the 2x2 patches)
TEXT_WIDTH = 16  # the transformer reads three text layers side by side: joint_attention_dim = 3 x 16
# FLUX.1-dev's scheduler config, which diffusers' FLUX.2 conversion loads for FLUX.2.
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
# Mistral's special tokens at their real ids, the rest of its first 20 ids as placeholders.
MISTRAL_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 10: "[IMG]", 11: "<pad>"}
MISTRAL_SPECIAL |= {12: "[IMG_BREAK]", 13: "[IMG_END]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]"}
# Mistral Small 3's template, text only: the content is a string or a list of {"type": "text"} parts.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}"
    "{%- set text.v = text.v + part['text'] -%}{%- endif -%}{%- endfor -%}"
    "{%- set text = text.v -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def _transformer(guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),
        rope_theta=2000,
        guidance_embeds=guidance_embeds,
    )


def _vae():
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),  # four levels: the VAE downsamples by 8, as the real one
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
    )
    # Statistics other than a fresh BatchNorm's 0 and 1, so a decode that skips the de-normalisation shows.
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.running_mean.numel()))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.numel()))
    return vae


def build_klein(target: Path, distilled: bool = False, kv: bool = False) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer, vocab_size = qwen_tokenizer((*QWEN_SPECIAL_TOKENS, "<think>", "</think>"))
    torch.manual_seed(0)
    transformer = _transformer(guidance_embeds=False)
    torch.manual_seed(1)
    vae = _vae()
    torch.manual_seed(2)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=TEXT_WIDTH,
            intermediate_size=32,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    # The KV variant is the same weights under Flux2KleinKVPipeline (its processors are set when it is made).
    pipeline = Flux2KleinKVPipeline if kv else Flux2KleinPipeline
    pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    ).save_pretrained(target)


def _mistral_processor():
    """A Pixtral processor: a byte-level tokenizer with Mistral's special ids (padding on the left, as Mistral
    Small 3's), a small image processor, a text-only template. transformers needs torchvision to build it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    special = [MISTRAL_SPECIAL.get(i, f"<SPECIAL_{i}>") for i in range(20)]
    vocab = {token: i for i, token in enumerate(special)}
    for symbol in byte_symbols():
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=[t for t in special if t not in ("<s>", "</s>", "<unk>", "<pad>")],
        model_max_length=131072,
        padding_side="left",
    )
    images = PixtralImageProcessor(size={"longest_edge": 32}, patch_size={"height": 8, "width": 8})
    return PixtralProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        spatial_merge_size=2,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def build_dev(target: Path) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = _mistral_processor()
    tokenizer = processor.tokenizer
    torch.manual_seed(0)
    transformer = _transformer(guidance_embeds=True)
    torch.manual_seed(1)
    vae = _vae()
    torch.manual_seed(2)
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<s>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("</s>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<pad>"),
    }
    text = {
        "model_type": "mistral",
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": 31,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        **ids,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "intermediate_size": 32,
        "image_size": 32,
        "patch_size": 8,
        "num_channels": 3,
    }
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=2,
            vision_feature_layer=-1,
            **ids,
        )
    ).eval()
    Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=transformer,
    ).save_pretrained(target)
