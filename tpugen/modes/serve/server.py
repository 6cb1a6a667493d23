"""Starting the server: its engines, then uvicorn (the one place it is called), then a clean stop on a signal."""

from __future__ import annotations

import ipaddress
import threading
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.engine import Display, Engine, EngineSpec
from tpugen.errors import InputError
from tpugen.logs import logger, to_console

log = logger("serve")

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_start(run: ResolvedRun, host: str, api_key: str | None) -> None:
    """What must hold before anything loads: an API key off loopback, the web stack installed, a way of
    running the server can drive."""
    if not is_loopback(host) and not api_key:
        raise InputError(
            f"--host {host}: binding an address other than loopback needs an API key (TPUGEN_API_KEY or --api-key)"
        )
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise InputError(
            f"tpugen serve needs the web stack ({exc.name} is missing): pip install 'tpugen[serve]'"
        ) from None
    execution = run.config.execution
    if execution.mode == "ray":
        raise InputError("execution.mode: ray spreads one run over a cluster; tpugen serve runs on this machine")
    if execution.mode == "multi" and execution.backend != "xla":
        raise InputError(
            f"execution.mode: multi under tpugen serve runs one engine per device on xla; backend {execution.backend} "
            "serves with mode: single"
        )
    if run.config.output.dir.startswith("gs://"):
        raise InputError("output.dir: the server writes runs to a local directory, not gs://")


def open_engines(run: ResolvedRun, display: Display) -> list[Engine]:
    """One engine, or under execution.mode: multi one per local device, in this process."""
    spec = EngineSpec.of(run)
    execution = run.config.execution
    if execution.mode != "multi":
        return [Engine.open(spec, display=display)]
    from tpugen.backends.xla.devices import local_device_count, use_devices

    use_devices(execution.cores, "tpugen serve")
    devices = local_device_count()
    return [Engine.open(spec, display=display, ranks_in_process=devices, device_index=i) for i in range(devices)]


def serve(
    run: ResolvedRun, *, host: str = "127.0.0.1", port: int = 7860, api_key: str | None = None, display=None
) -> None:
    """`tpugen serve`: load the engines, answer HTTP while they warm up (/readyz says when they are), and on
    SIGTERM or SIGINT drain: new requests get 503, batches in flight finish, runs stop resumable; exit 0."""
    display = display or Display()
    check_start(run, host, api_key)
    to_console()  # the server's own lines: tpugen serve: ...
    import uvicorn

    from tpugen.modes.serve.http import build_app
    from tpugen.modes.serve.service import Service

    engines = open_engines(run, display)
    service = Service(run, engines, output_root=Path(run.config.output.dir), display=display)

    class DrainingServer(uvicorn.Server):
        """The first signal drains: the socket stays open so new requests get 503 while those in flight get
        their images and runs stop after their batch; uvicorn then stops. A second signal stops at once."""

        signals = 0

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1
            if self.signals > 1:
                super().handle_exit(sig, frame)
                return
            service.begin_drain()

            def stop_when_drained() -> None:
                service.wait_drained()
                # What uvicorn's own handler does, without recording the signal: uvicorn would raise a
                # recorded one again once it has stopped, and a drained server exits 0.
                self.should_exit = True

            threading.Thread(target=stop_when_drained, name="tpugen-drain", daemon=True).start()

    config = uvicorn.Config(build_app(service, api_key), host=host, port=port, log_level="warning", access_log=False)
    log.info(f"listening on http://{host}:{port} (warming up; GET /readyz says when ready)")
    DrainingServer(config).run()
    log.info("stopped")
