"""The server's queue: a request's images (ImageJob) wait here until a device loop takes a batch of them (plain
Python, no device).

Images whose batch key is the same (shape, steps, guidance, scheduler) coalesce into one static batch of the
compiled batch size within the batch window; a batch is padded to that size, never made a new shape. Clients
take turns (round-robin, each client's images in the order it sent them), so one client's thousand images
never hold back another's one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tpugen.plan import ImageWork, WorkItem


class QueueFull(Exception):
    """More requests than the server keeps waiting (serve.max_queue)."""


@dataclass
class ImageJob:
    """One image a request asks for, and where its pixels go."""

    request: Request
    position: int  # its place among the request's images
    work: ImageWork  # as admission completed it (tpugen.modes.serve.admission.Admission.work_for)

    @property
    def key(self) -> tuple:
        """Jobs of one key can share a pipeline call (ImageWork.call_key)."""
        return self.work.call_key

    def work_item(self, index: int) -> WorkItem:
        """The image as row `index` of its batch."""
        return WorkItem.at(self.work, index=index)


@dataclass
class Request:
    """A request's images: done when every one has its pixels, when it fails as a whole, or (an interruptible
    one) when a client interrupts it."""

    images: int
    interruptible: bool = False  # the web UI's requests: /sdapi/v1/interrupt answers them with what they have
    client: str = ""  # who sent it (tpugen.modes.serve.request_ids.client_of): clients take turns
    job: object = None  # its progress record (tpugen.modes.serve.progress.Job), for whoever counts its images
    on_start: Callable[[], None] | None = None  # called once, when its first image is taken for a batch
    created: float = field(default_factory=time.monotonic)
    started: bool = False
    pixels: dict[int, object] = field(default_factory=dict)
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event)

    def deliver(self, position: int, pixels) -> None:
        self.pixels[position] = pixels
        if len(self.pixels) == self.images:
            self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def finish(self) -> None:
        """Done with whatever it has (an interrupt: the images made so far)."""
        self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()


class BatchQueue:
    """Requests' images by client, each client's in the order it sent them; device loops take batches of them,
    the clients taking turns."""

    def __init__(self, batch_size: int, window_seconds: float, max_requests: int) -> None:
        self.batch_size = batch_size
        self.window = window_seconds
        self.max_requests = max_requests
        # Each client's waiting images, oldest first; the clients in turn order (the next one to be served first).
        self._clients: OrderedDict[str, deque[ImageJob]] = OrderedDict()
        self._open: set[int] = set()  # ids of requests that are waiting or running
        self._requests: dict[int, Request] = {}
        self._changed = threading.Condition()
        self.closed = False

    def submit(self, request: Request, jobs: list[ImageJob]) -> None:
        """Queue a request's images; QueueFull when max_requests are open already."""
        with self._changed:
            if len(self._open) >= self.max_requests:
                raise QueueFull(f"{len(self._open)} requests are waiting or running (serve.max_queue)")
            self._open.add(id(request))
            self._requests[id(request)] = request
            if jobs:
                # A client new to the queue waits its turn after those already waiting.
                self._clients.setdefault(request.client, deque()).extend(jobs)
            self._changed.notify_all()

    def settle(self, request: Request) -> None:
        """The request has its answer (or gave up): its images still waiting are dropped, its slot freed."""
        with self._changed:
            waiting = self._clients.get(request.client)
            if waiting is not None:
                kept = deque(job for job in waiting if job.request is not request)
                if kept:
                    self._clients[request.client] = kept
                else:
                    del self._clients[request.client]
            self._open.discard(id(request))
            self._requests.pop(id(request), None)
            self._changed.notify_all()

    def depth(self) -> int:
        """Images waiting for a device."""
        with self._changed:
            return sum(len(jobs) for jobs in self._clients.values())

    def open_count(self) -> int:
        """Requests waiting or running: what serve.max_queue counts."""
        with self._changed:
            return len(self._open)

    def open_requests(self) -> list[Request]:
        with self._changed:
            return list(self._requests.values())

    def interrupt(self) -> int:
        """Every open interruptible request is done with the images it has (those not started are dropped when
        it settles); returns how many there were."""
        with self._changed:
            requests = [r for r in self._requests.values() if r.interruptible and not r.done]
        for request in requests:
            request.finish()
        return len(requests)

    def close(self) -> None:
        """No more batches: device loops waiting in take() return None."""
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def take(self, timeout: float) -> tuple[tuple, list[ImageJob]] | None:
        """The next batch, or None if nothing is ready within `timeout` or the queue is closed.

        A key is ready when it has a full batch or its oldest image has waited the batch window. The clients
        take turns: the first client in turn order with an image of a ready key gets its oldest such image's key
        served, and the batch is filled with images of that key from every client, one client at a time from
        that one on (each client's in the order it sent them). Every client served goes to the back of the turn
        order."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.closed:
                now = time.monotonic()
                chosen, wake = self._choose(now)
                if chosen is not None:
                    taken = self._fill(*chosen)
                    break
                if now >= deadline:
                    return None
                self._changed.wait(min(wake, deadline) - now)
            else:
                return None
        starting = [job.request for job in taken if not job.request.started]
        for request in starting:
            if not request.started:
                request.started = True
                if request.on_start is not None:
                    request.on_start()
        return chosen[1], taken

    def _choose(self, now: float) -> tuple[tuple[str, tuple] | None, float]:
        """(the client whose turn it is and the key it is served, or None; when a key next becomes ready)."""
        count: dict[tuple, int] = {}
        oldest: dict[tuple, float] = {}
        for jobs in self._clients.values():
            for job in jobs:
                count[job.key] = count.get(job.key, 0) + 1
                oldest[job.key] = min(oldest.get(job.key, job.request.created), job.request.created)
        ready = {key for key in count if count[key] >= self.batch_size or now >= oldest[key] + self.window}
        for client, jobs in self._clients.items():
            for job in jobs:
                if job.key in ready:
                    return (client, job.key), now
        return None, min((oldest[key] + self.window for key in count), default=float("inf"))

    def _fill(self, first: str, key: tuple) -> list[ImageJob]:
        """A batch of `key`, one image per client in turn from `first` on; those clients go to the back."""
        order = list(self._clients)
        order = order[order.index(first) :] + order[: order.index(first)]
        offers = {client: deque(job for job in self._clients[client] if job.key == key) for client in order}
        taken: list[ImageJob] = []
        served: list[str] = []
        while len(taken) < self.batch_size and any(offers.values()):
            for client in order:
                if offers[client] and len(taken) < self.batch_size:
                    taken.append(offers[client].popleft())
                    if client not in served:
                        served.append(client)
        chosen = {id(job) for job in taken}
        for client in served:
            kept = deque(job for job in self._clients.pop(client) if id(job) not in chosen)
            if kept:
                self._clients[client] = kept  # to the back of the turn order
        return taken
