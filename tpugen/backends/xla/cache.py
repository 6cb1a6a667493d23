"""torch_xla's persistent compile cache: one per process, one directory per device kind and process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tpugen.errors import InputError

# The cache belongs to the process (torch_xla allows one per process), not to a rank.
_PROCESS_CACHE: dict = {}
_LOCK = threading.Lock()


def start_cache(torch_xla, enabled: bool | str, directory: str | None) -> dict:
    """Point torch_xla's persistent compile cache at its directory; what happened, for the report.

    It must happen before the first computation; XLA:CPU writes entries but cannot load them back, so `auto`
    leaves it off there rather than pretend.
    """
    pjrt = os.environ["PJRT_DEVICE"].upper()
    if enabled == "auto" and pjrt != "TPU":
        return {
            "enabled": False,
            "dir": None,
            "note": f"off: XLA:{pjrt} cannot load serialized executables, so a persistent cache never hits "
            "across processes (cache.enabled: true tries anyway)",
        }
    if enabled is False:
        return {"enabled": False, "dir": None, "note": "off (cache.enabled: false)"}
    with _LOCK:
        if _PROCESS_CACHE:  # another rank of this process set it up already
            return dict(_PROCESS_CACHE)
        if torch_xla._XLAC._xla_computation_cache_is_initialized():
            return {"enabled": False, "dir": None, "note": "off: the XLA runtime had already started in this process"}
        _PROCESS_CACHE.update(_open(torch_xla, directory, pjrt))
        return dict(_PROCESS_CACHE)


def _open(torch_xla, directory: str | None, pjrt: str) -> dict:
    from tpugen.settings import cache_root

    # The process's index among the host's XLA processes, read from what torch_xla.launch sets, so that
    # asking does not start the runtime before the cache is set up.
    process = int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))
    root = Path(directory) if directory else cache_root() / "xla"
    path = root / f"{pjrt.lower()}-process{process}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cache.dir: cannot create {path}: {exc.strerror}") from None
    torch_xla.runtime.initialize_cache(str(path), readonly=False)
    return {"enabled": True, "dir": str(path), "note": "on"}
