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


def _build_tiny_sd(target: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_dir = target.parent / (target.name + ".vocab")
    vocab_dir.mkdir()
    vocab_size, bos_id, eos_id = _write_clip_vocab(vocab_dir)
    tokenizer = CLIPTokenizer(str(vocab_dir / "vocab.json"), str(vocab_dir / "merges.txt"), model_max_length=77)

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    torch.manual_seed(1)
    # Four levels, as in SD, so the VAE downsamples by 8 like the real models do.
    vae = AutoencoderKL(
        block_out_channels=(8, 16, 16, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=64,
    )
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=5,
            max_position_embeddings=77,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    )
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
    pipe.save_pretrained(target)
    shutil.rmtree(vocab_dir)


_BUILDERS = {"tiny-sd": _build_tiny_sd}


def builtin_path(name: str) -> Path:
    """The saved pipeline directory of a built-in, building it on first use (atomically)."""
    spec = BUILTINS[name]
    target = cache_root() / "models" / f"{name}-v{spec.build_version}"
    if (target / "model_index.json").is_file():
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
