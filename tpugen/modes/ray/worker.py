"""A ray run's workers: the host worker as Ray runs it (the actor class), and the driver's record of each one."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpugen.backends import Counters
from tpugen.modes.host import HostWorker


class _RayHost(HostWorker):
    """The worker as Ray runs it: the same, plus the Ray node it runs on."""

    def hello(self) -> dict:
        import ray

        return {**super().hello(), "node": ray.get_runtime_context().get_node_id()}


@dataclass
class Worker:
    """The driver's view of one worker: everything workers.json and the report say about it."""

    index: int
    handle: object = None
    state: str = "starting"
    node: str | None = None
    host: str | None = None
    pid: int | None = None
    pids: list[int] = field(default_factory=list)
    incarnation: str | None = None
    epoch: int = 0  # bumped at each loss, so the failures of one loss are counted once
    restarts: int = 0
    losses: int = 0
    batches_done: int = 0
    images: int = 0
    load_seconds: list[float] = field(default_factory=list)
    warmup: list[dict] = field(default_factory=list)
    warmup_seconds: float = 0.0
    in_flight: dict = field(default_factory=dict)  # future -> batch, oldest (the one running) first
    busy_since: float | None = None  # when the oldest batch in flight could start: its deadline counts from here
    warm_shapes: set = field(default_factory=set)  # shape keys this process has compiled (no deadline before)
    greet_retried: bool = False  # a greet after this loss already went unanswered once
    lost_at: float | None = None  # when its last loss was counted (perf_counter): Ray restarts it from then
    lost_batches: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    recompiles: list[dict] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    counters: Counters | None = None
    counted: bool = True  # every batch brought counters
    generate_seconds: float = 0.0
    write_seconds: float = 0.0
    busy_seconds: float = 0.0
    started: dict | None = None
    error: str | None = None
    cause: BaseException | None = None  # why it could not start

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "pids": self.pids,
            "state": self.state,
            "batches_done": self.batches_done,
            "images": self.images,
            "in_flight": sorted(b.number for b in self.in_flight.values()),
            "warmup_seconds": self.warmup_seconds,
            "restarts": self.restarts,
            "losses": self.losses,
            "lost_batches": self.lost_batches,
            "error": self.error,
        }
