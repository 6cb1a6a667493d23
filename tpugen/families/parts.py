"""The parts the tiny built-ins share: byte-level tokenizers, small CLIP and T5 encoders, a small VAE and UNet
layout, all built offline from fixed seeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def byte_symbols() -> list[str]:
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


def write_clip_vocab(directory: Path) -> tuple[int, int, int]:
    """A byte-level vocabulary with no merges: every byte is a token, alone or ending a word.

    Returns (vocab size, bos id, eos id).
    """
    symbols = byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return len(vocab), vocab["<|startoftext|>"], vocab["<|endoftext|>"]


def save(pipe, target: Path, scratch: Path) -> None:
    pipe.save_pretrained(target)
    shutil.rmtree(scratch)


def clip_tokenizer(scratch: Path):
    """A CLIP tokenizer over the byte-level vocabulary, and the text-encoder config fields it implies."""
    from transformers import CLIPTokenizer

    scratch.mkdir(exist_ok=True)
    vocab_size, bos_id, eos_id = write_clip_vocab(scratch)
    tokenizer = CLIPTokenizer(str(scratch / "vocab.json"), str(scratch / "merges.txt"), model_max_length=77)
    ids = {"vocab_size": vocab_size, "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    return tokenizer, ids


def clip_text_config(ids: dict, projection_dim: int | None = None):
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


def t5_tokenizer():
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


def t5_encoder(vocab_size: int, d_model: int):
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


def save_tiny_controlnet(unet_config: dict, target: Path, seed: int) -> None:
    """A tiny ControlNet of the UNet `unet_config` builds (its encoder: ControlNetModel.from_unet) with random
    weights from `seed`, its conditioning embedding downsampling by 8 as the VAE does; the zero convolutions out
    made small and random, since zero ones would make it a no-op and a test could not see it steer."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config)
    torch.manual_seed(seed)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16))
    with torch.no_grad():
        for block in [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block]:
            block.weight.normal_(0, 0.05)
        controlnet.controlnet_cond_embedding.conv_out.weight.normal_(0, 0.05)
    controlnet.save_pretrained(target, safe_serialization=True)


def save_transformer_controlnet(controlnet, target: Path) -> None:
    """A transformer family's tiny ControlNet (made by diffusers' from_transformer) saved with its zero layers, out
    (each block's) and in (the control's embedder), made small and random from the current seed, since zero ones
    would make it a no-op a test could not see steer."""
    import torch

    with torch.no_grad():
        for layer in [*controlnet.controlnet_blocks, *getattr(controlnet, "controlnet_single_blocks", ())]:
            layer.weight.normal_(0, 0.05)
        controlnet.controlnet_x_embedder.weight.normal_(0, 0.05)
    controlnet.save_pretrained(target, safe_serialization=True)


def tiny_vae(latent_channels: int, **extra):
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
TINY_UNET = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
)


# Qwen's chat template (Qwen3's), text only: what Qwen3-based pipelines (FLUX.2 [klein], Z-Image) apply to a prompt.
# With enable_thinking false the generation prompt gets an empty think block, as Qwen3's own template does.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The split transformers' Qwen2Tokenizer makes before byte-level BPE (tokenization_qwen2.py's pretokenize regex).
_QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def qwen_tokenizer(
    special_tokens: tuple[str, ...] = QWEN_SPECIAL_TOKENS,
    *,
    words_of: str = "",
    chat_template: str | None = QWEN_CHAT_TEMPLATE,
):
    """A Qwen2Tokenizer over the 256 byte symbols: every byte is a token; merges only for the words of
    `words_of` (a prompt template whose length in tokens a pipeline relies on), then the special tokens.

    Returns (tokenizer, vocabulary size)."""
    import regex  # a dependency of transformers
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    symbols = byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    texts = [t for t in regex.split("|".join(regex.escape(s) for s in special_tokens), words_of) if t]
    for piece in (p for text in texts for p in regex.findall(_QWEN_SPLIT, text)):
        word = "".join(symbols[b] for b in piece.encode("utf-8"))
        done = word[0]
        for char in word[1:]:
            if done + char not in vocab:
                merges.append((done, char))
                vocab[done + char] = len(vocab)
            done += char
    for token in special_tokens:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        padding_side="right",
        chat_template=chat_template,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens], special_tokens=True)
    return tokenizer, len(vocab)
