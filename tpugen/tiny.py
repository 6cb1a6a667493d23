"""Built-in tiny pipelines: real architectures with small random weights, built offline with fixed seeds."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tpugen.models import BUILTINS, cache_root


def _byte_symbols() -> list[str]:
    """One printable character per byte value, the alphabet CLIP's byte-level BPE works in.

    Printable Latin-1 bytes stand for themselves; the other bytes are given code points from 256 up,
    in byte order, so every byte has a visible, unique symbol.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _write_clip_vocab(directory: Path) -> tuple[int, int, int]:
    """A byte-level vocabulary with no merges: every byte is a token, alone or ending a word.

    Returns (vocab size, bos id, eos id).
    """
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return len(vocab), vocab["<|startoftext|>"], vocab["<|endoftext|>"]


def _save(pipe, target: Path, scratch: Path) -> None:
    pipe.save_pretrained(target)
    shutil.rmtree(scratch)


def _clip_tokenizer(scratch: Path):
    """A CLIP tokenizer over the byte-level vocabulary, and the text-encoder config fields it implies."""
    from transformers import CLIPTokenizer

    scratch.mkdir(exist_ok=True)
    vocab_size, bos_id, eos_id = _write_clip_vocab(scratch)
    tokenizer = CLIPTokenizer(str(scratch / "vocab.json"), str(scratch / "merges.txt"), model_max_length=77)
    ids = {"vocab_size": vocab_size, "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    return tokenizer, ids


def _clip_text_config(ids: dict, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    extra = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=5,
        max_position_embeddings=77,
        **ids,
        **extra,
    )


def _t5_tokenizer():
    """A T5 tokenizer from a unigram model over single characters: enough to turn any prompt into ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import T5TokenizerFast

    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [(c, -3.0) for c in chars]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tokenizer = T5TokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=512
    )
    return tokenizer, len(pieces)


def _t5_encoder(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_ff=37,
            d_kv=8,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )


def _tiny_vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    # Four levels, as in the real models, so the VAE downsamples by 8.
    return AutoencoderKL(
        block_out_channels=(8, 16, 16, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=64,
        **extra,
    )


# The UNet both SD 1.x and SDXL built-ins start from: two levels, 32 and 64 channels, attention in the second.
_TINY_UNET = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
)


def _build_tiny_sd(target: Path) -> None:
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = _clip_tokenizer(scratch)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    torch.manual_seed(1)
    vae = _tiny_vae(4)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(_clip_text_config(ids))
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
    _save(pipe, target, scratch)


def _build_tiny_sdxl(target: Path) -> None:
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = _clip_tokenizer(scratch)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        # 6 size/crop numbers embedded in 8 each, plus the second encoder's pooled projection (32)
        projection_class_embeddings_input_dim=80,
        cross_attention_dim=64,  # both encoders' hidden states side by side
    )
    torch.manual_seed(1)
    vae = _tiny_vae(4)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(_clip_text_config(ids))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(ids, projection_dim=32))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    _save(pipe, target, scratch)


def _build_tiny_sd3(target: Path) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = _clip_tokenizer(scratch)
    t5_tokenizer, t5_vocab = _t5_tokenizer()
    torch.manual_seed(0)
    transformer = tiny_sd3_transformer(2)
    torch.manual_seed(1)
    vae = _tiny_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(2)
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(ids, projection_dim=32))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(ids, projection_dim=32))
    torch.manual_seed(4)
    text_encoder_3 = _t5_encoder(t5_vocab, 32)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    _save(pipe, target, scratch)


def tiny_sd3_transformer(layers: int, dual_attention_layers: tuple[int, ...] = ()):
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


def tiny_flux_transformer(double_blocks: int, single_blocks: int):
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


def _build_tiny_flux(target: Path, double_blocks: int = 2, single_blocks: int = 2) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel

    scratch = target.parent / (target.name + ".vocab")
    tokenizer, ids = _clip_tokenizer(scratch)
    t5_tokenizer, t5_vocab = _t5_tokenizer()
    torch.manual_seed(0)
    transformer = tiny_flux_transformer(double_blocks, single_blocks)
    torch.manual_seed(1)
    vae = _tiny_vae(4, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(_clip_text_config(ids))
    torch.manual_seed(3)
    text_encoder_2 = _t5_encoder(t5_vocab, 32)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    _save(pipe, target, scratch)


_BUILDERS = {
    "tiny-sd": _build_tiny_sd,
    "tiny-sdxl": _build_tiny_sdxl,
    "tiny-sd3": _build_tiny_sd3,
    "tiny-flux": _build_tiny_flux,
    # Flux.1's real depth at a tiny width: what compile time (and scan_blocks) is measured on.
    "tiny-flux-deep": lambda target: _build_tiny_flux(target, double_blocks=19, single_blocks=38),
}


def _target(name: str) -> Path:
    return cache_root() / "models" / f"{name}-v{BUILTINS[name].build_version}"


def is_built(name: str) -> bool:
    """Whether the built-in is on disk already (builtin_path then builds nothing)."""
    return (_target(name) / "model_index.json").is_file()


def builtin_path(name: str) -> Path:
    """The saved pipeline directory of a built-in, building it on first use (atomically)."""
    target = _target(name)
    if is_built(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted build never looks finished.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        _BUILDERS[name](staging / "pipeline")
        try:
            (staging / "pipeline").rename(target)
        except OSError:
            if not (target / "model_index.json").is_file():  # lost a race to another builder: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
