"""What the server refuses work with, beyond a bad input: each error's HTTP status is in its docstring."""

from __future__ import annotations

from tpugen.errors import InputError, TpugenError


class NotReady(TpugenError):
    """The server is warming up or shutting down (503)."""


class NotWarm(InputError):
    """A request for a shape or scheduler the server has not compiled, under serve.new_shapes: reject (422)."""


class TimedOut(TpugenError):
    """A request that waited longer than serve.request_timeout_s (504)."""


class Conflict(InputError):
    """A run id that is taken (409)."""


class TooManyRuns(TpugenError):
    """serve.max_runs runs are queued or running already (429)."""
