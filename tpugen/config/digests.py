"""The sha256 of large model files, read once per file version: kept in tpugen's cache by path, inode, size and
change time, so a ControlNet's gigabytes are not read again at every check of the config that names it."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

from tpugen.files import read_json_object, write_json
from tpugen.settings import cache_root

KEPT = 512  # entries the cache keeps (the newest)
# A file changed this recently may change again within the filesystem's timestamp tick: its digest is not kept.
SETTLED_S = 2.0
_LOCK = threading.Lock()  # the cache file is read and replaced by one thread of a process at a time
_KNOWN: dict[str, str] = {}  # this process's digests, by key


def _cache_file() -> Path:
    return cache_root() / "file-sha256.json"


def _key(path: Path, stat: os.stat_result) -> str:
    return f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"


def file_sha256(path: Path) -> str | None:
    """The file's sha256 (None: it is gone or unreadable), from the cache while it is the same file version (its
    inode, size, modification and change times)."""
    try:
        with path.open("rb") as handle:
            before = os.fstat(handle.fileno())
            key = _key(path, before)
            with _LOCK:
                known = _KNOWN.get(key) or _read().get(key)
            if isinstance(known, str):
                return known
            digest = hashlib.sha256()
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
            after = os.fstat(handle.fileno())
    except OSError:
        return None
    found = digest.hexdigest()
    changed = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns)
    if not changed and time.time() - after.st_mtime > SETTLED_S:
        with _LOCK:
            _KNOWN[key] = found
            _write({**_read(), key: found})
    return found


def _read() -> dict:
    return read_json_object(_cache_file())


def _write(cached: dict) -> None:
    """The newest KEPT entries, written whole (a lost write, or a cache folder that cannot be written, only means
    reading the file again next time)."""
    target = _cache_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json(target, dict(list(cached.items())[-KEPT:]))
    except OSError:
        pass
