"""The rank side of `execution.mode: multi`: what each replica does, started by torch_xla.launch (a function
per device) or by torchrun (`python -m tpugen.modes.rank RUN_DIR`, a process per device)."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpugen.backends import load_device_runtime
from tpugen.config import ExecutionConfig, ResolvedRun, resolve
from tpugen.engine import PROCESS_STOP, Engine, EngineSpec, RunSession, Topology
from tpugen.errors import InputError, TpugenError, one_line
from tpugen.files import write_json
from tpugen.outputs.report import TimedPhase

RANK_PROCESS_ENV = "TPUGEN_RANK_PROCESS"  # set by the parent, inherited by the processes launch starts
LAUNCH_FILE = "torchrun.json"  # what a torchrun parent tells its rank processes; removed when they are done
# The points where every rank waits for the others: the timed phases start together, so "all images over
# the slowest rank's timed phase" measures one window. The ranks do not wait for each other at the end.
BARRIERS = ("warmed", "timed phase")


@dataclass(frozen=True)
class DistBackend:
    """What torchrun's ranks need to know about a tpugen backend."""

    process_group: str  # the torch.distributed backend of the ranks' process group
    device_type: str | None  # rank r of a host takes device r of this type; None: all share the host CPU


DIST_BACKENDS = {
    "torch_tpu": DistBackend("tpu_dist", "tpu"),
    "cuda": DistBackend("nccl", "cuda"),
    "cpu": DistBackend("gloo", None),
}


class _Meeting:
    """Meeting points for the ranks that are threads of one process, broken for all if one rank fails.

    Process state, not rank state: on a TPU VM each rank is its own process and meets only itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._barriers: dict[str, threading.Barrier] = {}
        self._aborted = False

    def meet(self, name: str, parties: int) -> bool:
        """Wait for the process's other ranks; False if one of them failed (so nobody waits for the dead)."""
        if parties <= 1:
            return True
        with self._lock:
            if self._aborted:
                return False
            barrier = self._barriers.setdefault(name, threading.Barrier(parties))
        try:
            barrier.wait()
            return True
        except threading.BrokenBarrierError:
            return False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for barrier in self._barriers.values():
                barrier.abort()


_MEETING = _Meeting()
# Within a process, one rank at a time warms up: the first compiles each shape key, the others find its
# graphs in the process's compile cache instead of compiling the same graphs concurrently.
_WARMUP_LOCK = threading.Lock()

if os.environ.get(RANK_PROCESS_ENV) and threading.current_thread() is threading.main_thread():
    # torch_xla.launch's process imports this module in its main thread, where handlers live; on XLA:CPU
    # the ranks themselves are threads that cannot install them.
    PROCESS_STOP.install()


@dataclass(frozen=True)
class RankGroup:
    """Where one rank stands among the run's ranks, and how it meets the others."""

    topology: Topology
    meet: Callable[[str], bool]  # wait at a named point; False if a rank failed (so nobody waits for the dead)


def rank_main(index: int, run: ResolvedRun, run_dir: str, finished: frozenset[int], worker: Topology) -> None:
    """What torch_xla.launch runs on every device. Never raises: it leaves rank-N.json for the parent."""

    def join() -> RankGroup:
        from tpugen.backends.xla.devices import rank_position

        ordinal, world, local = rank_position()
        # A pod-wide runtime (a real pod) numbers ranks over every worker; a runtime per worker (simulated
        # pods) numbers them on this worker only: either way the rank on this worker is ordinal % local.
        topology = worker.with_rank(ordinal % local, local, ranks_in_process=local)
        return RankGroup(topology, lambda name: _MEETING.meet(name, local))

    run_rank(index, run, Path(run_dir), finished, join, lambda exc: _MEETING.abort())


def run_rank(
    index: int,
    run: ResolvedRun,
    run_dir: Path,
    finished: frozenset[int],
    join: Callable[[], RankGroup],
    abort: Callable[[BaseException], None],
) -> dict:
    """One rank's whole share: `join` places it among the ranks, then its engine loads, warms up and
    generates. Never raises: the result (or the error) goes to rank-N.json for the parent, and is returned.
    `abort` releases the ranks that would otherwise wait for this one."""
    result: dict = {"rank": index, "pid": os.getpid(), "error": None}
    try:
        group = join()
        result.update(rank=group.topology.rank, worker=group.topology.worker)
        _rank_work(run, run_dir, finished, result, group)
    except BaseException as exc:  # report, and release the ranks waiting for this one
        abort(exc)
        result["error"] = one_line(exc)
        if not isinstance(exc, TpugenError):
            result["traceback"] = traceback.format_exc()
    write_json(run_dir / f"rank-{result['rank']}.json", result)
    return result


def _rank_work(run: ResolvedRun, run_dir: Path, finished: frozenset[int], result: dict, group: RankGroup) -> None:
    topology = group.topology
    result.update(world_size=topology.parts, ranks_in_process=topology.ranks_in_process)
    session = RunSession.attach(run, run_dir, finished)
    _, plan = session.share(topology.parts, topology.part)

    engine = Engine.open(EngineSpec.of(run), ranks_in_process=topology.ranks_in_process)
    result["load_seconds"] = engine.load_seconds
    result["device"] = engine.describe()
    result["cache"] = engine.backend.cache
    result["scheduler"] = engine.scheduler_name
    result["memory"] = engine.memory_summary(plan)

    with _WARMUP_LOCK:
        result["warmup"] = engine.warmup(plan)
    # Counters are process-wide: read them only while no rank of this process is working.
    group.meet("warmed")
    before = engine.backend.counters()
    group.meet("timed phase")

    phase = TimedPhase()
    writer = session.writer(engine, manifest=f"manifest.rank{topology.rank}.jsonl", extra={"rank": topology.rank})
    try:
        engine.run(
            plan, writer, checkpoint=PROCESS_STOP.check, strict_shapes=run.config.execution.strict_shapes, phase=phase
        )
    finally:
        writer.close()
        result.update(
            timed_phase={
                "batches": phase.batches,
                "generate_seconds": phase.generate_seconds,
                "write_seconds": phase.write_seconds,
                "wall_seconds": phase.wall_seconds,
            },
            recompiles=phase.recompiles,
            images=len(phase.written),
            written=phase.written,
        )
    all_done = group.meet("done")
    after = engine.backend.counters()
    result["process_counters"] = (after - before).as_dict() if all_done and before and after else None


# ---------------------------------------------------------------- torchrun's rank processes


class RankBarriers:
    """dist.barrier at each of BARRIERS; a rank that fails still passes the ones it owes, so that no other
    rank waits for it forever."""

    def __init__(self) -> None:
        self.joined = False
        self._entered: set[str] = set()

    def meet(self, name: str) -> bool:
        """Wait for every rank at `name`; False if the group broke there (a rank died)."""
        if name in BARRIERS:
            import torch.distributed as dist

            self._entered.add(name)
            try:
                dist.barrier()
            except Exception:  # the group is broken: nobody is left to wait for
                return False
        return True

    def abort(self, exc: BaseException) -> None:
        if not self.joined or isinstance(exc, KeyboardInterrupt):  # a second signal: stop at once
            return
        import torch.distributed as dist

        for name in BARRIERS:
            if name not in self._entered:
                self._entered.add(name)
                try:
                    dist.barrier()
                except Exception:  # the group is broken: nobody is left waiting
                    return


def rank_process(run_dir: Path) -> int:
    """`python -m tpugen.modes.rank RUN_DIR`, as torchrun starts it: this rank's share of the run.

    Exits 0 once it has left rank-N.json, even for a rank that failed, so that torchrun lets the other
    ranks finish; 1 if it failed before joining the process group, so that torchrun stops the others,
    which would wait for it there.
    """
    PROCESS_STOP.install()  # SIGTERM from tpugen: stop after the batch in flight
    launch = json.loads((run_dir / LAUNCH_FILE).read_text())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    barriers = RankBarriers()
    try:
        run = resolve(launch["config"], base_dir=run_dir)
    except TpugenError as exc:
        write_json(run_dir / f"rank-{rank}.json", {"rank": rank, "pid": os.getpid(), "error": exc.lines[0]})
        return 1
    if run.config_hash != launch["config_hash"]:
        error = f"{LAUNCH_FILE}: the config resolves to hash {run.config_hash}, not the run's {launch['config_hash']}"
        write_json(run_dir / f"rank-{rank}.json", {"rank": rank, "pid": os.getpid(), "error": error})
        return 1
    backend = DIST_BACKENDS[run.config.execution.backend]
    worker = Topology(**launch["worker"])

    def join() -> RankGroup:
        # The backend's runtime first (TorchTPU imports torch itself, as its autoload would).
        load_device_runtime(run.config.execution)
        import torch
        import torch.distributed as dist

        if run.model_source.kind == "builtin":
            from tpugen.tiny import builtin_path

            # Built before the process group exists: inside one, transformers' save_pretrained writes the
            # weights on rank 0 only, and another rank's build would leave a model without them.
            builtin_path(run.model_source.ref)
        if backend.device_type is not None:
            torch.accelerator.set_device_index(local_rank)  # "tpu" (or "cuda") then means this rank's chip
        dist.init_process_group(backend.process_group)
        barriers.joined = True
        # torchrun numbers each worker's ranks from 0: worker w of W with rank r of R takes w*R + r.
        return RankGroup(worker.with_rank(dist.get_rank(), dist.get_world_size()), barriers.meet)

    run_rank(rank, run, run_dir, frozenset(launch["finished"]), join, barriers.abort)
    if not barriers.joined:
        return 1
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def count_devices(execution_json: str) -> int:
    """`python -m tpugen.modes.rank --count-devices EXECUTION`: prints how many devices the backend sees."""
    from tpugen.backends import make_backend
    from tpugen.config import CacheConfig, CompileConfig

    try:
        make_backend(ExecutionConfig.model_validate_json(execution_json), CompileConfig(), CacheConfig())
    except InputError as exc:
        print(exc.lines[0], file=sys.stderr)
        return InputError.exit_code
    import torch

    print(torch.accelerator.device_count())
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--count-devices":
        return count_devices(argv[1])
    if len(argv) == 1:
        return rank_process(Path(argv[0]))
    print("usage: python -m tpugen.modes.rank RUN_DIR | --count-devices EXECUTION_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
