"""The tiny-shapes pipeline's parts: its architecture (which the training script trains), its tokenizer and
scheduler, and the builder that assembles the pipeline from the shipped weights after checking their sha256s."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tpugen.families.parts import save, write_clip_vocab
from tpugen.families.sd.shapes import MANIFEST, SIZE, WEIGHTS, WORDS

# The VAE downsamples by 4 (64x64 pixels -> 4x16x16 latents): shapes need sharper edges than 8x8 latents keep.
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 32),
    latent_channels=4,
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=SIZE,
)
TEXT_WIDTH = 64
UNET = dict(
    sample_size=SIZE // 4,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    cross_attention_dim=TEXT_WIDTH,
    attention_head_dim=8,
    norm_num_groups=16,
)
# The ControlNet's conditioning embedding: two stride-2 convolutions, 64x64 control pixels to the 16x16 latents.
CONTROL_EMBEDDING = (8, 16, 32)
# SD 1.x's noise schedule.
SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)


def tokenizer(scratch: Path):
    """CLIP's byte-level vocabulary plus one token for each word of the prompts (merges built letter by letter), so
    any text tokenizes and the prompts' words are single tokens. Returns (tokenizer, the text config's ids)."""
    from transformers import CLIPTokenizer

    scratch.mkdir(parents=True, exist_ok=True)
    write_clip_vocab(scratch)
    vocab = json.loads((scratch / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    for word in WORDS:
        if len(word) < 2:
            continue
        done = word[0]
        for i, char in enumerate(word[1:], 1):
            piece = char + ("</w>" if i == len(word) - 1 else "")
            if done + piece not in vocab:
                merges.append(f"{done} {piece}")
                vocab[done + piece] = len(vocab)
            done += piece
    (scratch / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (scratch / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")
    tok = CLIPTokenizer(str(scratch / "vocab.json"), str(scratch / "merges.txt"), model_max_length=77)
    end = vocab["<|endoftext|>"]
    ids = {"vocab_size": len(vocab), "bos_token_id": vocab["<|startoftext|>"], "eos_token_id": end, "pad_token_id": end}
    return tok, ids


def text_config(ids: dict):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
        **ids,
    )


def scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(**SCHEDULE, clip_sample=False, set_alpha_to_one=False, steps_offset=1)


def file_hashes(root: Path = WEIGHTS) -> dict[str, str]:
    """sha256 of every weights file under root (the manifest's own file aside), by path relative to root."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p != root / MANIFEST.name
    }


def check_weights(root: Path = WEIGHTS) -> None:
    """Raise if the shipped files are not those the manifest lists."""
    expected = json.loads((root / MANIFEST.name).read_text(encoding="utf-8"))["sha256"]
    found = file_hashes(root)
    if found != expected:
        bad = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        raise RuntimeError(f"tiny-shapes weights in {root} differ from manifest.json: {', '.join(bad)}")


def build(target: Path, weights: Path = WEIGHTS) -> None:
    """The pipeline from the shipped fp16 weights, saved as float32 to `target`."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    check_weights(weights)
    scratch = target.parent / (target.name + ".vocab")
    tok, _ = tokenizer(scratch)
    pipe = StableDiffusionPipeline(
        unet=UNet2DConditionModel.from_pretrained(weights / "unet", torch_dtype=torch.float32),
        vae=AutoencoderKL.from_pretrained(weights / "vae", torch_dtype=torch.float32),
        text_encoder=CLIPTextModel.from_pretrained(weights / "text_encoder", dtype=torch.float32),
        tokenizer=tok,
        scheduler=scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    save(pipe, target, scratch)


def build_controlnet(target: Path, weights: Path = WEIGHTS) -> None:
    """The tiny-shapes ControlNet from its shipped fp16 weights, saved as float32 to `target`."""
    import torch
    from diffusers import ControlNetModel

    check_weights(weights)
    ControlNetModel.from_pretrained(weights / "controlnet", torch_dtype=torch.float32).save_pretrained(
        target, safe_serialization=True
    )
