"""`scripts/bench.py jax`: execution.backend jax against xla with trace once, side by side in one run.

(a) End to end, each family's tiny built-in: `tpugen generate` on jax and on xla (compile.trace_once: true), each
    in a fresh process with a compile cache of its own, the same workload (8 prompts, 64x64, batch 2, 20 steps, seed
    5): images per second of the timed phase, the host's and the device's ms per step from the report, warmup
    seconds and graphs compiled, how far apart the two sides' pixels are.
(b) The next process: the same config again in a fresh process with the same cache folder, on both backends:
    warmup seconds and compiles against the first process's (JAX reads its cache back; torch_xla 2.9 does not on
    the CPU, nor on a TPU).
(c) Full size: SD 1.5's and SDXL's UNets from their configs, random bfloat16 weights, on JAX's CPU: host ms to hand
    one CFG call (batch 2 at 64x64) of the jitted denoiser to the device, and to hand a whole 20-step DDIM loop with
    CFG (tpugen's loop program), the device idle before each (a pause, then the previous call waited for); medians
    of 7 calls and 3 loops after one untimed. Then the next process: the same programs again with the same cache
    folder, JAX's own seconds of tracing, lowering and compiling (or reading the cache) in each. xla's side of the
    host figures: `scripts/bench.py trace` (part (b) there).
(d) Every device: tiny-sd on jax, execution.mode: multi over 4 JAX CPU devices (XLA_FLAGS) against mode single on
    one, batch 4 (one row a device), the rest as (a): images per second of each, how far apart their pixels are.
    On XLA:CPU the 4 devices share this machine's cores, so the ratio is the mesh's cost here, not a TPU's speed-up.
(e) Step caching: the deep Flux.1 built-in (tiny-flux-deep: 57 blocks, 128x128, 12 steps, 8 prompts, batch 1) with
    and without TaylorSeer (configs/flux-step-cache.yaml's options), on jax and on xla with trace once (which a step
    cache keeps on xla where it is TaylorSeer), each in a fresh process: images per second, warmup seconds (on jax
    a cached loop is traced call by call, a program per step count; on xla dynamo traces once per step index), how
    far the cached images are from the uncached ones.

Writes bench/jax.json.
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
TINY = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    "tiny-flux2",
    "tiny-flux2-klein",
    "tiny-z-image",
    "tiny-qwen-image",
]
PROMPTS = [
    "a red circle",
    "a blue square",
    "a green triangle",
    "a white circle",
    "a lighthouse at dawn",
    "a red fox in snow",
    "a castle in the clouds",
    "a ship in a storm",
]
STEPS = 20
FULL = [
    ("SD 1.5 UNet", "sd", "stable-diffusion-v1-5/stable-diffusion-v1-5"),
    ("SDXL UNet", "sdxl", "stabilityai/stable-diffusion-xl-base-1.0"),
]
CALLS = 7
LOOPS = 3  # timed hand-overs of a full-size loop (each loop runs 20 steps on these 2 cores)
SETTLE = 2.0  # seconds between timed calls, the device idle (bench_trace.py says why on XLA:CPU)


def _config(model: str, backend: str, workdir: Path, run_id: str, cache: Path) -> dict:
    return {
        "model": {"id": model, "dtype": "float32"},
        "prompts": PROMPTS,
        "height": 64,
        "width": 64,
        "steps": STEPS,
        "batch_size": 2,
        "seed": 5,
        "execution": {"backend": backend},
        "compile": {"trace_once": True},
        "cache": {"enabled": True, "dir": str(cache)},
        "output": {"dir": str(workdir), "run_id": run_id},
    }


def _side(report: dict) -> dict:
    timed = report["timed_phase"]
    return {
        "images_per_second": timed["images_per_second"],
        "host_ms_per_step": timed["host_ms_per_step"],
        "device_ms_per_step": timed["device_ms_per_step"],
        "warmup_seconds": report["warmup_seconds"],
        "warmup_compiles": report["xla_counters"]["warmup"]["compiles"],
        "persistent_cache_hits": report["persistent_cache"].get("hits"),
        "compiles_after_warmup": report["compiles_after_warmup"],
    }


def end_to_end(models: list[str], again: list[str]) -> list[dict]:
    from bench import _generate_fresh  # scripts/bench.py: `tpugen generate` in a fresh process
    from bench_trace import _max_difference

    rows = []
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-jax-") as tmp:
        work = Path(tmp)
        for model in models:
            row = {"model": model}
            for backend in ("jax", "xla"):
                print(f"(a) {model} on {backend} ...", flush=True)
                cache = work / f"cache-{model}-{backend}"
                report = _generate_fresh(
                    work, f"{model}-{backend}", _config(model, backend, work, f"{model}-{backend}", cache)
                )
                row[backend] = _side(report)
                if backend == "jax":
                    row["jax"]["denoising_loop"] = report["device"]["denoising_loop"]
                if model in again:
                    print(f"(b) {model} on {backend}, the next process ...", flush=True)
                    run_id = f"{model}-{backend}-again"
                    second = _generate_fresh(work, run_id, _config(model, backend, work, run_id, cache))
                    row[backend]["next_process"] = _side(second)
                    row[backend]["next_over_first_warmup"] = second["warmup_seconds"] / report["warmup_seconds"]
            row["max_pixel_difference"] = _max_difference(work / f"{model}-jax", work / f"{model}-xla")
            row["images_per_second_jax_over_xla"] = row["jax"]["images_per_second"] / row["xla"]["images_per_second"]
            rows.append(row)
    return rows


# ---------------------------------------------------------------- (d) every device


def every_device(model: str = "tiny-sd", count: int = 4) -> dict:
    from bench import _generate_fresh
    from bench_trace import _max_difference

    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={count}", "JAX_PLATFORMS": "cpu"}
    row = {"model": model, "devices": count}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-jax-devices-") as tmp:
        work = Path(tmp)
        for mode in ("single", "multi"):
            print(f"(d) {model} on jax, mode {mode} ...", flush=True)
            config = _config(model, "jax", work, mode, work / f"cache-{mode}")
            config["execution"] = {"backend": "jax", "mode": mode}
            config["batch_size"] = count
            report = _generate_fresh(work, mode, config, env=env)
            row[mode] = {**_side(report), "devices": report["device"]["devices"]}
        row["max_pixel_difference"] = _max_difference(work / "single", work / "multi")
    row["images_per_second_multi_over_single"] = row["multi"]["images_per_second"] / row["single"]["images_per_second"]
    return row


# ---------------------------------------------------------------- (e) step caching

DEEP_PROMPTS = PROMPTS
TAYLORSEER = {
    "method": "taylorseer",
    "cache_interval": 3,
    "disable_cache_before_step": 2,
    "taylor_factors_dtype": "float32",
}


def step_caching(model: str = "tiny-flux-deep") -> dict:
    from bench import _generate_fresh
    from bench_trace import _max_difference

    row: dict = {"model": model, "height": 128, "steps": 12, "images": len(DEEP_PROMPTS)}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-jax-cache-") as tmp:
        work = Path(tmp)
        for backend in ("jax", "xla"):
            for cached in (False, True):
                run_id = f"{backend}-{'taylorseer' if cached else 'none'}"
                print(f"(e) {model} on {backend}, {'TaylorSeer' if cached else 'no step cache'} ...", flush=True)
                config = _config(model, backend, work, run_id, work / f"cache-{run_id}")
                config.update(prompts=DEEP_PROMPTS, height=128, width=128, steps=12, batch_size=1)
                if cached:
                    config["compile"] = {"trace_once": True, "step_cache": TAYLORSEER}
                report = _generate_fresh(work, run_id, config)
                row[run_id] = {**_side(report), "trace_once": report["device"].get("trace_once", {}).get("state")}
            row[f"{backend}_cached_apart_from_uncached"] = _max_difference(
                work / f"{backend}-none", work / f"{backend}-taylorseer"
            )
            row[f"{backend}_cached_over_uncached"] = (
                row[f"{backend}-taylorseer"]["images_per_second"] / row[f"{backend}-none"]["images_per_second"]
            )
        row["jax_over_xla_cached"] = (
            row["jax-taylorseer"]["images_per_second"] / row["xla-taylorseer"]["images_per_second"]
        )
        row["cached_jax_apart_from_xla"] = _max_difference(work / "jax-taylorseer", work / "xla-taylorseer")
    return row


# ---------------------------------------------------------------- (c) full size


def full_size_worker(family_name: str, model_id: str, cache: str, again: bool) -> None:
    """One full-size UNet in bfloat16 on JAX's CPU, JAX's persistent cache in `cache`: prints a JSON line with the
    seconds to the first call's result (trace, compile or cache read, and the call itself) of one CFG call and of a
    whole 20-step loop, and, unless `again` (the next process: those seconds alone), the host ms to hand each over."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import diffusers
    import torch

    from tpugen.backends.jax.loop import LoopPrograms
    from tpugen.backends.jax.modules import JaxModule, to_jax
    from tpugen.backends.jax.runtime import process_runtime
    from tpugen.engine.linear_schedule import derive
    from tpugen.engine.whole_loop import DenoiserLoop, LoopWork
    from tpugen.families import family as family_named

    from bench_trace import _inputs

    runtime = process_runtime()
    runtime.use_cache(cache)
    (known,) = [m for m in family_named(family_name).known_models if m.id == model_id]
    class_name, config = known.components["unet"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    start = time.perf_counter()
    unet = getattr(diffusers, class_name).from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    denoiser = JaxModule(runtime, unet, "unet")
    build_seconds = time.perf_counter() - start
    inputs = _inputs(class_name, unet.config, 64, torch.device("cpu"))
    jitted = runtime.jax.jit(
        lambda weights, arrays: runtime.env.t2j_iso(
            _call(runtime, denoiser, weights, {k: runtime.env.j2t_iso(v) for k, v in arrays.items()})
        )
    )
    arrays = runtime.jax.tree_util.tree_map(to_jax, inputs)

    compiling: dict[int, float] = {}  # JAX's own seconds of tracing, lowering and compiling or loading, per program

    def timed(call, repeats: int) -> tuple[list[float], float, float]:
        before = runtime.reading()
        first = time.perf_counter()
        call().block_until_ready()  # trace, compile (or read the cache), run
        first_seconds = time.perf_counter() - first
        after = runtime.reading()
        hits = after.cache_hits - before.cache_hits
        compiling[len(compiling)] = after.compile_seconds - before.compile_seconds
        times = []
        for _ in range(repeats + 1 if repeats else 0):
            time.sleep(SETTLE)
            start = time.perf_counter()
            out = call()
            times.append((time.perf_counter() - start) * 1000.0)
            out.block_until_ready()  # the device's work, outside the clock
        return times[1:], first_seconds, hits

    call_ms, call_first, call_hits = timed(lambda: jitted(denoiser.weights, arrays), 0 if again else CALLS)

    scheduler = diffusers.DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    scheduler.set_timesteps(STEPS)
    schedule = derive(scheduler, list(scheduler.timesteps))
    loops = LoopPrograms(runtime, denoiser)
    body = DenoiserLoop(
        sample=0,
        timestep=1,
        timestep_rows=False,
        timestep_divisor=1.0,
        scales_input=True,
        cfg="batch",
        cfg_by_call=(),
        cfg_rescale=None,
        appendix_dim=None,
        blends=False,
    )
    kwargs = {k: v for k, v in inputs.items() if k not in ("sample", "timestep")}
    work = LoopWork(
        latents=inputs["sample"][:1],
        schedule=schedule,
        noise=None,
        body=body,
        inputs={
            "args": (None, None),
            "kwargs": {**kwargs, "return_dict": False},
            "negative": {},
            "timestep_dtype": torch.int64,
            "sample_dtype": torch.bfloat16,
            "appendix": None,
        },
        guidance=7.5,
    )
    loop_ms, loop_first, loop_hits = timed(lambda: loops.run(work), 0 if again else LOOPS)
    measured = {
        "parameters": sum(p.numel() for p in unet.parameters()),
        "build_seconds": build_seconds,
        "call_first_seconds": call_first,
        "call_compile_seconds": compiling[0],
        "call_cache_hits": call_hits,
        "loop_first_seconds": loop_first,
        "loop_compile_seconds": compiling[1],
        "loop_cache_hits": loop_hits,
        "loop_steps": STEPS,
    }
    if not again:
        measured.update(
            call_host_ms_median=statistics.median(call_ms),
            call_host_ms_min=min(call_ms),
            loop_host_ms_median=statistics.median(loop_ms),
            loop_host_ms_min=min(loop_ms),
            loop_host_ms_per_step=statistics.median(loop_ms) / STEPS,
        )
    print(json.dumps(measured))


def _call(runtime, denoiser, weights, inputs):
    with runtime.env:
        return denoiser.traced(weights, "forward", **inputs, return_dict=False)[0]


def _full_size_process(label: str, family_name: str, model_id: str, cache: Path, again: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--full-size-worker", family_name, model_id, str(cache), "again" if again else ""],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU"},
    )
    if proc.returncode:
        sys.exit(f"the {label} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_size(labels: list[str] | None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-jax-full-") as tmp:
        for label, family_name, model_id in FULL:
            if labels and label not in labels:
                continue
            cache = Path(tmp) / family_name
            print(f"(c) {label} on JAX's CPU ...", flush=True)
            measured = _full_size_process(label, family_name, model_id, cache, again=False)
            print(
                f"    one CFG call: {measured['call_host_ms_median']:.2f} ms; a {STEPS}-step loop: "
                f"{measured['loop_host_ms_median']:.2f} ms ({measured['loop_host_ms_per_step']:.3f} ms a step)"
            )
            print(f"(c) {label}, the next process ...", flush=True)
            measured["next_process"] = _full_size_process(label, family_name, model_id, cache, again=True)
            rows.append({"denoiser": label, "model": model_id, **measured})
    return rows


def report(tiny: list[dict], full: list[dict], devices: dict | None = None, caching: dict | None = None) -> None:
    if tiny:
        print("\n(a) tiny built-ins, 64x64, batch 2, 20 steps, 8 prompts; jax against xla with trace once")
        print(
            f"{'model':28s} {'jax img/s':>9s} {'xla img/s':>9s} {'ratio':>6s} {'jax host ms/step':>16s} "
            f"{'xla host ms/step':>16s} {'jax warmup s':>12s} {'xla warmup s':>12s} {'apart /255':>10s}"
        )
        for row in tiny:
            jax, xla = row["jax"], row["xla"]
            print(
                f"{row['model']:28s} {jax['images_per_second']:9.2f} {xla['images_per_second']:9.2f} "
                f"{row['images_per_second_jax_over_xla']:6.2f} {jax['host_ms_per_step']:16.3f} "
                f"{xla['host_ms_per_step']:16.2f} {jax['warmup_seconds']:12.2f} {xla['warmup_seconds']:12.2f} "
                f"{row['max_pixel_difference']:10d}"
            )
        for row in tiny:
            for backend in ("jax", "xla"):
                side = row[backend]
                if "next_process" in side:
                    nxt = side["next_process"]
                    print(
                        f"(b) {row['model']} on {backend}: warmup {side['warmup_seconds']:.2f} s ({side['warmup_compiles']} "
                        f"compiles), the next process {nxt['warmup_seconds']:.2f} s ({nxt['warmup_compiles']} compiles, "
                        f"{nxt['persistent_cache_hits']} cache hits): ratio {side['next_over_first_warmup']:.2f}"
                    )
    if devices:
        single, multi = devices["single"], devices["multi"]
        print(
            f"(d) {devices['model']} on jax, batch {devices['devices']}: mode multi over {multi['devices']} devices "
            f"{multi['images_per_second']:.2f} img/s, mode single on {single['devices']} {single['images_per_second']:.2f} "
            f"img/s: ratio {devices['images_per_second_multi_over_single']:.2f} (the devices share this machine's "
            f"cores); {devices['max_pixel_difference']}/255 apart; compiles after warmup {multi['compiles_after_warmup']}"
        )
    if caching:
        print(
            f"(e) {caching['model']}, {caching['height']}x{caching['height']}, {caching['steps']} steps, "
            f"{caching['images']} images; TaylorSeer against none"
        )
        for backend in ("jax", "xla"):
            none, cached = caching[f"{backend}-none"], caching[f"{backend}-taylorseer"]
            print(
                f"    {backend}: {cached['images_per_second']:.2f} against {none['images_per_second']:.2f} img/s, ratio "
                f"{caching[f'{backend}_cached_over_uncached']:.2f}; warmup {cached['warmup_seconds']:.1f} against "
                f"{none['warmup_seconds']:.1f} s; trace once {none['trace_once']} without the cache, "
                f"{cached['trace_once']} with it; cached {caching[f'{backend}_cached_apart_from_uncached']}/255 from "
                f"uncached; compiles after warmup {cached['compiles_after_warmup']}"
            )
        print(
            f"    cached, jax against xla: ratio {caching['jax_over_xla_cached']:.2f}, "
            f"{caching['cached_jax_apart_from_xla']}/255 apart"
        )
    for row in full:
        nxt = row["next_process"]
        print(
            f"(c) {row['denoiser']}: one CFG call handed over in {row['call_host_ms_median']:.2f} ms (min "
            f"{row['call_host_ms_min']:.2f}); a {row['loop_steps']}-step loop in {row['loop_host_ms_median']:.2f} ms "
            f"({row['loop_host_ms_per_step']:.3f} ms a step); tracing and compiling: call {row['call_compile_seconds']:.1f} s, "
            f"loop {row['loop_compile_seconds']:.1f} s; the next process (tracing and reading the cache) call "
            f"{nxt['call_compile_seconds']:.1f} s, loop {nxt['loop_compile_seconds']:.1f} s "
            f"({nxt['call_cache_hits'] + nxt['loop_cache_hits']} cache hits)"
        )


def run(
    models: list[str] | None, full_labels: list[str] | None, skip_tiny: bool, skip_full: bool, only_caching: bool
) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    models = models or TINY
    skip_tiny, skip_full = skip_tiny or only_caching, skip_full or only_caching
    tiny = [] if skip_tiny else end_to_end(models, again=["tiny-sd", "tiny-flux"])
    devices = None if skip_tiny else every_device()
    caching = step_caching() if not skip_tiny or only_caching else None
    full = [] if skip_full else full_size(full_labels)
    report(tiny, full, devices, caching)
    return {
        "measured": time.strftime("%Y-%m-%d"),
        "tiny": tiny,
        "every_device": devices,
        "step_caching": caching,
        "full_size": full,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--full-size-worker":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        full_size_worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "again")
