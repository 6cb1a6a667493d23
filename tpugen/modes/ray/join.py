"""Joining the Ray cluster for one run (or starting a local one): the address probed first, a failure in one line."""

from __future__ import annotations

import logging
import os
import socket

from tpugen import settings
from tpugen.backends import backend_environment
from tpugen.config import ResolvedRun
from tpugen.errors import InputError, RunError, one_line
from tpugen.modes.ray.resources import Node

RAY_EXTRA = "pip install 'tpugen[ray]'"
# A throwaway local cluster's object store: only batches and records travel through it, never pixels.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


def import_ray():
    """ray, or the one line that says how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError(f"execution.mode: ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


def _probe(host: str, port: int, timeout: float) -> str | None:
    """Why nothing answers at host:port within `timeout`, or None: ray.init itself retries a dead address
    forever."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _join_failure(exc: BaseException) -> str:
    """ray.init's failure in one line. Ray Client's "Initialization failure from server:" is followed by the
    server's whole traceback, whose last line is the reason (a runtime env agent that timed out, a backend the
    proxy could not reach): that line is kept too."""
    first = one_line(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1] not in first:
        return f"{first.rstrip(':')}: {lines[-1]}"
    return first


def _target(ray, address: str) -> str:
    """The address ray.init is given: auto is resolved here (RAY_ADDRESS, else the cluster `ray start` made on
    this machine), so that it can be probed first."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        from tpugen.config.schema import is_ray_address

        value = os.environ["RAY_ADDRESS"]
        if not is_ray_address(value):  # e.g. a job dashboard's http://HOST:8265, which ray.init cannot join
            raise InputError(
                f"RAY_ADDRESS: must be ray://HOST:PORT or HOST:PORT (execution.ray.address: auto reads it), "
                f"got {value!r}"
            )
        return value
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        return canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError:
        raise InputError(
            "execution.ray.address: auto: no Ray cluster was started on this machine (`ray start --head` makes "
            "one) and RAY_ADDRESS is not set"
        ) from None


class Cluster:
    """The connection to the cluster, for one run: joined (or, for address local, started) on entry, left (or
    stopped) on exit."""

    def __init__(self, run: ResolvedRun) -> None:
        self.settings = run.config.execution.ray
        self.debug = settings.debug()
        env = {**backend_environment(run.config.execution, run.config.cache)}
        runtime_env = dict(self.settings.runtime_env or {})
        if env:
            runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
        self.runtime_env = runtime_env or None
        self.ray = None
        self.address = self.settings.address

    def __enter__(self) -> Cluster:
        ray = self.ray = import_ray()
        common = {"namespace": "tpugen", "runtime_env": self.runtime_env, "logging_level": logging.WARNING}
        if self.address == "local":
            try:
                ray.init(
                    address="local",
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    log_to_driver=self.debug,
                    **common,
                )
            except Exception as exc:  # a start that fails halfway must not leave Ray's processes behind
                if ray.is_initialized():
                    ray.shutdown()
                raise RunError(
                    f"execution.ray.address: local: could not start a Ray cluster: {one_line(exc)}"
                ) from None
            return self
        target = _target(ray, self.address)
        host, _, port = target.removeprefix("ray://").rpartition(":")
        why = _probe(host, int(port), self.settings.connect_timeout_s) if port.isdigit() else "not HOST:PORT"
        if why:
            raise InputError(f"execution.ray.address: {self.address} ({target}) does not answer: {why}")
        client = target.startswith("ray://")  # Ray Client takes fewer options
        try:
            ray.init(address=target, **common, **({} if client else {"log_to_driver": self.debug}))
        except Exception as exc:  # a version mismatch, an auth token, a port that is not Ray's
            if ray.is_initialized():
                ray.shutdown()
            raise InputError(
                f"execution.ray.address: cannot join the Ray cluster at {target}: {_join_failure(exc)}"
            ) from None
        return self

    def __exit__(self, *exc) -> None:
        if self.ray is not None and self.ray.is_initialized():
            self.ray.shutdown()  # for address local, this also stops the cluster it started

    def nodes(self) -> list[Node]:
        return [
            Node(n["NodeID"], n.get("NodeManagerAddress", ""), dict(n.get("Resources") or {}))
            for n in self.ray.nodes()
            if n.get("Alive")
        ]
