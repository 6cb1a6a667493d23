"""Stable Diffusion XL: SD's UNet layout at a larger size, two CLIP encoders and text-time embeddings."""

from __future__ import annotations

from tpugen.families.base import SECOND_TEXT_ENCODER, UNET_KEYS, Builtin, Family, KnownModel, LoraSign, keys_start
from tpugen.families.components import CLIP_G, CLIP_L, VAE_4
from tpugen.families.controlnets import ControlNets

# kohya names SDXL's UNet blocks by the original model's layout (input/middle/output blocks).
SDXL_UNET_KEYS = LoraSign(
    "SDXL UNet block names (lora_unet_input_blocks_*)",
    keys_start("lora_unet_input_blocks", "lora_unet_middle_block", "lora_unet_output_blocks"),
    implies=(UNET_KEYS.evidence,),
)

_UNET = {
    "block_out_channels": [320, 640, 1280],
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "cross_attention_dim": 2048,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "use_linear_projection": True,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "sample_size": 128,
}


def _build(target):
    from tpugen.families.sdxl.tiny import build

    build(target)


def _build_controlnet(target):
    from tpugen.families.sdxl.tiny import build_controlnet

    build_controlnet(target)


class StableDiffusionXL(Family):
    name = "sdxl"
    title = "Stable Diffusion XL"
    pipeline_classes = ("StableDiffusionXLPipeline",)
    size = 1024
    guidance_scale = 5.0
    lora_signs = (UNET_KEYS, SDXL_UNET_KEYS, SECOND_TEXT_ENCODER)
    builtins = (
        Builtin(
            "tiny-sdxl",
            "SDXL architecture (two CLIP encoders, text-time embeddings) with tiny random weights; noise",
            1,
            _build,
        ),
    )
    controlnet = ControlNets(
        addition_embed="text_time",
        multi_layout="controlnet batches",
        builtins=(
            Builtin(
                "tiny-sdxl-controlnet",
                "a ControlNet for tiny-sdxl with tiny random weights, built offline: it steers, but toward nothing",
                1,
                _build_controlnet,
            ),
        ),
    )
    known_models = (
        KnownModel(
            "stabilityai/stable-diffusion-xl-base-1.0",
            note="fits one v5e chip in bfloat16",
            components={
                "text_encoder": ("CLIPTextModel", CLIP_L),
                "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_G),
                "unet": ("UNet2DConditionModel", _UNET),
                "vae": ("AutoencoderKL", VAE_4),
            },
        ),
    )

    clip_tokenizers = ("tokenizer", "tokenizer_2")
    # The web UI reads SDXL's prompts from both encoders' penultimate layers and leaves its clip skip setting out.
    clip_skip_refusal = "SDXL reads both encoders' penultimate layers, as the web UI does; clip skip is for SD 1.x/2.x"

    def clip_embeddings(
        self, pipe, prompts: list[str], negatives: list[str] | None, chunks: int, clip_skip: int = 1
    ) -> dict:
        from tpugen.families.clip_text import sdxl_embeddings

        return sdxl_embeddings(pipe, prompts, negatives, chunks)

    def load_options(self, model) -> dict:
        # The invisible watermark runs on the host and is not saved in model_index.json: off unless asked.
        return {"add_watermarker": model.watermark}


FAMILY = StableDiffusionXL()
