"""Z-Image and Z-Image-Turbo: a single-stream DiT (image and text tokens in one sequence, after noise and context
refiners), a Qwen3 text encoder, Flux.1's 16-channel VAE; CFG whenever guidance is above 0."""

from __future__ import annotations

from dataclasses import dataclass

from tpugen.families.base import (
    TRANSFORMER_KEYS,
    UNET_KEYS,
    Builtin,
    FlashRoute,
    KnownModel,
    LoopCall,
    LoraSign,
    TransformerFamily,
    keys_start,
)
from tpugen.families.components import VAE_16
from tpugen.families.controlnets import RESIDUALS_OF_A_UNET, ControlNets
from tpugen.sharding import COLUMN, ROW

_TRANSFORMER = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "cap_feat_dim": 2560,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
# Qwen3-4B; Z-Image reads its second-to-last hidden state.
_QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def _build(target):
    from tpugen.families.zimage.tiny import build

    build(target)


def _build_controlnet(target):
    from tpugen.families.zimage.tiny import build_controlnet

    build_controlnet(target)


@dataclass(frozen=True, kw_only=True)
class ZImageControlNets(ControlNets):
    """Z-Image's ControlNets (Z-Image-Turbo-Fun-Controlnet-Union): one beside each control layer of the DiT."""

    residual_weights_refusal: str | None = RESIDUALS_OF_A_UNET

    def refusal(self, task: str, controlnets: list[dict] | tuple = ()) -> str | None:
        """ZImageControlNetInpaintPipeline takes a 2.x ControlNet (33 channels: the mask and the masked image beside
        the control); a 1.0 one's control is the latents alone (16 channels, the transformer's own)."""
        if task == "inpaint" and any(config.get("control_in_dim", 33) <= 16 for config in controlnets):
            return (
                "a ControlNet whose control has 16 channels (Z-Image-Turbo-Fun-Controlnet-Union 1.0) cannot inpaint: "
                "diffusers 0.42's ZImageControlNetInpaintPipeline takes a 2.x one (33 channels: the mask and the "
                "masked image beside the control)"
            )
        return super().refusal(task, controlnets)

    def residuals(self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int) -> int | None:
        """A ZImageControlNetModel's hints: one per control layer over the joint sequence (the image's patches and
        the text, each padded to a multiple of 32; its refiner-stage hints stay inside it)."""
        side = vae_scale * 2
        image = (height // side) * (width // side)
        joint = image + (-image) % 32 + text_tokens + (-text_tokens) % 32
        return len(config["control_layers_places"]) * joint * config["dim"]


class ZImage(TransformerFamily):
    latent_upscale_refusal = "ZImageImg2ImgPipeline encodes pixels; use upscaler: lanczos"
    name = "zimage"
    title = "Z-Image"
    pipeline_classes = ("ZImagePipeline",)
    # A whole loop on its fixed-length device part (loop_body): the frames and timestep by position.
    loop_call = LoopCall(sample=0, timestep=1, scales_input=False, noising="scale_noise")
    step_cache_refusal = "diffusers 0.42 has no step cache for it: ZImageTransformer2DModel has no enable_cache"
    # Its fixed-length text path reads each caption's real length (a Python number) for the position tables, which
    # it builds on the host; the part after them takes only tensors (static.DEVICE_FORWARD).
    traced_method = "tpugen_device_forward"
    steps = 50
    guidance_scale = 5.0
    max_sequence_length = 512  # text padded to this many tokens (the pipeline's default), masked as keys
    # diffusers' converter also reads kohya files, which name the transformer's layers lora_unet_layers_*.
    lora_signs = (
        TRANSFORMER_KEYS,
        LoraSign(
            "kohya's Z-Image layer names (lora_unet_layers_*)", keys_start("lora_unet_layers_"), (UNET_KEYS.evidence,)
        ),
    )
    builtins = (
        Builtin(
            "tiny-z-image",
            "Z-Image architecture (Qwen3 text encoder, single-stream DiT with refiners) with tiny random weights; noise",
            1,
            _build,
        ),
    )
    controlnet = ZImageControlNets(
        model_class="ZImageControlNetModel",
        image_argument="control_image",
        # Its ControlNet's traced part takes only tensors, as the transformer's does (static.DEVICE_FORWARD).
        traced_method="tpugen_device_forward",
        loop_refusal=(
            "ZImageControlNetPipeline lends its ControlNet the transformer's embedders and refiners as it is made, "
            "and Z-Image's whole loop (its fixed-length device part) does not call a ControlNet yet"
        ),
        img2img_refusal=(
            "diffusers 0.42 has no ControlNet img2img pipeline for Z-Image; a controlled prompt starts from noise, or "
            "inpaints with a mask_image"
        ),
        # ZImageControlNetInpaintPipeline: the ControlNet is given the control, the mask and the masked image's
        # latents (its 33 channels), and the picture is drawn from noise.
        pipelines={"inpaint": "ZImageControlNetInpaintPipeline"},
        inpaint_strength_refusal=(
            "ControlNet inpainting starts from noise (diffusers 0.42's ZImageControlNetInpaintPipeline takes no "
            "strength: the ControlNet is given the masked image); set the strength to 1"
        ),
        multi_refusal=(
            "one ControlNet at a time (diffusers 0.42's ZImageControlNetPipeline takes one ZImageControlNetModel and has "
            "no multi-ControlNet class)"
        ),
        window_refusal=(
            "the ControlNet runs at every step (diffusers 0.42's ZImageControlNetPipeline has no control_guidance_start "
            "or _end); leave the start at 0 and the end at 1"
        ),
        builtins=(
            Builtin(
                "tiny-z-image-controlnet",
                "a ControlNet for tiny-z-image (Z-Image's ControlNet in the 2.1 layout: a refiner-stage block and one "
                "beside each main layer) with tiny random weights, built offline: it steers, but toward nothing",
                1,
                _build_controlnet,
            ),
        ),
    )
    known_models = (
        KnownModel(
            "Tongyi-MAI/Z-Image-Turbo",
            steps=9,
            guidance_scale=0.0,
            note=(
                "distilled: 9 steps, no CFG; 20.5 GB in bfloat16 (6.15B DiT 12.3 GB, Qwen3-4B 8.0 GB): fits one v6e "
                "or v5p chip; on v5e offload, or SPMD over 2+ chips"
            ),
            components={
                "text_encoder": ("Qwen3Model", _QWEN3_4B),
                "transformer": ("ZImageTransformer2DModel", _TRANSFORMER),
                "vae": ("AutoencoderKL", VAE_16),
            },
        ),
    )
    # The refiners and the main layers are blocks of one kind, each returning the sequence it was given.
    scan_attributes = {"noise_refiner": ("x",), "context_refiner": ("x",), "layers": ("x",)}
    denoiser_rules = {
        "ZImageTransformer2DModel": [
            (r"(^|\.)attention\.(to_q|to_k|to_v)$", COLUMN),
            (r"(^|\.)attention\.to_out\.0$", ROW),
            (r"(^|\.)feed_forward\.(w1|w3)$", COLUMN),
            (r"(^|\.)feed_forward\.w2$", ROW),
            (r"(^|\.)adaLN_modulation\.0$", COLUMN),
        ]
    }
    # Text of a fixed length needs a key mask, and diffusers 0.42's XLA attention backend refuses masks.
    flash_attention = FlashRoute(
        (), unsupported="diffusers 0.42's XLA flash attention takes no mask, and Z-Image's padded text needs one"
    )

    def attention_geometry(
        self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int
    ) -> tuple[int, int]:
        side = vae_scale * 2
        return (height // side) * (width // side) + text_tokens, config["n_heads"]

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 0  # ZImagePipeline's own rule: g = 1 still runs the negative pass

    guidance_note = "CFG above guidance 0 (Turbo: guidance 0, no CFG)"

    def install_hooks(self, pipe, device, hooks) -> None:
        """The timestep (the transformer's second positional argument) moved to the device at its door, and the
        text at a fixed length (tpugen.families.zimage.static; measured on XLA:CPU, diffusers 0.42.1: as shipped
        8 compiles and 10 host reads for a first call, and every new prompt length or step count compiled
        again; with both, 3 and 1)."""
        from tpugen.families.zimage import static

        _timestep_at_the_door(pipe.transformer, device, hooks, "the denoiser's")
        static.install(pipe, hooks)
        static.precompute_rope(pipe.transformer, device, hooks)

    def controlnet_hooks(self, controlnet, device, hooks, label: str) -> None:
        """The timestep moved to the device at the ControlNet's door too, and its fixed-length path (its embedders,
        refiners and rotary tables are the transformer's, lent by the ControlNet pipeline)."""
        from tpugen.families.zimage import static

        _timestep_at_the_door(controlnet, device, hooks, f"the {label}'s")
        static.install_on_controlnet(controlnet, hooks, label)

    def loop_body(self, denoiser, args: tuple, kwargs: dict, variables: dict):
        """ZImagePipeline's step on the transformer's fixed-length device part (tpugen.families.zimage.loop)."""
        from tpugen.families.zimage.loop import loop_body

        return loop_body(denoiser, args, kwargs, variables)

    def pipeline_hooks(self, pipe, hooks) -> None:
        from tpugen.families.zimage import static

        static.install_on_pipeline(pipe, hooks)


def _timestep_at_the_door(module, device, hooks, whose: str) -> None:
    """The timestep (the second positional argument of Z-Image's transformer and ControlNet) moved to the device as
    `module` is called: the pipeline keeps its timesteps on the host."""

    def to_device(module, args, kwargs):
        if len(args) > 1 and str(args[1].device) != str(device):
            args = (args[0], args[1].to(device), *args[2:])
        return args, kwargs

    handle = module.register_forward_pre_hook(to_device, with_kwargs=True)
    hooks.add(f"timesteps at {whose} door", handle.remove)


FAMILY = ZImage()
