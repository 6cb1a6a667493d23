"""Engines (a loaded, warmed pipeline that any number of runs use), run sessions, topology and stopping."""

from tpugen.engine.engine import Display, Engine, EngineSpec
from tpugen.engine.session import RunSession
from tpugen.engine.signals import PROCESS_STOP, StopSignals
from tpugen.engine.topology import Topology, pod_position, worker_topology

__all__ = [
    "PROCESS_STOP",
    "Display",
    "Engine",
    "EngineSpec",
    "RunSession",
    "StopSignals",
    "Topology",
    "pod_position",
    "worker_topology",
]
