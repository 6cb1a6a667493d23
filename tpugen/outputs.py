"""What a run leaves on disk: images with their parameters, the manifest, and atomic file writes."""

from __future__ import annotations

import io
import json
import math
import os
import re
import tempfile
import unicodedata
from pathlib import Path

from PIL import Image, PngImagePlugin

from tpugen.lines import text_lines

SLUG_MAX = 40
GRID_MAX_IMAGES = 64
GRID_CELL_MAX = 256


def slug(prompt: str) -> str:
    """ASCII lowercase words joined by '-', at most 40 characters; never a separator, '..' or leading dot."""
    ascii_text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode("ascii").lower()
    words = re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")
    return words[:SLUG_MAX].rstrip("-") or "image"


def image_filename(index: int, seed: int, prompt: str) -> str:
    return f"{index:05d}-{seed}-{slug(prompt)}.png"


def inside(run_dir: Path, name: str) -> Path:
    """`run_dir / name`, refusing any name that would land outside the run directory."""
    path = (run_dir / name).resolve()
    if path.parent != run_dir.resolve():
        raise ValueError(f"refusing to write {name!r} outside {run_dir}")
    return path


def _one_line(text: str) -> str:
    """Line breaks (any that a reader may split on) as spaces: the web UI's text format has no escape, so a
    prompt holding one could forge the negative prompt or the settings line. The exact text stays in the
    `tpugen` chunk and the manifest."""
    return " ".join(text.splitlines())


def _a1111_value(value: object) -> str:
    text = str(value)
    # The format splits on ", " and ": ", so a value holding either (or a newline) is JSON-quoted.
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def a1111_parameters(record: dict) -> str:
    """The `parameters` text that AUTOMATIC1111-compatible tools read from a PNG."""
    lines = [_one_line(record["prompt"])]
    if record.get("negative_prompt"):
        lines.append(f"Negative prompt: {_one_line(record['negative_prompt'])}")
    fields = {
        "Steps": record["steps"],
        "Sampler": record["scheduler"],
        "CFG scale": record["guidance_scale"],
        "Seed": record["seed"],
        "Size": f"{record['width']}x{record['height']}",
        "Model": record["model"],
        "Version": f"tpugen {record['tpugen_version']}",
    }
    lines.append(", ".join(f"{key}: {_a1111_value(value)}" for key, value in fields.items()))
    return "\n".join(lines)


def _new_file_mode() -> int:
    """The mode an ordinary new file gets under this process's umask (0644 under 022).

    Read once, at import: os.umask can only be read by setting it, which must not race with rank threads
    that create files."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


NEW_FILE_MODE = _new_file_mode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory, then rename: a crash leaves all or nothing.

    The temporary file is private (0600) while it is written; it gets an ordinary file's mode before the rename.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, NEW_FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data: object) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def save_png(path: Path, image: Image.Image, record: dict) -> None:
    """Save with a `parameters` tEXt chunk (A1111 format) and a `tpugen` chunk holding the full record."""
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", a1111_parameters(record))
    info.add_text("tpugen", json.dumps(record, ensure_ascii=False))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    atomic_write_bytes(path, buffer.getvalue())


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
    for line in text_lines(path.read_text(encoding="utf-8")):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and type(record.get("index")) is int:  # anything else is not an image's
            records.append(record)
    return records


def contact_sheet(paths: list[Path]) -> Image.Image | None:
    """A grid of the first 64 images, each cell at most 256 px on its longer side."""
    paths = paths[:GRID_MAX_IMAGES]
    if not paths:
        return None
    images = [Image.open(p).convert("RGB") for p in paths]
    cell_w = max(im.width for im in images)
    cell_h = max(im.height for im in images)
    scale = min(1.0, GRID_CELL_MAX / max(cell_w, cell_h))
    cell_w, cell_h = max(1, int(cell_w * scale)), max(1, int(cell_h * scale))
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), "black")
    for i, im in enumerate(images):
        im.thumbnail((cell_w, cell_h))
        sheet.paste(im, ((i % cols) * cell_w, (i // cols) * cell_h))
    return sheet
