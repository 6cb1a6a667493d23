"""Where a denoising step's time goes: the host's share (recording and handing the step to the device) and the
device's, measured in every pipeline call at almost no cost to the step loop."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """One pipeline call's denoising steps: the host's median per step and the device's mean per step (None where
    the backend cannot tell)."""

    steps: int
    host_ms_per_step: float | None
    device_ms_per_step: float | None

    def as_dict(self) -> dict:
        return {"host_ms_per_step": self.host_ms_per_step, "device_ms_per_step": self.device_ms_per_step}


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class StepClock:
    """Host time per step: from one step's hand-off to the device (its sync returned, which does not wait for the
    device) to the next one's, the first step counted from the loop's start. Device time per step: the device's
    execution seconds over the loops (read from the backend's counters with the device idle at each end: one wait
    where a loop starts and one where it ends, none inside it), over their steps. Each execution counts from its
    dispatch to its completion, so where executions queue behind each other (the host ahead of the device) their
    sum passes the time the device was busy; it can never be busy longer than the loop took, so the figure is
    the smaller of the two: exact while the device waits on the host, the loop's own time while the host waits on
    the device.

    A denoising loop may run more than once in a call (hires fix's second pass): the figures cover every loop.
    `device_measured` False: the backend's counters count other engines' work too (a server's engines per device
    in one process), so the device's figure is None, not theirs added to this one's."""

    def __init__(self, backend, *, device_measured: bool = True) -> None:
        self._backend = backend
        self._host: list[float] = []
        self._last: float | None = None
        self._device = 0.0
        self._device_known = device_measured
        self._loop_started_at: float | None = None  # the device's execution seconds where the running loop started

    def loop_started(self) -> None:
        self._backend.wait()
        self._loop_started_at = self._execute_seconds()
        self._last = self._loop_wall_start = time.perf_counter()

    def step_handed_off(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._host.append(now - self._last)
        self._last = now

    def loop_ended(self) -> None:
        if self._loop_started_at is None:
            return
        self._backend.wait()
        end, wall = self._execute_seconds(), time.perf_counter() - self._loop_wall_start
        if end is None or self._loop_started_at is None:
            self._device_known = False
        else:
            self._device += min(end - self._loop_started_at, wall)
        self._loop_started_at, self._last = None, None

    def whole_loop(self, steps: int, handed_off: float, finished: float) -> None:
        """A loop handed to the device as one call (a backend that runs whole loops): the host's share of each step
        is the hand-off's seconds over the steps; the device's, the seconds from the hand-off to the loop's end."""
        if steps <= 0:
            return
        self._host.extend([handed_off / steps] * steps)
        self._device += finished
        self._loop_started_at, self._last = None, None

    def _execute_seconds(self) -> float | None:
        counters = self._backend.counters()
        return None if counters is None else counters.execute_seconds

    def timing(self) -> StepTiming:
        steps = len(self._host)
        host = median(self._host)
        device = self._device / steps if steps and self._device_known and self._device > 0 else None
        return StepTiming(
            steps,
            None if host is None else host * 1000.0,
            None if device is None else device * 1000.0,
        )
