"""`tpugen serve`'s life: the socket bound before the model loads (/healthz at once, /readyz saying what it does),
a port in use, the watchdog that ends a server whose device broke, runs bounded (serve.max_runs, spread over the
engines, ended ones read from disk, listed by page), a second signal that stops at once, and the API key in front
of every route, the docs and the schema included."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import FAKES, TPUGEN, tiny_config, write_config
from serve_support import AUTH, BASE, KEY, free_port, metric, run_body, serve_config, wait_run

from tpugen.config import load_config
from tpugen.config.schema import ServeConfig

# ---------------------------------------------------------------- device-free


def test_a_server_bounds_its_runs_and_its_failed_batches_by_default():
    serve = ServeConfig()
    assert (serve.max_runs, serve.max_failed_batches) == (2, 3)


def test_a_port_in_use_is_one_line_at_once_and_exit_1(tmp_path):
    path = serve_config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [TPUGEN, "serve", str(path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PJRT_DEVICE": "CPU"},
        )
    # Before anything loads: no line of the model's, one line of the port's.
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"error: --port {port}: 127.0.0.1:{port} is in use\n")


def test_only_the_runtime_failing_a_warm_shape_counts_against_the_device():
    from tpugen.errors import InputError, RunError
    from tpugen.modes.serve.device_loops import counts_against_the_device
    from tpugen.modes.serve.service import NotWarm

    assert counts_against_the_device(RuntimeError("INTERNAL: the device stopped answering"), cold_shape=False)
    assert counts_against_the_device(RunError("out of memory on the device"), cold_shape=False)
    # A request's own doing: bad input found only in its batch, a shape compiled for it (serve.new_shapes:
    # compile) that does not fit, a Python error of the pipeline for its values (DDIM at 1000 steps, seen here).
    assert not counts_against_the_device(InputError("prompt: bad"), cold_shape=False)
    assert not counts_against_the_device(NotWarm("size 80x64 is not warm"), cold_shape=False)
    assert not counts_against_the_device(RunError("out of memory on the device"), cold_shape=True)
    assert not counts_against_the_device(IndexError("index 1000 is out of bounds"), cold_shape=False)


def test_a_run_goes_to_the_engine_with_the_fewest_runs():
    from tpugen.modes.serve.runs import idlest

    assert idlest([0]) == 0
    assert idlest([1, 0]) == 1  # not always the first engine
    assert idlest([1, 1, 0, 0]) == 2
    assert idlest([2, 1, 1]) == 1


def _service(tmp_path: Path, engines=(), **serve):
    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service

    run = load_config(serve_config(tmp_path, **serve), prompts_required=False)
    return Service(run, list(engines), output_root=tmp_path / "runs", display=Display())


def test_ended_runs_are_read_back_from_their_directories_and_listed_newest_first(tmp_path):
    """What GET /v1/runs and /v1/runs/ID answer for runs no longer in memory: each from its run directory, its
    state from its report.json (none: the server stopped under it, so it says how to resume it)."""
    from tpugen.outputs.run_record import write_run_record

    service = _service(tmp_path)
    made = load_config(write_config(tmp_path / "run.yaml", tiny_config(tmp_path)))  # 3 prompts, 3 images
    reports = {
        "a-complete": {"complete": True, "error": None, "images_planned": 3},
        "b-stopped": {"complete": False, "error": "interrupted by SIGTERM", "images_planned": 3},
        "c-failed": {"complete": False, "error": "the run failed: boom", "images_planned": 3},
        "d-abandoned": None,
    }
    start = time.time() - 100
    for number, (run_id, report) in enumerate(reports.items()):
        run_dir = service.output_root / run_id
        run_dir.mkdir(parents=True)
        write_run_record(run_dir, made, run_id)
        if report is not None:
            (run_dir / "report.json").write_text(json.dumps(report))
        os.utime(run_dir / "run.json", (start + number, start + number))  # started one after another
    (service.output_root / "not-a-run").mkdir()

    states = {run_id: (h.state, h.error, h.planned) for run_id in reports if (h := service.find_run(run_id))}
    assert states == {
        "a-complete": ("complete", None, 3),
        "b-stopped": ("stopped", ["interrupted by SIGTERM"], 3),
        "c-failed": ("failed", ["the run failed: boom"], 3),
        "d-abandoned": (
            "stopped",
            [
                "the server stopped before the run ended (it has no report.json)",
                f"resume with: tpugen resume {service.output_root / 'd-abandoned'}",
            ],
            3,
        ),
    }
    assert [service.find_run(name) for name in ("not-a-run", "..", ".", "nope")] == [None] * 4
    page, after = service.list_runs(3)
    assert ([h.id for h in page], after) == (["d-abandoned", "c-failed", "b-stopped"], "b-stopped")
    page, after = service.list_runs(3, after)
    assert ([h.id for h in page], after) == (["a-complete"], None)


class _LostBackend:
    """A device whose loop thread finds it gone once `lost` is set (a device loop dies only where tpugen or the
    runtime has a bug, which no real engine can be made to have)."""

    device_count = 1  # the Backend protocol's: one device

    def __init__(self) -> None:
        self.lost = threading.Event()

    def bind_thread(self) -> None:
        if threading.current_thread().name.startswith("tpugen-device"):
            assert self.lost.wait(60)
            raise RuntimeError("the device is gone")

    def counters(self):
        return None


class _FakeEngine:
    """An engine that warms at once (a fake: the test is of the device loop's death, not of a pipeline)."""

    def __init__(self) -> None:
        self.backend = _LostBackend()
        self.loaded = type("Loaded", (), {"default_scheduler": "DDIM", "max_steps": lambda self, scheduler: 1000})()
        self.model_label = "tiny-sd"
        self.embeddings = ()  # the textual-inversion embeddings its text encoders hold: none
        self.warm = set()

    def is_warm(self, shape, scheduler=None, steps=None) -> bool:  # no step cache: steps compile nothing
        return (str(shape), scheduler or "DDIM") in self.warm

    def warmup(self, plan, display=None, scheduler=None) -> list:
        self.warm.update((str(batch.shape), scheduler or "DDIM") for batch in plan.batches)
        return []


def test_a_device_loop_that_dies_turns_readyz_503_and_answers_the_requests_waiting(tmp_path):
    """A fake engine (see _LostBackend): its device loop raises as it starts once `lost` is set, with a request
    waiting. The app is tpugen's own, spoken to through FastAPI's TestClient."""
    from fastapi.testclient import TestClient

    from tpugen.modes.serve.http import build_app
    from tpugen.modes.serve.service import NotReady
    from tpugen.plan import ImageWork

    engine = _FakeEngine()
    service = _service(tmp_path, [engine])
    with TestClient(build_app(service, None)) as client:
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.02)
        answers = []

        def ask() -> None:
            try:
                service.generate(
                    [
                        ImageWork(
                            prompt="a cat", negative_prompt="", seed=1, steps=3, guidance_scale=7.5, height=64, width=64
                        )
                    ]
                )
            except NotReady as exc:
                answers.append(exc.lines)

        waiting = threading.Thread(target=ask)
        waiting.start()
        while service.queue.open_count() != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.backend.lost.set()
        waiting.join(30)
        assert answers == [["device loop 0 died: RuntimeError: the device is gone"]]
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json() == {
            "status": "failed",
            "warm": "sizes 64x64 (width x height; cfg, batch 2); samplers DDIM",
            "error": "device loop 0 died: RuntimeError: the device is gone",
        }
        assert "tpugen_device_failures_total 1.0" in client.get("/metrics").text
        assert service.broken.is_set()  # what tpugen serve exits 1 on (the watchdog test below sees it do so)


# ---------------------------------------------------------------- the session's server


@pytest.mark.xla
def test_every_route_the_docs_and_the_schema_need_the_key(server):
    from tpugen.modes.serve.http import OPEN_PATHS, build_app

    url, service = server
    # The server's own routes, as an app like its own lists them in its schema, and the docs' own two.
    paths = build_app(service, KEY).openapi()["paths"]
    routes = [(method.upper(), re.sub(r"\{[^}]+\}", "x", path)) for path in paths for method in paths[path]]
    routes += [("GET", "/docs"), ("GET", "/openapi.json")]
    assert ("GET", "/docs") in routes and ("GET", "/openapi.json") in routes and ("GET", "/v1/runs") in routes
    for method, path in routes:
        answer = httpx.request(method, f"{url}{path}", timeout=30)
        assert answer.status_code == (200 if path in OPEN_PATHS else 401), (method, path, answer.text)
    page = httpx.get(f"{url}/docs", headers=AUTH)
    # tpugen's own page: every route listed, nothing loaded from elsewhere (a TPU VM may have no internet).
    assert page.status_code == 200 and "<code>/sdapi/v1/txt2img</code>" in page.text
    assert "<code>/v1/runs/{run_id}/files/{name}</code>" in page.text
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page.text)
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    assert "/v1/runs/{run_id}" in schema["paths"] and "/sdapi/v1/txt2img" in schema["paths"]


@pytest.mark.xla
def test_an_ended_run_leaves_memory_and_is_answered_and_listed_from_its_directory(client, server):
    service = server[1]
    for run_id in ("paged-older", "paged-newer"):
        sent = client.post("/v1/runs", content=run_body(run_id, prompts=["a small boat"]))
        assert sent.status_code == 201, sent.text
        assert wait_run(client, run_id)["status"] == "complete"
    deadline = time.monotonic() + 10
    while {"paged-older", "paged-newer"} & set(service.runs):  # its thread forgets it just after its state is set
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status = client.get("/v1/runs/paged-older").json()
    assert (status["status"], status["images"], status["images_planned"]) == ("complete", 1, 1)
    assert status["report"]["complete"] is True and status["error"] is None
    assert "report.json" in client.get("/v1/runs/paged-older/files").json()["files"]
    first = client.get("/v1/runs", params={"limit": 1}).json()
    assert [r["id"] for r in first["runs"]] == ["paged-newer"] and first["next"] == "paged-newer"
    assert "report" not in first["runs"][0]
    second = client.get("/v1/runs", params={"limit": 1, "after": "paged-newer"}).json()
    assert [r["id"] for r in second["runs"]] == ["paged-older"]
    refused = client.get("/v1/runs", params={"after": "no-such-run"})
    assert (refused.status_code, refused.json()["detail"]) == (422, ["after: no run 'no-such-run' on this server"])
    assert client.get("/v1/runs", params={"limit": 0}).status_code == 422


# ---------------------------------------------------------------- servers in processes of their own


def _start(tmp: Path, config: Path, *overrides: str, env: dict | None = None):
    port = free_port()
    log = open(tmp / "server.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(
        [TPUGEN, "serve", str(config), "--port", str(port), *overrides],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PJRT_DEVICE": "CPU", "TPUGEN_API_KEY": KEY, **(env or {})},
    )
    return proc, f"http://127.0.0.1:{port}", log, started


def _stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)
    log.close()


def _wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def _watch_start(url: str, proc: subprocess.Popen, started: float, seconds: float = 300) -> tuple[float, list]:
    """Poll /healthz and /readyz from the process's start until ready: (seconds to the first /healthz answer,
    each change of (/readyz status code, body) with the seconds it was first seen at)."""
    first_health, seen = None, []
    deadline = started + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            health = httpx.get(f"{url}/healthz", timeout=10)
            ready = httpx.get(f"{url}/readyz", timeout=10)
        except httpx.TransportError:
            time.sleep(0.02)
            continue
        now = time.monotonic() - started
        if first_health is None:
            assert health.status_code == 200
            first_health = now
        answer = (ready.status_code, ready.json())
        if not seen or seen[-1][1:] != answer:
            seen.append((now, *answer))
        if ready.status_code == 200:
            return first_health, seen
        time.sleep(0.05)
    raise AssertionError(f"not ready within {seconds} s: {seen[-1:]}")


@pytest.mark.xla
def test_the_socket_is_bound_first_runs_are_bounded_and_spread_and_a_second_signal_stops_at_once(tmp_path):
    """Multi mode (2 XLA:CPU devices, 2 samplers: 4 shape keys to warm): /healthz answers while the model loads,
    /readyz counts the keys compiled; two runs go to the two engines, a third is a 429; the first SIGTERM drains,
    the second stops at once: both runs' batches in flight (900 steps each) are abandoned, their directories
    resumable."""
    from tpugen.engine.session import RunSession
    from tpugen.outputs.run_record import load_run

    config = serve_config(tmp_path, batch_window_ms=0, schedulers=["Euler a"], max_runs=2)
    proc, url, log, started = _start(tmp_path, config, "execution.mode=multi", "execution.cores=2")
    try:
        first_health, seen = _watch_start(url, proc, started)
        ready_after = seen[-1][0]
        print(
            f"\ntpugen serve, tiny-sd, execution.mode multi on 2 XLA:CPU devices: first /healthz answer "
            f"{first_health:.2f} s after the process started, ready after {ready_after:.1f} s"
        )
        assert seen[0][1:] == (503, {"status": "loading", "detail": "loading tiny-sd (an engine per device)"})
        assert seen[-1][1:] == (
            200,
            {"status": "ready", "warm": "sizes 64x64 (width x height; cfg, batch 2); samplers DDIM, Euler a"},
        )
        compiling = [body["detail"] for _, code, body in seen if body["status"] == "compiling" and code == 503]
        counts = [
            int(re.fullmatch(r"compiling (\d) of 4 shape keys \(1 size x 2 samplers x 2 engines\)", d)[1])
            for d in compiling
        ]
        assert (
            counts
            and counts == sorted(counts)
            and {b["status"] for _, _, b in seen} == {"loading", "compiling", "ready"}
        )

        prompts = ["a lighthouse", "a fox", "an owl", "a bee"]
        for run_id in ("first", "second"):
            sent = httpx.post(f"{url}/v1/runs", content=run_body(run_id, prompts=prompts, steps=900), headers=AUTH)
            assert sent.status_code == 201, sent.text
        third = httpx.post(f"{url}/v1/runs", content=run_body("third", prompts=prompts), headers=AUTH)
        assert (third.status_code, third.json()["detail"]) == (
            429,
            ["2 runs are queued or running (serve.max_runs: 2); send it again when one ends"],
        )
        assert int(third.headers["retry-after"]) > 0
        text = (tmp_path / "server.log").read_text()
        assert "run first: 4 images on engine 0 of 2" in text and "run second: 4 images on engine 1 of 2" in text
        listed = httpx.get(f"{url}/v1/runs", headers=AUTH).json()
        assert [r["id"] for r in listed["runs"]] == ["second", "first"] and listed["next"] is None
        _wait_for(
            lambda: all((tmp_path / "runs" / r / "run.json").is_file() for r in ("first", "second")), "run directories"
        )

        statuses = [httpx.get(f"{url}/v1/runs/{r}", headers=AUTH).json()["status"] for r in ("first", "second")]
        assert statuses == ["running", "running"]
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: httpx.get(f"{url}/readyz").json()["status"] == "draining", "draining")
        assert httpx.get(f"{url}/readyz").json()["detail"] == "draining: 0 requests and 2 runs in flight"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        print(f"second SIGTERM to exit: {time.monotonic() - signalled:.2f} s")
    finally:
        _stop(proc, log)
    assert "stopped at once by a second SIGTERM" in (tmp_path / "server.log").read_text()
    for run_id in ("first", "second"):
        run_dir = tmp_path / "runs" / run_id
        # A drain would have let each finish its batch and write report.json: the batches in flight were abandoned.
        assert not (run_dir / "report.json").exists()
        full, remaining = RunSession.resume(load_run(run_dir), run_dir).share()
        assert len(remaining.items) == len(full.items) == 4  # resumable, from its first image


@pytest.mark.xla
def test_a_broken_device_turns_readyz_503_answers_what_waits_and_exits_1(tmp_path):
    """The device's failure is injected at the engine seam (tests/fakes/device_fault): the real, warm engine's
    generate raises what a failing runtime raises for prompts that say so, since no XLA:CPU device can be made to
    fail on demand. A request's own bad input never counts; failures count only in a row."""
    path = serve_config(tmp_path, batch_window_ms=0, max_failed_batches=3)
    fault = {"PYTHONPATH": os.pathsep.join(p for p in (str(FAKES / "device_fault"), os.environ.get("PYTHONPATH")) if p)}
    proc, url, log, started = _start(tmp_path, path, env={**fault, "TPUGEN_TEST_DEVICE_FAULT": "break the device"})
    try:
        first_health, seen = _watch_start(url, proc, started)
        print(
            f"\ntpugen serve, tiny-sd, one XLA:CPU device: first /healthz answer {first_health:.2f} s after the "
            f"process started, ready after {seen[-1][0]:.1f} s"
        )

        def ask(prompt: str, **fields) -> httpx.Response:
            body = {**BASE, "prompt": prompt, "seed": 1, **fields}
            return httpx.post(f"{url}/sdapi/v1/txt2img", json=body, headers=AUTH, timeout=120)

        for _ in range(3):
            assert ask("bad input here").status_code == 422
        assert metric(url, "tpugen_device_failures_total") == 0
        assert [ask("break the device").status_code for _ in range(2)] == [500, 500]
        assert ask("a red fox").status_code == 200  # a good batch: the failures in a row start again
        assert httpx.get(f"{url}/readyz").status_code == 200 and metric(url, "tpugen_device_failures_total") == 2

        # A run in flight keeps the process up after the third failure, until it stops after its batch. The
        # failing requests below never wait for the run's batches (the fault raises before the engine's lock);
        # three batches of 300 steps (3 s each at the 10 ms a step floor) outlast them, the slow one's 3 s
        # included, and the process then waits for one batch, not for 900 steps.
        sent = httpx.post(
            f"{url}/v1/runs",
            content=run_body("in-flight", prompts=["a", "b", "c", "d", "e", "f"], steps=300),
            headers=AUTH,
        )
        assert sent.status_code == 201, sent.text
        _wait_for(lambda: (tmp_path / "runs" / "in-flight" / "run.json").is_file(), "the run's directory")
        assert [ask("break the device").status_code for _ in range(2)] == [500, 500]
        assert httpx.get(f"{url}/readyz").status_code == 200
        answers = {}
        third = threading.Thread(target=lambda: answers.update(third=ask("break the device slowly")))
        behind = threading.Thread(target=lambda: answers.update(behind=ask("a cat", steps=4)))  # another batch
        third.start()
        _wait_for(lambda: metric(url, "tpugen_requests_open") == 1, "the third failing request")
        behind.start()
        _wait_for(lambda: metric(url, "tpugen_requests_open") == 2, "a request waiting behind it", seconds=3)
        third.join(60)
        behind.join(60)
        reason = (
            "3 batches in a row failed on engine 0 (serve.max_failed_batches: 3); the last: RuntimeError: INTERNAL: "
            "the device stopped answering (TPUGEN_TEST_DEVICE_FAULT=break the device)"
        )
        assert answers["third"].status_code == 500
        assert (answers["behind"].status_code, answers["behind"].json()["detail"]) == (503, [reason])
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503 and (ready.json()["status"], ready.json()["error"]) == ("failed", reason)
        assert metric(url, "tpugen_device_failures_total") == 5
        assert proc.wait(300) == 1  # once the run has stopped after its batch
    finally:
        _stop(proc, log)
    text = (tmp_path / "server.log").read_text()
    assert f"error: {reason}\n" in text
    report = json.loads((tmp_path / "runs" / "in-flight" / "report.json").read_text())
    assert report["complete"] is False and report["error"] == "interrupted by SIGTERM"


def test_the_servers_own_socket_sends_replies_without_waiting_on_nagle():
    # Bound by tpugen before uvicorn takes it: without TCP_NODELAY, which accepted connections inherit, every
    # reply on a kept-alive connection waited on the client's delayed ACK (44 ms a /healthz here, against 0.7 ms).
    from tpugen.modes.serve.server import listen

    with listen("127.0.0.1", 0) as sock, socket.create_connection(sock.getsockname()):
        accepted, _ = sock.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
