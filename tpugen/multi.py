"""All chips of a VM: one replica per device, each making its share of the images, merged into one run."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpugen.backends import Backend, Counters, host_index, launch_ranks, make_backend
from tpugen.config import ResolvedRun, dump_config
from tpugen.errors import Interrupted, RunError, TpugenError
from tpugen.outputs import atomic_write_text, write_json
from tpugen.plan import plan_run, plan_share
from tpugen.pod import pod_position
from tpugen.resume import all_records, check_resumable, finished_records, rewrite_manifest, write_run_record
from tpugen.runner import (
    RunDisplay,
    TimedPhase,
    already_complete,
    build_report,
    earlier_sessions_of,
    make_run_dir,
    persistent_cache_summary,
    run_batches,
    run_id_for,
    warmup,
    write_grid,
    write_report,
)

FAIL_RANK_ENV = "TPUGEN_TEST_FAIL_RANK"  # test hook: this rank raises after its first batch


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

RANK_PROCESS_ENV = "TPUGEN_RANK_PROCESS"  # set by the parent, inherited by the processes launch starts


class _StopRequest:
    """SIGTERM/SIGINT in a rank process: its ranks stop after the batch in flight; a second one, at once.

    Installed when torch_xla.launch's process imports this module (in its main thread, where handlers
    live), because on XLA:CPU the ranks themselves are threads that cannot install handlers; torchrun's
    rank processes install it themselves (tpugen.dist).
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum


STOP_REQUEST = _StopRequest()
if os.environ.get(RANK_PROCESS_ENV) and threading.current_thread() is threading.main_thread():
    STOP_REQUEST.install()


@dataclass(frozen=True)
class RankGroup:
    """Where one rank stands among the run's ranks, and how it meets the others."""

    rank: int
    world_size: int
    ranks_in_process: int  # ranks that share this process (and its process-wide counters)
    share: tuple[int, int]  # (parts, part): this rank makes plan_share(run, parts, part)
    meet: Callable[[str], bool]  # wait at a named point; False if a rank failed (so nobody waits for the dead)


def rank_main(index: int, run: ResolvedRun, run_dir: str, finished: frozenset[int]) -> None:
    """What torch_xla.launch runs on every device. Never raises: it leaves rank-N.json for the parent."""

    def join(backend) -> RankGroup:
        rank, world, local = backend.rank(), backend.world_size(), backend.ranks_in_process()
        worker, workers = pod_position(run.config.execution.pod, os.environ, host_index)
        # Worker w of W with local rank r of R takes index % (W*R) == w*R + r. A pod-wide runtime (a real
        # pod) numbers ranks globally already; a runtime per worker (simulated pods) numbers them locally.
        share = (world, rank) if workers == 1 or world == workers * local else (workers * world, worker * world + rank)
        return RankGroup(rank, world, local, share, lambda name: _MEETING.meet(name, local))

    run_rank(index, run, Path(run_dir), finished, join, lambda exc: _MEETING.abort())


def error_line(exc: BaseException) -> str:
    """A rank's failure in one line: tpugen's own errors as worded, anything else with its type."""
    if isinstance(exc, TpugenError) and exc.lines:
        return exc.lines[0]
    return (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]


def run_rank(
    rank: int,
    run: ResolvedRun,
    run_dir: Path,
    finished: frozenset[int],
    join: Callable[[Backend], RankGroup],
    abort: Callable[[BaseException], None],
) -> dict:
    """One rank's whole share: its backend, then `join` places it among the ranks, then load, warm up and
    generate. Never raises: the result (or the error) goes to rank-N.json for the parent, and is returned.
    `abort` releases the ranks that would otherwise wait for this one."""
    result: dict = {"rank": rank, "pid": os.getpid(), "error": None}
    try:
        backend = make_backend(run.config)
        result.update(_rank_work(run, run_dir, finished, result, backend, join(backend)))
    except BaseException as exc:  # report, and release the ranks waiting for this one
        abort(exc)
        result["error"] = error_line(exc)
        result["traceback"] = traceback.format_exc()
    write_json(run_dir / f"rank-{result['rank']}.json", result)
    return result


def _rank_work(
    run: ResolvedRun, run_dir: Path, finished: frozenset[int], result: dict, backend: Backend, group: RankGroup
) -> dict:
    rank, local = group.rank, group.ranks_in_process
    result.update(rank=rank, world_size=group.world_size, ranks_in_process=local)
    plan = plan_share(run, *group.share, finished)

    from tpugen.pipeline import load_pipeline

    start = time.perf_counter()
    loaded = load_pipeline(run, backend, ranks_in_process=local)
    backend.wait()
    result["load_seconds"] = time.perf_counter() - start
    result["device"] = {**backend.describe(), "world_size": group.world_size, "rank": rank}
    result["cache"] = backend.cache
    result["scheduler"] = loaded.scheduler_name

    with _WARMUP_LOCK:
        result["warmup"] = warmup(loaded, plan, RunDisplay())
    # Counters are process-wide: read them only while no rank of this process is working.
    group.meet("warmed")
    before = backend.counters()
    group.meet("timed phase")

    phase = TimedPhase()
    fail_rank = os.environ.get(FAIL_RANK_ENV)

    def checkpoint() -> None:
        if STOP_REQUEST.signum is not None:
            raise Interrupted(STOP_REQUEST.signum, f"interrupted by {signal.Signals(STOP_REQUEST.signum).name}")
        if fail_rank is not None and int(fail_rank) == rank and phase.batches:
            raise RuntimeError(f"failed on purpose after its first batch ({FAIL_RANK_ENV}={rank})")

    try:
        run_batches(
            run,
            loaded,
            plan,
            run_dir,
            phase,
            RunDisplay(),
            finished=finished,
            checkpoint=checkpoint,
            manifest_name=f"manifest.rank{rank}.jsonl",
            extra={"rank": rank},
        )
    finally:
        result.update(
            batches=phase.batches,
            recompiles=phase.recompiles,
            images=len(phase.written),
            written=[p.name for p in phase.written],
            generate_seconds=phase.generate_seconds,
            write_seconds=phase.write_seconds,
            wall_seconds=phase.wall_seconds,
        )
    all_done = group.meet("done")
    after = backend.counters()
    result["process_counters"] = (after - before).as_dict() if all_done and before and after else None
    return result


class XlaLaunch:
    """torch_xla.launch, in a thread of the parent: one process per chip on a TPU VM; on XLA:CPU, one
    process whose ranks are threads."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self.world_size: int | None = None  # known only from the ranks' own results
        self._thread: threading.Thread | None = None
        self._error: list[BaseException] = []

    def announce(self) -> str:
        return f"launching one replica per device (execution.cores: {self.cores or 'all'})"

    def start(self, run: ResolvedRun, run_dir: Path, finished: frozenset[int]) -> None:
        def launch() -> None:
            try:
                launch_ranks(rank_main, (run, str(run_dir), finished), self.cores)
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
        if not self._error:
            return None
        return f"torch_xla.launch failed: {(str(self._error[0]).splitlines() or [''])[0]}"

    def finish(self, run_dir: Path, ok: bool) -> None:
        """Nothing of its own to clean up."""

    def report_fields(self) -> dict:
        return {"launcher": {"tool": "torch_xla.launch", "devices": self.cores or "all"}}


def run_multi(run: ResolvedRun, *, display: RunDisplay | None = None, resume_dir: Path | None = None) -> dict:
    """`tpugen generate` with execution.mode: multi. The parent plans, launches, then merges the ranks.

    Backend xla launches through torch_xla.launch; the others through torchrun (tpugen.dist).
    """
    display = display or RunDisplay()
    if run.config.execution.backend == "xla":
        launcher = XlaLaunch(run.config.execution.cores)
    else:
        from tpugen.dist import TorchrunLaunch

        # Counts the chips first, so a missing backend or device is one line and nothing is written.
        launcher = TorchrunLaunch(run)
    full_plan = plan_run(run)
    finished: dict[int, dict] = {}
    earlier: list[dict] = []
    if resume_dir is not None:
        run_dir = Path(resume_dir).resolve()
        check_resumable(run, run_dir)
        finished, problems = finished_records(run_dir, run)
        for problem in problems:
            display.warning(problem)
        if len(finished) == len(full_plan.items):
            return already_complete(run_dir, len(full_plan.items), finished)
        earlier = earlier_sessions_of(run_dir)
        run_id = run_dir.name
    else:
        run_id = run_id_for(run)
        run_dir = make_run_dir(run, run_id)
        atomic_write_text(run_dir / "config.yaml", dump_config(run.config))
        write_run_record(run_dir, run, run_id)
    for stale in run_dir.glob("rank-*.json"):
        stale.unlink()

    display.phase(launcher.announce())
    started = time.perf_counter()
    stopped: list[int] = []

    def forward(signum: int, frame) -> None:
        # The rank processes stop after their batch in flight.
        stopped.append(signum)
        display.phase(f"{signal.Signals(signum).name}: the ranks stop after their batch in flight")
        launcher.stop_ranks(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main_thread else {}
    try:
        launcher.start(run, run_dir, frozenset(finished))
        total = len(full_plan.items)
        display.batches_started(total)
        while launcher.running(0.5):
            done = len({r["index"] for r in all_records(run_dir)})
            display.progress(done, total)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        display.finished()
    wall = time.perf_counter() - started

    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank-*.json"))]
    for path in run_dir.glob("rank-*.json"):
        path.unlink()
    records = {r["index"]: r for r in all_records(run_dir)}
    rewrite_manifest(run_dir, records)
    for path in run_dir.glob("manifest.rank*.jsonl"):
        path.unlink()
    write_grid(run_dir, sorted(run_dir.glob("[0-9]*.png")))

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

    if stopped:
        failures = [f"interrupted by {signal.Signals(stopped[0]).name}"]
    elif resume_dir is None and results and not records and all("load_seconds" not in r for r in results):
        # No rank got its model loaded (a bad model id, offline, gated): no run to resume, so none is left.
        launcher.finish(run_dir, ok=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise RunError(*(dict.fromkeys(r["error"] for r in results if r.get("error")) or failures))
    report = _merged_report(run, run_id, run_dir, full_plan, results, finished, wall, "; ".join(failures) or None)
    report["earlier_sessions"] = earlier
    report.update(launcher.report_fields())
    write_report(run_dir, report)
    launcher.finish(run_dir, ok=not failures)
    if stopped:
        raise Interrupted(
            stopped[0],
            f"interrupted by {signal.Signals(stopped[0]).name}, the ranks stopped after their batch in flight; "
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


def _merged_report(run, run_id, run_dir, plan, results, finished, wall, error) -> dict:
    ok = [r for r in results if "batches" in r]
    phase = TimedPhase(
        batches=[{**b, "rank": r["rank"]} for r in ok for b in r["batches"]],
        recompiles=[{**e, "rank": r["rank"]} for r in ok for e in r["recompiles"]],
        written=[run_dir / name for r in ok for name in r["written"]],
        generate_seconds=sum(r["generate_seconds"] for r in ok),
        write_seconds=sum(r["write_seconds"] for r in ok),
        # Aggregate throughput is total images over the slowest rank's timed phase.
        wall_seconds=max((r["wall_seconds"] for r in ok), default=0.0),
    )
    by_process = {r["pid"]: r["process_counters"] for r in ok if r.get("process_counters")}
    if by_process and len(by_process) == len({r["pid"] for r in ok}):
        counters = [Counters(**c) for c in by_process.values()]
        phase.counters = sum(counters[1:], counters[0]) if len(counters) > 1 else counters[0]
    warm = [{**w, "rank": r["rank"]} for r in ok for w in r.get("warmup", [])]
    first = ok[0] if ok else {}
    report = build_report(
        run,
        run_id=run_id,
        run_dir=run_dir,
        plan=plan,
        device=first.get(
            "device",
            {"backend": run.config.execution.backend, "device_kind": "unknown", "world_size": len(results)},
        ),
        scheduler=first.get("scheduler", "unknown"),
        load_seconds=max((r.get("load_seconds", 0.0) for r in ok), default=0.0),
        warmup_results=warm,
        persistent_cache=persistent_cache_summary(first.get("cache", {"enabled": False, "note": "no rank ran"}), warm),
        phase=phase,
        images_reused=len(finished),
        error=error,
        pod=pod_position(run.config.execution.pod, os.environ, lambda: 0),
    )
    shared = max((r.get("ranks_in_process", 1) for r in ok), default=1)
    report["mode"] = "multi"
    report["launch_wall_seconds"] = wall
    report["weights_loaded"] = (
        f"from disk once per process, then copied to each of its {shared} ranks"
        if shared > 1
        else "from disk once per rank process"
    )
    report["counters_scope"] = (
        f"{shared} ranks are threads of one process and XLA counters are process-wide: warmup counts are exact "
        "per rank (one rank warms up at a time); timed-phase counts are the process's totals, read while no rank ran"
        if shared > 1
        else "one process per rank: every count is that rank's own"
    )
    report["ranks"] = [
        {
            "rank": r["rank"],
            "pid": r["pid"],
            "images": r.get("images", 0),
            "batches": len(r.get("batches", [])),
            "warmup_compiles": sum(w["compiles"] or 0 for w in r.get("warmup", [])),
            "warmup_seconds": sum(w["seconds"] for w in r.get("warmup", [])),
            "per_image_seconds": (sum(b["seconds"] for b in r["batches"]) / r["images"] if r.get("images") else None),
            "timed_wall_seconds": r.get("wall_seconds"),
            "compiles_after_warmup": (r.get("process_counters") or {}).get("compiles"),
            "error": r.get("error"),
        }
        for r in sorted(results, key=lambda r: r["rank"])
    ]
    return report
