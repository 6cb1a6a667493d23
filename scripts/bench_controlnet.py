#!/usr/bin/env python
"""A ControlNet's share of a step, side by side in one run on XLA:CPU: `tpugen generate` of tiny-sd without and with
tiny-sd-controlnet, with compile.trace_once on (the UNet, and the ControlNet beside it, traced once by dynamo) and
off (both recorded as lazy tensors every step), each a fresh process on the same prompts and seeds (64x64, batch 2,
8 steps, 3 batches). Prints the report's host ms and device ms per step, images per second of the timed phase and
compiles after warmup, and the ratios; writes bench/controlnet.json. `--model` names another built-in with a tiny
ControlNet of the same name plus -controlnet (tiny-sdxl, tiny-flux, tiny-qwen-image): bench/controlnet-MODEL.json.

    .venv/bin/python scripts/bench_controlnet.py [--model tiny-flux]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white circle", "a black square", "a cat"]


def control_image(folder: Path) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64, 64))
    ImageDraw.Draw(image).ellipse((10, 10, 44, 44), fill=(255, 255, 255))
    image.save(folder / "control.png")
    return "control.png"


def side(folder: Path, name: str, controlled: bool, trace: bool, model: str) -> dict:
    config = {
        "model": {"id": model, **({"controlnets": [{"id": f"{model}-controlnet"}]} if controlled else {})},
        "prompts": [{"prompt": p, **({"control_image": "control.png"} if controlled else {})} for p in PROMPTS],
        "height": 64,
        "width": 64,
        "steps": 8,
        "batch_size": 2,
        "seed": 3,
        "compile": {"trace_once": trace},
        "output": {"dir": str(folder / "runs"), "run_id": name},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    tpugen = str(Path(sys.executable).parent / "tpugen")
    proc = subprocess.run(
        [tpugen, "generate", str(path), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    if proc.returncode:
        raise SystemExit(f"{name}: {proc.stderr.strip()}")
    report = json.loads((folder / "runs" / name / "report.json").read_text())
    timed = report["timed_phase"]
    return {
        "host_ms_per_step": timed["host_ms_per_step"],
        "device_ms_per_step": timed["device_ms_per_step"],
        "images_per_second": timed["images_per_second"],
        "compiles_after_warmup": report["compiles_after_warmup"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sd", help="a built-in with a tiny ControlNet (MODEL-controlnet)")
    model = parser.parse_args().model
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        control_image(folder)
        for trace in (True, False):
            for controlled in (False, True):
                name = f"{'controlnet' if controlled else 'plain'}-trace-{'on' if trace else 'off'}"
                results[name] = side(folder, name, controlled, trace, model)
                print(name, results[name], flush=True)
    print()
    print(f"{'side':28} {'host ms/step':>13} {'device ms/step':>15} {'images/s':>9} {'compiles after':>15}")
    for name, row in results.items():
        print(
            f"{name:28} {row['host_ms_per_step']:13.2f} {row['device_ms_per_step']:15.2f} "
            f"{row['images_per_second']:9.2f} {row['compiles_after_warmup']:15d}"
        )
    ratios = {
        "host, controlnet / plain, trace on": results["controlnet-trace-on"]["host_ms_per_step"]
        / results["plain-trace-on"]["host_ms_per_step"],
        "host, controlnet / plain, trace off": results["controlnet-trace-off"]["host_ms_per_step"]
        / results["plain-trace-off"]["host_ms_per_step"],
        "host, controlnet, trace off / on": results["controlnet-trace-off"]["host_ms_per_step"]
        / results["controlnet-trace-on"]["host_ms_per_step"],
    }
    print()
    for label, ratio in ratios.items():
        print(f"{label:40} {ratio:6.2f}x")
    out = ROOT / "bench"
    out.mkdir(exist_ok=True)
    written = out / ("controlnet.json" if model == "tiny-sd" else f"controlnet-{model}.json")
    written.write_text(json.dumps({"model": model, "sides": results, "ratios": ratios}, indent=2) + "\n")
    print(f"\nwrote {written}")


if __name__ == "__main__":
    main()
