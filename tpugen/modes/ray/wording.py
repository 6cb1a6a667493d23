"""What a ray run says of its failures: a worker's exception, every worker gone, a gs:// run directory refused."""

from __future__ import annotations

from tpugen.errors import TpugenError, one_line
from tpugen.modes.ray.worker import Worker


def _message(cause: BaseException) -> str:
    """A worker's exception in one line; tpugen's own errors come back across the process as their first line."""
    if isinstance(cause, TpugenError):
        return (str(cause).split("\n") or [type(cause).__name__])[0]
    return one_line(cause)


def _gone_line(workers: list[Worker], max_restarts: int) -> str:
    parts = []
    for w in workers:
        if w.state == "failed":
            parts.append(f"worker {w.index} could not start ({w.error})")
        else:
            times = f" {w.losses} times" if w.losses > 1 else ""
            parts.append(f"worker {w.index} lost{times}" + (f", restarted {w.restarts} times" if w.restarts else ""))
    return f"every Ray worker is gone ({'; '.join(parts)}; max_restarts: {max_restarts})"


def gs_refusal() -> str:
    try:
        import google.cloud.storage  # noqa: F401
    except ImportError:
        return (
            "output.dir: a gs:// run directory for execution.mode: ray is written with google-cloud-storage, which is "
            "not installed; give a path every worker sees (NFS, Filestore, a GCS FUSE mount)"
        )
    return (
        "output.dir: gs:// run directories are not written by execution.mode: ray yet; give a path every worker "
        "sees (NFS, Filestore, a GCS FUSE mount)"
    )
