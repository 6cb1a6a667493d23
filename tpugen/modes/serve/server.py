"""Starting the server: its socket, then uvicorn (the one place it is called) while the engines load and warm
up, then a clean stop on a signal, or exit 1 once its model or device has failed."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.engine import Display, Engine, EngineSpec
from tpugen.errors import InputError, RunError
from tpugen.logs import logger, to_console
from tpugen.modes.serve.browsers import is_loopback

log = logger("serve")

BACKLOG = 2048  # uvicorn's own: connections made while the model loads wait here for the event loop
# How long a server whose device broke waits for its runs to stop after their batch before it exits anyway.
BROKEN_GRACE_S = 120.0


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
    if execution.mode == "multi" and execution.backend not in ("xla", "jax"):
        raise InputError(
            f"execution.mode: multi under tpugen serve runs one engine per device on xla, one program over every "
            f"device on jax; backend {execution.backend} serves with mode: single"
        )
    if execution.mode == "multi" and execution.backend == "xla" and execution.strict_shapes:
        raise InputError(
            "execution.strict_shapes: under execution.mode: multi the server's engines share one process, whose "
            "compile count torch_xla keeps for the process: a compile for one device's request would stop a run on "
            "another; serve with strict_shapes: false"
        )
    if run.config.output.dir.startswith("gs://"):
        raise InputError("output.dir: the server writes runs to a local directory, not gs://")


def open_engines(run: ResolvedRun, display: Display) -> list[Engine]:
    """One engine (on jax under execution.mode: multi, its program over every device), or under mode multi on xla
    one per local device, in this process; each loads the embeddings of serve.embeddings_dir. The annotators
    model.annotators_dir has the weights of are loaded first."""
    spec = replace(EngineSpec.of(run), embeddings_dir=run.config.serve.embeddings_dir)
    if run.config.model.annotators_dir is not None:  # a weights file that does not load fails the start, not a request
        from tpugen.engine.controls import load_annotators

        load_annotators(run.config.model.annotators_dir)
    execution = run.config.execution
    if execution.mode != "multi" or execution.backend == "jax":  # jax: one engine, its program over every device
        return [Engine.open(spec, display=display)]
    from tpugen.backends.xla.devices import local_device_count, use_devices

    use_devices(execution.cores, "tpugen serve")
    devices = local_device_count()
    return [
        Engine.open(spec, display=display, ranks_in_process=devices, device_index=i, neighbours=devices - 1)
        for i in range(devices)
    ]


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before anything loads: a port in use is one line at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses the port
        # Accepted connections inherit it. Without it a reply's head and body wait on each other (Nagle against the
        # client's delayed ACK): 44 ms per request on a kept-alive connection here, against 0.7 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RunError(f"--port {port}: {where} is in use") from None
        if exc.errno == errno.EACCES:
            raise RunError(f"--port {port}: {where}: permission denied (ports below 1024 need privileges)") from None
        raise RunError(f"--host {host}: cannot listen on {where}: {exc.strerror or exc}") from None
    return sock


def serve(
    run: ResolvedRun, *, host: str = "127.0.0.1", port: int = 7860, api_key: str | None = None, display=None
) -> None:
    """`tpugen serve`: bind the socket, then answer HTTP at once while the engines load and warm up in a
    thread (/healthz 200 throughout, /readyz 503 saying what it is doing until ready).

    SIGTERM or SIGINT drains: new requests get 503, those in flight their images, runs stop after their batch
    (resumable); exit 0. A second signal stops at once: batches in flight abandoned, runs resumable, exit
    128 + its number. A model that fails to load or warm up, or a broken device (a device loop that died,
    serve.max_failed_batches failed batches in a row), is said by /readyz and the log, and once the requests
    in flight are answered the process exits 1, for its supervisor to restart it."""
    display = display or Display()
    check_start(run, host, api_key)
    sock = listen(host, port)
    try:
        _serve_on(sock, run, where=sock.getsockname(), api_key=api_key, display=display)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, run: ResolvedRun, *, where, api_key: str | None, display: Display) -> None:
    to_console()  # the server's own lines: tpugen serve: ...
    import uvicorn

    from tpugen.modes.serve.http import build_app
    from tpugen.modes.serve.service import Service

    service = Service(
        run,
        [],
        output_root=Path(run.config.output.dir),
        display=display,
        open_engines=lambda: open_engines(run, display),
    )

    class DrainingServer(uvicorn.Server):
        """The first signal drains: the socket stays open so new requests get 503 while those in flight get
        their images and runs stop after their batch; uvicorn then stops. A second signal stops at once. A
        service that broke stops it too, once the requests it answered 503 are sent."""

        signals = 0
        forced_by: int | None = None

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1
            if self.signals > 1:
                # Not uvicorn's own handler: it would wait for every open connection (a request may wait
                # serve.request_timeout_s) and then run the app's shutdown, which joins the batches in flight.
                self.forced_by = sig
                service.abandon()
                self.force_exit = self.should_exit = True
                # uvicorn skips the app's shutdown, and would print the lifespan task's cancellation as an error.
                logging.getLogger("uvicorn.error").disabled = True
                return
            service.begin_drain()
            log.info(f"{signal.Signals(sig).name}: draining (a second signal stops at once)")
            threading.Thread(
                target=self.stop_after, args=(service.wait_drained,), name="tpugen-drain", daemon=True
            ).start()

        def stop_after(self, wait, *args) -> None:
            wait(*args)
            # What uvicorn's own handler does, without recording a signal: uvicorn would raise a recorded one
            # again once it has stopped, and a drained server exits 0.
            self.should_exit = True

    def stop_when_broken() -> None:
        service.broken.wait()
        server.stop_after(service.wait_drained, BROKEN_GRACE_S)

    server = DrainingServer(uvicorn_config(build_app(service, api_key, host=where[0]), run.config.serve))
    threading.Thread(target=stop_when_broken, name="tpugen-watchdog", daemon=True).start()
    host, port = where[0], where[1]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    log.info(f"listening on {url} (loading {run.config.model.id}; GET /readyz says when it is ready)")
    server.run(sockets=[sock])
    if server.forced_by is not None:
        name = signal.Signals(server.forced_by).name
        log.error(f"stopped at once by a second {name}: batches in flight abandoned, runs resumable (tpugen resume)")
        # Not a return through the CLI: the interpreter's exit would wait for the device threads mid-batch (and
        # torch_xla's exit hooks for the device), which is what a second signal is for skipping.
        _exit_now(128 + server.forced_by)
    if service.fatal is not None:
        raise service.fatal  # the CLI's boundary says it in one line; exit 1 (2 for a bad input found loading)
    if service.starting():
        # A signal while the model loads or compiles: nothing was served, so nothing is lost by not waiting,
        # but the interpreter's exit under a thread inside XLA aborts the process (seen on XLA:CPU).
        log.info("stopped while loading or compiling")
        _exit_now(0)
    log.info("stopped")


def uvicorn_config(app, serve, **where):
    """uvicorn's settings for a server's app (`where`: host and port, unless it is given a socket): connections
    closed when idle for serve.idle_timeout_s, or when a request's head is late by serve.read_timeout_s."""
    import uvicorn

    from tpugen.modes.serve.connections import protocol_with_deadline

    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        http=protocol_with_deadline(serve.read_timeout_s),
        timeout_keep_alive=serve.idle_timeout_s,
        **where,
    )


def _exit_now(code: int) -> None:
    """Exit without the interpreter's shutdown, which would wait for (or abort under) threads mid-batch."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
