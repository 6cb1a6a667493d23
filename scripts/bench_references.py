#!/usr/bin/env python
"""Editing by reference, side by side on XLA:CPU: FLUX.2 [klein] re-encoding its references at every step
(Flux2KleinPipeline: the references' tokens join the latent's in every transformer pass) against the KV variant
(Flux2KleinKVPipeline: the references run at the first step alone; their attention keys and values are kept and
every later step attends to them without their tokens). Both sides are the same tiny random weights
(tiny-flux2-klein-distilled and tiny-flux2-klein-kv), each a fresh `tpugen generate` process, at 1 and at 4
references; printed: seconds per image, device ms per denoising step, and the ratio of each pair.

Then what it should save on a TPU, from the real model's shapes (FLUX.2 [klein] 9B at 1024x1024, 4 steps): the
transformer's FLOPs per image both ways (each reference fitted to the image's size, as tpugen fits them).

    .venv/bin/python scripts/bench_references.py [--size 256] [--steps 4] [--images 3]

Writes bench/references.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = {"re-encoded every step": "tiny-flux2-klein-distilled", "keys and values kept": "tiny-flux2-klein-kv"}
PROMPTS = ["the cat from image 1 on the sofa", "a watercolour of image 1", "image 1 at night, rain"]


def _references(folder: Path, count: int) -> list[str]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(count)
    paths = []
    for n in range(count):
        path = folder / f"reference-{count}-{n}.png"
        Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def _side(workdir: Path, model: str, references: list[str], args) -> dict:
    """One fresh `tpugen generate` process of `args.images` edits; what its report says of the timed phase."""
    run_id = f"{model}-{len(references)}"
    prompts = [{"prompt": PROMPTS[i % len(PROMPTS)], "reference_images": references} for i in range(args.images)]
    config = {
        "model": {"id": model},
        "prompts": prompts,
        "height": args.size,
        "width": args.size,
        "steps": args.steps,
        "batch_size": 1,
        "seed": 5,
        "execution": {"backend": "xla"},
        "output": {"dir": str(workdir), "run_id": run_id},
    }
    path = workdir / f"{run_id}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "tpugen"), "generate", str(path), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    if proc.returncode:
        sys.exit(f"tpugen failed:\n{proc.stderr}")
    report = json.loads((workdir / run_id / "report.json").read_text())
    batches = report["timed_phase"]["batches"]
    return {
        "seconds_per_image": statistics.median(b["seconds"] / b["images"] for b in batches),
        "device_ms_per_step": report["timed_phase"]["device_ms_per_step"],
        "host_ms_per_step": report["timed_phase"]["host_ms_per_step"],
        "compiles_after_warmup": report["compiles_after_warmup"],
        "transfers_to_host_per_batch": [b["transfers_to_host"] for b in batches],
        "warmup": {w["shape_key"]: w["graphs_per_phase"] for w in report["warmup"]},
    }


def transformer_flops(config: dict, text: int, image: int, references: int, steps: int, kept: bool) -> float:
    """FLOPs of FLUX.2's transformer for one image of `image` latent tokens, `text` text tokens and `references`
    references of `image` tokens each, over `steps` steps: every block's projections and MLP (13 d^2 multiply-adds
    a token: q, k, v and out 4 d^2, the SwiGLU MLP at ratio 3 9 d^2) and its attention (4 d flops per query and
    key). Re-encoded, every step runs all tokens against all; kept (the KV variant), the first step runs all
    (the references attending to themselves alone) and the later ones the text and image tokens against all."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    blocks = config["num_layers"] + config["num_single_layers"]
    refs, own = references * image, text + image
    every = own + refs

    def step(queries: int, attention_pairs: int) -> float:
        return blocks * (26 * width * width * queries + 4 * width * attention_pairs)

    full = step(every, every * every)
    if not kept:
        return steps * full
    first = step(every, own * every + refs * refs)
    return first + (steps - 1) * step(own, own * every)


def tpu_estimate(steps: int = 4, side: int = 1024) -> list[dict]:
    from tpugen.families.flux2 import FLUX2_KLEIN_DISTILLED

    model = next(m for m in FLUX2_KLEIN_DISTILLED.known_models if m.id.endswith("klein-9B"))
    config = model.components["transformer"][1]
    image = (side // 16) ** 2  # 8x VAE, 2x2 patches
    rows = []
    for references in (1, 2, 4):
        again = transformer_flops(config, 512, image, references, steps, kept=False)
        kept = transformer_flops(config, 512, image, references, steps, kept=True)
        rows.append({"model": model.id, "references": references, "tflops_re_encoded": again / 1e12})
        rows[-1] |= {"tflops_kept": kept / 1e12, "ratio": again / kept}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="image side in pixels (references fitted to it)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps ([klein] distilled: 4)")
    parser.add_argument("--images", type=int, default=3, help="edits a side, one per batch")
    args = parser.parse_args()
    results: dict = {"size": args.size, "steps": args.steps, "images": args.images, "measured": []}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-references-") as tmp:
        workdir = Path(tmp)
        for count in (1, 4):
            references = _references(workdir, count)
            row = {"references": count}
            for label, model in SIDES.items():
                print(f"{count} reference(s), {label} ({model}) ...", flush=True)
                row[label] = _side(workdir, model, references, args)
            again, kept = (row[label] for label in SIDES)
            row["seconds_per_image_ratio"] = again["seconds_per_image"] / kept["seconds_per_image"]
            row["device_ms_per_step_ratio"] = again["device_ms_per_step"] / kept["device_ms_per_step"]
            results["measured"].append(row)
    results["tpu_estimate"] = tpu_estimate(args.steps)
    print(f"\nmeasured on XLA:CPU, tiny weights, {args.size}x{args.size}, {args.steps} steps, batch 1:")
    print(
        f"{'refs':>4}  {'s/image again':>13}  {'s/image kept':>12}  {'ratio':>5}  {'ms/step again':>13}  "
        f"{'ms/step kept':>12}  {'ratio':>5}"
    )
    for row in results["measured"]:
        again, kept = (row[label] for label in SIDES)
        print(
            f"{row['references']:>4}  {again['seconds_per_image']:>13.3f}  {kept['seconds_per_image']:>12.3f}  "
            f"{row['seconds_per_image_ratio']:>5.2f}  {again['device_ms_per_step']:>13.1f}  "
            f"{kept['device_ms_per_step']:>12.1f}  {row['device_ms_per_step_ratio']:>5.2f}"
        )
    print("\nthe transformer's FLOPs per image on a TPU, from the model's shapes (1024x1024, 512 text tokens):")
    for row in results["tpu_estimate"]:
        print(
            f"{row['model']}: {row['references']} reference(s): {row['tflops_re_encoded']:.1f} TFLOP re-encoded, "
            f"{row['tflops_kept']:.1f} kept: {row['ratio']:.2f}x"
        )
    out = ROOT / "bench"
    out.mkdir(exist_ok=True)
    (out / "references.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out / 'references.json'}")


if __name__ == "__main__":
    main()
