"""The driver of a ray run: one queue of batches, the workers' results and faults settled in one place, the report."""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone

from tpugen import settings
from tpugen.backends import Counters
from tpugen.config import ResolvedRun
from tpugen.engine import Display, RunSession, StopSignals
from tpugen.errors import InputError, Interrupted, RunError, TpugenError, one_line
from tpugen.files import write_json
from tpugen.modes.host import NotStarted, warmup_plan
from tpugen.modes.ray.join import Cluster
from tpugen.modes.ray.resources import IN_FLIGHT, actor_options, show_resources, worker_count, worker_resources
from tpugen.modes.ray.wording import _gone_line, _message, gs_refusal
from tpugen.modes.ray.worker import Worker, _RayHost
from tpugen.outputs.report import RunReport, build_report, merge_phases, persistent_cache_summary, plan_counts
from tpugen.outputs.run_dir import check_run_dir_free
from tpugen.outputs.sections import RaySection
from tpugen.plan import Batch, RunPlan, plan_run

WORKERS_FILE = "workers.json"
ALIVE = ("starting", "warming", "ready", "restarting")  # states in which a worker may still take batches
# A lost worker whose greet Ray answers "being restarted" (ActorUnavailableError) is greeted again every
# GREET_PAUSE_S for up to RESTART_PATIENCE_S from its loss, then counted lost again.
RESTART_PATIENCE_S = 120.0
GREET_PAUSE_S = 0.25
WAIT_SECONDS = 1.0  # the longest the driver waits for any answer before it looks at deadlines and signals again


class BatchOverdue(Exception):
    """The driver's own verdict on a worker that has not finished its batch by the batch deadline
    (execution.ray.batch_timeout_s): taken as lost like a dead one, and killed so that Ray restarts it."""


@dataclass(frozen=True)
class Call:
    kind: str  # hello, start or batch
    worker: Worker
    epoch: int
    batch: Batch | None = None


class ClusterRun:
    """One session of a ray run: the queue, the workers, and the one place where their results and their faults
    are handled (`_settle`)."""

    def __init__(
        self, cluster: Cluster, run: ResolvedRun, session, plan: RunPlan, resources: dict, display: Display, skip_warmup
    ) -> None:
        self.cluster, self.ray, self.run = cluster, cluster.ray, run
        self.resources = resources
        self.session = session  # None until the first worker has its engine open (a new run)
        self.plan = plan  # the whole run
        self.display = display
        self.skip_warmup = skip_warmup
        finished = frozenset(session.finished) if session else frozenset()
        self.remaining = RunPlan(
            plan.items, tuple(b for b in plan.batches if any(i.index not in finished for i in b.items))
        )
        self.queue: deque[Batch] = deque(self.remaining.batches)
        self.confirmed: dict[int, dict] = {}  # index -> record, this session
        self.futures: dict = {}  # future -> Call
        self.workers: list[Worker] = []
        self.events: list[dict] = []
        self.lost_from: dict[int, list[int]] = {}  # batch number -> workers it was lost with
        self.failure: str | None = None
        self.manifest = None
        self.begin = time.perf_counter()
        self.timed_start: float | None = None
        self.timed_end: float | None = None

    @property
    def finished(self) -> dict:
        return self.session.finished if self.session else {}

    # ---------------------------------------------------------------- workers

    def launch(self, count: int) -> None:
        actor = self.ray.remote(_RayHost).options(
            **actor_options(self.resources, self.run.config.execution.ray.max_restarts)
        )
        warm = None if self.skip_warmup else warmup_plan(self.remaining)
        for index in range(count):
            worker = Worker(index, actor.remote(self.run, index, warm))
            self.workers.append(worker)
            self._greet(worker)

    def _greet(self, worker: Worker) -> None:
        """hello then start: Ray runs a worker's calls in order, so the pid is known before the engine opens."""
        self.futures[worker.handle.hello.remote()] = Call("hello", worker, worker.epoch)
        self.futures[worker.handle.start.remote()] = Call("start", worker, worker.epoch)

    def _event(self, what: str, worker: Worker | None = None, **fields) -> None:
        at = time.perf_counter() - self.begin
        self.events.append({"seconds": round(at, 3), "event": what, "worker": worker and worker.index, **fields})

    def _alive(self) -> list[Worker]:
        return [w for w in self.workers if w.state in ALIVE]

    # ---------------------------------------------------------------- the loop

    def work(self, stop: StopSignals) -> None:
        """Hand out batches and settle results until every batch is confirmed, or nothing can go on."""
        ray = self.ray
        total = len(self.plan.items)
        self.display.batches_started(total)
        while True:
            handing = self.failure is None and not stop.requested
            if handing:
                self._hand_out()
            if not any(c.kind == "batch" for c in self.futures.values()):
                # Nothing in flight: done, stopping, or no worker left to take what is left. A worker that Ray
                # is still restarting is not waited for once every batch is confirmed.
                if not self._left() or not handing or not self._alive() or not self.futures:
                    return
            ready, _ = ray.wait(list(self.futures), num_returns=1, timeout=self._wait_seconds())
            for future in ready:
                self._settle(future)
            for future, overdue in self._overdue():
                self._settle(future, overdue)
            self.display.progress(len(self.finished) + len(self.confirmed), total, "all workers")

    def _deadlines(self) -> list[tuple[float, object, Batch]]:
        """(when it is due, its future, the batch) for the running batch of every ready worker that has a deadline:
        one of this process's (a batch of a loss already counted is not waited for) and of a warm shape key (with
        the warmup skipped, a worker's first batch of each shape compiles)."""
        limit = self.run.config.execution.ray.batch_timeout_s
        due = []
        for worker in self.workers:
            if limit is None or worker.state != "ready" or not worker.in_flight or worker.busy_since is None:
                continue
            future, batch = next(iter(worker.in_flight.items()))
            if self.futures[future].epoch == worker.epoch and batch.shape in worker.warm_shapes:
                due.append((worker.busy_since + limit, future, batch))
        return due

    def _wait_seconds(self) -> float:
        now = time.perf_counter()
        return max(0.0, min([WAIT_SECONDS, *(due - now for due, _, _ in self._deadlines())]))

    def _overdue(self) -> list[tuple[object, BatchOverdue]]:
        """The running batches past their deadline, each with the verdict `_settle` takes as its worker's loss."""
        now, limit = time.perf_counter(), self.run.config.execution.ray.batch_timeout_s
        return [
            (future, BatchOverdue(f"batch {batch.number} not done within {limit:g} s"))
            for due, future, batch in self._deadlines()
            if now >= due
        ]

    def _left(self) -> list[Batch]:
        done = set(self.finished) | set(self.confirmed)
        return [b for b in self.queue if any(i.index not in done for i in b.items)]

    def _hand_out(self) -> None:
        """One batch at a time to each ready worker with room, fewest in flight first, until the queue is empty."""
        done = set(self.finished) | set(self.confirmed)
        while self.queue:
            ready = [w for w in self.workers if w.state == "ready" and len(w.in_flight) < IN_FLIGHT]
            if not ready:
                return
            worker = min(ready, key=lambda w: (len(w.in_flight), w.index))
            batch = self.queue.popleft()
            if all(i.index in done for i in batch.items):
                continue  # confirmed meanwhile (a worker thought lost came back with it)
            if self.timed_start is None:
                self.timed_start = time.perf_counter()
            skip = frozenset(i.index for i in batch.items if i.index in self.finished)
            if not worker.in_flight:  # it starts at once; otherwise when the one before it is done
                worker.busy_since = time.perf_counter()
            future = worker.handle.run_batch.remote(batch, str(self.session.run_dir), skip)
            self.futures[future] = Call("batch", worker, worker.epoch, batch)
            worker.in_flight[future] = batch
            if batch.number in self.lost_from:
                self._event("retried", worker, batch=batch.number)
            self._write_workers()

    def _settle(self, future, overdue: BatchOverdue | None = None) -> None:
        """A finished call: its result, or the fault it brings back, handled here and nowhere else; with
        `overdue`, a batch past its deadline, whose worker is taken as lost without waiting for it."""
        ray = self.ray
        call = self.futures.pop(future)
        worker = call.worker
        if call.kind == "batch" and worker.in_flight.pop(future, None) is not None:
            # Ray runs a worker's calls in order: the next batch in flight starts now.
            worker.busy_since = time.perf_counter() if worker.in_flight else None
        try:
            if overdue is not None:
                raise overdue
            value = ray.get(future)
        except BatchOverdue as exc:  # hung (or too slow): lost, and killed so that Ray restarts it
            self._lost(call, exc)
        except ray.exceptions.RayActorError as exc:  # the process died, its node was lost, or it is unreachable
            self._lost(call, exc)
        except ray.exceptions.RayTaskError as exc:  # the worker's own code raised
            self._raised(call, exc.cause if exc.cause is not None else exc, exc)
        except ray.exceptions.RayError as exc:  # a runtime env that cannot be set up, an actor Ray cannot place
            self._raised(call, exc, exc)
        else:
            {"hello": self._hello, "start": self._started, "batch": self._batch_done}[call.kind](call, value)
        self._write_workers()

    def _lost(self, call: Call, exc) -> None:
        """A worker's process is gone (or hung, or unreachable): its batch goes back to the queue, the loss is
        counted once, and the worker is greeted again, which the restarted process answers, or Ray, saying
        there is none. Only Ray's answer to that greet ends a worker: a death while it starts (hello, start) is
        a loss like any other, since Ray restarts it while max_restarts allow."""
        worker = call.worker
        if call.batch is not None:
            self._requeue(call.batch, worker)
        if call.epoch != worker.epoch or worker.state in ("lost", "failed"):
            return  # another failure of a loss already counted, or of a worker already given up
        died = isinstance(exc, self.ray.exceptions.ActorDiedError)
        if worker.state == "restarting":  # the answer to the greet after a loss
            # ActorDiedError there is Ray saying there will be no restart (max_restarts used up), unless the node
            # was preempted (Ray restarts a preempted actor elsewhere without counting it): then within the
            # driver's own count of its losses.
            preempted = getattr(exc, "preempted", False) and worker.losses <= self.run.config.execution.ray.max_restarts
            if died and not preempted:
                self._gone(worker)
                return
            # Ray saying the actor is being restarted (ActorUnavailableError) is no new loss: greeted again, a
            # moment later, for as long as a restart may take. Seen on two busy cores: the greet after a kill
            # met it twice, and a second loss of the same process was counted.
            restarting = isinstance(exc, self.ray.exceptions.ActorUnavailableError) and (
                time.perf_counter() - (worker.lost_at or 0.0) < RESTART_PATIENCE_S
            )
            if not died and (restarting or not worker.greet_retried):
                # No process answered yet: the old one was still going down (one the driver killed, say) when the
                # greet reached it. Asked once more, not counted as another loss.
                worker.greet_retried = True
                worker.epoch += 1  # the rest of the unanswered greet is ignored
                if restarting:
                    time.sleep(GREET_PAUSE_S)
                self._greet(worker)
                return
        self._count_loss(worker, call, exc)
        if isinstance(exc, BatchOverdue):
            self._abandon(worker)
        worker.state = "restarting"
        self._greet(worker)  # answered by the restarted process, or by Ray saying there is none

    def _gone(self, worker: Worker) -> None:
        worker.state = "lost"
        self._event("gone", worker, reason="Ray will not restart it (max_restarts used up)")
        self.display.warning(f"worker {worker.index} is gone: Ray will not restart it")

    def _abandon(self, worker: Worker) -> None:
        """A worker past its batch deadline: its other batches in flight go back to the queue now (the driver
        stops waiting for them), and its process is killed, so that Ray restarts it if restarts are left."""
        for position, (future, batch) in enumerate(list(worker.in_flight.items()), start=1):
            self.futures.pop(future, None)
            self._requeue(batch, worker, position)  # after the overdue one, in the order they were handed out
        worker.in_flight.clear()
        worker.busy_since = None
        try:
            self.ray.kill(worker.handle, no_restart=False)
        except Exception:  # already gone: the greet's answer says whether Ray restarts it
            pass

    def _count_loss(self, worker: Worker, call: Call, exc) -> None:
        worker.losses += 1
        worker.epoch += 1
        worker.greet_retried = False
        worker.lost_at = time.perf_counter()
        lost = sorted({call.batch.number} if call.batch else set()) + sorted(
            b.number for b in worker.in_flight.values()
        )
        reason = str(exc) if isinstance(exc, BatchOverdue) else type(exc).__name__
        self._event("lost", worker, pid=worker.pid, node=worker.node, batches=lost, reason=reason)
        self.display.warning(
            f"worker {worker.index} (pid {worker.pid}) lost ({reason})"
            + (f"; batches {', '.join(map(str, lost))} go back to the queue" if lost else "")
        )

    def _requeue(self, batch: Batch, worker: Worker, position: int = 0) -> None:
        self.queue.insert(position, batch)  # redone first, so a retried batch does not wait for the whole queue
        worker.lost_batches.append(batch.number)
        self.lost_from.setdefault(batch.number, []).append(worker.index)

    def _raised(self, call: Call, cause: BaseException, exc) -> None:
        worker = call.worker
        if settings.debug():
            print(f"worker {worker.index}: {exc}", flush=True)
        if isinstance(cause, NotStarted):  # restarted between batches, unseen: start it again
            self._lost(call, cause)
            return
        message = _message(cause)
        if call.kind == "batch":
            self.queue.appendleft(call.batch)  # not made: a resume makes it
            self.failure = self.failure or f"worker {worker.index}: batch {call.batch.number}: {message}"
            self._event("failed", worker, batch=call.batch.number, error=message)
            return
        if call.epoch != worker.epoch:
            return
        worker.state, worker.error, worker.cause = "failed", message, cause
        self._event("failed", worker, error=message)
        self.display.warning(f"worker {worker.index} could not start: {message}")

    def _hello(self, call: Call, value: dict) -> None:
        worker = call.worker
        if call.epoch != worker.epoch:
            return
        if worker.incarnation is not None and value["incarnation"] != worker.incarnation:
            worker.restarts += 1
            self._event("restarted", worker, pid=value["pid"], node=value["node"])
            self.display.phase(f"worker {worker.index} restarted by Ray (pid {value['pid']}): warming up again")
        elif worker.incarnation is not None:
            self._event("back", worker, pid=value["pid"])  # unreachable for a moment, never died
        worker.incarnation = value["incarnation"]
        worker.pid, worker.node, worker.host = value["pid"], value["node"], value["host"]
        if value["pid"] not in worker.pids:
            worker.pids.append(value["pid"])
        worker.state = "warming"

    def _started(self, call: Call, value: dict) -> None:
        worker = call.worker
        if call.epoch != worker.epoch:
            return
        if value["fresh"]:
            worker.load_seconds.append(value["load_seconds"])
            number = len(worker.load_seconds)
            worker.warmup.extend({**w, "worker": worker.index, "start": number} for w in value["warmup"])
            worker.warmup_seconds += sum(w["seconds"] for w in value["warmup"])
            worker.started = value
            # A fresh process: warm for every shape key, unless the warmup was skipped (then each compiles once).
            worker.warm_shapes = set() if self.skip_warmup else {b.shape for b in self.plan.batches}
            self._event("warm", worker, pid=value["pid"], seconds=round(value["start_seconds"], 3))
        if self.session is None:  # the first engine open: the model loads, so now there is a run
            self.session = RunSession.create(self.run)
        if self.manifest is None:
            self.manifest = self.session.open_manifest()
            self.display.phase(f"run directory {self.session.run_dir}")
        worker.state = "ready"

    def _batch_done(self, call: Call, value: dict) -> None:
        worker = call.worker
        fresh = [
            r for r in value["records"] if r["index"] not in self.confirmed and r["index"] not in self.finished
        ]  # a batch redone after its worker came back is appended once
        self.manifest.append(fresh)
        for record in fresh:
            self.confirmed[record["index"]] = record
        worker.batches_done += 1
        worker.warm_shapes.add(call.batch.shape)
        worker.images += len(fresh)
        worker.written.extend(r["file"] for r in fresh)
        worker.rows.append(value["row"])
        worker.recompiles.extend(value["recompiles"])
        worker.generate_seconds += value["generate_seconds"]
        worker.write_seconds += value["write_seconds"]
        worker.busy_seconds += value["wall_seconds"]
        if value["counters"] is None:
            worker.counted = False
        else:
            counters = Counters(**value["counters"])
            worker.counters = counters if worker.counters is None else worker.counters + counters
        self.timed_end = time.perf_counter()

    # ---------------------------------------------------------------- files

    def _write_workers(self) -> None:
        """workers.json, rewritten (atomically) at every change, once the run directory exists."""
        if self.session is None:
            return
        write_json(
            self.session.run_dir / WORKERS_FILE,
            {
                "run_id": self.session.run_id,
                "updated_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "address": self.cluster.address,
                "images_done": len(self.finished) + len(self.confirmed),
                "images_planned": len(self.plan.items),
                "workers": [w.as_dict() for w in self.workers],
            },
        )

    def release(self) -> None:
        """Stop every worker now (their engines go with them); a worker Ray already gave up on is skipped."""
        for worker in self.workers:
            try:
                self.ray.kill(worker.handle, no_restart=True)
            except Exception:  # already dead, or the cluster is gone: nothing left to stop
                pass
        finished = not self._left() and not self.failure
        for worker in self.workers:
            if worker.state == "ready":
                worker.state = "done" if finished else "stopped"
            elif worker.state in ALIVE:  # the run ended while it was still starting (or restarting)
                worker.state = f"stopped while {worker.state}"
        self._write_workers()

    def report(self, error: str | None) -> RunReport:
        """The one report: build_report over the workers' batches, plus the per-worker table and the faults."""
        workers = self.workers
        parts = [
            {
                "worker": w.index,
                "timed_phase": {
                    "batches": w.rows,
                    "generate_seconds": w.generate_seconds,
                    "write_seconds": w.write_seconds,
                    "wall_seconds": w.busy_seconds,
                },
                "recompiles": w.recompiles,
                "written": w.written,
            }
            for w in workers
        ]
        phase = merge_phases(parts, "worker")
        # Throughput over the driver's window, from the first batch handed out to the last one confirmed: the
        # workers overlap, and a worker's own sum would leave out the time its lost batches cost.
        phase.wall_seconds = (self.timed_end - self.timed_start) if self.timed_start and self.timed_end else 0.0
        counted = [w.counters for w in workers if w.rows]
        if counted and all(w.counted for w in workers if w.rows):
            phase.counters = sum(counted[1:], counted[0]).as_dict()
        warmup = [entry for w in workers for entry in w.warmup]
        first = next((w.started for w in workers if w.started), None) or {}
        from tpugen.backends import versions

        report = build_report(
            run=self.run,
            run_id=self.session.run_id,
            run_dir=self.session.run_dir,
            **plan_counts(self.plan),
            device=first.get("device", {"backend": self.run.config.execution.backend, "device_kind": "unknown"}),
            versions=first.get("versions") or versions(),
            scheduler=first.get("scheduler", "unknown"),
            load_seconds=max((s for w in workers for s in w.load_seconds), default=None),
            warmup=warmup,
            persistent_cache=persistent_cache_summary(
                first.get("cache", {"enabled": False, "note": "no worker started"}), warmup
            ),
            phase=phase,
            topology={
                "worker_index": 0,
                "num_workers": 1,
                "rank": 0,
                "ranks_per_worker": 1,
                "world_size": len(workers),
            },
            images_reused=len(self.finished),
            error=error,
            memory=first.get("memory"),
            earlier_sessions=self.session.earlier_sessions,
            counters_scope="one process per Ray worker: each count is a worker's own, summed over the workers",
        )
        settings = self.run.config.execution.ray
        lost = [e for e in self.events if e["event"] == "lost"]
        ray = {
            "address": settings.address,
            "workers": len(workers),
            "resources_per_worker": self.resources,
            "max_restarts": settings.max_restarts,
            "in_flight_per_worker": IN_FLIGHT,
            "batch_timeout_s": settings.batch_timeout_s,
            "timed_wall": "the driver's window, from the first batch handed out to the last one confirmed",
            "per_worker": [
                {
                    **w.as_dict(),
                    "load_seconds": w.load_seconds,
                    "timed_busy_seconds": w.busy_seconds,
                    "per_image_seconds": (sum(r["seconds"] for r in w.rows) / w.images) if w.images else None,
                    "compiles_after_warmup": w.counters.compiles if w.counters and w.counted else None,
                }
                for w in workers
            ],
            "events": self.events,
            "lost_workers": sorted({e["worker"] for e in lost}),
            "restarts": sum(w.restarts for w in workers),
            "retried_batches": sorted(self.lost_from),
        }
        return report.but(section=RaySection(ray))


def run_cluster(
    run: ResolvedRun, *, display: Display | None = None, skip_warmup: bool = False, resume_dir=None
) -> RunReport:
    """`tpugen generate` with execution.mode: ray: returns the report, also written to the run directory.

    Nothing is written until a worker has its engine open, so bad input, a cluster that does not answer or lacks
    the resources, and a model no worker can load leave no run behind. A resume connects only if work is left.
    """
    display = display or Display()
    if run.config.output.dir.startswith("gs://"):
        raise InputError(gs_refusal())
    plan = plan_run(run)
    session = None
    if resume_dir is None and run.config.output.run_id:
        # Refused now, not after every worker has loaded and warmed the model.
        check_run_dir_free(run.config.output.dir, run.config.output.run_id)
    if resume_dir is not None:
        session = RunSession.resume(run, resume_dir)
        for problem in session.problems:
            display.warning(problem)
        done = session.already_complete(len(plan.items))
        if done is not None:
            return done

    def stopping(signum: int) -> None:
        display.phase(f"{signal.Signals(signum).name}: stopping after the batches in flight (again: stop now)")

    with Cluster(run) as cluster:
        nodes = cluster.nodes()
        resources = worker_resources(cluster.settings, nodes)
        count = worker_count(cluster.settings, nodes, resources)
        display.phase(
            f"starting {count} Ray workers of {show_resources(resources)} at {cluster.address} ({len(nodes)} nodes)"
        )
        driver = ClusterRun(cluster, run, session, plan, resources, display, skip_warmup)
        stopped_now = False
        with StopSignals(on_signal=stopping) as stop:
            try:
                driver.launch(count)
                driver.work(stop)
            except KeyboardInterrupt:
                stopped_now = True
            except Exception as exc:  # the driver's own failure (a full disk, say): what was made is kept
                if driver.session is None:
                    raise
                driver.failure = driver.failure or f"the driver failed: {one_line(exc)}"
            finally:
                display.finished()
                driver.release()
        return _finish(driver, stop, stopped_now)


def _finish(driver: ClusterRun, stop: StopSignals, stopped_now: bool) -> RunReport:
    session = driver.session
    if session is None:  # no worker ever had its engine open: no run to resume, none left
        failed = [w for w in driver.workers if w.state == "failed"]
        causes = [w.cause for w in failed]
        if stopped_now or stop.requested:
            raise Interrupted(stop.signum or signal.SIGINT, "interrupted before any worker started; nothing written")
        if failed and all(isinstance(c, TpugenError) for c in causes) and len({_message(c) for c in causes}) == 1:
            raise type(causes[0])(_message(causes[0]))  # the same for every worker: a model that cannot load
        raise RunError(_gone_line(driver.workers, driver.run.config.execution.ray.max_restarts) + "; nothing written")
    if driver.manifest is not None:
        driver.manifest.close()
    run_dir = session.run_dir
    left = driver._left()
    if stopped_now or stop.requested:
        name = signal.Signals(stop.signum or signal.SIGINT).name
        error = f"interrupted by {name}"
    elif driver.failure:
        error = driver.failure
    elif left:
        error = _gone_line(driver.workers, driver.run.config.execution.ray.max_restarts)
    else:
        error = None
    report = driver.report(error)
    session.finish(report)
    if error is None:
        return report
    kept = f"{report['images']} of {report['images_planned']} images, the manifest and report.json are in {run_dir}"
    resume = f"resume with: tpugen resume {run_dir}"
    if stopped_now or stop.requested:
        when = "at once" if stopped_now else "after the batches in flight"
        raise Interrupted(stop.signum or signal.SIGINT, f"{error}, stopped {when}; {kept}", resume)
    if driver.failure:
        raise RunError(driver.failure, kept, resume)
    raise RunError(f"{error}: the run stopped; {kept}", resume)
