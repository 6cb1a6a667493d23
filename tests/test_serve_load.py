"""`tpugen serve` under load, in a process of its own on loopback: a burst past serve.max_queue gets images or a
503 with Retry-After and nothing else, hundreds more requests leave its memory flat, and SIGTERM with requests in
flight answers each of them and exits 0. Bounded in count and time throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import TPUGEN
from serve_support import AUTH, BASE, KEY, decode, free_port, metric, serve_config, wait_ready

pytestmark = pytest.mark.xla

BURST = 48  # one-image requests sent at once, against serve.max_queue: 8
MORE = 240  # requests after the burst, 8 at a time, over which the process's memory is watched
GROWTH_LIMIT_MB = 64


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_a_burst_past_the_queue_then_hundreds_more_then_sigterm_in_flight(tmp_path):
    path = serve_config(tmp_path, max_queue=8, batch_window_ms=20)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [TPUGEN, "serve", str(path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PJRT_DEVICE": "CPU", "TPUGEN_API_KEY": KEY},
    )
    try:
        wait_ready(url, proc=proc)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:

            def ask(seed: int) -> httpx.Response:
                return client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a lighthouse", "seed": seed})

            with ThreadPoolExecutor(BURST) as pool:
                burst = list(pool.map(ask, range(BURST)))
            statuses = sorted({r.status_code for r in burst})
            assert set(statuses) <= {200, 503}, [r.text[:200] for r in burst if r.status_code not in (200, 503)]
            made = [r for r in burst if r.status_code == 200]
            refused = [r for r in burst if r.status_code == 503]
            assert made and all(decode(r.json()["images"][0]).size == (64, 64) for r in made)
            # 48 at once against a queue of 8: the requests past it are refused, each saying why, and counted.
            assert refused, f"all {BURST} requests of the burst were taken by a queue of 8"
            assert all(int(r.headers["retry-after"]) > 0 for r in refused)
            assert all("the server is busy" in r.json()["detail"][0] for r in refused), refused[0].text
            assert all("(serve.max_queue)" in r.json()["detail"][0] for r in refused), refused[0].text
            refusals = 'tpugen_requests_total{endpoint="/sdapi/v1/txt2img",status="503"}'
            assert metric(url, refusals) == len(refused)
            print(f"burst of {BURST} at serve.max_queue 8: {len(made)} images, {len(refused)} refused with 503")

            before = rss_mb(proc.pid)
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:  # at most serve.max_queue open at once: every one is answered
                more = list(pool.map(ask, range(BURST, BURST + MORE)))
            assert [r.status_code for r in more] == [200] * MORE
            growth = rss_mb(proc.pid) - before
            print(f"{MORE} more requests in {time.monotonic() - started:.1f} s: resident memory {growth:+.1f} MB")
            assert growth < GROWTH_LIMIT_MB
            assert metric(url, "tpugen_requests_open") == 0

            # SIGTERM while requests are in flight: each gets its image or a 503, and the process exits 0.
            with ThreadPoolExecutor(8) as pool:
                flying = [pool.submit(ask, seed) for seed in range(1000, 1008)]
                deadline = time.monotonic() + 60  # until all 8 are at the server (open or answered)
                while time.monotonic() < deadline:
                    if metric(url, "tpugen_requests_open") + sum(f.done() for f in flying) >= len(flying):
                        break
                    time.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                answered = [future.result(timeout=120).status_code for future in flying]
            assert set(answered) <= {200, 503} and 200 in answered, answered
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        log.close()
