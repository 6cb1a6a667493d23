"""`tpugen serve` in a process of its own, for what touches the process itself: compiling a cold shape, a request
timing out, a full queue, draining on SIGTERM, and multi mode's one engine per device."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import OTHER_DEVICE_COUNT, PROMPTS, forked_tpugen
from PIL import Image
from serve_support import AUTH, BASE, KEY, decode, free_port, metric, pixels, run_body, serve_config, wait_ready

from tpugen.outputs.png import image_filename

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def own_process_server(tmp_path_factory):
    """For what touches the process itself: compiling a new shape, a full queue, a timeout, SIGTERM."""
    tmp = tmp_path_factory.mktemp("own")
    path = serve_config(tmp, new_shapes="compile", max_queue=2, request_timeout_s=3, batch_window_ms=50)
    port = free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(  # a process of its own (forked_tpugen): its signals and counters are the server's
        [forked_tpugen(), "serve", str(path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PJRT_DEVICE": "CPU", "TPUGEN_API_KEY": KEY},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc=proc)
        yield url, proc, tmp
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        log.close()


def test_a_cold_shape_compiles_once_a_waiting_request_times_out_and_a_full_queue_refuses(own_process_server):
    url, _, tmp = own_process_server
    results = {}

    def ask(name: str, **fields) -> None:
        response = httpx.post(
            f"{url}/sdapi/v1/txt2img", json={**BASE, "prompt": "x", **fields}, headers=AUTH, timeout=120
        )
        results[name] = response

    # 80x64 is not warm: under new_shapes: compile its batch compiles, then runs 320 steps: longer than the 3 s
    # timeout whatever the compile takes (6.1 s on the 2-core machine the team tests on, idle, before tests
    # compiled without LLVM's optimizations; under 3 s once since), as a step takes 10 ms or more here (30-50 ms
    # lazily traced; 600 steps took 115 s of a busy full run).
    cold = threading.Thread(target=ask, args=("cold",), kwargs={"height": 80, "seed": 1, "steps": 320})
    cold.start()
    wait_for(lambda: "for a request (serve.new_shapes: compile)" in (tmp / "server.log").read_text(), "cold compile")
    queued = threading.Thread(target=ask, args=("queued",), kwargs={"seed": 2})
    queued.start()
    wait_for(lambda: metric(url, "tpugen_requests_open") == 2, "two open requests")
    ask("refused", seed=3)  # the third open request: serve.max_queue is 2
    cold.join(120)
    queued.join(120)
    assert results["refused"].status_code == 503 and results["refused"].headers["retry-after"]
    assert results["cold"].status_code == 504, results["cold"].text
    assert results["cold"].json()["detail"] == ["the request waited 3 s (serve.request_timeout_s) for a device"]
    # The compile finished anyway and the shape stays warm: the same request now answers, compiling nothing more.
    deadline = time.monotonic() + 120
    while (
        "tpugen serve: batch" not in (own_process_server[2] / "server.log").read_text() and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    compiled = metric(url, "tpugen_compiles_after_warmup_total")
    ask("warm now", height=80, seed=1)
    assert results["warm now"].status_code == 200 and compiled > 0
    assert metric(url, "tpugen_compiles_after_warmup_total") == compiled


def wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def test_sigterm_drains_answers_what_is_in_flight_and_leaves_runs_resumable(own_process_server):
    url, proc, tmp = own_process_server
    results = {}

    def ask() -> None:  # one 3-step batch: well inside the fixture's 3 s request timeout even behind a run's batch
        results["in flight"] = httpx.post(
            f"{url}/sdapi/v1/txt2img",
            json={**BASE, "prompt": "x", "seed": 9, "batch_size": 2},
            headers=AUTH,
            timeout=120,
        )

    prompts = [f"a painted {w}" for w in ("cat", "dog", "owl", "fox", "bee", "elk")]
    assert (
        httpx.post(f"{url}/v1/runs", content=run_body("draining", prompts=prompts, steps=20), headers=AUTH).status_code
        == 201
    )
    request = threading.Thread(target=ask)
    request.start()
    wait_for(lambda: metric(url, "tpugen_requests_open") == 1, "open request")
    proc.send_signal(15)
    wait_for(lambda: httpx.get(f"{url}/readyz", timeout=10).status_code == 503, "draining server")
    late = httpx.get(f"{url}/sdapi/v1/options", headers=AUTH, timeout=10)
    assert late.status_code == 503 and httpx.get(f"{url}/readyz").status_code == 503
    assert httpx.get(f"{url}/v1/runs/draining", headers=AUTH, timeout=10).status_code == 200  # runs stay readable
    request.join(120)
    assert proc.wait(120) == 0
    assert results["in flight"].status_code == 200 and len(results["in flight"].json()["images"]) == 2
    report = json.loads((tmp / "runs" / "draining" / "report.json").read_text())
    assert report["complete"] is False and report["error"] == "interrupted by SIGTERM"
    assert "tpugen serve: stopped" in (tmp / "server.log").read_text()


def test_multi_mode_serves_one_engine_per_device_from_one_queue(tmp_path, xla_run):
    path = serve_config(tmp_path, batch_window_ms=0)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [forked_tpugen(), "serve", str(path), "--port", str(port), "execution.mode=multi", "execution.cores=2"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PJRT_DEVICE": "CPU"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc=proc)
            answers = {}

            def ask(i: int) -> None:
                answers[i] = httpx.post(
                    f"{url}/sdapi/v1/txt2img", json={**BASE, "prompt": PROMPTS[i], "seed": 7 + i}, timeout=120
                )

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
        finally:
            proc.terminate()
            assert proc.wait(120) == 0
    text = log.read_text()
    assert "ready, 2 device loop(s)" in text
    # Two engines, one process: torch_xla's counts are the process's. No compile after warmup (each counted once
    # where batches overlap); the host's time per step is each call's own, the device's not measured.
    value = {line.split()[0]: line.split()[1] for line in metrics.splitlines() if line.startswith("tpugen_")}
    assert value["tpugen_compiles_after_warmup_total"] == "0.0" and value["tpugen_device_ms_per_step"] == "NaN"
    assert float(value["tpugen_host_ms_per_step"]) > 0
    for i, answer in answers.items():
        assert answer.status_code == 200, answer.text
        image = decode(answer.json()["images"][0])
        reference = Image.open(xla_run / image_filename(i, 7 + i, PROMPTS[i]))
        # Two CPU devices in this process against one: within 1/255 (FACTS.md).
        assert int(np.abs(pixels(image) - pixels(reference)).max()) <= OTHER_DEVICE_COUNT
