"""FLUX.2: [dev] (Flux2Pipeline: a Mistral 3 text encoder, embedded guidance) and [klein] (Flux2KleinPipeline: a
Qwen3 text encoder; the distilled models ignore guidance, the base ones run CFG against an empty prompt), on one
transformer (double- then single-stream blocks over 2x2 patches of a 32-channel latent) and one VAE whose latents
are batch-normalised."""

from __future__ import annotations

from tpugen.families.base import (
    TRANSFORMER_KEYS,
    Builtin,
    FlashRoute,
    KnownModel,
    TransformerFamily,
    flow_transformer_call,
)
from tpugen.families.flux import FLUX_BLOCK_KEYS, FLUX_KOHYA_KEYS
from tpugen.sharding import ATTENTION, COLUMN, ROW

_VAE = {"latent_channels": 32}  # AutoencoderKLFlux2's defaults are the real VAE's


def _transformer(double: int, single: int, heads: int, text_width: int, guidance: bool) -> dict:
    return {
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": double,
        "num_single_layers": single,
        "attention_head_dim": 128,
        "num_attention_heads": heads,
        "joint_attention_dim": 3 * text_width,  # three of the text encoder's layers side by side
        "guidance_embeds": guidance,
    }


def _qwen3(width: int, mlp: int) -> dict:
    return {
        "hidden_size": width,
        "intermediate_size": mlp,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": width < 4096,
    }


# Mistral Small 3.2 24B with its Pixtral vision tower (loaded, never run: tpugen gives it no image). Its lm_head is
# a weight of its own (the checkpoint holds both); transformers 5's Mistral3Config ties it to the embeddings by
# default, which would count 0.67B parameters too few.
_MISTRAL_SMALL = {
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "sliding_window": None,
    },
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "image_size": 1540,
        "patch_size": 14,
    },
}


def _build_dev(target):
    from tpugen.families.flux2.tiny import build_dev

    build_dev(target)


def _build_klein(target):
    from tpugen.families.flux2.tiny import build_klein

    build_klein(target)


def _build_klein_distilled(target):
    from tpugen.families.flux2.tiny import build_klein

    build_klein(target, distilled=True)


class Flux2(TransformerFamily):
    img2img_refusal = (
        "diffusers 0.42 has no img2img for FLUX.2 (its image input is a reference to edit from, with no strength)"
    )
    name = "flux2"
    title = "FLUX.2 [dev]"
    pipeline_classes = ("Flux2Pipeline",)
    steps = 50
    guidance_scale = 4.0  # embedded in the transformer, as FLUX.1-dev's: no CFG
    cfg = False
    negative_prompt = False
    guidance_note = "no CFG; guidance embedded in the transformer"
    # As Flux.1's, the latents cast to the transformer's dtype (the call seen says which).
    loop_call = flow_transformer_call()
    # References to edit from (Flux2Pipeline's `image` list): Black Forest Labs recommend at most 6 for [dev], 4
    # for [klein]; each is encoded by the VAE once and its tokens join the latent's at every step.
    max_references = 6
    max_sequence_length = 512  # the pipelines pad their text to this many tokens
    patch = 2  # 2x2 patches of the latent are one token (the transformer's own patch_size is 1)
    # diffusers' converter also reads kohya and BFL files (lora_unet_double_blocks_*, diffusion_model.*); its own
    # names have Flux.1's single_transformer_blocks.
    lora_signs = (TRANSFORMER_KEYS, FLUX_BLOCK_KEYS, FLUX_KOHYA_KEYS)
    builtins = (
        Builtin(
            "tiny-flux2",
            "FLUX.2 [dev] architecture (Mistral 3 text encoder, embedded guidance) with tiny random weights; noise",
            1,
            _build_dev,
        ),
    )
    known_models = (
        KnownModel(
            "black-forest-labs/FLUX.2-dev",
            note=(
                "gated (HF_TOKEN); 112.6 GB in bfloat16 (32.2B transformer 64.4 GB, 24.0B Mistral Small 3.2 48.0 GB): "
                "no single chip; SPMD over 8 v6e chips or 2+ v5p chips (8 v5e chips are too few)"
            ),
            components={
                "text_encoder": ("Mistral3ForConditionalGeneration", _MISTRAL_SMALL),
                "transformer": ("Flux2Transformer2DModel", _transformer(8, 48, 48, 5120, True)),
                "vae": ("AutoencoderKLFlux2", _VAE),
            },
        ),
    )
    # The double blocks return both streams; the single blocks, given the streams joined, return them joined.
    scan_attributes = {
        "transformer_blocks": ("encoder_hidden_states", "hidden_states"),
        "single_transformer_blocks": ("hidden_states",),
    }
    denoiser_rules = {
        "Flux2Transformer2DModel": ATTENTION
        + [
            (r"(^|\.)ff(_context)?\.linear_in$", COLUMN),
            (r"(^|\.)ff(_context)?\.linear_out$", ROW),
            # The single blocks' fused projections: [q, k, v, MLP in] out, and [attention, MLP out] in.
            (r"(^|\.)attn\.to_qkv_mlp_proj$", COLUMN),
            (r"^single_transformer_blocks\.\d+\.attn\.to_out$", ROW),
            # The modulation every block shares, computed once per step.
            (r"^(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear$", COLUMN),
        ]
    }
    # FLUX.2's processors on diffusers' "_native_xla" backend (enable_xla_flash_attention), as Flux.1's; diffusers
    # 0.42 gives the kernel no partition spec.
    flash_attention = FlashRoute(("transformer",), is_flux=True, takes_partition_spec=False)
    # diffusers' cache hooks keep their state per cache_context, which Flux2KleinPipeline names and
    # Flux2Pipeline does not (its transformer call would fail: "No cache context is set").
    step_cache_refusal = (
        "diffusers 0.42's Flux2Pipeline calls its transformer outside a cache_context, which diffusers' step caches "
        "need (FLUX.2 [klein] has one)"
    )

    def noise(self, pipe, generators, height: int, width: int) -> list:
        """The latent in 2x2 patches (channels x 4), not yet packed into tokens: what `latents=` takes."""
        import torch

        side = pipe.vae_scale_factor * 2
        channels = pipe.transformer.config.in_channels
        shape = (1, channels, height // side, width // side)
        return [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]

    def call_arguments(self, pipe, rows, guidance_scale: float) -> dict:
        return {"max_sequence_length": self.max_sequence_length}

    def decode(self, pipe, latents, height: int, width: int, device):
        """[dev] returns its tokens packed and batch-normalised: unpacked (row-major, as its position ids lay them
        out), de-normalised by the VAE's running statistics, un-patched, decoded."""
        import torch

        vae = pipe.vae
        side = pipe.vae_scale_factor * 2
        rows, _, channels = latents.shape
        latents = latents.to(device).permute(0, 2, 1).reshape(rows, channels, height // side, width // side)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device)
        latents = pipe._unpatchify_latents(latents * std.to(latents.dtype) + mean)
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def install_hooks(self, pipe, device, hooks) -> None:
        """Timesteps at the door (TransformerFamily), and the text encoder's padding mask handed over as the 4-D
        causal mask it would build: transformers reads a 2-D mask on the host to decide whether it can skip it
        (masking_utils `_ignore_causal_mask_sdpa`, 2 host reads per encoder call); a 4-D one it takes as given.
        Measured on XLA:CPU, diffusers 0.42.1: as shipped a graph per step and 3 to 5 host reads per call; with
        both, 3 graphs and 1 host read."""
        super().install_hooks(pipe, device, hooks)
        handle = pipe.text_encoder.register_forward_pre_hook(_four_dimensional_mask, with_kwargs=True)
        hooks.add("text mask in four dimensions", handle.remove)


class Flux2Klein(Flux2):
    """The base [klein] models: CFG against an empty prompt above guidance 1 (a second transformer pass)."""

    name = "flux2_klein"
    title = "FLUX.2 [klein]"
    pipeline_classes = ("Flux2KleinPipeline",)
    cfg = True
    # CFG is a second transformer call with the empty prompt's embeddings and ids (none for the distilled models).
    loop_call = flow_transformer_call(
        cfg="calls",
        cfg_by_call=(("encoder_hidden_states", "negative_prompt_embeds"), ("txt_ids", "negative_text_ids")),
    )
    guidance_note = "CFG against an empty prompt above guidance 1"
    max_references = 4
    # diffusers' TaylorSeer on Flux2Transformer2DModel (CacheMixin); the pipeline names the cond and uncond contexts.
    step_cache_refusal = None
    builtins = (
        Builtin(
            "tiny-flux2-klein",
            "FLUX.2 [klein] base architecture (Qwen3 text encoder, CFG) with tiny random weights; noise",
            1,
            _build_klein,
        ),
    )
    known_models = ()

    def covers(self, index: dict) -> bool:
        return not index.get("is_distilled")

    def decode_loop_latents(self, pipe, latents, height: int, width: int, device):
        """The loop's latents are tokens, as [dev]'s pipeline returns them: decoded as [dev] decodes those."""
        return Flux2.decode(self, pipe, latents, height, width, device)

    def decode(self, pipe, latents, height: int, width: int, device):
        """[klein] returns its latents already unpacked, de-normalised and un-patched: only the VAE is left."""
        vae = pipe.vae
        image = vae.decode(latents.to(device=device, dtype=vae.dtype), return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)


class Flux2KleinDistilled(Flux2Klein):
    """The distilled [klein] models (model_index.json's is_distilled): 4 steps, guidance ignored, one pass."""

    name = "flux2_klein_distilled"
    title = "FLUX.2 [klein] distilled"
    steps = 4
    guidance_scale = 1.0
    cfg = False
    guidance_note = "none: the pipeline ignores guidance"
    builtins = (
        Builtin(
            "tiny-flux2-klein-distilled",
            "FLUX.2 [klein] distilled architecture (Qwen3 text encoder, no guidance) with tiny random weights; noise",
            1,
            _build_klein_distilled,
        ),
    )
    known_models = (
        KnownModel(
            "black-forest-labs/FLUX.2-klein-4B",
            note=(
                "distilled: 4 steps; 16.0 GB in bfloat16 (3.88B transformer 7.8 GB, Qwen3-4B 8.0 GB): fits one v6e "
                "or v5p chip; on v5e offload, or SPMD over 2+ chips"
            ),
            components={
                "text_encoder": ("Qwen3ForCausalLM", _qwen3(2560, 9728)),
                "transformer": ("Flux2Transformer2DModel", _transformer(5, 20, 24, 2560, False)),
                "vae": ("AutoencoderKLFlux2", _VAE),
            },
        ),
        KnownModel(
            "black-forest-labs/FLUX.2-klein-9B",
            note=(
                "distilled: 4 steps; 34.7 GB in bfloat16 (9.08B transformer 18.2 GB, Qwen3-8B 16.4 GB): fits one v5p "
                "chip; on v6e offload, or SPMD over 2+ chips; on v5e SPMD over 4+ chips"
            ),
            components={
                "text_encoder": ("Qwen3ForCausalLM", _qwen3(4096, 12288)),
                "transformer": ("Flux2Transformer2DModel", _transformer(8, 24, 32, 4096, False)),
                "vae": ("AutoencoderKLFlux2", _VAE),
            },
        ),
    )

    def covers(self, index: dict) -> bool:
        return bool(index.get("is_distilled"))


def _build_klein_kv(target):
    from tpugen.families.flux2.tiny import build_klein

    build_klein(target, distilled=True, kv=True)


class Flux2KleinKV(Flux2KleinDistilled):
    """The [klein] KV models (Flux2KleinKVPipeline, distilled): an edit's references run through the transformer
    at the first step alone, which keeps their attention keys and values; every later step attends to those
    without the references' tokens. Two step graphs per shape key: the first step's, and the later steps'."""

    name = "flux2_klein_kv"
    title = "FLUX.2 [klein] KV"
    pipeline_classes = ("Flux2KleinKVPipeline",)
    arguments_not_taken = ("guidance_scale",)  # a distilled model's pipeline without guidance
    # Its own attention processors keep the references' keys and values; the XLA flash-attention ones would
    # replace them.
    flash_attention = FlashRoute(
        (), unsupported="Flux2KleinKVPipeline's attention processors keep the references' keys and values"
    )
    # compile.scan_blocks would run the blocks without the keys and values each keeps (the transformer's own loop
    # hands every block its layer's cache): not built.
    scan_attributes = {}
    loop_edit_refusal = (
        "Flux2KleinKVPipeline runs the references through the transformer at the first step alone and keeps their "
        "attention keys and values in its processors for the later steps, which a whole loop does not carry yet"
    )
    step_cache_refusal = (
        "diffusers 0.42's Flux2KleinKVPipeline calls its transformer outside a cache_context, which diffusers' step "
        "caches need"
    )
    builtins = (
        Builtin(
            "tiny-flux2-klein-kv",
            "FLUX.2 [klein] KV architecture (distilled; references' keys and values kept after the first step) with "
            "tiny random weights; noise",
            1,
            _build_klein_kv,
        ),
    )
    known_models = ()

    def covers(self, index: dict) -> bool:
        return True

    def install_hooks(self, pipe, device, hooks) -> None:
        super().install_hooks(pipe, device, hooks)
        self.pipeline_hooks(pipe, hooks)

    def pipeline_hooks(self, pipe, hooks) -> None:
        """The latent's tokens put back in their grid without reading their position ids: diffusers 0.42's
        Flux2KleinKVPipeline sizes the grid from the ids' maximum (a host read per row, and a graph per read),
        where the tokens lie row by row (its own ids say so) in the grid its latents were made in."""
        grid: dict[str, tuple[int, int]] = {}

        def remember(original):
            def prepare_latent_ids(latents):
                grid["size"] = tuple(latents.shape[-2:])
                return original(latents)

            return prepare_latent_ids

        def unpack(_original):
            def unpack_latents(tokens, ids):
                height, width = grid["size"]
                return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], height, width)

            return unpack_latents

        hooks.wrap(pipe, "_prepare_latent_ids", "latent grid remembered", remember)
        hooks.wrap(pipe, "_unpack_latents_with_ids", "latent tokens unpacked by shape", unpack)


def _four_dimensional_mask(module, args, kwargs):
    import torch

    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return args, kwargs
    tokens = mask.shape[-1]
    causal = torch.ones((tokens, tokens), dtype=torch.bool, device=mask.device).tril()
    full = causal[None, None] & mask.bool()[:, None, None, :]
    if getattr(module.config, "_attn_implementation", "sdpa") != "sdpa":  # eager attention adds a float mask
        dtype = module.dtype
        full = torch.where(full, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)
    kwargs["attention_mask"] = full
    return args, kwargs


FLUX2 = Flux2()
FLUX2_KLEIN = Flux2Klein()
FLUX2_KLEIN_DISTILLED = Flux2KleinDistilled()
FLUX2_KLEIN_KV = Flux2KleinKV()
