"""grid.png: a contact sheet of the first images of a run."""

from __future__ import annotations

import io
import math
from pathlib import Path

from PIL import Image

from tpugen.files import atomic_write_bytes

GRID_MAX_IMAGES = 64
GRID_CELL_MAX = 256


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


def write_grid(run_dir: Path, images: list[Path]) -> None:
    sheet = contact_sheet(images)
    if sheet is not None:
        buffer = io.BytesIO()
        sheet.save(buffer, format="PNG")
        atomic_write_bytes(run_dir / "grid.png", buffer.getvalue())
