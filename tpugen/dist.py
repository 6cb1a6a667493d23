"""All chips of a VM through torchrun: one process per device, for the backends that torch.distributed serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tpugen.backends import host_index, make_backend, torch_tpu_environment
from tpugen.config import ExecutionConfig, ModelConfig, ResolvedRun, RunConfig, resolve
from tpugen.errors import InputError, RunError, TpugenError
from tpugen.multi import STOP_REQUEST, RankGroup, run_rank
from tpugen.outputs import write_json
from tpugen.pod import pod_position


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

LAUNCH_FILE = "torchrun.json"  # what the parent tells its rank processes; removed when they are done
LOG_FILE = "torchrun.log"  # torchrun's and the ranks' output; kept only when torchrun itself failed
# The points where every rank waits for the others: the timed phases start together, so "all images over
# the slowest rank's timed phase" measures one window. The ranks do not wait for each other at the end.
BARRIERS = ("warmed", "timed phase")


def torchrun_command(processes: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    """torchrun on this host only (--standalone picks a free rendezvous port), one process per device."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "tpugen.dist",
        str(run_dir),
    ]


def rank_environment(run: ResolvedRun, processes: int, base: dict[str, str], host_cores: int) -> dict[str, str]:
    """The rank processes' environment: the variables the backend reads when torch is imported (so they are
    there before any process of the run imports it), and each rank's share of the host's cores unless the
    user chose (torchrun would otherwise set OMP_NUM_THREADS=1)."""
    env = dict(base)
    if run.config.execution.backend == "torch_tpu":
        env.update(torch_tpu_environment(run.config.execution.torch_tpu.mode))
    env.setdefault("OMP_NUM_THREADS", str(max(1, host_cores // processes)))
    return env


def count_devices(run: ResolvedRun, env: dict[str, str]) -> int:
    """How many devices the run's backend sees, as torch.accelerator reports them, asked in a process of its
    own: so this one neither imports torch nor holds a chip that a rank will need, and a missing backend or
    device is one line before anything is written."""
    execution = run.config.execution
    proc = subprocess.run(
        [sys.executable, "-m", "tpugen.dist", "--count-devices", execution.model_dump_json()],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode == InputError.exit_code:
        raise InputError(*proc.stderr.strip().splitlines()[-1:])
    lines = proc.stdout.split()
    if proc.returncode or not lines or not lines[-1].isdigit():
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RunError(f"execution.backend: {execution.backend}: counting its devices failed: {last}")
    return int(lines[-1])


def rank_processes(run: ResolvedRun, env: dict[str, str]) -> int:
    """execution.cores, or every device the backend sees (0); never more than it sees."""
    execution = run.config.execution
    if DIST_BACKENDS[execution.backend].device_type is None:  # the host CPU: as many as asked
        return execution.cores
    found = count_devices(run, env)
    if found < 1 or execution.cores > found:
        raise InputError(
            f"execution.cores: {execution.cores or 'every device'} asked for, and execution.backend: "
            f"{execution.backend} sees {found} devices"
        )
    return execution.cores or found


class TorchrunLaunch:
    """The parent's side: torchrun in a session of its own, whose rank processes run `python -m tpugen.dist`."""

    def __init__(self, run: ResolvedRun) -> None:
        self.backend = DIST_BACKENDS[run.config.execution.backend]
        cores = len(os.sched_getaffinity(0))
        self.world_size = rank_processes(run, rank_environment(run, 1, dict(os.environ), cores))
        self.env = rank_environment(run, self.world_size, dict(os.environ), cores)
        self.command: list[str] = []
        self.log: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._stops = 0  # SIGTERM/SIGINT requests that came to tpugen
        self._signalled: dict[int, int] = {}  # rank process id: SIGTERMs sent to it

    def announce(self) -> str:
        return f"launching {self.world_size} rank processes with torchrun (process group {self.backend.process_group})"

    def start(self, run: ResolvedRun, run_dir: Path, finished: frozenset[int]) -> None:
        write_json(
            run_dir / LAUNCH_FILE,
            {
                "config": json.loads(run.config.model_dump_json()),
                "config_hash": run.config_hash,
                "finished": sorted(finished),
            },
        )
        self.command = torchrun_command(self.world_size, run_dir)
        self.log = run_dir / LOG_FILE
        with open(self.log, "wb") as log:
            # A session of its own: a terminal's Ctrl-C reaches tpugen only, which asks the ranks to stop
            # after their batch in flight; torchrun, signalled too, would stop them at once.
            self._proc = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def running(self, seconds: float) -> bool:
        if self._stops:
            self._signal_ranks()  # ranks torchrun started after the request came
        try:
            self._proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return True
        return False

    def stop_ranks(self, signum: int) -> None:
        self._stops += 1
        self._signal_ranks()

    def _signal_ranks(self) -> None:
        # One SIGTERM per request to each rank process (stop after the batch in flight; a second: at once).
        # torchrun itself is left alone: it sees its ranks exit and exits too.
        for pid in _children(self._proc.pid):
            while self._signalled.get(pid, 0) < self._stops:
                self._signalled[pid] = self._signalled.get(pid, 0) + 1
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    break

    def failure(self) -> str | None:
        code = self._proc.returncode if self._proc else None
        if not code:
            return None
        return f"torchrun exited with code {code}; its output and the ranks' are in {self.log}"

    def finish(self, run_dir: Path, ok: bool) -> None:
        (run_dir / LAUNCH_FILE).unlink(missing_ok=True)
        if self._proc is not None and self._proc.returncode == 0:
            self.log.unlink(missing_ok=True)

    def report_fields(self) -> dict:
        return {
            "launcher": {
                "tool": "torchrun",
                "process_group": self.backend.process_group,
                "processes": self.world_size,
                "command": self.command,
                "environment": {
                    key: self.env[key] for key in ("OMP_NUM_THREADS", "TORCH_TPU_DEFER_AND_FUSE") if key in self.env
                },
            }
        }


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux: /proc/PID/task/*/children)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


# ---------------------------------------------------------------- the rank processes


class RankBarriers:
    """dist.barrier at each of BARRIERS; a rank that fails still passes the ones it owes, so that no other
    rank waits for it forever."""

    def __init__(self) -> None:
        self.joined = False
        self._entered: set[str] = set()

    def meet(self, name: str) -> bool:
        if name in BARRIERS:
            import torch.distributed as dist

            self._entered.add(name)
            dist.barrier()
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
    """`python -m tpugen.dist RUN_DIR`, as torchrun starts it: this rank's share of the run.

    Exits 0 once it has left rank-N.json, even for a rank that failed, so that torchrun lets the other
    ranks finish; 1 if it failed before joining the process group, so that torchrun stops the others,
    which would wait for it there.
    """
    STOP_REQUEST.install()  # SIGTERM from tpugen: stop after the batch in flight
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

    def join(_) -> RankGroup:
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
        global_rank, world = dist.get_rank(), dist.get_world_size()
        worker, workers = pod_position(run.config.execution.pod, os.environ, host_index)
        # torchrun numbers each worker's ranks from 0: worker w of W with rank r of R takes w*R + r.
        return RankGroup(global_rank, world, 1, (workers * world, worker * world + global_rank), barriers.meet)

    run_rank(rank, run, run_dir, frozenset(launch["finished"]), join, barriers.abort)
    if not barriers.joined:
        return 1
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _count_devices(execution_json: str) -> int:
    """`python -m tpugen.dist --count-devices EXECUTION`: prints how many devices the backend sees."""
    config = RunConfig(
        model=ModelConfig(id="count-devices"), execution=ExecutionConfig.model_validate_json(execution_json)
    )
    try:
        make_backend(config)
    except InputError as exc:
        print(exc.lines[0], file=sys.stderr)
        return InputError.exit_code
    import torch

    print(torch.accelerator.device_count())
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--count-devices":
        return _count_devices(argv[1])
    if len(argv) == 1:
        return rank_process(Path(argv[0]))
    print("usage: python -m tpugen.dist RUN_DIR | --count-devices EXECUTION_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
