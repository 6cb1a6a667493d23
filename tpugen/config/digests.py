"""The sha256 of large model files, read once per file version: kept in tpugen's cache by path, size and mtime, so a
ControlNet's gigabytes are not read again at every check of the config that names it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tpugen.settings import cache_root

KEPT = 512  # entries the cache keeps (the newest)


def _cache_file() -> Path:
    return cache_root() / "file-sha256.json"


def file_sha256(path: Path) -> str | None:
    """The file's sha256 (None: it is gone or unreadable), from the cache while its size and mtime are the same."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        cached = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if isinstance(cached.get(key), str):
        return cached[key]
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    except OSError:
        return None
    cached[key] = digest.hexdigest()
    kept = dict(list(cached.items())[-KEPT:])
    try:  # a lost write only means reading the file again next time
        target = _cache_file()
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(kept))
        os.replace(scratch, target)
    except OSError:
        pass
    return cached[key]
