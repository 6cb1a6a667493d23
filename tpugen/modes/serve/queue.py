"""The server's queue: images wait here until a device loop takes a batch of them (plain Python, no device).

Images whose batch key is the same (shape, steps, guidance, scheduler) coalesce into one static batch of the
compiled batch size within the batch window; a batch is padded to that size, never made a new shape.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """More requests than the server keeps waiting (serve.max_queue)."""


@dataclass(frozen=True)
class BatchKey:
    """Images with the same key can share a pipeline call."""

    height: int
    width: int
    cfg: bool
    steps: int
    guidance_scale: float
    scheduler: str | None  # None: the model's own
    loras: tuple = ()  # tpugen.config.loras.loras_key of the LoRAs fused for it: other sets never share a batch


@dataclass
class ImageJob:
    """One image a request asks for, and where its pixels go."""

    request: Request
    position: int  # its place among the request's images
    prompt: str
    negative_prompt: str
    seed: int
    key: BatchKey
    loras: tuple = ()  # the Lora objects the key names


@dataclass
class Request:
    """A request's images: done when every one has its pixels, when it fails as a whole, or (an interruptible
    one) when a client interrupts it."""

    images: int
    interruptible: bool = False  # the web UI's requests: /sdapi/v1/interrupt answers them with what they have
    created: float = field(default_factory=time.monotonic)
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
    """Requests' images by batch key, oldest first; device loops take batches of them."""

    def __init__(self, batch_size: int, window_seconds: float, max_requests: int) -> None:
        self.batch_size = batch_size
        self.window = window_seconds
        self.max_requests = max_requests
        self._waiting: OrderedDict[BatchKey, deque[ImageJob]] = OrderedDict()
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
            for job in jobs:
                self._waiting.setdefault(job.key, deque()).append(job)
            self._changed.notify_all()

    def settle(self, request: Request) -> None:
        """The request has its answer (or gave up): its images still waiting are dropped, its slot freed."""
        with self._changed:
            for key in list(self._waiting):
                kept = deque(job for job in self._waiting[key] if job.request is not request)
                if kept:
                    self._waiting[key] = kept
                else:
                    del self._waiting[key]
            self._open.discard(id(request))
            self._requests.pop(id(request), None)
            self._changed.notify_all()

    def depth(self) -> int:
        """Images waiting for a device."""
        with self._changed:
            return sum(len(jobs) for jobs in self._waiting.values())

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

    def take(self, timeout: float) -> tuple[BatchKey, list[ImageJob]] | None:
        """The next batch: of the keys that have a full batch or whose first image has waited the batch window,
        the one whose first image is oldest (so a busy key never starves a quiet one); None if nothing is ready
        within `timeout`, or the queue is closed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.closed:
                now = time.monotonic()
                wake = deadline
                ready = []
                for key, jobs in self._waiting.items():
                    due = jobs[0].request.created + self.window
                    if len(jobs) >= self.batch_size or now >= due:
                        ready.append((jobs[0].request.created, key))
                    else:
                        wake = min(wake, due)
                if ready:
                    key = min(ready, key=lambda entry: entry[0])[1]
                    jobs = self._waiting[key]
                    taken = [jobs.popleft() for _ in range(min(self.batch_size, len(jobs)))]
                    if not jobs:
                        del self._waiting[key]
                    return key, taken
                if now >= deadline:
                    return None
                self._changed.wait(wake - now)
            return None
