"""Progress per job (an image request or a run), in one place: its counts, its state and its numbered events."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

ENDED = ("complete", "interrupted", "stopped", "failed")  # a job in one of these states changes no more


@dataclass(frozen=True)
class Event:
    """One server-sent event of a job: `progress` (its counts) or `end` (its final status); ids increase."""

    id: int
    name: str
    data: dict


@dataclass
class Job:
    """A job's progress. `step` is the denoising step of its batch on a device, counted as each step is handed to
    the device (a request's batches; nothing is read back to know it), and `steps` once a batch of it is done;
    a run's is counted per batch from its manifest."""

    kind: str  # "request" (an A1111 or OpenAI request) or "run" (POST /v1/runs)
    name: str  # a request's task id (A1111 force_task_id) or request id; a run's id
    images_planned: int
    steps: int
    images_done: int = 0
    step: int = 0
    images_in_flight: int = 0  # its images in the batch on a device now
    state: str = "queued"  # queued, running, then one of ENDED
    error: str | None = None
    summary: dict | None = None  # a run's report, in brief, once it ends
    created: float = field(default_factory=time.monotonic)
    timestamp: str = field(default_factory=lambda: time.strftime("%Y%m%d%H%M%S"))  # the web UI's job_timestamp
    started: float | None = None
    ended: float | None = None
    watch: object = None  # what the job's counts are read from, for a run (tpugen.modes.serve.runs_api)
    events: deque[Event] = field(default_factory=deque)
    last_id: int = 0
    serial: int = -1  # its place among the jobs opened (Jobs keeps it)

    @property
    def done(self) -> bool:
        return self.state in ENDED

    @property
    def fraction(self) -> float:
        """How much of it is done, 0 to 1: its images made, and of those on a device the share of steps handed
        to it."""
        if not self.images_planned:
            return float(self.done)
        going = self.images_in_flight * self.step / self.steps if self.steps and self.images_in_flight else 0.0
        return min(1.0, (self.images_done + going) / self.images_planned)

    def eta(self) -> float | None:
        """Seconds left at the pace so far, once it has started and made something; else None."""
        if self.done:
            return 0.0
        if self.started is None or not self.images_done:
            return None
        elapsed = time.monotonic() - self.started
        return elapsed / self.fraction - elapsed

    def counts(self) -> dict:
        return {
            "state": self.state,
            "images_done": self.images_done,
            "images_planned": self.images_planned,
            "step": self.step,
            "steps": self.steps,
        }


class Jobs:
    """Every open job, and the last finished ones: a finished job is forgotten once `keep_finished` newer
    ones have finished or `keep_seconds` have passed, and a job keeps its last `events_per_job` events, so
    memory stays flat however long the server runs. Thread-safe: device loops, request threads and the event
    loop all call it."""

    def __init__(self, *, keep_finished: int = 256, keep_seconds: float = 900.0, events_per_job: int = 64) -> None:
        self.keep_finished = keep_finished
        self.keep_seconds = keep_seconds
        self.events_per_job = events_per_job
        self._lock = threading.Lock()
        self._open: dict[int, Job] = {}
        self._finished: OrderedDict[int, Job] = OrderedDict()  # oldest end first
        self._named: dict[tuple[str, str], Job] = {}  # the latest job of each name
        self._serial = itertools.count()

    def open(
        self, kind: str, name: str, *, images_planned: int, steps: int, state: str = "queued", watch: object = None
    ) -> Job:
        """A new job (queued, or running already); it takes over the name from an older job of its kind and name."""
        job = Job(kind, name, images_planned, steps, state=state, watch=watch)
        job.started = time.monotonic() if state == "running" else None
        job.events = deque(maxlen=self.events_per_job)
        with self._lock:
            self._forget_old()
            job.serial = next(self._serial)
            self._open[job.serial] = job
            self._named[(kind, name)] = job
            self._add(job, "progress", job.counts())
        return job

    def start(self, job: Job) -> None:
        """Its first batch is on a device."""
        with self._lock:
            if job.state == "queued":
                job.state, job.started = "running", time.monotonic()
                self._add(job, "progress", job.counts())

    def stepped(self, job: Job, step: int, images: int) -> None:
        """Step `step` of the batch holding `images` of its images is on the device."""
        with self._lock:
            if job.done:
                return
            if job.started is None:
                job.started = time.monotonic()
            job.state, job.step, job.images_in_flight = "running", min(step, job.steps), images
            self._add(job, "progress", job.counts())

    def advance(self, job: Job, images: int) -> None:
        """`images` more of its images are made (a batch of them: every step of it done)."""
        with self._lock:
            if job.done:
                return
            if job.started is None:
                job.started = time.monotonic()
            job.state = "running"
            job.images_done = min(job.images_done + images, job.images_planned)
            job.step, job.images_in_flight = job.steps, 0
            self._add(job, "progress", job.counts())

    def observe(self, job: Job, *, images_done: int, state: str) -> None:
        """What a job's own records say of it (a run's manifest): a progress event when that changed."""
        with self._lock:
            if job.done:
                return
            if state == "running" and job.started is None:
                job.started = time.monotonic()
            counts = (min(images_done, job.images_planned), job.steps if images_done else 0, state)
            if counts != (job.images_done, job.step, job.state):
                job.images_done, job.step, job.state = counts
                self._add(job, "progress", job.counts())

    def end(self, job: Job, status: str, *, error: str | None = None, summary: dict | None = None) -> None:
        """It is over (`status` one of ENDED); its `end` event is its last."""
        assert status in ENDED, status
        with self._lock:
            if job.done:
                return
            job.state, job.error, job.summary, job.ended = status, error, summary, time.monotonic()
            job.watch = None  # what it was read from (a run's handle and config) leaves memory with it
            self._add(job, "end", {**job.counts(), "status": status, "error": error, "summary": summary})
            self._open.pop(job.serial, None)
            self._finished[job.serial] = job
            self._forget_old()

    def find(self, kind: str, name: str) -> Job | None:
        """A copy of the latest job of that name, open or not yet forgotten (its events left out)."""
        with self._lock:
            self._forget_old()
            job = self._named.get((kind, name))
            return replace(job, events=deque()) if job is not None else None

    def live(self, kind: str, name: str) -> Job | None:
        """The latest job of that name itself, for whoever reports on it (a run's events route)."""
        with self._lock:
            self._forget_old()
            return self._named.get((kind, name))

    def open_jobs(self, kind: str) -> list[Job]:
        """The open jobs of `kind` themselves, oldest first."""
        with self._lock:
            return [job for job in self._open.values() if job.kind == kind]

    def current(self, kind: str) -> Job | None:
        """A copy of the open job of `kind` being worked on that started last, else of the one that was queued
        last; None when none is open."""
        with self._lock:
            jobs = [job for job in self._open.values() if job.kind == kind]
            running = [job for job in jobs if job.state == "running"]
            if running:
                chosen = max(running, key=lambda job: job.started or 0.0)
            elif jobs:
                chosen = max(jobs, key=lambda job: job.serial)
            else:
                return None
            return replace(chosen, events=deque())

    def events_after(self, job: Job, last_id: int | None) -> list[Event]:
        """The events a client that saw `last_id` (None: none) has not: those kept after it. An id newer than
        any this job has (a client of a job since forgotten and opened again) gets the job's latest events."""
        with self._lock:
            events = list(job.events)
        if last_id is None:
            return events
        if last_id > job.last_id:
            return [event for event in events if event.name == "end" or event is _last(events, "progress")]
        return [event for event in events if event.id > last_id]

    def sizes(self) -> tuple[int, int]:
        """(open jobs, finished jobs kept): what memory holds."""
        with self._lock:
            self._forget_old()
            return len(self._open), len(self._finished)

    def _add(self, job: Job, name: str, data: dict) -> None:
        if name == "progress":
            previous = _last(job.events, "progress")
            if previous is not None and previous.data == data:
                return  # nothing changed
        job.last_id += 1
        job.events.append(Event(job.last_id, name, dict(data)))

    def _forget_old(self) -> None:
        """Under the lock: finished jobs past the bounds leave."""
        horizon = time.monotonic() - self.keep_seconds
        while self._finished:
            key, job = next(iter(self._finished.items()))
            if len(self._finished) <= self.keep_finished and job.ended >= horizon:
                break
            del self._finished[key]
            if self._named.get((job.kind, job.name)) is job:
                del self._named[(job.kind, job.name)]


def _last(events, name: str) -> Event | None:
    return next((event for event in reversed(events) if event.name == name), None)
