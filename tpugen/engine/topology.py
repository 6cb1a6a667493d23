"""Where one replica stands: rank r of R on worker w of W, computed once and passed down."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from tpugen.errors import InputError


@dataclass(frozen=True)
class Topology:
    """Rank `rank` of `ranks` on worker `worker` of `workers`. Every image of a run goes to exactly one
    (worker, rank): the one whose part it is (see `part`), so file names and seeds never depend on it."""

    worker: int = 0
    workers: int = 1
    rank: int = 0  # among this worker's ranks
    ranks: int = 1  # replicas per worker (one per chip in multi mode)
    ranks_in_process: int = 1  # ranks that share this OS process (threads on XLA:CPU)

    @property
    def parts(self) -> int:
        return self.workers * self.ranks

    @property
    def part(self) -> int:
        """The share this replica makes: the images whose index % parts == part (worker-major)."""
        return self.worker * self.ranks + self.rank

    def with_rank(self, rank: int, ranks: int, ranks_in_process: int = 1) -> Topology:
        return replace(self, rank=rank, ranks=ranks, ranks_in_process=ranks_in_process)

    def as_dict(self) -> dict:
        return {
            "worker_index": self.worker,
            "num_workers": self.workers,
            "rank": self.rank,
            "ranks_per_worker": self.ranks,
            "world_size": self.parts,
        }


def pod_position(pod, env: Mapping[str, str], host_index: Callable[[], int] | None = None) -> tuple[int, int]:
    """(worker index, worker count): from the config (pod-run sets both), else TPU_WORKER_ID or
    CLOUD_TPU_TASK_ID, else torch_xla's host index; the count defaults to one worker. Without
    `host_index`, a pod worker that has neither variable is an error rather than a guess."""
    count = pod.num_workers or 1
    if pod.worker_index is not None:
        index = pod.worker_index
    elif env.get("TPU_WORKER_ID", "").isdigit():
        index = int(env["TPU_WORKER_ID"])
    elif env.get("CLOUD_TPU_TASK_ID", "").isdigit():
        index = int(env["CLOUD_TPU_TASK_ID"])
    elif count > 1:
        if host_index is None:
            raise InputError(
                "execution.pod: this worker's index is unknown; set execution.pod.worker_index or TPU_WORKER_ID"
            )
        index = host_index()
    else:
        index = 0
    if index >= count:
        raise InputError(f"execution.pod: worker index {index} is not below the worker count {count}")
    return index, count


def worker_topology(pod, env: Mapping[str, str], host_index: Callable[[], int] | None = None) -> Topology:
    """This worker's place in its pod, one replica on it (ranks are added by the mode that starts them)."""
    worker, workers = pod_position(pod, env, host_index)
    return Topology(worker=worker, workers=workers)
