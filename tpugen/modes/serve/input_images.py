"""The images a request or a run sends: stored once under the server's output root, by their content."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tpugen.config.images import image_problem
from tpugen.errors import InputError
from tpugen.files import atomic_write_bytes
from tpugen.logs import logger

log = logger("serve")
MIB = 1 << 20


class InputImages:
    """The images requests and runs send, stored once under OUTPUT_ROOT/.inputs by their content and kept while
    something may read them: past `max_bytes` of them, the least recently used go, save those a queued or
    running run holds (`held()`: their paths) and those used within `keep_s` (a request's images: it waits at
    most serve.request_timeout_s, its batch then ends)."""

    def __init__(self, output_root: Path, *, max_bytes: int, keep_s: float, held: Callable[[], set[str]] = set) -> None:
        self.folder = output_root / ".inputs"
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self.held = held
        self._lock = threading.Lock()
        self._over = False  # past max_bytes with nothing to let go: said once, until it is under again

    def store(self, data: bytes, where: str) -> tuple[str, str]:
        """(path, sha256) of an image a request sent; an InputError naming `where` if it is no image tpugen can
        use. Stored again (by its content, so once) it counts as used now."""
        problem = image_problem(data)
        if problem:
            raise InputError(f"{where}: {problem}" if not problem.startswith("not") else f"{where}: is {problem}")
        digest = hashlib.sha256(data).hexdigest()
        path = self.folder / f"{digest}.img"
        with self._lock:
            try:
                os.utime(path)  # used now: the last to go
            except FileNotFoundError:
                self.folder.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data)
            self._make_room(keep=path)
        return str(path), digest

    def _make_room(self, keep: Path) -> None:
        entries = []
        with os.scandir(self.folder) as found:
            for entry in found:
                if entry.name.endswith(".img") and entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            self._over = False
            return
        held, now = self.held(), time.time()
        for used, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path == str(keep) or path in held or now - used < self.keep_s:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
        if total > self.max_bytes and not self._over:
            log.warning(
                f"input images: {total // MIB} MiB kept, past serve.max_input_mb ({self.max_bytes // MIB}): the "
                "rest are in use by runs and recent requests"
            )
        self._over = total > self.max_bytes


def data_uri_bytes(value, where: str) -> bytes:
    """The bytes of a run's image sent as a base64 data: URI (data:[TYPE];base64,DATA); InputError naming `where`
    for anything else, a path above all."""
    import base64
    import binascii

    header, comma, payload = value.partition(",") if isinstance(value, str) else ("", "", "")
    if not (header.startswith("data:") and header.endswith(";base64") and comma):
        raise InputError(f"{where}: send the image itself (a base64 data: URI); the server reads no paths")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: the data: URI's base64 does not decode") from None
