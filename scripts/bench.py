#!/usr/bin/env python
"""Side-by-side benchmark on XLA:CPU: the naive torch_xla port of a diffusers script vs `tpugen generate`.

Workload (the same for both): tiny-sd, 10 prompts, batch size 4, sizes 64x64 and 96x64, 10 steps.
(a) naive: what the PyTorch/XLA guide leads to -- the pipeline moved to torch_xla.device(), a loop over
    batches of prompts for each size, nothing else.
(b) tpugen: `tpugen generate` on the same workload (warmup per shape key, padded batches, timed phase).
Each side runs in a fresh process, so neither sees the other's in-memory compile cache. Prints a table
and writes bench/results.json and bench/results.png.

    .venv/bin/python scripts/bench.py [--repeat N]

With --compile instead: the compile seconds of one Flux transformer forward (tiny width) at 14 blocks
(2 double + 12 single) and at Flux.1's real depth of 57 (19 + 38), unrolled vs compile.scan_blocks, each in
a fresh process; writes bench/compile.json.

With `trace` instead (scripts/bench.py trace): compile.trace_once against recording the denoiser every step; see
scripts/bench_trace.py for what it measures. Writes bench/trace.json.

With `jax` instead (scripts/bench.py jax): execution.backend jax against xla with trace once, the next process's
warmup against the first's, and the host's share of a full-size UNet's call and whole loop on JAX; see
scripts/bench_jax.py. Writes bench/jax.json.

With `serve` instead (scripts/bench.py serve): `tpugen serve` against fresh processes, side by side.
(1) five small runs (tiny-sd, 3 prompts, batch 2, 10 steps) as five fresh `tpugen generate` processes, against
    one server started for them (its start and warmup counted) plus five `tpugen generate --server` calls;
(2) eight one-image A1111 requests sent at once, against the same eight sent one at a time (server batch
    size 4): images per second, p50/p99 latency, and the padding rows each computed;
(3) 1, 8 and 32 concurrent clients, each sending one-image requests (48 requests per level, server batch size 4):
    images per second and p50/p99 latency of the answered ones, and how many were turned away (503);
(4) /healthz latency p50/p99, polled every 10 ms while a request for 16 images at 512x512 is made and encoded,
    against /healthz on an idle server; writes bench/serve.json.

With --step-cache instead: each compile.step_cache method against none, each a fresh `tpugen generate` process
on XLA:CPU: taylorseer (cache_interval 3, disable_cache_before_step 2, float32 factors), magcache (threshold
0.06, max_skip_steps 3, its mag_ratios measured first by `tpugen calibrate` on the same model and steps) and
pyramid_attention_broadcast (diffusers' defaults: every other attention call reused inside timesteps 100..800), on a
random-weight Flux at the real depth (tiny-flux-deep: 19 double + 38 single blocks, tiny width), 128x128, 12 steps,
batch 1. Seconds per image and per step of the timed phase, compiles in warmup and after it, and how far the cached images are
from the uncached ones (max and mean difference in /255, PSNR); writes bench/step-cache.json. --step-cache-model names another built-in (a
shallower one where time is short).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "a lighthouse on a cliff at dawn",
    "a red fox in fresh snow",
    "an astronaut riding a horse",
    "a bowl of ramen, studio lighting",
    "a tiny robot watering plants",
    "a castle in the clouds",
    "a sailing ship in a storm",
    "a cat reading a newspaper",
    "a city street at night in the rain",
    "a field of sunflowers under a blue sky",
]
SIZES = [(64, 64), (96, 64)]
BATCH = 4
STEPS = 10
GUIDANCE = 7.5


def naive_worker() -> None:
    """The naive port, timed from after model load; prints one JSON line."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla
    import torch_xla.debug.metrics as met
    from diffusers import DiffusionPipeline

    from tpugen.tiny import builtin_path

    device = torch_xla.device()
    pipe = DiffusionPipeline.from_pretrained(builtin_path("tiny-sd")).to(device)
    pipe.set_progress_bar_config(disable=True)
    met.clear_all()
    batches = []
    start = time.perf_counter()
    for height, width in SIZES:
        for first in range(0, len(PROMPTS), BATCH):
            prompts = PROMPTS[first : first + BATCH]
            before = (met.metric_data("CompileTime") or [0])[0]
            t0 = time.perf_counter()
            images = pipe(
                prompts, height=height, width=width, num_inference_steps=STEPS, guidance_scale=GUIDANCE
            ).images
            seconds = time.perf_counter() - t0
            compiles = (met.metric_data("CompileTime") or [0])[0] - before
            batches.append(
                {"images": len(images), "seconds": seconds, "compiles": compiles, "full": len(prompts) == BATCH}
            )
    wall = time.perf_counter() - start
    total = met.metric_data("CompileTime")
    print(json.dumps({"wall_seconds": wall, "compiles": int(total[0]), "batches": batches}))


def run_naive() -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--naive-worker"],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    if proc.returncode:
        sys.exit(f"naive port failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steady = [b["seconds"] / b["images"] for b in result["batches"] if b["full"] and not b["compiles"]]
    return {
        "compiles": result["compiles"],
        "wall_seconds": result["wall_seconds"],
        "process_seconds": time.perf_counter() - start,
        "steady_seconds_per_image": statistics.mean(steady) if steady else None,
        "images": sum(b["images"] for b in result["batches"]),
    }


def _generate_fresh(workdir: Path, run_id: str, config: dict, env: dict | None = None) -> dict:
    """`tpugen generate` of `config` in a fresh process (so no compile is reused), with `env` added to its
    environment; its report.json."""
    path = workdir / f"{run_id}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "tpugen"), "generate", str(path), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU", **(env or {})},
    )
    if proc.returncode:
        sys.exit(f"tpugen failed:\n{proc.stderr}")
    return json.loads((workdir / run_id / "report.json").read_text())


def run_tpugen(workdir: Path, run_id: str) -> dict:
    config = {
        "model": {"id": "tiny-sd"},
        "prompts": PROMPTS,
        "sizes": [list(s) for s in SIZES],
        "steps": STEPS,
        "guidance_scale": GUIDANCE,
        "batch_size": BATCH,
        "execution": {"backend": "xla"},
        "output": {"dir": str(workdir), "run_id": run_id},
    }
    start = time.perf_counter()
    report = _generate_fresh(workdir, run_id, config)
    full = [b for b in report["timed_phase"]["batches"] if not b["padding"] and not b["compiles"]]
    return {
        "compiles": report["xla_counters"]["warmup"]["compiles"] + report["compiles_after_warmup"],
        "wall_seconds": report["warmup_seconds"] + report["timed_phase"]["wall_seconds"],
        "process_seconds": time.perf_counter() - start,
        "steady_seconds_per_image": statistics.mean(b["seconds"] / b["images"] for b in full),
        "images": report["images"],
    }


def compile_worker(double: int, single: int, scanned: bool) -> None:
    """Compile one forward of a tiny-width Flux transformer; prints compile and wall seconds as JSON."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from tpugen.backends import scan_repeated_blocks
    from tpugen.families.flux.tiny import tiny_transformer as tiny_flux_transformer

    torch.manual_seed(0)
    model = tiny_flux_transformer(double, single).eval()
    if scanned:
        scan_repeated_blocks(model)
    device = torch_xla.device()
    model.to(device)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 64, 16, generator=g).to(device),
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=g).to(device),
        "pooled_projections": torch.randn(2, 32, generator=g).to(device),
        "timestep": torch.tensor([0.5, 0.5]).to(device),
        "img_ids": torch.zeros(64, 3).to(device),
        "txt_ids": torch.zeros(16, 3).to(device),
    }
    met.clear_all()
    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs, return_dict=False)[0].cpu()
        first = time.perf_counter() - start
        start = time.perf_counter()
        model(**inputs, return_dict=False)[0].cpu()
        second = time.perf_counter() - start
    compiled = met.metric_data("CompileTime")
    print(
        json.dumps(
            {
                "compile_seconds": compiled[1] / 1e9,
                "graphs": int(compiled[0]),
                "first_call_seconds": first,
                "second_call_seconds": second,
            }
        )
    )


def run_compile_bench() -> None:
    rows = []
    for double, single in ((2, 12), (19, 38)):
        row = {"blocks": double + single, "double": double, "single": single}
        for scanned in (False, True):
            proc = subprocess.run(
                [sys.executable, __file__, "--compile-worker", str(double), str(single), str(int(scanned))],
                capture_output=True,
                text=True,
                env={**os.environ, "PJRT_DEVICE": "CPU"},
            )
            if proc.returncode:
                sys.exit(f"compile worker failed:\n{proc.stderr}")
            row["scan" if scanned else "loop"] = json.loads(proc.stdout.strip().splitlines()[-1])
        row["compile_ratio"] = row["loop"]["compile_seconds"] / row["scan"]["compile_seconds"]
        rows.append(row)
    print("one Flux transformer forward, tiny width, XLA:CPU, each in a fresh process")
    print(
        f"{'blocks':>8}{'loop compile s':>16}{'scan compile s':>16}{'loop/scan':>11}{'loop 2nd call s':>17}{'scan 2nd call s':>17}"
    )
    for r in rows:
        print(
            f"{r['blocks']:>8}{r['loop']['compile_seconds']:>16.2f}{r['scan']['compile_seconds']:>16.2f}"
            f"{r['compile_ratio']:>11.2f}{r['loop']['second_call_seconds']:>17.3f}{r['scan']['second_call_seconds']:>17.3f}"
        )
    out = ROOT / "bench"
    out.mkdir(exist_ok=True)
    (out / "compile.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out / 'compile.json'}")


def bar_chart(results: dict, path: Path) -> None:
    """Three panels (compiles, wall seconds, steady seconds per image), naive vs tpugen."""
    from PIL import Image, ImageDraw

    metrics = [
        ("compiles", "compiles"),
        ("wall_seconds", "wall seconds"),
        ("steady_seconds_per_image", "steady seconds per image"),
    ]
    panel_w, panel_h, margin = 220, 260, 30
    image = Image.new("RGB", (panel_w * len(metrics), panel_h + 2 * margin), "white")
    draw = ImageDraw.Draw(image)
    colours = {"naive": (200, 90, 70), "tpugen": (60, 120, 200)}
    for i, (key, label) in enumerate(metrics):
        x0 = i * panel_w
        values = {side: results[side][key] for side in ("naive", "tpugen")}
        top = max(values.values()) or 1
        draw.text((x0 + 10, 8), label, fill="black")
        for j, (side, value) in enumerate(values.items()):
            height = int((panel_h - 40) * value / top)
            left = x0 + 40 + j * 80
            bottom = margin + panel_h - 20
            draw.rectangle([left, bottom - height, left + 50, bottom], fill=colours[side])
            draw.text((left, bottom - height - 14), f"{value:.3g}", fill="black")
            draw.text((left, bottom + 4), side, fill="black")
    image.save(path)


SERVE_PROMPTS = PROMPTS[:3]


def _small_config(path: Path, output: Path, run_id: str, **extra) -> Path:
    import yaml

    config = {
        "model": {"id": "tiny-sd", "scheduler": "DDIM"},
        "prompts": SERVE_PROMPTS,
        "height": 64,
        "width": 64,
        "steps": STEPS,
        "guidance_scale": GUIDANCE,
        "batch_size": 2,
        "output": {"dir": str(output), "run_id": run_id},
        **extra,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(config: Path, port: int, log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/tpugen"), "serve", str(config), "--port", str(port)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")},
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {log}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server was not ready in 15 minutes")


def _metric(port: int, name: str) -> float:
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def run_serve_bench() -> None:
    import httpx

    tpugen = str(ROOT / ".venv/bin/tpugen")
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-serve-") as tmp:
        tmp = Path(tmp)
        print("(1) five runs as five fresh `tpugen generate` processes ...", flush=True)
        start = time.perf_counter()
        for i in range(5):
            config = _small_config(tmp / f"fresh-{i}.yaml", tmp / "fresh", f"run-{i}", seed=i * 10)
            subprocess.run([tpugen, "generate", str(config), "--quiet"], check=True, env=env, capture_output=True)
        fresh = time.perf_counter() - start

        print("(1) one server (start and warmup counted) and five `tpugen generate --server` ...", flush=True)
        port = _free_port()
        serve_config = _small_config(tmp / "serve.yaml", tmp / "served", "unused")
        start = time.perf_counter()
        server = _start_server(serve_config, port, tmp / "server.log")
        ready = time.perf_counter() - start
        try:
            for i in range(5):
                config = _small_config(tmp / f"client-{i}.yaml", tmp / "client", f"run-{i}", seed=i * 10)
                subprocess.run(
                    [tpugen, "generate", str(config), "--quiet", "--server", f"http://127.0.0.1:{port}"],
                    check=True,
                    env=env,
                    capture_output=True,
                )
            served = time.perf_counter() - start
        finally:
            server.terminate()
            server.wait(120)

        print("(2) eight one-image requests: at once, and one at a time (server batch size 4) ...", flush=True)
        port = _free_port()
        config = _small_config(
            tmp / "serve4.yaml", tmp / "served4", "unused", batch_size=4, serve={"batch_window_ms": 50}
        )
        server = _start_server(config, port, tmp / "server4.log")
        url = f"http://127.0.0.1:{port}/sdapi/v1/txt2img"
        body = {"prompt": "a lighthouse", "steps": STEPS, "cfg_scale": GUIDANCE, "width": 64, "height": 64}

        def one(seed: int) -> float:
            began = time.perf_counter()
            response = httpx.post(url, json={**body, "seed": seed}, timeout=600)
            response.raise_for_status()
            return time.perf_counter() - began

        def measure(concurrent: bool) -> dict:
            from concurrent.futures import ThreadPoolExecutor

            padding = _metric(port, "tpugen_padding_rows_total")
            began = time.perf_counter()
            if concurrent:
                with ThreadPoolExecutor(8) as pool:
                    latencies = list(pool.map(one, range(8)))
            else:
                latencies = [one(seed) for seed in range(8)]
            wall = time.perf_counter() - began
            latencies.sort()
            return {
                "images_per_second": 8 / wall,
                "p50_seconds": statistics.median(latencies),
                "p99_seconds": latencies[-1],  # of eight requests, the slowest
                "padding_rows": _metric(port, "tpugen_padding_rows_total") - padding,
                "wall_seconds": wall,
            }

        try:
            one(99)  # a first request, so neither side pays anything the warmup left
            sequential = measure(concurrent=False)
            concurrent = measure(concurrent=True)
        finally:
            server.terminate()
            server.wait(120)

    load = run_serve_load_bench(tmp_root=None)

    print(f"\n(1) five small runs (tiny-sd, {len(SERVE_PROMPTS)} prompts, batch 2, {STEPS} steps), XLA:CPU")
    print(f"{'five fresh generate processes s':42}{fresh:10.2f}")
    print(f"{'server ready s (start + load + warmup)':42}{ready:10.2f}")
    print(f"{'server + five generate --server s':42}{served:10.2f}")
    print(f"{'ratio (target <= 0.4)':42}{served / fresh:10.3f}")
    print("\n(2) eight one-image requests, server batch size 4")
    print(f"{'':24}{'one at a time':>16}{'at once':>12}{'at once / one at a time':>26}")
    for key in ("images_per_second", "p50_seconds", "p99_seconds", "padding_rows"):
        ratio = concurrent[key] / sequential[key] if sequential[key] else float("nan")
        print(f"{key:24}{sequential[key]:16.3f}{concurrent[key]:12.3f}{ratio:26.3f}")
    out = ROOT / "bench"
    out.mkdir(exist_ok=True)
    payload = {
        "five_runs": {
            "fresh_seconds": fresh,
            "server_ready_seconds": ready,
            "served_seconds": served,
            "ratio": served / fresh,
        },
        "eight_requests": {"one_at_a_time": sequential, "at_once": concurrent},
        **load,
    }
    (out / "serve.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out / 'serve.json'}")


def _quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p99": None, "max": None}
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "max": ordered[-1],
    }


def run_serve_load_bench(tmp_root: Path | None) -> dict:
    """(3) throughput and latency at 1, 8 and 32 concurrent clients; (4) /healthz while 16 big images are encoded.
    Prints its tables and returns their figures."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-load-", dir=tmp_root) as tmp:
        tmp = Path(tmp)
        port = _free_port()
        config = _small_config(
            tmp / "load.yaml",
            tmp / "served",
            "unused",
            batch_size=4,
            serve={"batch_window_ms": 20, "max_queue": 16, "sizes": [[64, 64], [512, 512]]},
        )
        print("(3, 4) one server warm at 64x64 and 512x512, batch size 4 ...", flush=True)
        server = _start_server(config, port, tmp / "load.log")
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "a lighthouse", "steps": STEPS, "cfg_scale": GUIDANCE, "width": 64, "height": 64}
        try:
            with httpx.Client(timeout=600) as client:

                def one(seed: int) -> tuple[int, float]:
                    began = time.perf_counter()
                    status = client.post(f"{base}/sdapi/v1/txt2img", json={**body, "seed": seed}).status_code
                    return status, time.perf_counter() - began

                one(0)
                levels = {}
                for clients in (1, 8, 32):
                    began = time.perf_counter()
                    with ThreadPoolExecutor(clients) as pool:
                        answers = list(pool.map(one, range(48)))
                    wall = time.perf_counter() - began
                    ok = [seconds for status, seconds in answers if status == 200]
                    levels[clients] = {
                        "requests": len(answers),
                        "answered": len(ok),
                        "turned_away_503": sum(status == 503 for status, _ in answers),
                        "images_per_second": len(ok) / wall,
                        **{f"{k}_seconds": v for k, v in _quantiles(ok).items()},
                    }
                results["concurrent_clients"] = levels

                def health_latencies(until) -> list[float]:
                    seen = []
                    deadline = time.monotonic() + 600
                    with httpx.Client(timeout=60) as probe:
                        while not until() and time.monotonic() < deadline and len(seen) < 100_000:
                            began = time.perf_counter()
                            probe.get(f"{base}/healthz")
                            seen.append(time.perf_counter() - began)
                            time.sleep(0.01)
                    return seen

                idle_end = time.monotonic() + 3
                idle = health_latencies(lambda: time.monotonic() > idle_end)
                big = {**body, "width": 512, "height": 512, "batch_size": 4, "n_iter": 4}
                with ThreadPoolExecutor(1) as pool:
                    request = pool.submit(client.post, f"{base}/sdapi/v1/txt2img", json=big)
                    busy = health_latencies(request.done)
                    reply = request.result()
                reply.raise_for_status()
                results["healthz"] = {
                    "idle": {**_quantiles(idle), "samples": len(idle)},
                    "during_16_images_512": {**_quantiles(busy), "samples": len(busy)},
                    "reply_megabytes": len(reply.content) / 1e6,
                    "images": len(reply.json()["images"]),
                }
        finally:
            server.terminate()
            server.wait(120)

    print("\n(3) one-image requests, 48 per level, server batch size 4, serve.max_queue 16")
    print(f"{'clients':>8}{'answered':>10}{'503':>6}{'images/s':>10}{'p50 s':>9}{'p99 s':>9}")
    for clients, level in results["concurrent_clients"].items():
        print(
            f"{clients:>8}{level['answered']:>10}{level['turned_away_503']:>6}{level['images_per_second']:>10.2f}"
            f"{level['p50_seconds'] or float('nan'):>9.3f}{level['p99_seconds'] or float('nan'):>9.3f}"
        )
    health = results["healthz"]
    print(
        f"\n(4) /healthz every 10 ms (ms): idle p50 {health['idle']['p50'] * 1e3:.1f}, p99 "
        f"{health['idle']['p99'] * 1e3:.1f}; while {health['images']} images at 512x512 are made and encoded "
        f"({health['reply_megabytes']:.1f} MB reply): p50 {health['during_16_images_512']['p50'] * 1e3:.1f}, "
        f"p99 {health['during_16_images_512']['p99'] * 1e3:.1f}, max {health['during_16_images_512']['max'] * 1e3:.1f}"
    )
    return results


STEP_CACHE_PROMPTS = ["a lighthouse at dawn", "a red fox in snow", "an astronaut on a horse"]
STEP_CACHE_TAYLORSEER = {
    "method": "taylorseer",
    "cache_interval": 3,
    "disable_cache_before_step": 2,
    "taylor_factors_dtype": "float32",
}


STEP_CACHE_MAGCACHE = {"method": "magcache", "threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2}
STEP_CACHE_PAB = {"method": "pyramid_attention_broadcast"}
# The table's column for each method (pyramid_attention_broadcast is too long a heading).
STEP_CACHE_COLUMNS = {"pyramid_attention_broadcast": "PAB"}


def _step_cache_config(workdir: Path, model: str, run_id: str, step_cache: dict | None) -> dict:
    return {
        "model": {"id": model},
        "prompts": STEP_CACHE_PROMPTS,
        "height": 128,
        "width": 128,
        "steps": 12,
        "batch_size": 1,
        "seed": 3,
        "execution": {"backend": "xla"},
        "compile": {"step_cache": step_cache} if step_cache else {},
        "output": {"dir": str(workdir), "run_id": run_id},
    }


def _calibrated(workdir: Path, model: str) -> dict:
    """STEP_CACHE_MAGCACHE with the ratios `tpugen calibrate` measures, in a fresh process, for the bench's run."""
    path = workdir / "calibrate.yaml"
    path.write_text(json.dumps(_step_cache_config(workdir, model, "calibrate", None)))
    ratios = workdir / "ratios.yaml"
    tpugen = str(Path(sys.executable).parent / "tpugen")
    command = [tpugen, "calibrate", str(path), "--out", str(ratios), "--quiet"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
    if proc.returncode:
        sys.exit(f"tpugen calibrate failed:\n{proc.stderr}")
    return {**STEP_CACHE_MAGCACHE, "mag_ratios": str(ratios)}


def _step_cache_side(workdir: Path, model: str, step_cache: dict | None) -> dict:
    """One fresh `tpugen generate` process: its timed phase and compiles, and where its images are."""
    run_id = step_cache["method"] if step_cache else "none"
    config = _step_cache_config(workdir, model, run_id, step_cache)
    start = time.perf_counter()
    report = _generate_fresh(workdir, run_id, config)
    batches = report["timed_phase"]["batches"]
    (warm,) = report["warmup"]
    return {
        "seconds_per_image": statistics.mean(b["seconds"] / b["images"] for b in batches),
        "seconds_per_image_each": [b["seconds"] / b["images"] for b in batches],
        # Each batch's seconds over its denoising steps (its text encoding and decoding included), as report.md's.
        "seconds_per_step": sum(b["seconds"] for b in batches) / sum(b["steps"] for b in batches),
        "warmup_seconds": report["warmup_seconds"],
        "warmup_compiles": warm["compiles"],
        "step_graphs": warm["graphs_per_phase"]["first denoising step"]
        + warm["graphs_per_phase"]["later denoising steps"],
        "compiles_after_warmup": report["compiles_after_warmup"],
        "transfers_to_host_per_batch": [b["transfers_to_host"] for b in batches],
        "steps_full": sum(b.get("steps_full", b["steps"]) for b in batches),
        "steps_cached": sum(b.get("steps_cached", 0) for b in batches),
        "process_seconds": time.perf_counter() - start,
        "run_dir": str(workdir / run_id),
    }


def _image_difference(run_dir: Path, reference: Path) -> dict:
    """Max and mean absolute difference (/255) and PSNR (dB) over all images of two runs, matched by file name."""
    import math

    import numpy as np
    from PIL import Image

    diffs = []
    for png in sorted(reference.glob("[0-9]*.png")):
        a = np.asarray(Image.open(run_dir / png.name).convert("RGB"), dtype=np.float64)
        b = np.asarray(Image.open(png).convert("RGB"), dtype=np.float64)
        diffs.append(np.abs(a - b))
    every = np.concatenate([d.ravel() for d in diffs])
    mse = float((every**2).mean())
    return {
        "images": len(diffs),
        "max": float(every.max()),
        "mean": float(every.mean()),
        "psnr_db": math.inf if mse == 0 else 10 * math.log10(255**2 / mse),
    }


def run_step_cache_bench(model: str) -> dict:
    """Each step cache against none, side by side, each in a fresh process; prints the table."""
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-step-cache-") as tmp:
        tmp = Path(tmp)
        print(f"no step cache ({model}, 128x128, 12 steps) ...", flush=True)
        sides = {"none": _step_cache_side(tmp, model, None)}
        print("taylorseer ...", flush=True)
        sides["taylorseer"] = _step_cache_side(tmp, model, STEP_CACHE_TAYLORSEER)
        print("magcache: tpugen calibrate, then the run ...", flush=True)
        magcache = _calibrated(tmp, model)
        sides["magcache"] = _step_cache_side(tmp, model, magcache)
        magcache["mag_ratios"] = _read_ratios(Path(magcache["mag_ratios"]))
        print("pyramid_attention_broadcast ...", flush=True)
        sides["pyramid_attention_broadcast"] = _step_cache_side(tmp, model, STEP_CACHE_PAB)
        for name in ("taylorseer", "magcache", "pyramid_attention_broadcast"):
            sides[name]["difference"] = _image_difference(Path(sides[name]["run_dir"]), Path(sides["none"]["run_dir"]))
            sides[name]["speedup"] = sides["none"]["seconds_per_image"] / sides[name]["seconds_per_image"]
    print(f"\n{model}, 128x128, 12 steps, batch 1, {len(STEP_CACHE_PROMPTS)} timed images per side, XLA:CPU")
    print(f"{'':34}" + "".join(f"{STEP_CACHE_COLUMNS.get(name, name):>12}" for name in sides))
    for key, label, form in [
        ("seconds_per_image", "timed s per image", "{:12.3f}"),
        ("seconds_per_step", "s per step", "{:12.3f}"),
        ("steps_full", "steps full (timed phase)", "{:12d}"),
        ("steps_cached", "steps cached (timed phase)", "{:12d}"),
        ("step_graphs", "step graphs compiled", "{:12d}"),
        ("warmup_compiles", "warmup compiles", "{:12d}"),
        ("warmup_seconds", "warmup s", "{:12.1f}"),
        ("compiles_after_warmup", "compiles after warmup", "{:12d}"),
    ]:
        print(f"{label:34}" + "".join(form.format(side[key]) for side in sides.values()))
    print(
        f"{'transfers to host per batch':34}"
        + "".join(f"{str(s['transfers_to_host_per_batch']):>12}" for s in sides.values())
    )
    print("PAB: pyramid_attention_broadcast")
    for name in ("taylorseer", "magcache", "pyramid_attention_broadcast"):
        difference = sides[name]["difference"]
        print(
            f"{name}: {sides[name]['speedup']:.2f}x the timed phase of none; against none's images: max "
            f"{difference['max']:.0f}/255, mean {difference['mean']:.3f}/255, PSNR {difference['psnr_db']:.1f} dB "
            f"over {difference['images']} images"
        )
    return {
        "model": model,
        "workload": {"height": 128, "width": 128, "steps": 12, "batch_size": 1, "images": len(STEP_CACHE_PROMPTS)},
        "options": {
            "taylorseer": STEP_CACHE_TAYLORSEER,
            "magcache": magcache,
            "pyramid_attention_broadcast": STEP_CACHE_PAB,
        },
        **sides,
    }


def _read_ratios(path: Path) -> list[float]:
    import yaml

    return yaml.safe_load(path.read_text())["mag_ratios"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what",
        nargs="?",
        choices=["serve", "serve-load", "trace", "jax"],
        help="serve: the server against fresh processes, then under load; serve-load: the load part only; "
        "trace: compile.trace_once against recording every step (scripts/bench_trace.py); "
        "jax: execution.backend jax against xla with trace once (scripts/bench_jax.py)",
    )
    parser.add_argument(
        "--models", nargs="*", help="trace, jax: the tiny built-ins of part (a) (default: one per family)"
    )
    parser.add_argument("--denoisers", nargs="*", help="trace, jax: the full-size denoisers, by label")
    parser.add_argument("--skip-tiny", action="store_true", help="trace, jax: the full-size part only")
    parser.add_argument("--skip-full", action="store_true", help="trace, jax: part (a) only")
    parser.add_argument("--step-caching", action="store_true", help="jax: part (e) alone (deep Flux, TaylorSeer)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side (medians are reported)")
    parser.add_argument("--compile", action="store_true", help="scan_blocks vs unrolled compile seconds instead")
    parser.add_argument("--step-cache", action="store_true", help="each step cache vs none on a deep Flux instead")
    parser.add_argument("--step-cache-model", default="tiny-flux-deep", help="the built-in for --step-cache")
    parser.add_argument("--naive-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_worker:
        naive_worker()
        return
    if args.compile_worker:
        compile_worker(args.compile_worker[0], args.compile_worker[1], bool(args.compile_worker[2]))
        return
    if args.compile:
        run_compile_bench()
        return
    if args.step_cache:
        out = ROOT / "bench"
        out.mkdir(exist_ok=True)
        (out / "step-cache.json").write_text(json.dumps(run_step_cache_bench(args.step_cache_model), indent=2) + "\n")
        print(f"\nwrote {out / 'step-cache.json'}")
        return
    if args.what == "serve":
        run_serve_bench()
        return
    if args.what == "trace":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_trace

        out = ROOT / "bench"
        out.mkdir(exist_ok=True)
        results = bench_trace.run(args.models, args.denoisers, args.skip_tiny, args.skip_full)
        (out / "trace.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {out / 'trace.json'}")
        return
    if args.what == "jax":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_jax

        out = ROOT / "bench"
        out.mkdir(exist_ok=True)
        results = bench_jax.run(args.models, args.denoisers, args.skip_tiny, args.skip_full, args.step_caching)
        (out / "jax.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {out / 'jax.json'}")
        return
    if args.what == "serve-load":
        out = ROOT / "bench"
        out.mkdir(exist_ok=True)
        (out / "serve-load.json").write_text(json.dumps(run_serve_load_bench(tmp_root=None), indent=2) + "\n")
        print(f"\nwrote {out / 'serve-load.json'}")
        return

    runs: dict[str, list[dict]] = {"naive": [], "tpugen": []}
    with tempfile.TemporaryDirectory(prefix="tpugen-bench-") as tmp:
        for r in range(args.repeat):  # alternate, so drift in the machine's speed hits both sides alike
            print(f"run {r + 1}/{args.repeat}: naive port ...", flush=True)
            runs["naive"].append(run_naive())
            print(f"run {r + 1}/{args.repeat}: tpugen ...", flush=True)
            runs["tpugen"].append(run_tpugen(Path(tmp), f"bench-{r}"))

    keys = ["compiles", "wall_seconds", "steady_seconds_per_image", "process_seconds", "images"]
    results = {side: {k: statistics.median(r[k] for r in rs) for k in keys} for side, rs in runs.items()}
    ratios = {k: results["tpugen"][k] / results["naive"][k] for k in keys[:4]}
    targets = {
        "compiles ratio <= 0.5": ratios["compiles"] <= 0.5,
        "wall ratio <= 0.7": ratios["wall_seconds"] <= 0.7,
        # The point is that tpugen's bookkeeping costs nothing visible: at most 5% slower per image.
        "steady per-image at most 5% slower": ratios["steady_seconds_per_image"] <= 1.05,
    }
    workload = {"prompts": len(PROMPTS), "sizes": SIZES, "batch_size": BATCH, "steps": STEPS, "model": "tiny-sd"}

    print(f"\nworkload: {workload}, XLA:CPU, {args.repeat} run(s) each, medians")
    print(f"{'':28}{'naive':>12}{'tpugen':>12}{'tpugen/naive':>14}")
    for key, label in [
        ("compiles", "compiles"),
        ("wall_seconds", "wall s (after load)"),
        ("steady_seconds_per_image", "steady s per image"),
        ("process_seconds", "process wall s"),
    ]:
        print(f"{label:28}{results['naive'][key]:12.3f}{results['tpugen'][key]:12.3f}{ratios[key]:14.3f}")
    print(f"{'images':28}{results['naive']['images']:12.0f}{results['tpugen']['images']:12.0f}")
    for target, met in targets.items():
        print(f"target {target}: {'met' if met else 'NOT met'}")

    out = ROOT / "bench"
    out.mkdir(exist_ok=True)
    payload = {
        "workload": workload,
        "repeat": args.repeat,
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    bar_chart(results, out / "results.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'results.png'}")


if __name__ == "__main__":
    main()
