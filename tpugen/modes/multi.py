"""All chips of a VM: one replica per device, each making its share of the images, merged into one run.

The parent plans, owns the run session, launches the ranks (tpugen.modes.rank) and merges what they made;
on xla through torch_xla.launch, on torch_tpu, cuda and cpu through torchrun."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tpugen import settings
from tpugen.backends import Counters, backend_environment, versions
from tpugen.config import ResolvedRun
from tpugen.engine import Display, RunSession, StopSignals, Topology, worker_topology
from tpugen.errors import InputError, Interrupted, RunError, first_line
from tpugen.files import write_json
from tpugen.modes.rank import DIST_BACKENDS, LAUNCH_FILE, RANK_PROCESS_ENV, rank_main
from tpugen.modes.single import host_index_for
from tpugen.outputs.report import RunReport, build_report, merge_phases, persistent_cache_summary, plan_counts
from tpugen.outputs.sections import RanksSection
from tpugen.plan import plan_share

LOG_FILE = "torchrun.log"  # torchrun's and the ranks' output; kept only when torchrun itself failed


class XlaLaunch:
    """torch_xla.launch, in a thread of the parent: one process per chip on a TPU VM; on XLA:CPU, one
    process whose ranks are threads."""

    def __init__(self, run: ResolvedRun) -> None:
        self.cores = run.config.execution.cores
        self.world_size: int | None = None  # known only from the ranks' own results
        self._thread: threading.Thread | None = None
        self._error: list[BaseException] = []

    def announce(self) -> str:
        return f"launching one replica per device (execution.cores: {self.cores or 'all'})"

    def start(self, run: ResolvedRun, run_dir: Path, finished: frozenset[int], worker: Topology) -> None:
        from tpugen.backends.xla.devices import launch_ranks

        def launch() -> None:
            try:
                launch_ranks(rank_main, (run, str(run_dir), finished, worker), self.cores)
            except BaseException as exc:  # reported with the ranks' own results
                self._error.append(exc)

        os.environ[RANK_PROCESS_ENV] = "1"
        self._thread = threading.Thread(target=launch, name="tpugen-launch")
        self._thread.start()

    def running(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return self._thread.is_alive()

    def stop_ranks(self, signum: int) -> None:
        # A terminal's Ctrl-C reaches the rank processes itself; SIGTERM to tpugen is passed on.
        if signum == signal.SIGTERM:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)

    def failure(self) -> str | None:
        return f"torch_xla.launch failed: {first_line(str(self._error[0]))}" if self._error else None

    def finish(self, run_dir: Path, ok: bool) -> None:
        """Nothing of its own to clean up."""

    def description(self) -> dict:
        return {"tool": "torch_xla.launch", "devices": self.cores or "all"}


def torchrun_command(processes: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    """torchrun on this host only (--standalone picks a free rendezvous port), one process per device."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "tpugen.modes.rank",
        str(run_dir),
    ]


def rank_environment(run: ResolvedRun, processes: int, base: dict[str, str], host_cores: int) -> dict[str, str]:
    """The rank processes' environment: the variables the backend reads when torch is imported (so they are
    there before any process of the run imports it), and each rank's share of the host's cores unless the
    user chose (torchrun would otherwise set OMP_NUM_THREADS=1)."""
    env = {**base, **backend_environment(run.config.execution, run.config.cache)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, host_cores // processes)))
    return env


def count_devices(run: ResolvedRun, env: dict[str, str]) -> int:
    """How many devices the run's backend sees, as torch.accelerator reports them, asked in a process of its
    own: so this one neither imports torch nor holds a chip that a rank will need, and a missing backend or
    device is one line before anything is written."""
    execution = run.config.execution
    proc = subprocess.run(
        [sys.executable, "-m", "tpugen.modes.rank", "--count-devices", execution.model_dump_json()],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode == InputError.exit_code:
        raise InputError(*proc.stderr.strip().split("\n")[-1:])
    lines = proc.stdout.split()
    if proc.returncode or not lines or not lines[-1].isdigit():
        last = (proc.stderr.strip().split("\n") or [f"exit code {proc.returncode}"])[-1]
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
    """The parent's side: torchrun in a session of its own, whose rank processes run tpugen.modes.rank."""

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

    def start(self, run: ResolvedRun, run_dir: Path, finished: frozenset[int], worker: Topology) -> None:
        write_json(
            run_dir / LAUNCH_FILE,
            {
                "config": json.loads(run.config.model_dump_json()),
                "config_hash": run.config_hash,
                "finished": sorted(finished),
                "worker": {"worker": worker.worker, "workers": worker.workers},
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

    def description(self) -> dict:
        return {
            "tool": "torchrun",
            "process_group": self.backend.process_group,
            "processes": self.world_size,
            "command": self.command,
            "environment": {
                key: self.env[key] for key in ("OMP_NUM_THREADS", "TORCH_TPU_DEFER_AND_FUSE") if key in self.env
            },
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


def run_multi(run: ResolvedRun, *, display: Display | None = None, resume_dir: Path | None = None) -> RunReport:
    """`tpugen generate` with execution.mode: multi. The parent plans, launches, then merges the ranks."""
    display = display or Display()
    worker = worker_topology(run.config.execution.pod, os.environ, host_index_for(run))
    full_plan = plan_share(run, worker.workers, worker.worker)  # this worker's share, finished images included
    if resume_dir is not None:
        session = RunSession.resume(run, resume_dir)
        for problem in session.problems:
            display.warning(problem)
        done = session.already_complete(len(full_plan.items))
        if done is not None:  # nothing to make: no chip is counted, no model loaded
            return done
    # Counts the chips before a run directory is made (torchrun), so a missing backend or device is one line.
    launcher = XlaLaunch(run) if run.config.execution.backend == "xla" else TorchrunLaunch(run)
    if resume_dir is None:
        session = RunSession.create(run)
    session.settle()  # the ranks append to fresh per-rank manifests, never to a torn line of a killed session
    run_dir = session.run_dir
    for stale in run_dir.glob("rank-*.json"):
        stale.unlink()

    display.phase(launcher.announce())
    started = time.perf_counter()
    total = len(full_plan.items)

    def forward(signum: int) -> None:
        # The rank processes stop after their batch in flight.
        display.phase(f"{signal.Signals(signum).name}: the ranks stop after their batch in flight")
        launcher.stop_ranks(signum)

    # Every signal is forwarded: the ranks stop after their batch in flight at the first, at once at a second.
    with StopSignals(on_signal=forward, second_stops_now=False) as stop:
        launcher.start(run, run_dir, frozenset(session.finished), worker)
        display.batches_started(total)
        try:
            while launcher.running(0.5):
                display.progress(len(session.records()), total)
        finally:
            display.finished()
    wall = time.perf_counter() - started

    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank-*.json"))]
    for path in run_dir.glob("rank-*.json"):
        path.unlink()
    if settings.debug():  # the ranks' tracebacks, as the CLI shows its own
        for r in results:
            if r.get("traceback"):
                print(f"rank {r['rank']}:\n{r['traceback']}", file=sys.stderr)
    made = len(session.records())

    failures = [f"rank {r['rank']}: {r['error']}" for r in results if r.get("error")]
    world = launcher.world_size or (results[0].get("world_size") if results else None)
    if world and len(results) < world:
        missing = sorted(set(range(world)) - {r["rank"] for r in results})
        failures.append(f"ranks {missing} left no result (killed?)")
    launch_failure = launcher.failure()
    if launch_failure and not failures:
        failures.append(launch_failure)
    if not results and not failures:
        failures.append("no rank reported back")

    if stop.requested:
        failures = [f"interrupted by {stop.name}"]
    elif not session.resumed and results and not made and all("load_seconds" not in r for r in results):
        # No rank got its model loaded (a bad model id, offline, gated): no run to resume, so none is left.
        launcher.finish(run_dir, ok=False)
        session.discard()
        raise RunError(*(dict.fromkeys(r["error"] for r in results if r.get("error")) or failures))
    report = merged_report(
        session, full_plan, results, worker, wall, "; ".join(failures) or None, launcher.description()
    )
    session.finish(report)
    launcher.finish(run_dir, ok=not failures)
    if stop.requested:
        raise Interrupted(
            stop.signum,
            f"interrupted by {stop.name}, the ranks stopped after their batch in flight; "
            f"{report['images']} images, the manifest and report.json are in {run_dir}",
            f"resume with: tpugen resume {run_dir}",
        )
    if failures:
        raise RunError(
            *failures,
            f"{report['images']} images (the other ranks' included), the manifest and report.json are in {run_dir}",
            *([launch_failure] if launch_failure and launch_failure not in failures else []),
            f"resume with: tpugen resume {run_dir}",
        )
    return report


def merged_report(
    session: RunSession, plan, results: list[dict], worker: Topology, wall: float, error, launcher: dict | None
) -> RunReport:
    """One report for the ranks: their batches, warmups and counters, and a table per rank."""
    ok = [r for r in results if "timed_phase" in r]
    phase = merge_phases(ok, "rank")
    by_process = {r["pid"]: r["process_counters"] for r in ok if r.get("process_counters")}
    if by_process and len(by_process) == len({r["pid"] for r in ok}):
        counters = [Counters(**c) for c in by_process.values()]
        phase.counters = sum(counters[1:], counters[0]).as_dict()
    warmup = [{**w, "rank": r["rank"]} for r in ok for w in r.get("warmup", [])]
    first = ok[0] if ok else {}
    shared = max((r.get("ranks_in_process", 1) for r in ok), default=1)
    ranks = first.get("world_size", len(results)) // max(1, worker.workers) if first else len(results)
    scope = (
        f"{shared} ranks are threads of one process and XLA counters are process-wide: warmup counts are exact "
        "per rank (one rank warms up at a time); timed-phase counts are the process's totals, read while no "
        "rank ran"
        if shared > 1
        else "one process per rank: every count is that rank's own"
    )
    report = build_report(
        run=session.run,
        run_id=session.run_id,
        run_dir=session.run_dir,
        **plan_counts(plan),
        device=first.get("device", {"backend": session.run.config.execution.backend, "device_kind": "unknown"}),
        versions=versions(),
        scheduler=first.get("scheduler", "unknown"),
        load_seconds=max((r.get("load_seconds", 0.0) for r in ok), default=0.0),
        warmup=warmup,
        persistent_cache=persistent_cache_summary(
            first.get("cache", {"enabled": False, "note": "no rank ran"}), warmup
        ),
        phase=phase,
        topology=worker.with_rank(0, max(1, ranks)).as_dict(),
        images_reused=len(session.finished),
        error=error,
        memory=first.get("memory"),
        earlier_sessions=session.earlier_sessions,
        counters_scope=scope,
    )
    rows = [
        {
            "rank": r["rank"],
            "pid": r["pid"],
            "images": r.get("images", 0),
            "batches": len((r.get("timed_phase") or {}).get("batches", [])),
            "warmup_compiles": sum(w["compiles"] or 0 for w in r.get("warmup", [])),
            "warmup_seconds": sum(w["seconds"] for w in r.get("warmup", [])),
            "per_image_seconds": (
                sum(b["seconds"] for b in r["timed_phase"]["batches"]) / r["images"] if r.get("images") else None
            ),
            "timed_wall_seconds": (r.get("timed_phase") or {}).get("wall_seconds"),
            "compiles_after_warmup": (r.get("process_counters") or {}).get("compiles"),
            "error": r.get("error"),
        }
        for r in sorted(results, key=lambda r: r["rank"])
    ]
    weights = (
        f"from disk once per process, then copied to each of its {shared} ranks"
        if shared > 1
        else "from disk once per rank process"
    )
    return report.but(
        section=RanksSection(
            launch_wall_seconds=wall, weights_loaded=weights, counters_scope=scope, ranks=rows, launcher=launcher
        )
    )
