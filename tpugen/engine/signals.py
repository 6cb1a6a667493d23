"""The one stop mechanism: SIGINT/SIGTERM finish the batch in flight, a second signal stops at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from tpugen.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """The first SIGINT or SIGTERM is remembered (and passed to `on_signal`, e.g. to forward it to rank
    processes); work checks `check()` between batches. A second one raises KeyboardInterrupt: stop now.

    Handlers can only live in the main thread; elsewhere (rank threads, a server's workers) `install` does
    nothing and the stop is asked for with `request` by whoever owns the signal.
    """

    def __init__(self, on_signal: Callable[[int], None] | None = None, *, second_stops_now: bool = True) -> None:
        self.signum: int | None = None
        self.on_signal = on_signal
        # False: every signal goes to on_signal (a parent that forwards them to rank processes, which count).
        self.second_stops_now = second_stops_now
        self._previous: dict = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and self.second_stops_now:
            raise KeyboardInterrupt
        self.request(signum)

    def request(self, signum: int) -> None:
        """Ask for a stop after the batch in flight, as a first signal does."""
        if self.signum is None:
            self.signum = signum
        if self.on_signal is not None:
            self.on_signal(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def check(self) -> None:
        """Called between batches: stop here if a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum, f"interrupted by {self.name}")


# A rank process's own stop request: its ranks (threads, on XLA:CPU) check it between batches. Installed by
# the rank processes (tpugen.modes.rank) in their main thread.
PROCESS_STOP = StopSignals()
