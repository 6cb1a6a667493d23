"""Writing files that are whole or absent: a temporary name, fsync, rename; ordinary modes; inside a folder (a run)."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path


def inside(run_dir: Path, name: str) -> Path:
    """`run_dir / name`, refusing any name that would land outside the run directory."""
    path = (run_dir / name).resolve()
    if path.parent != run_dir.resolve():
        raise ValueError(f"refusing to write {name!r} outside {run_dir}")
    return path


def _new_file_mode() -> int:
    """The mode an ordinary new file gets under this process's umask (0644 under 022).

    Read once, at import: os.umask can only be read by setting it, which must not race with rank threads
    that create files."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


NEW_FILE_MODE = _new_file_mode()


def atomic_write_bytes(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write via a temporary file in the same directory, then rename: a crash leaves all or nothing.

    The temporary file is private (0600) while it is written; it gets an ordinary file's mode before the rename.
    `exclusive`: FileExistsError if `path` exists, decided atomically (a hard link never replaces), so of two
    processes creating the same file one wins; where the file system has no hard links, a plain rename.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, NEW_FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            _link_or_rename(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _link_or_rename(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)  # FileExistsError if another process made it first
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some FUSE and object-store mounts)
        if path.exists():
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def atomic_write_text(path: Path, text: str, *, exclusive: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), exclusive=exclusive)


def write_json(path: Path, data: object, *, exclusive: bool = False) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n", exclusive=exclusive)


def read_json_object(path: Path) -> dict:
    """A JSON object kept in a file (a cache's), or {} where the file is missing, unreadable or holds no object."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
