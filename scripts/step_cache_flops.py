"""What diffusers' TaylorSeer should save per cached step on a TPU, computed (not measured) from the models' shapes.

Each transformer is built on the meta device from the config tpugen lists for it (`tpugen models`: no weights, no
download), run once at 1024x1024 (4096 image tokens) with 512 text tokens (the padded length tpugen runs), batch 1,
under torch.utils.flop_counter.FlopCounterMode. Printed per model: FLOPs per forward, the attention product's share
(QK^T and AV, the bmm), the share inside the modules TaylorSeer predicts by default (each block's `attn`), every
block's share, and the Taylor factors a cached run keeps (each hooked module's output, max_order 1: two copies,
float32), per image and CFG pass. Usage: .venv/bin/python scripts/step_cache_flops.py
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("PJRT_DEVICE", "CPU")  # diffusers imports torch_xla when it is installed

MODELS = [
    ("flux", "black-forest-labs/FLUX.1-dev"),
    ("flux2_klein_distilled", "black-forest-labs/FLUX.2-klein-4B"),
    ("flux2_klein_distilled", "black-forest-labs/FLUX.2-klein-9B"),
    ("qwenimage", "Qwen/Qwen-Image"),
]
SIDE, TEXT_TOKENS = 1024, 512


def _inputs(transformer, side: int, text: int) -> dict:
    """One forward's arguments, as the family's pipeline passes them (random, on the meta device)."""
    import torch

    config, tokens = transformer.config, (side // 16) ** 2
    hidden = torch.randn(1, tokens, config.in_channels)
    context = torch.randn(1, text, config.joint_attention_dim)
    name = type(transformer).__name__
    if name == "FluxTransformer2DModel":
        return dict(hidden_states=hidden, encoder_hidden_states=context, timestep=torch.ones(1),
                    pooled_projections=torch.randn(1, config.pooled_projection_dim),
                    img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
                    guidance=torch.ones(1) if config.guidance_embeds else None)  # fmt: skip
    if name == "Flux2Transformer2DModel":
        return dict(hidden_states=hidden, encoder_hidden_states=context, timestep=torch.ones(1),
                    img_ids=torch.zeros(1, tokens, 4), txt_ids=torch.zeros(1, text, 4),
                    guidance=torch.ones(1) if config.guidance_embeds else None)  # fmt: skip
    return dict(hidden_states=hidden, encoder_hidden_states=context, encoder_hidden_states_mask=torch.ones(1, text),
                timestep=torch.ones(1), img_shapes=[(1, side // 16, side // 16)])  # fmt: skip


def shares(family_name: str, model_id: str, side: int = SIDE, text: int = TEXT_TOKENS) -> dict:
    """The figures for one model (see the module docstring)."""
    import diffusers
    import torch
    from diffusers.hooks.taylorseer_cache import _BLOCK_IDENTIFIERS, _TRANSFORMER_BLOCK_IDENTIFIERS
    from torch.utils.flop_counter import FlopCounterMode

    from tpugen.families import family

    (known,) = [m for m in family(family_name).known_models if m.id == model_id]
    class_name, config = known.components["transformer"]
    with torch.device("meta"):
        transformer = getattr(diffusers, class_name).from_config(config)
        arguments = _inputs(transformer, side, text)
    names = [name for name, _ in transformer.named_modules()]

    def matching(patterns) -> list[str]:
        return [name for name in names if any(re.fullmatch(p, name) for p in patterns)]

    hooked = matching(_TRANSFORMER_BLOCK_IDENTIFIERS)
    outputs = []
    for name in hooked:
        transformer.get_submodule(name).register_forward_hook(
            lambda module, args, out: outputs.append(
                sum(t.numel() for t in (out if isinstance(out, tuple) else (out,)))
            )
        )
    counter = FlopCounterMode(display=False, depth=None)
    with torch.no_grad(), torch.device("meta"), counter:
        transformer(**arguments, return_dict=False)
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())

    def flops(modules: list[str]) -> int:
        return sum(sum(counts.get(f"{class_name}.{name}", {}).values()) for name in modules)

    return {
        "model": model_id,
        "tflop_per_forward": total / 1e12,
        "attention_product": sum(v for op, v in counts["Global"].items() if "bmm" in str(op)) / total,
        "attn_modules": flops(hooked) / total,
        "blocks": flops(matching(_BLOCK_IDENTIFIERS)) / total,
        "factors_gb_float32": sum(outputs) * 2 * 4 / 1e9,
    }


def main() -> None:
    print(f"{SIDE}x{SIDE}, {TEXT_TOKENS} text tokens, batch 1, one forward (computed, not measured)")
    for family_name, model_id in MODELS:
        s = shares(family_name, model_id)
        print(
            f"{s['model']}: {s['tflop_per_forward']:.1f} TFLOP; attention product {s['attention_product']:.1%}; "
            f"attn modules {s['attn_modules']:.1%}; rest of the blocks {s['blocks'] - s['attn_modules']:.1%}; "
            f"TaylorSeer factors {s['factors_gb_float32']:.1f} GB float32 per image and pass"
        )


if __name__ == "__main__":
    main()
