"""What the `tpugen serve` tests share: a server in this process on a free loopback port, its key, and how to
speak to it. The session's server itself is tests/conftest.py's `server` fixture (one per test session)."""

from __future__ import annotations

import base64
import contextlib
import io
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import yaml
from conftest import tiny_config, write_config
from PIL import Image

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# What every A1111 request here shares with the reference run (tests/conftest.py's tiny config).
BASE = {"negative_prompt": "blurry", "steps": 3, "cfg_scale": 7.5, "width": 64, "height": 64}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_config(tmp: Path, **serve) -> Path:
    config = tiny_config(tmp, output={"dir": str(tmp / "runs")}, serve={"batch_window_ms": 300, **serve})
    del config["prompts"]  # a server's config needs none
    config["output"].pop("run_id")
    return write_config(tmp / "serve.yaml", config)


@contextlib.contextmanager
def running_server(config: Path, runs: Path, key: str | None):
    """`tpugen serve` of `config` in this process (sharing its compile cache), uvicorn on a thread of its own on
    a free loopback port; stopped, and its thread joined, on the way out."""
    import uvicorn

    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.modes.serve.http import build_app
    from tpugen.modes.serve.server import check_start, open_engines, uvicorn_config
    from tpugen.modes.serve.service import Service

    run = load_config(config, prompts_required=False)
    check_start(run, "127.0.0.1", key)
    service = Service(run, open_engines(run, Display()), output_root=runs, display=Display())
    port = free_port()
    app = build_app(service, key, host="127.0.0.1")
    uvicorn_server = uvicorn.Server(uvicorn_config(app, run.config.serve, host="127.0.0.1", port=port))
    thread = threading.Thread(target=uvicorn_server.run, name="test-server")
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        uvicorn_server.should_exit = True
        thread.join(120)
        assert not thread.is_alive()


def wait_ready(url: str, seconds: float = 180, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server at {url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} was not ready within {seconds} s")


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def txt2img(client, **fields) -> dict:
    response = client.post("/sdapi/v1/txt2img", json={**BASE, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def batches(client) -> float:
    """How many pipeline calls the server has made, from its own metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("tpugen_batch_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def run_body(run_id: str, **changes) -> str:
    """The reference run's config as a client sends it: no model, execution or batch size (the server's are used)."""
    config = tiny_config(Path("/nowhere/on/the/server"), **{"output": {"run_id": run_id}, **changes})
    if "model" not in changes:
        del config["model"]
    if "batch_size" not in changes:
        del config["batch_size"]
    del config["execution"]
    return yaml.safe_dump(config)


def wait_run(client, run_id: str, seconds: float = 180) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = client.get(f"/v1/runs/{run_id}").json()
        if status["status"] not in ("queued", "running"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not end within {seconds} s")
