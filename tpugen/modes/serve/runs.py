"""Runs sent to the server (POST /v1/runs): each checked, then run in a thread of its own on the engine with the
fewest runs; found and listed while they run and, once ended, from their run directories."""

from __future__ import annotations

import signal
import threading
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from tpugen.config import ResolvedRun
from tpugen.config.schema import is_safe_run_id
from tpugen.engine import Display, Topology
from tpugen.errors import InputError, Interrupted, TpugenError, one_line
from tpugen.logs import logger
from tpugen.modes.serve.input_images import InputImages
from tpugen.modes.serve.refusals import Conflict, NotWarm, TooManyRuns
from tpugen.modes.serve.run_configs import resolve_run
from tpugen.modes.serve.run_handles import RunHandle, run_on_disk, runs_on_disk
from tpugen.modes.serve.warm import WarmEngines
from tpugen.outputs.run_dir import RUN_RECORD, run_id_for
from tpugen.plan import image_count, plan_run

log = logger("serve")


class SentRuns:
    """The server's runs: those queued or running in memory (`live`), the ended ones in its output root."""

    def __init__(self, warm: WarmEngines, *, output_root: Path, display: Display, inputs: InputImages) -> None:
        self.warm = warm
        self.output_root = output_root
        self.inputs = inputs  # where the input images runs send are stored
        self.display = display
        self.live: dict[str, RunHandle] = {}  # queued or running only: an ended run is read from its directory
        self._ended_unwritten: OrderedDict[str, RunHandle] = OrderedDict()  # ended before their directory existed
        self._lock = threading.Lock()

    def resolve(self, data: dict) -> ResolvedRun:
        """A client's run config under the server's model and way of running (run_configs.resolve_run). Its prompts
        are read with every embedding the engine holds (serve.embeddings_dir's too), as the engine encodes them."""
        run = resolve_run(data, self.warm.run, self.output_root, self.inputs.store)
        return replace(run, embeddings=self.warm.embeddings())

    def input_paths(self) -> set[str]:
        """The input images the runs queued or running read: kept while they may (InputImages)."""
        with self._lock:
            runs = [handle.run for handle in self.live.values() if handle.run is not None]
        return {path for run in runs for prompt in run.prompts for _, path, _ in prompt.files()}

    def start(self, data: dict) -> RunHandle:
        """A run config sent by a client, checked, then run in a thread on the engine with the fewest runs;
        TooManyRuns past serve.max_runs queued or running."""
        warm, serve = self.warm, self.warm.serve
        run = self.resolve(data)
        count, limit = image_count(run), serve.max_images_per_run
        if count > limit:
            raise InputError(
                f"the run plans {count} images; this server runs at most {limit} per run (serve.max_images_per_run)"
            )
        plan = plan_run(run)
        for batch in plan.batches:  # the checks a request's images meet, for each batch of the run (whose
            # model section is the server's: its scheduler is the one the engine loaded)
            if problems := warm.steps_problems(batch.steps, batch.hires, None, f"batch {batch.number}: "):
                raise InputError(*problems)
        if serve.new_shapes == "reject":
            engine = warm.engines[0]
            most_steps: dict = {}
            for batch in plan.batches:
                most_steps[batch.shape] = max(most_steps.get(batch.shape, 0), batch.steps)
            # Each step count its own program (engine.per_step_count): every count is checked, not the most.
            asked = {(b.shape, b.steps) for b in plan.batches} if engine.per_step_count else most_steps.items()
            cold = sorted(
                {engine.program_key(shape, steps) for shape, steps in asked if not engine.is_warm(shape, None, steps)}
            )
            if cold:
                raise NotWarm(
                    f"the run needs {', '.join(cold)}, not warm (serve.new_shapes: reject); warm: {warm.summary()}"
                )
        run_id = run_id_for(run)
        with self._lock:
            if not run.config.output.run_id:  # made here (a second's time and the config's hash): made unique
                made, number = run_id, 1
                while self._taken(run_id):
                    number += 1
                    run_id = f"{made}-{number}"
            run_dir = self.output_root / run_id
            if self._taken(run_id):
                raise Conflict(f"output.run_id: {run_id} exists on this server; choose another run_id")
            limit = serve.max_runs
            if len(self.live) >= limit:
                raise TooManyRuns(
                    f"{len(self.live)} runs are queued or running (serve.max_runs: {limit}); send it again when "
                    "one ends"
                )
            engines = len(warm.engines)
            engine = idlest([sum(h.engine == i for h in self.live.values()) for i in range(engines)])
            handle = RunHandle(run_id, run, run_dir, len(plan.items), engine=engine)
            # A daemon thread: a second signal ends the process under its batch in flight (stop() joins it).
            handle.thread = threading.Thread(
                target=self._execute, args=(handle,), name=f"tpugen-run-{run_id}", daemon=True
            )
            self.live[run_id] = handle
        handle.thread.start()
        log.info(f"run {run_id}: {handle.planned} images on engine {engine} of {engines}")
        return handle

    def _taken(self, run_id: str) -> bool:
        """Whether a run of the server has `run_id` (queued, running, or on disk); under _lock."""
        run_dir = self.output_root / run_id
        return run_id in self.live or run_id in self._ended_unwritten or (run_dir.exists() and any(run_dir.iterdir()))

    def find(self, run_id: str) -> RunHandle | None:
        """A run of this server: queued or running, else ended, read back from its run directory. None for an id
        no run can have (too long for a folder name, a path)."""
        if not is_safe_run_id(run_id):
            return None
        with self._lock:
            handle = self.live.get(run_id)
            unwritten = self._ended_unwritten.get(run_id)
        return handle or run_on_disk(self.output_root, run_id) or unwritten

    def page(self, limit: int, after: str | None = None) -> tuple[list[RunHandle], str | None]:
        """(a page of `limit` of this server's runs, newest first, the id to ask for the next page after; None
        on the last page). The runs queued or running, and those in its output directory (by when each
        started: run.json's time). `after`: the last id of the page before."""
        with self._lock:
            live = {handle.id: handle.created for handle in self.live.values()}
        started = {**live, **runs_on_disk(self.output_root)}
        order = sorted(started, key=lambda run_id: (-started[run_id], run_id))
        if after is not None:
            if after not in started:
                raise InputError(f"after: no run {after!r} on this server")
            order = order[order.index(after) + 1 :]
        page = order[:limit]
        handles = [handle for handle in map(self.find, page) if handle is not None]
        return handles, page[-1] if len(order) > limit else None

    def _execute(self, handle: RunHandle) -> None:
        from tpugen.modes.single import run_single

        engine = self.warm.engines[handle.engine]
        handle.state = "running"
        try:
            engine.backend.bind_thread()
            handle.report = run_single(
                handle.run,
                engine=engine,
                topology=Topology(),
                stop=handle.stop,
                display=self.display,
                run_id=handle.id,
            )
            handle.state = "complete"
        except Interrupted as exc:
            handle.state, handle.error = "stopped", exc.lines
        except TpugenError as exc:
            handle.state, handle.error = "failed", exc.lines
        except BaseException as exc:
            handle.state, handle.error = "failed", [one_line(exc)]
        finally:
            self._forget(handle)
        log.info(f"run {handle.id} {handle.state}")

    def _forget(self, handle: RunHandle) -> None:
        """An ended run leaves memory: its run directory answers for it. One that ended before it had one (it
        failed as it started) is kept, the last few of them, to say why."""
        with self._lock:
            self.live.pop(handle.id, None)
            if not (handle.run_dir / RUN_RECORD).is_file():
                self._ended_unwritten[handle.id] = handle
                while len(self._ended_unwritten) > 16:
                    self._ended_unwritten.popitem(last=False)

    def stop(self, run_id: str) -> RunHandle | None:
        """Stop a queued or running run after its batch in flight (resumable); None if none is."""
        with self._lock:
            handle = self.live.get(run_id)
        if handle is not None:
            handle.stop.request(signal.SIGTERM)
        return handle

    def stop_all(self) -> None:
        """Every queued or running run stops after its batch in flight (resumable)."""
        with self._lock:
            for handle in self.live.values():
                handle.stop.request(signal.SIGTERM)

    def open_count(self) -> int:
        """How many runs are queued or running."""
        with self._lock:
            return len(self.live)

    def threads(self) -> list[threading.Thread]:
        """The threads of the runs queued or running."""
        with self._lock:
            return [handle.thread for handle in self.live.values() if handle.thread is not None]


def idlest(runs_per_engine: list[int]) -> int:
    """The engine a new run goes to: the one with the fewest runs, the first of those tied."""
    return min(range(len(runs_per_engine)), key=lambda i: (runs_per_engine[i], i))
