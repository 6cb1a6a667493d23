"""`scripts/bench.py trace`: compile.trace_once against recording the denoiser every step, side by side in one run.

(a) End to end: `tpugen generate` of each family's tiny built-in with trace_once true and false, each in a fresh
    process (the same prompts, seeds, 64x64, batch 2, 8 steps): images per second of the timed phase, the host's and
    the device's milliseconds per step from the report, graphs compiled in warmup, whether the pixels are equal, and
    whether the family traced once or fell back (and why).
(c) The parts of a step's host time (tiny-sd and tiny-flux, trace_once false and true): between steps, the door,
    the denoiser's call, what comes after it (CFG, the scheduler's step) and the step-end callback's sync.
(b) Full size: the host milliseconds of one denoiser call, built from the family's own config with random weights in
    bfloat16 on XLA:CPU: lazy (the forward recorded as lazy tensors and its graph hashed, as torch_xla does at every
    step; nothing executed), lazy-sync (recorded, then handed to the device by a sync, as a lazy step is) and traced
    once (the call into dynamo's cached graph, which hands it to the device); the device's work is waited for
    outside the clock. The host's cost of a call does not depend on the image size
    (it is per operation), which the lazy rows show at two sizes; the traced call is measured at the small one,
    because executing a full-size step on two CPU cores takes minutes.

Writes bench/trace.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux2-klein", "tiny-z-image", "tiny-qwen-image"]
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white circle"]
# (label, family, known hub id whose config tpugen keeps, the component, image sizes for the lazy rows, which
# executing sides run here). SDXL's traced side does not fit this machine: dynamo's trace of the SDXL UNet through
# torch_xla's bridge on XLA:CPU passed 19 GB of resident memory (of 24 GiB) before it was stopped. FLUX.2 [klein]'s
# 4B transformer is only recorded (its executing sides were not tried on this machine).
FULL = [
    ("SD 1.5 UNet", "sd", "stable-diffusion-v1-5/stable-diffusion-v1-5", "unet", [512, 64], ("lazy-sync", "traced")),
    ("SDXL UNet", "sdxl", "stabilityai/stable-diffusion-xl-base-1.0", "unet", [1024, 64], ("lazy-sync",)),
    (
        "FLUX.2 [klein] 4B transformer",
        "flux2_klein_distilled",
        "black-forest-labs/FLUX.2-klein-4B",
        "transformer",
        [1024, 64],
        (),
    ),
]
CALLS = 7  # timed calls per side (the median is reported), after one untimed call
# Seconds to let the host settle after the device finished, outside the clock. On XLA:CPU the "device" is this
# machine's cores and memory: right after a full-size step, freeing its buffers held the next call up by 300-540 ms
# (measured: SD 1.5's traced call took 300-540 ms before its graph was dispatched, and 2-9 ms after a 1.5 s pause).
# A TPU's buffers live in its own memory, so that wait is XLA:CPU's, not the host work this measures.
SETTLE = 2.0


# ---------------------------------------------------------------- (a) end to end


def _run_config(model: str, trace_once: bool, output: dict, **work) -> dict:
    """A run of `model` at 64x64 on XLA:CPU with trace_once as given: what every side of this benchmark runs."""
    return {
        "model": {"id": model, "dtype": "float32"},
        "height": 64,
        "width": 64,
        **work,
        "execution": {"backend": "xla"},
        "compile": {"trace_once": trace_once},
        "output": output,
    }


def _generate(workdir: Path, model: str, trace_once: bool) -> dict:
    from bench import _generate_fresh  # scripts/bench.py: `tpugen generate` in a fresh process

    run_id = f"{model}-{'traced' if trace_once else 'lazy'}"
    output = {"dir": str(workdir), "run_id": run_id}
    config = _run_config(model, trace_once, output, prompts=PROMPTS, steps=8, batch_size=2, seed=5)
    return _generate_fresh(workdir, run_id, config)


def _max_difference(a: Path, b: Path) -> int:
    import numpy as np
    from PIL import Image

    worst = 0
    for image in sorted(a.glob("[0-9]*.png")):
        x = np.asarray(Image.open(image).convert("RGB"), dtype=np.int16)
        y = np.asarray(Image.open(b / image.name).convert("RGB"), dtype=np.int16)
        worst = max(worst, int(np.abs(x - y).max()))
    return worst


def end_to_end(models: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-trace-") as tmp:
        for model in models:
            print(f"(a) {model}: trace_once false, then true ...", flush=True)
            lazy, traced = _generate(Path(tmp), model, False), _generate(Path(tmp), model, True)
            trace = traced["device"]["trace_once"]
            row = {
                "model": model,
                "traced_once": trace["state"] == "on",
                "reason": trace["reason"],
                "max_pixel_difference": _max_difference(Path(tmp) / f"{model}-traced", Path(tmp) / f"{model}-lazy"),
            }
            for side, report in (("lazy", lazy), ("traced", traced)):
                timed = report["timed_phase"]
                row[side] = {
                    "images_per_second": timed["images_per_second"],
                    "host_ms_per_step": timed["host_ms_per_step"],
                    "device_ms_per_step": timed["device_ms_per_step"],
                    "warmup_graphs": report["xla_counters"]["warmup"]["compiles"],
                    "warmup_seconds": report["warmup_seconds"],
                    "compiles_after_warmup": report["compiles_after_warmup"],
                }
            row["images_per_second_ratio"] = row["traced"]["images_per_second"] / row["lazy"]["images_per_second"]
            rows.append(row)
    return rows


# ---------------------------------------------------------------- (b) full-size denoisers, host time per call


def full_size_worker(family_name: str, model_id: str, component: str, side: str, size: int) -> None:
    """One denoiser built from its config in bfloat16 on XLA:CPU; prints one JSON line with the host ms per call."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import diffusers
    import torch
    import torch_xla

    from tpugen.families import family as family_named

    family = family_named(family_name)
    (known,) = [m for m in family.known_models if m.id == model_id]
    class_name, config = known.components[component]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    start = time.perf_counter()
    module = getattr(diffusers, class_name).from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    device = torch_xla.device()
    module.to(device)
    build_seconds = time.perf_counter() - start
    inputs = _inputs(class_name, module.config, size, device)
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops([])
    times = []
    with torch.no_grad():
        if side == "lazy":
            for _ in range(CALLS + 1):
                start = time.perf_counter()
                out = module(**inputs, return_dict=False)[0]
                torch_xla._XLAC._get_graph_hash([out])  # what a sync does first to find the executable
                times.append(time.perf_counter() - start)
                torch_xla._XLAC._clear_pending_irs(str(device))
                time.sleep(SETTLE)
            compile_seconds = None
        elif side == "lazy-sync":
            for _ in range(CALLS + 1):
                start = time.perf_counter()
                module(**inputs, return_dict=False)[0]
                torch_xla.sync()  # recorded, hashed and handed to the device, as at every lazy step
                times.append(time.perf_counter() - start)
                torch_xla._XLAC._xla_wait_device_ops([])  # the device's work, outside the clock
                time.sleep(SETTLE)
            compile_seconds = None
        else:
            compiled = torch.compile(module.forward, backend="openxla", fullgraph=True, dynamic=False)
            start = time.perf_counter()
            compiled(**inputs, return_dict=False)
            torch_xla._XLAC._xla_wait_device_ops([])
            compile_seconds = time.perf_counter() - start
            for _ in range(CALLS + 1):
                time.sleep(SETTLE)
                start = time.perf_counter()
                compiled(**inputs, return_dict=False)
                times.append(time.perf_counter() - start)
                torch_xla._XLAC._xla_wait_device_ops([])  # the device's work, outside the clock
    host_ms = [t * 1000.0 for t in times[1:]]
    print(
        json.dumps(
            {
                "host_ms_median": statistics.median(host_ms),
                "host_ms_min": min(host_ms),
                "host_ms": host_ms,
                "parameters": sum(p.numel() for p in module.parameters()),
                "build_seconds": build_seconds,
                "compile_seconds": compile_seconds,
            }
        )
    )


def _inputs(class_name: str, config, size: int, device) -> dict:
    """A CFG step's inputs (batch 2) at `size` x `size` pixels for the denoiser class."""
    import torch

    bf16 = torch.bfloat16
    latent = size // 8
    if class_name == "UNet2DConditionModel":
        inputs = {
            "sample": torch.randn(2, config.in_channels, latent, latent, dtype=bf16),
            "timestep": torch.tensor(500.0),
            "encoder_hidden_states": torch.randn(2, 77, config.cross_attention_dim, dtype=bf16),
        }
        if config.addition_embed_type == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            inputs["added_cond_kwargs"] = {
                "text_embeds": torch.randn(2, pooled, dtype=bf16),
                "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * 2, dtype=bf16),
            }
    else:  # Flux2Transformer2DModel: packed latents (2x2 patches), text tokens, and their position ids
        tokens, text = (latent // 2) ** 2, 512
        inputs = {
            "hidden_states": torch.randn(2, tokens, config.in_channels, dtype=bf16),
            "encoder_hidden_states": torch.randn(2, text, config.joint_attention_dim, dtype=bf16),
            "timestep": torch.tensor([0.5, 0.5], dtype=bf16),
            "img_ids": torch.zeros(tokens, 4),
            "txt_ids": torch.zeros(text, 4),
        }
        if config.guidance_embeds:
            inputs["guidance"] = torch.tensor([4.0, 4.0], dtype=bf16)
    return _to(inputs, device)


def _to(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    return {key: _to(item, device) for key, item in value.items()}


def full_size(labels: list[str] | None) -> list[dict]:
    rows = []
    for label, family_name, model_id, component, sizes, executing in FULL:
        if labels and label not in labels:
            continue
        sides = [("lazy", size) for size in sizes] + [(side, sizes[-1]) for side in executing]
        row = {"denoiser": label, "model": model_id, "sides": []}
        for side, size in sides:
            print(f"(b) {label}: {side} at {size}x{size} ...", flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, "--full-size-worker", family_name, model_id, component, side, str(size)],
                capture_output=True,
                text=True,
                env={**os.environ, "PJRT_DEVICE": "CPU"},
            )
            if proc.returncode:
                sys.exit(f"the {label} {side} worker failed:\n{proc.stderr[-4000:]}")
            measured = json.loads(proc.stdout.strip().splitlines()[-1])
            row["sides"].append({"side": side, "size": size, **measured})
            print(f"    host ms per call: median {measured['host_ms_median']:.2f}, min {measured['host_ms_min']:.2f}")
        if "traced" in executing:
            traced = next(s for s in row["sides"] if s["side"] == "traced")
            same_size = next(s for s in row["sides"] if s["side"] == "lazy-sync")
            row["lazy_over_traced"] = same_size["host_ms_median"] / traced["host_ms_median"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- (c) the parts of a step's host time


def step_parts_worker(model: str, trace_once: bool) -> None:
    """One warm engine of `model` (64x64, batch 1, 20 steps): the host's milliseconds per step in each part of the
    step, timed by hooks around the denoiser and the step-end callback; prints one JSON line of medians."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import yaml

    from tpugen.config import load_config
    from tpugen.engine import Engine, EngineSpec
    from tpugen.plan import plan_run

    with tempfile.TemporaryDirectory() as tmp:
        config = _run_config(model, trace_once, {"dir": tmp}, prompts=["a red circle"], steps=20, batch_size=1)
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(config))
        run = load_config(path)
    engine = Engine.open(EngineSpec.of(run))
    (batch,) = plan_run(run).batches
    engine.warmup(plan_run(run))
    loaded = engine.loaded
    denoiser = getattr(loaded.pipe, loaded.family.denoiser)
    marks: list[tuple[str, float]] = []

    def mark(name):
        def hook(*args):
            marks.append((name, time.perf_counter()))

        return hook

    handles = [
        denoiser.register_forward_pre_hook(mark("call"), prepend=True),  # before tpugen's door
        denoiser.register_forward_pre_hook(mark("door done")),  # after it: the denoiser itself next
        denoiser.register_forward_hook(mark("denoiser done")),
    ]
    step_end = loaded._step_end

    def timed_step_end(*args):
        marks.append(("callback", time.perf_counter()))
        result = step_end(*args)
        marks.append(("callback done", time.perf_counter()))
        return result

    loaded._step_end = timed_step_end
    parts: dict[str, list[float]] = {}
    for _ in range(3):
        marks.clear()
        engine.generate(batch)
        previous = None
        for (name, at), (_, before) in zip(marks[1:], marks, strict=False):
            part = {
                "door done": "door: inputs moved and the work before the denoiser handed off",
                "denoiser done": "the denoiser's call",
                "callback": "after the denoiser: CFG and the scheduler's step, recorded",
                "callback done": "the step-end callback: its sync hands the step off",
                "call": "between steps: diffusers' loop, its mark_step, the CFG batch and input scaling, recorded",
            }[name]
            parts.setdefault(part, []).append((at - before) * 1000.0)
            previous = name
        assert previous == "callback done"
    for handle in handles:
        handle.remove()
    print(json.dumps({part: statistics.median(values) for part, values in parts.items()}))


def step_parts(models: list[str]) -> list[dict]:
    rows = []
    for model in models:
        for trace_once in (False, True):
            print(f"(c) {model}: parts of a step, trace_once {str(trace_once).lower()} ...", flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, "--step-parts-worker", model, str(int(trace_once))],
                capture_output=True,
                text=True,
                env={**os.environ, "PJRT_DEVICE": "CPU"},
            )
            if proc.returncode:
                sys.exit(f"the step parts worker failed for {model}:\n{proc.stderr[-4000:]}")
            rows.append({"model": model, "trace_once": trace_once, **json.loads(proc.stdout.strip().splitlines()[-1])})
    return rows


def report(tiny: list[dict], full: list[dict], parts: list[dict] = ()) -> None:
    if tiny:
        print("\n(a) end to end, tiny built-ins, 64x64, batch 2, 8 steps, XLA:CPU, each side a fresh process")
        print(
            f"{'model':22}{'img/s lazy':>11}{'traced':>9}{'ratio':>7}{'host ms lazy':>14}{'traced':>8}"
            f"{'dev ms lazy':>13}{'traced':>8}{'graphs':>8}{'max diff':>9}  traced once?"
        )
        for r in tiny:
            lazy, traced = r["lazy"], r["traced"]
            print(
                f"{r['model']:22}{lazy['images_per_second']:11.2f}{traced['images_per_second']:9.2f}"
                f"{r['images_per_second_ratio']:7.2f}{lazy['host_ms_per_step']:14.2f}{traced['host_ms_per_step']:8.2f}"
                f"{lazy['device_ms_per_step']:13.2f}{traced['device_ms_per_step']:8.2f}"
                f"{lazy['warmup_graphs']:4}->{traced['warmup_graphs']:<3}{r['max_pixel_difference']:6}/255  "
                f"{'yes' if r['traced_once'] else 'no: ' + str(r['reason'])}"
            )
    if full:
        print("\n(b) host ms per denoiser call, full-size denoisers in bfloat16, random weights, CFG batch 2")
        print(f"{'denoiser':32}{'side':8}{'size':>6}{'median ms':>11}{'min ms':>9}{'params':>9}")
        for r in full:
            for s in r["sides"]:
                print(
                    f"{r['denoiser']:32}{s['side']:8}{s['size']:6}{s['host_ms_median']:11.2f}{s['host_ms_min']:9.2f}"
                    f"{s['parameters'] / 1e9:8.2f}B"
                )
            if "lazy_over_traced" in r:
                print(f"{'':32}lazy (recorded, handed off) / traced once, same size: {r['lazy_over_traced']:.2f}x")
    if parts:
        print("\n(c) the host's ms per step by part (median over 3 calls of 20 steps, 64x64, batch 1, XLA:CPU)")
        for r in parts:
            print(f"{r['model']}, trace_once {str(r['trace_once']).lower()}:")
            for part, ms in r.items():
                if part not in ("model", "trace_once"):
                    print(f"  {ms:8.2f}  {part}")


def run(tiny_models: list[str] | None, full_labels: list[str] | None, skip_tiny: bool, skip_full: bool) -> dict:
    tiny = [] if skip_tiny else end_to_end(tiny_models or TINY)
    parts = [] if skip_tiny else step_parts(["tiny-sd", "tiny-flux"])
    full = [] if skip_full else full_size(full_labels)
    report(tiny, full, parts)
    return {"end_to_end": tiny, "step_parts": parts, "full_size": full}


if __name__ == "__main__" and sys.argv[1:2] == ["--step-parts-worker"]:
    step_parts_worker(sys.argv[2], bool(int(sys.argv[3])))

if __name__ == "__main__" and sys.argv[1:2] == ["--full-size-worker"]:
    family_name, model_id, component, side, size = sys.argv[2:7]
    full_size_worker(family_name, model_id, component, side, int(size))
