"""Train the tiny-shapes built-in from a seed on the CPU: the autoencoder first, then the UNet and text encoder
together, on pictures of `a COLOUR SHAPE on a COLOUR background` drawn on the fly; writes fp16 safetensors and a
manifest of their sha256s into tpugen/families/sd/shapes/weights/.

    .venv/bin/python scripts/train_tiny_shapes.py             # the shipped weights (about 45 min on 2 cores)
    .venv/bin/python scripts/train_tiny_shapes.py --lora red  # a LoRA on those weights that makes every shape red
    .venv/bin/python scripts/train_tiny_shapes.py --controlnet  # a ControlNet on them: a white shape on black
                                                                # places the shape (about 30 min)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")  # diffusers imports torch_xla when it is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tpugen.families.sd.shapes import COLOURS, MANIFEST, SHAPES, SIZE, WEIGHTS, prompt  # noqa: E402
from tpugen.families.sd.shapes import build as parts  # noqa: E402

NAMES = list(COLOURS)
RGB = torch.tensor([COLOURS[c] for c in NAMES], dtype=torch.float32) / 127.5 - 1  # in the VAE's [-1, 1]


def draw(n: int, gen: torch.Generator, shape_colour: int | None = None, masks: bool = False):
    """n random pictures (n, 3, SIZE, SIZE) in [-1, 1] and their prompts. A shape is 16 to 40 px across, at least
    4 px from the edge; `shape_colour` (an index into NAMES) overrides the colour drawn, not the prompt,
    and the background is never it. With `masks`, also each shape's mask (n, SIZE, SIZE) as booleans."""
    fg = torch.randint(len(NAMES), (n,), generator=gen)
    bg = (fg + torch.randint(1, len(NAMES), (n,), generator=gen)) % len(NAMES)  # never the shape's colour
    if shape_colour is not None:  # nor the colour drawn: the next colour that is neither
        while (clash := (bg == shape_colour) | (bg == fg)).any():
            bg = torch.where(clash, (bg + 1) % len(NAMES), bg)
    kind = torch.randint(len(SHAPES), (n,), generator=gen)
    half = 8 + torch.rand(n, generator=gen) * 12
    lo, hi = 4 + half, SIZE - 4 - half
    cx = lo + torch.rand(n, generator=gen) * (hi - lo)
    cy = lo + torch.rand(n, generator=gen) * (hi - lo)
    y, x = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    dx, dy = x[None] - cx[:, None, None], y[None] - cy[:, None, None]
    h = half[:, None, None]
    circle = dx**2 + dy**2 <= h**2
    square = (dx.abs() <= h) & (dy.abs() <= h)
    triangle = (dy.abs() <= h) & (dx.abs() <= (dy + h) / 2)  # apex up, base at the bottom: half its box
    mask = torch.stack([circle, square, triangle], 1)[torch.arange(n), kind]
    drawn = fg if shape_colour is None else torch.full_like(fg, shape_colour)
    images = torch.where(mask[:, None], RGB[drawn][:, :, None, None], RGB[bg][:, :, None, None])
    prompts = [
        prompt(NAMES[f], SHAPES[k], NAMES[b]) for f, k, b in zip(fg.tolist(), kind.tolist(), bg.tolist(), strict=True)
    ]
    return (images, prompts, mask) if masks else (images, prompts)


def log(phase: str, step: int, steps: int, loss: float, started: float) -> None:
    print(f"{phase} step {step:5d}/{steps}  loss {loss:.5f}  {time.time() - started:7.1f} s", flush=True)


def train_vae(args, gen):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**parts.VAE)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    started, running = time.time(), None
    for step in range(1, args.vae_steps + 1):
        images, _ = draw(args.vae_batch, gen)
        posterior = vae.encode(images).latent_dist
        # Decoded from the mean, as the UNet's latents are: sampling's noise only blurs what a short run learns.
        recon = vae.decode(posterior.mean).sample
        kl = posterior.kl().mean() / images[0].numel()
        loss = F.mse_loss(recon, images) + F.l1_loss(recon, images) + args.kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = args.vae_lr * 0.5 * (1 + math.cos(math.pi * step / args.vae_steps))
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.vae_steps:
            log("vae", step, args.vae_steps, running, started)
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # latents scaled to unit spread, as SD's 0.18215 does for its VAE
        images, _ = draw(512, gen)
        latents = vae.encode(images).latent_dist.mean
        vae.register_to_config(scaling_factor=float(1 / latents.std()))
        recon = vae.decode(latents).sample
    print(
        f"vae: reconstruction mse {F.mse_loss(recon, images).item():.5f}, "
        f"scaling_factor {vae.config.scaling_factor:.4f}, {time.time() - started:.0f} s",
        flush=True,
    )
    return vae


def train_decoder(args, vae):
    """Sharpen the decoder with the encoder frozen, so the latents the UNet learned keep their meaning: a short
    autoencoder run rounds the corners that tell a triangle from a circle. It starts from the fp16-rounded
    autoencoder and its own seed, so that a run resumed from a --save-every folder ends the same."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    vae = vae.to(torch.float16).to(torch.float32).requires_grad_(False)
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.decoder_lr, weight_decay=0.0)
    started, running = time.time(), None
    for step in range(1, args.decoder_steps + 1):
        images, _ = draw(args.vae_batch, gen)
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.mean
        recon = vae.decode(latents).sample
        loss = F.mse_loss(recon, images) + F.l1_loss(recon, images)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = args.decoder_lr * 0.5 * (1 + math.cos(math.pi * step / args.decoder_steps))
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.decoder_steps:
            log("decoder", step, args.decoder_steps, running, started)
    return vae.requires_grad_(False).eval()


def encode_prompts(tok, text_encoder, prompts):
    ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt")
    return text_encoder(ids.input_ids)[0]


def diffusion_loss(unet, text, latents, gen, alphas, offset: float = 0.0):
    """SD's epsilon loss at uniform timesteps, weighted by min-SNR (gamma 5) so the easy low-noise steps do not
    take the whole gradient. `offset` adds noise constant over each channel ("offset noise"): on 16x16 latents the
    starting noise's own mean is as large as what SD's schedule leaves of the picture's at t=999, so without it the
    background's colour follows the noise, not the prompt."""
    n = latents.shape[0]
    t = torch.randint(0, len(alphas), (n,), generator=gen)
    noise = torch.randn(latents.shape, generator=gen)
    noise = noise + offset * torch.randn((n, latents.shape[1], 1, 1), generator=gen)
    a = alphas[t].view(n, 1, 1, 1)
    noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
    pred = unet(noisy, t, encoder_hidden_states=text).sample
    snr = alphas[t] / (1 - alphas[t])
    weight = torch.minimum(snr, torch.full_like(snr, 5.0)) / snr
    return (weight * ((pred - noise) ** 2).mean(dim=(1, 2, 3))).mean()


def alphas_cumprod():
    from diffusers import DDPMScheduler

    return DDPMScheduler(**parts.SCHEDULE).alphas_cumprod.float()


def train_unet(args, vae, tok, ids):
    """The UNet and text encoder together, from their own seed and the fp16-rounded autoencoder, so that a run
    given --vae-from a folder this script wrote trains the same."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    gen = torch.Generator().manual_seed(args.seed + 2)
    torch.manual_seed(args.seed + 2)
    vae = vae.to(torch.float16).to(torch.float32)
    unet = UNet2DConditionModel(**parts.UNET)
    text_encoder = CLIPTextModel(parts.text_config(ids))
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=0.01)
    ema = [copy.deepcopy(unet).requires_grad_(False), copy.deepcopy(text_encoder).requires_grad_(False)]
    alphas = alphas_cumprod()
    started, running = time.time(), None
    for step in range(1, args.unet_steps + 1):
        images, prompts = draw(args.batch, gen)
        prompts = ["" if torch.rand(1, generator=gen).item() < 0.1 else p for p in prompts]  # for CFG
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.mean * vae.config.scaling_factor
        loss = diffusion_loss(unet, encode_prompts(tok, text_encoder, prompts), latents, gen, alphas, args.offset)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for group in opt.param_groups:  # warm up, then constant: the weights at step n are those of --unet-steps n
            group["lr"] = args.unet_lr * min(1.0, step / 200)
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for averaged, live in zip(ema, (unet, text_encoder), strict=True):
                for pa, pl in zip(averaged.parameters(), live.parameters(), strict=True):
                    pa.lerp_(pl, 1 - decay)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == args.unet_steps:
            log("unet", step, args.unet_steps, running, started)
        if args.save_every and step % args.save_every == 0 and step < args.unet_steps:
            write_weights(args.out.with_name(f"{args.out.name}-{step}"), vae, *ema, tok)
    return ema[0].eval(), ema[1].eval()


def load_weights(folder: Path):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    return (
        AutoencoderKL.from_pretrained(folder / "vae", torch_dtype=torch.float32),
        UNet2DConditionModel.from_pretrained(folder / "unet", torch_dtype=torch.float32),
        CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=torch.float32),
    )


def write_weights(out: Path, vae, unet, text_encoder, tok) -> None:
    """fp16 safetensors and configs of the three models, then the manifest of their sha256s."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, model in (("vae", vae), ("unet", unet), ("text_encoder", text_encoder)):
        copy.deepcopy(model).to(torch.float16).save_pretrained(out / name, safe_serialization=True)
    (out / MANIFEST.name).write_text(json.dumps({"sha256": parts.file_hashes(out)}, indent=2) + "\n", encoding="utf-8")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {total / 1e6:.2f} MB", flush=True)


def frozen_shipped():
    """The shipped pipeline's UNet, autoencoder and text encoder, frozen, and its tokenizer: what a LoRA or a
    ControlNet trains on."""
    from diffusers import StableDiffusionPipeline

    with tempfile.TemporaryDirectory() as tmp:
        parts.build(Path(tmp) / "pipe")
        pipe = StableDiffusionPipeline.from_pretrained(Path(tmp) / "pipe")
    for model in (pipe.unet, pipe.vae, pipe.text_encoder):
        model.requires_grad_(False)
    return pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer


def train_lora(args, gen) -> None:
    """A LoRA (rank 4, the UNet's attention projections) on the shipped weights that draws every shape red,
    whatever colour the prompt asks for: trained on the same prompts with red shapes, saved in diffusers' format."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    unet, vae, text_encoder, tok = frozen_shipped()
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=list(args.targets)))
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lora_lr)
    alphas = alphas_cumprod()
    red = NAMES.index(args.lora)
    started, running = time.time(), None
    for step in range(1, args.lora_steps + 1):
        images, prompts = draw(args.batch, gen, shape_colour=red)
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.mean * vae.config.scaling_factor
            text = encode_prompts(tok, text_encoder, prompts)
        loss = diffusion_loss(unet, text, latents, gen, alphas)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.lora_steps:
            log("lora", step, args.lora_steps, running, started)
    state = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    out = args.out / "loras"
    out.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        out, unet_lora_layers={k: v.to(torch.float16) for k, v in state.items()}, weight_name=f"{args.lora}.safetensors"
    )
    (args.out / MANIFEST.name).write_text(
        json.dumps({"sha256": parts.file_hashes(args.out)}, indent=2) + "\n", encoding="utf-8"
    )
    print(f"wrote {out / f'{args.lora}.safetensors'}: {(out / f'{args.lora}.safetensors').stat().st_size} bytes")


def held_out(prompt_text: str) -> bool:
    """The prompts the ControlNet never trains on (12 of the 90, by a fixed rule), so that a test can
    place shapes for prompts it never saw (tpugen.families.sd.shapes.CONTROL_HELD_OUT says the same)."""
    from tpugen.families.sd.shapes import control_held_out

    return control_held_out(prompt_text)


def train_controlnet(args, gen) -> None:
    """A ControlNet on the shipped weights (frozen) whose control image is the shape's mask, white on black at
    64x64, so the shape is drawn where the mask is, as the prompt describes it. Made from the UNet's own encoder
    (ControlNetModel.from_unet: its zero convolutions start it as a no-op), its conditioning embedding
    downsampling by 4 as the autoencoder does; prompts held out (held_out) are never drawn."""
    from diffusers import ControlNetModel

    unet, vae, text_encoder, tok = frozen_shipped()
    torch.manual_seed(args.seed + 3)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=parts.CONTROL_EMBEDDING)
    controlnet.train()
    params = list(controlnet.parameters())
    opt = torch.optim.AdamW(params, lr=args.controlnet_lr, weight_decay=0.0)
    alphas = alphas_cumprod()
    started, running = time.time(), None
    for step in range(1, args.controlnet_steps + 1):
        images, prompts, masks = draw(2 * args.batch, gen, masks=True)
        keep = [n for n, p in enumerate(prompts) if not held_out(p)][: args.batch]
        images, masks = images[keep], masks[keep]
        prompts = ["" if torch.rand(1, generator=gen).item() < 0.1 else prompts[n] for n in keep]
        control = masks[:, None].float().expand(-1, 3, -1, -1)  # [0, 1], as diffusers' control image processor
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.mean * vae.config.scaling_factor
            text = encode_prompts(tok, text_encoder, prompts)
        n = latents.shape[0]
        t = torch.randint(0, len(alphas), (n,), generator=gen)
        noise = torch.randn(latents.shape, generator=gen) + args.offset * torch.randn(
            (n, latents.shape[1], 1, 1), generator=gen
        )
        a = alphas[t].view(n, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        down, mid = controlnet(noisy, t, encoder_hidden_states=text, controlnet_cond=control, return_dict=False)
        pred = unet(
            noisy,
            t,
            encoder_hidden_states=text,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for group in opt.param_groups:
            group["lr"] = args.controlnet_lr * min(1.0, step / 100)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == args.controlnet_steps:
            log("controlnet", step, args.controlnet_steps, running, started)
    out = args.out / "controlnet"
    if out.exists():
        shutil.rmtree(out)
    controlnet.eval().to(torch.float16).save_pretrained(out, safe_serialization=True)
    (args.out / MANIFEST.name).write_text(
        json.dumps({"sha256": parts.file_hashes(args.out)}, indent=2) + "\n", encoding="utf-8"
    )
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}: {total / 1e6:.2f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=WEIGHTS, help="the weights folder (default: the package's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vae-steps", type=int, default=1000)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--kl", type=float, default=1e-4, help="weight of the KL term per latent value")
    parser.add_argument("--unet-steps", type=int, default=4500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--decoder-steps", type=int, default=500)
    parser.add_argument("--decoder-lr", type=float, default=5e-4)
    parser.add_argument(
        "--resume", type=Path, help="a --save-every folder: its autoencoder and UNet, then the decoder phase only"
    )
    parser.add_argument("--vae-from", type=Path, help="a folder this script wrote: its autoencoder, not a new one")
    parser.add_argument("--offset", type=float, default=0.1, help="offset noise (per channel) in the UNet's loss")
    parser.add_argument("--save-every", type=int, default=0, help="also write the weights every n UNet steps")
    parser.add_argument(
        "--lora", choices=NAMES, help="train a LoRA on the shipped weights that draws shapes this colour"
    )
    parser.add_argument("--lora-steps", type=int, default=1000)
    parser.add_argument("--lora-lr", type=float, default=2e-3)
    parser.add_argument("--targets", nargs="+", default=["to_q", "to_k", "to_v", "to_out.0"])
    parser.add_argument(
        "--controlnet", action="store_true", help="train a ControlNet on the shipped weights: a mask places the shape"
    )
    parser.add_argument("--controlnet-steps", type=int, default=3000)
    parser.add_argument("--controlnet-lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    started = time.time()
    if args.lora:
        train_lora(args, gen)
    elif args.controlnet:
        train_controlnet(args, gen)
    else:
        tok, ids = parts.tokenizer(Path(tempfile.mkdtemp(prefix="tiny-shapes-vocab-")))
        if args.resume:
            vae, unet, text_encoder = load_weights(args.resume)
        else:
            vae = load_weights(args.vae_from)[0] if args.vae_from else train_vae(args, gen)
            unet, text_encoder = train_unet(args, vae, tok, ids)
        if args.decoder_steps:
            vae = train_decoder(args, vae)
        write_weights(args.out, vae, unet, text_encoder, tok)
    print(f"done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
