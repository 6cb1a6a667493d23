"""manifest.jsonl: one JSON line per image, appended and fsynced after each batch, read back leniently."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpugen.files import atomic_write_text
from tpugen.lines import text_lines


class Manifest:
    """manifest.jsonl: one JSON line per image, appended and fsynced after each batch."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = open(path, "a", encoding="utf-8")

    def append(self, records: list[dict]) -> None:
        self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()


def read_manifest(path: Path) -> list[dict]:
    """The manifest's image records; a torn last line (a crash mid-write), or a line that is not a record, is
    skipped."""
    records = []
    for line in text_lines(read_text_lenient(path)):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and type(record.get("index")) is int:  # anything else is not an image's
            records.append(record)
    return records


def read_text_lenient(path: Path) -> str:
    """A manifest's text. A crash (or a read while a rank appends) can cut a line inside a multi-byte
    character: that byte run becomes U+FFFD, so only the torn line fails to parse, not the whole file."""
    return path.read_bytes().decode("utf-8", errors="replace")


def rewrite_manifest(run_dir: Path, records: dict[int, dict]) -> None:
    """Replace the manifest with these records in index order (drops torn lines and missing images)."""
    lines = "".join(json.dumps(records[i], ensure_ascii=False) + "\n" for i in sorted(records))
    atomic_write_text(run_dir / "manifest.jsonl", lines)
