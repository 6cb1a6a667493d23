"""Which XLA devices a process gets, set up before the runtime starts, and how torch_xla.launch starts ranks."""

from __future__ import annotations

import glob
import os

from tpugen.errors import InputError


def tpu_present() -> bool:
    """A TPU VM exposes its chips as /dev/accel* (v4, v5p) or VFIO devices (v5e, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def pjrt_device() -> str:
    """The PJRT device torch_xla will use here: PJRT_DEVICE, else TPU where this VM has chips, else CPU."""
    return os.environ.get("PJRT_DEVICE", "TPU" if tpu_present() else "CPU").upper()


def choose_pjrt_device() -> str:
    """PJRT_DEVICE, said by us when unset, so torch_xla does not guess (and warn) on a machine without a TPU."""
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = pjrt_device()
    return os.environ["PJRT_DEVICE"].upper()


def use_devices(cores: int, what: str) -> None:
    """Before the runtime starts: on XLA:CPU, `cores` devices; on a TPU VM every chip, so cores must be 0."""
    if choose_pjrt_device() == "CPU" and cores > 0:
        os.environ["CPU_NUM_DEVICES"] = str(cores)
    elif cores > 0:
        raise InputError(f"execution.cores: on a TPU VM {what} uses every chip; set cores: 0 (got {cores})")


def import_torch_xla():
    """torch_xla, or the one-line error that says how to install it."""
    choose_pjrt_device()
    try:
        import torch_xla
        import torch_xla.runtime  # noqa: F401
    except ImportError as exc:
        raise InputError(
            f"execution.backend: xla needs torch_xla ({exc}); install tpugen[tpu] on a TPU VM or tpugen[xla] elsewhere"
        ) from None
    return torch_xla


def host_index() -> int:
    """This TPU VM's index in its pod, as torch_xla reads it from the TPU environment. Off a TPU there is no pod
    to stand in (torch_xla says 0 on any machine), so a worker count above one with no index is refused there."""
    device = pjrt_device()
    if device != "TPU":
        raise InputError(
            f"execution.pod: this worker's index is unknown: TPU_WORKER_ID is unset and PJRT_DEVICE={device} has no "
            "pod host index; set execution.pod.worker_index or TPU_WORKER_ID"
        )
    import torch_xla.runtime as xr

    return xr.host_index()


def launch_ranks(fn, args: tuple, cores: int) -> None:
    """Run fn(index, *args) once per local XLA device with torch_xla.launch.

    On a TPU VM that is one process per chip; on XLA:CPU, CPU_NUM_DEVICES devices driven by threads of one
    child process. `cores` > 0 sets how many CPU devices; on TPU every chip is used.
    """
    use_devices(cores, "tpugen")
    import_torch_xla().launch(fn, args=args)


def rank_position() -> tuple[int, int, int]:
    """(this rank's ordinal, the world size, ranks in this process), as a torch_xla.launch rank sees them."""
    import torch_xla.runtime as xr

    return xr.global_ordinal(), xr.world_size(), xr.addressable_device_count()


def local_device_count() -> int:
    """The XLA devices this process drives (on XLA:CPU, CPU_NUM_DEVICES; on a TPU VM, its chips)."""
    return import_torch_xla().runtime.addressable_device_count()
