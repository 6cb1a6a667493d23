"""Qwen-Image: a 60-block MMDiT over 2x2-packed latents of a 5-D (video-shaped) VAE, a Qwen2.5-VL text encoder,
and true classifier-free guidance with a negative prompt (`true_cfg_scale`)."""

from __future__ import annotations

from tpugen.families.base import (
    TRANSFORMER_KEYS,
    UNET_KEYS,
    Builtin,
    FlashRoute,
    KnownModel,
    LoraSign,
    TransformerFamily,
    flow_transformer_call,
    keys_start,
)
from tpugen.families.controlnets import TransformerControlNets
from tpugen.sharding import ADALN, ATTENTION, COLUMN, ROW

_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
# Qwen2.5-VL-7B-Instruct; only its last hidden state is used (the vision tower and lm_head are loaded, not run).
_TEXT_ENCODER = {
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
    },
}
_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
}


def _build(target):
    from tpugen.families.qwenimage.tiny import build

    build(target)


def _build_controlnet(target):
    from tpugen.families.qwenimage.tiny import build_controlnet

    build_controlnet(target)


def components(**transformer) -> dict[str, tuple[str, dict]]:
    """Qwen-Image's components for counting on the meta device (KnownModel), its transformer's config changed by
    `transformer` (the edit models share the rest)."""
    return {
        "text_encoder": ("Qwen2_5_VLForConditionalGeneration", _TEXT_ENCODER),
        "transformer": ("QwenImageTransformer2DModel", {**_TRANSFORMER, **transformer}),
        "vae": ("AutoencoderKLQwenImage", _VAE),
    }


_NO_CONTROLLED_IMAGE = (
    "diffusers 0.42's AutoPipeline makes no ControlNet img2img or inpainting pipeline for Qwen-Image; a "
    "controlled prompt starts from noise"
)


class QwenImage(TransformerFamily):
    latent_upscale_refusal = (
        "QwenImageImg2ImgPipeline encodes pixels (its latents are packed, its VAE's 5-D); use upscaler: lanczos"
    )
    name = "qwenimage"
    title = "Qwen-Image"
    pipeline_classes = ("QwenImagePipeline",)
    # True CFG: a second transformer call with the negative prompt's embeddings and mask, the combined prediction
    # rescaled to the conditional one's norm.
    loop_call = flow_transformer_call(
        cfg="calls",
        cfg_by_call=(
            ("encoder_hidden_states_mask", "negative_prompt_embeds_mask"),
            ("encoder_hidden_states", "negative_prompt_embeds"),
        ),
        cfg_flag="do_true_cfg",
        cfg_scale="true_cfg_scale",
        cfg_rescale="norm",
    )
    size = 1328  # the model card's 1:1 size
    steps = 50
    guidance_scale = 4.0  # true_cfg_scale: CFG is two transformer passes per step, each with its own text
    max_sequence_length = 512  # text padded to this many tokens (the pipeline's default), with a mask
    # diffusers' converter also reads kohya files, which name the transformer's blocks lora_unet_*.
    lora_signs = (
        TRANSFORMER_KEYS,
        LoraSign(
            "kohya's Qwen-Image block names (lora_unet_transformer_blocks_*)",
            keys_start("lora_unet_transformer_blocks_"),
            (UNET_KEYS.evidence,),
        ),
    )
    builtins = (
        Builtin(
            "tiny-qwen-image",
            "Qwen-Image architecture (Qwen2.5-VL text encoder, MMDiT, 5-D VAE) with tiny random weights; noise",
            1,
            _build,
        ),
    )
    controlnet = TransformerControlNets(
        model_class="QwenImageControlNetModel",
        image_argument="control_image",
        samples_control_first=True,
        img2img_refusal=_NO_CONTROLLED_IMAGE,
        inpaint_refusal=_NO_CONTROLLED_IMAGE,
        multi_refusal=(
            "one ControlNet at a time (diffusers 0.42's QwenImageMultiControlNetModel runs a single ControlNet-Union "
            "only: it raises for two ControlNets)"
        ),
        builtins=(
            Builtin(
                "tiny-qwen-image-controlnet",
                "a ControlNet for tiny-qwen-image (Qwen-Image's ControlNet: one block) with tiny random weights, built "
                "offline: it steers, but toward nothing",
                1,
                _build_controlnet,
            ),
        ),
    )
    known_models = (
        KnownModel(
            "Qwen/Qwen-Image",
            note=(
                "57.7 GB in bfloat16 (20.4B transformer 40.9 GB, 8.29B Qwen2.5-VL 16.6 GB): fits one v5p chip; "
                "SPMD over 4+ v6e chips or 8 v5e chips"
            ),
            components=components(),
        ),
    )
    scan_attributes = {"transformer_blocks": ("encoder_hidden_states", "hidden_states")}
    # diffusers' TaylorSeer on QwenImageTransformer2DModel (CacheMixin); the pipeline names the cond and uncond contexts.
    step_cache_refusal = None
    denoiser_rules = {
        "QwenImageTransformer2DModel": ATTENTION
        + ADALN
        + [
            (r"(^|\.)(img|txt)_mlp\.net\.0\.proj$", COLUMN),
            (r"(^|\.)(img|txt)_mlp\.net\.2$", ROW),
            # The modulation projections (a third of each block's weights): split by their outputs.
            (r"(^|\.)(img|txt)_mod\.1$", COLUMN),
        ]
    }
    # The attention takes a padding mask for the text (tpugen pads it to a fixed length), and diffusers 0.42's
    # XLA attention backend refuses masks.
    flash_attention = FlashRoute(
        (), unsupported="diffusers 0.42's XLA flash attention takes no mask, and Qwen-Image's text needs one"
    )

    def noise(self, pipe, generators, height: int, width: int) -> list:
        """A (frame, channel, h, w) latent per image, packed into 2x2 patches as the pipeline packs it."""
        import torch

        scale = pipe.vae_scale_factor
        channels = pipe.transformer.config.in_channels // 4
        h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
        noise = [torch.randn((1, 1, channels, h, w), generator=g, dtype=torch.float32) for g in generators]
        return [pipe._pack_latents(n, 1, channels, h, w) for n in noise]

    def call_arguments(self, pipe, rows, guidance_scale: float) -> dict:
        # Qwen-Image's guidance is true CFG (a second pass with the negative prompt); guidance_scale is only for
        # guidance-distilled models, which it is not.
        return {
            "true_cfg_scale": guidance_scale,
            "guidance_scale": None,
            "max_sequence_length": self.max_sequence_length,
        }

    def decode(self, pipe, latents, height: int, width: int, device):
        """Unpacked to one frame, un-normalised by the VAE's latents_mean and latents_std, decoded, frame dropped."""
        import torch

        vae = pipe.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(device, vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1)

    def install_hooks(self, pipe, device, hooks) -> None:
        """Timesteps at the door (TransformerFamily), and three patches that keep every graph's shapes static and
        every value on the device (measured on XLA:CPU, diffusers 0.42.1: 14 compiles and 11 host reads per call
        as shipped, a new prompt length or step count compiling again; 3 and 1 with them):

        - text of a fixed length: diffusers pads prompts to the longest, picks the real tokens out with a boolean
          mask (a read to the host) and `.tolist()`, and re-pads; here each prompt is padded to
          max_sequence_length on the host and its mask kept (the masked attention gives the same image);
        - the image RoPE table computed on the host once per shape (diffusers caches it on the device, so the
          first step's graph also made the table, and differed from every later step's);
        - the VAE's "nearest-exact" 2x upsampling as "nearest" (the same pixels for a factor of 2), which
          torch_xla lowers (the exact one ran on the CPU, a host read per upsampler)."""

        super().install_hooks(pipe, device, hooks)
        self.pipeline_hooks(pipe, hooks)
        _rope_hooks(pipe.transformer.pos_embed, hooks, "")
        hooks.add("VAE upsampling lowered", _nearest_upsampling(pipe.vae))

    def controlnet_hooks(self, controlnet, device, hooks, label: str) -> None:
        """Timesteps at its door, and its image RoPE table on the host, as the transformer's."""
        super().controlnet_hooks(controlnet, device, hooks, label)
        _rope_hooks(controlnet.pos_embed, hooks, f" ({label})")

    def pipeline_hooks(self, pipe, hooks) -> None:
        """The text of a fixed length, with its mask kept (QwenImageImg2ImgPipeline and the inpaint pipeline
        encode their text with the same two methods)."""
        import types

        hooks.wrap(pipe, "_get_qwen_prompt_embeds", "text of a fixed length", lambda _: types.MethodType(_text, pipe))
        hooks.wrap(pipe, "encode_prompt", "text mask kept", lambda _: types.MethodType(_encode_prompt, pipe))


def _text(pipe, prompt=None, device=None, dtype=None, max_sequence_length: int = 512):
    """The last hidden state of the text encoder for each prompt, padded to `max_sequence_length` tokens after the
    template's prefix, and its mask. The encoder runs without the mask: it is causal and the padding is on the
    right, so the real tokens' states are the same (and transformers would read the mask on the host)."""
    device = device or pipe._execution_device
    dtype = dtype or pipe.text_encoder.dtype
    prompt = [prompt] if isinstance(prompt, str) else prompt
    drop = pipe.prompt_template_encode_start_idx
    tokens = pipe.tokenizer(
        [pipe.prompt_template_encode.format(p) for p in prompt],
        max_length=drop + max_sequence_length,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    )
    output = pipe.text_encoder(input_ids=tokens.input_ids.to(device), output_hidden_states=True, use_cache=False)
    hidden = output.hidden_states[-1][:, drop:]
    mask = tokens.attention_mask[:, drop:]
    hidden = hidden * mask.unsqueeze(-1).to(hidden.device, hidden.dtype)  # padded rows are zeros, as diffusers'
    return hidden.to(dtype=dtype, device=device), mask.to(device)


def _encode_prompt(
    pipe,
    prompt,
    device=None,
    num_images_per_prompt: int = 1,
    prompt_embeds=None,
    prompt_embeds_mask=None,
    max_sequence_length: int = 1024,
):
    """QwenImagePipeline.encode_prompt with the text of a fixed length, whose mask is always kept (diffusers
    drops it when every token is real, a read to the host and another graph)."""
    device = device or pipe._execution_device
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch = len(prompt) if prompt_embeds is None else prompt_embeds.shape[0]
    if prompt_embeds is None:
        prompt_embeds, prompt_embeds_mask = _text(pipe, prompt, device, max_sequence_length=max_sequence_length)
    prompt_embeds = prompt_embeds[:, :max_sequence_length]
    length = prompt_embeds.shape[1]
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1).view(batch * num_images_per_prompt, length, -1)
    if prompt_embeds_mask is not None:
        prompt_embeds_mask = prompt_embeds_mask[:, :max_sequence_length]
        prompt_embeds_mask = prompt_embeds_mask.repeat(1, num_images_per_prompt, 1)
        prompt_embeds_mask = prompt_embeds_mask.view(batch * num_images_per_prompt, length)
    return prompt_embeds, prompt_embeds_mask


def _rope_on_host(compute):
    """diffusers' image RoPE table, computed once per shape where the host computes it. diffusers' own is behind
    an lru_cache, which across JAX traces (backend jax, whose traced module holds its buffers as a trace's values)
    would keep one trace's values for the next: the table is taken from the function under that cache."""
    raw, owner = getattr(compute, "__wrapped__", None), getattr(compute, "__self__", None)
    tables: dict = {}

    def compute_video_freqs(frame, height, width, idx=0, device=None):
        key = (frame, height, width, idx, str(device))
        if key in tables:
            return tables[key]
        # From the host's tables (device None).
        table = (
            raw(owner, frame, height, width, idx, None)
            if raw and owner is not None
            else compute(frame, height, width, idx, None)
        )
        table = table.to(device) if device is not None else table
        if not any("jax" in str(where) for where in (table.device, device)):  # inside a JAX trace: that program's
            tables[key] = table
        return table

    return compute_video_freqs


def _rope_hooks(pos_embed, hooks, label: str) -> None:
    hooks.wrap(pos_embed, "_compute_video_freqs", f"RoPE table on the host{label}", _rope_on_host)
    if callable(getattr(pos_embed, "_get_device_freqs", None)):
        hooks.wrap(
            pos_embed, "_get_device_freqs", f"RoPE frequencies kept outside JAX traces{label}", _frequencies_uncached
        )


def _frequencies_uncached(get_device_freqs):
    """diffusers' RoPE frequencies moved to a device, kept per device as its lru_cache keeps them, except on
    backend jax's: there the move inside a trace is that trace's value, which kept would reach the next."""
    owner = get_device_freqs.__self__
    moved: dict = {}

    def device_freqs(device):
        if str(device) in moved:
            return moved[str(device)]
        freqs = owner.pos_freqs.to(device), owner.neg_freqs.to(device)
        if "jax" not in str(device):
            moved[str(device)] = freqs
        return freqs

    return device_freqs


def _nearest_upsampling(vae):
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageUpsample

    changed = [m for m in vae.modules() if isinstance(m, QwenImageUpsample) and m.mode == "nearest-exact"]
    for module in changed:
        module.mode = "nearest"

    def restore() -> None:
        for module in changed:
            module.mode = "nearest-exact"

    return restore


FAMILY = QwenImage()
