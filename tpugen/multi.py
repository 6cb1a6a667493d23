"""All chips of a VM: one replica per device through torch_xla.launch, each making its share of the images."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from tpugen.backends import Counters, host_index, launch_ranks, make_backend
from tpugen.config import ResolvedRun, dump_config
from tpugen.errors import Interrupted, RunError
from tpugen.outputs import atomic_write_text, write_json
from tpugen.plan import plan_run, plan_share
from tpugen.pod import pod_position
from tpugen.resume import all_records, check_resumable, finished_records, rewrite_manifest
from tpugen.runner import (
    RunDisplay,
    TimedPhase,
    build_report,
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
    live), because on XLA:CPU the ranks themselves are threads that cannot install handlers.
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


_STOP = _StopRequest()
if os.environ.get(RANK_PROCESS_ENV) and threading.current_thread() is threading.main_thread():
    _STOP.install()


def rank_main(index: int, run: ResolvedRun, run_dir: str, finished: frozenset[int]) -> None:
    """What torch_xla.launch runs on every device. Never raises: it leaves rank-N.json for the parent."""
    directory = Path(run_dir)
    result: dict = {"rank": index, "pid": os.getpid(), "error": None}
    try:
        result.update(_rank_work(run, directory, finished, result))
    except BaseException as exc:  # report, and release the ranks waiting for this one
        _MEETING.abort()
        result["error"] = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]
        result["traceback"] = traceback.format_exc()
    write_json(directory / f"rank-{result['rank']}.json", result)


def _rank_work(run: ResolvedRun, run_dir: Path, finished: frozenset[int], result: dict) -> dict:
    cfg = run.config
    backend = make_backend(cfg)
    rank, world, local = backend.rank(), backend.world_size(), backend.ranks_in_process()
    result.update(rank=rank, world_size=world, ranks_in_process=local)
    worker, workers = pod_position(cfg.execution.pod, os.environ, host_index)
    # Worker w of W with local rank r of R takes index % (W*R) == w*R + r. A pod-wide runtime (a real
    # pod) numbers ranks globally already; a runtime per worker (simulated pods) numbers them locally.
    parts, part = (
        (world, rank) if workers == 1 or world == workers * local else (workers * world, worker * world + rank)
    )
    plan = plan_share(run, parts, part, finished)

    from tpugen.pipeline import load_pipeline

    start = time.perf_counter()
    loaded = load_pipeline(run, backend, ranks_in_process=local)
    backend.wait()
    result["load_seconds"] = time.perf_counter() - start
    result["device"] = backend.describe()
    result["cache"] = backend.cache
    result["scheduler"] = loaded.scheduler_name

    with _WARMUP_LOCK:
        result["warmup"] = warmup(loaded, plan, RunDisplay())
    # Counters are process-wide: read them only while no rank of this process is working.
    _MEETING.meet("warmed", local)
    before = backend.counters()
    _MEETING.meet("timed phase", local)

    phase = TimedPhase()
    fail_rank = os.environ.get(FAIL_RANK_ENV)

    def checkpoint() -> None:
        if _STOP.signum is not None:
            raise Interrupted(_STOP.signum, f"interrupted by {signal.Signals(_STOP.signum).name}")
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
    all_done = _MEETING.meet("done", local)
    after = backend.counters()
    result["process_counters"] = (after - before).as_dict() if all_done and before and after else None
    return result


def run_multi(run: ResolvedRun, *, display: RunDisplay | None = None, resume_dir: Path | None = None) -> dict:
    """`tpugen generate` with execution.mode: multi. The parent plans, launches, then merges the ranks."""
    display = display or RunDisplay()
    full_plan = plan_run(run)
    finished: dict[int, dict] = {}
    if resume_dir is not None:
        run_dir = Path(resume_dir).resolve()
        check_resumable(run, run_dir)
        finished = finished_records(run_dir)
        run_id = run_dir.name
    else:
        run_id = run_id_for(run)
        run_dir = make_run_dir(run, run_id)
        atomic_write_text(run_dir / "config.yaml", dump_config(run.config))
    for stale in run_dir.glob("rank-*.json"):
        stale.unlink()

    launch_error: list[BaseException] = []

    def launch() -> None:
        try:
            launch_ranks(rank_main, (run, str(run_dir), frozenset(finished)), run.config.execution.cores)
        except BaseException as exc:  # reported with the ranks' own results below
            launch_error.append(exc)

    display.phase(f"launching one replica per device (execution.cores: {run.config.execution.cores or 'all'})")
    started = time.perf_counter()
    os.environ[RANK_PROCESS_ENV] = "1"
    launcher = threading.Thread(target=launch, name="tpugen-launch")
    stopped: list[int] = []

    def forward(signum: int, frame) -> None:
        # The rank processes stop after their batch in flight; a terminal's Ctrl-C reaches them itself.
        stopped.append(signum)
        display.phase(f"{signal.Signals(signum).name}: the ranks stop after their batch in flight")
        if signum == signal.SIGTERM:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main_thread else {}
    try:
        launcher.start()
        total = len(full_plan.items)
        display.batches_started(total)
        while launcher.is_alive():
            launcher.join(0.5)
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
    world = results[0].get("world_size") if results else None
    if world and len(results) < world:
        missing = sorted(set(range(world)) - {r["rank"] for r in results})
        failures.append(f"ranks {missing} left no result (killed?)")
    if launch_error and not failures:
        failures.append(f"torch_xla.launch failed: {(str(launch_error[0]).splitlines() or [''])[0]}")
    if not results and not failures:
        failures.append("no rank reported back")

    if stopped:
        failures = [f"interrupted by {signal.Signals(stopped[0]).name}"]
    report = _merged_report(run, run_id, run_dir, full_plan, results, finished, wall, "; ".join(failures) or None)
    write_report(run_dir, report)
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
        device=first.get("device", {"backend": "xla", "device_kind": "unknown", "world_size": len(results)}),
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
