"""The web UI's "SD upscale" img2img script on the host: its arguments, the tiles of the upscaled image, the blend."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpugen.config.hires import MAX_HIRES_SCALE
from tpugen.errors import InputError

if TYPE_CHECKING:
    import numpy as np

# The script as the web UI's API names it in script_name (its title, matched in lower case).
TITLE = "SD upscale"
# The web UI's own image upscalers, in the order it lists them (GET /sdapi/v1/upscalers), so an index a client
# takes from that list, or one it learned from the web UI, names the same upscaler. None keeps the image's size.
UPSCALERS = ("None", "Lanczos", "Nearest")
# script_args as the web UI's script reads them, and its own defaults for those a client leaves off.
ARGS = ("info (ignored)", "tile overlap", "upscaler", "scale factor")
DEFAULT_ARGS = ("", 64, "None", 2.0)
MIN_SCALE = 1.0  # the web UI's scale slider starts at 1: the image tiled and redrawn at its own size


def named(script_name: object) -> bool:
    """Whether a request's script_name is this script ("sd upscale", "SD upscale", any case)."""
    return isinstance(script_name, str) and script_name.strip().lower() == TITLE.lower()


@dataclass(frozen=True)
class SdUpscale:
    """What the script does to an init image: upscales it by `scale` with `upscaler` (one of UPSCALERS), then
    redraws it in tiles of the request's size that overlap by `overlap` pixels."""

    overlap: int
    upscaler: str
    scale: float

    def size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the upscaled image, as the web UI's upscalers size it: each side times the scale,
        floored to a multiple of 8; the None upscaler keeps the image as it is."""
        if self.upscaler == "None":
            return width, height
        return max(8, int(width * self.scale) // 8 * 8), max(8, int(height * self.scale) // 8 * 8)

    def upscaled(self, image):
        """`image` (PIL) at size(): Lanczos or Nearest resampling in one resize, or the image itself."""
        from PIL import Image

        size = self.size(image.width, image.height)
        if self.upscaler == "None" or size == image.size:
            return image
        resample = Image.Resampling.LANCZOS if self.upscaler == "Lanczos" else Image.Resampling.NEAREST
        return image.resize(size, resample)


def _shown(value: object) -> str:
    return repr(value)[:100]


def _whole(value: object) -> int | None:
    """A JSON number that is a whole number (8 or 8.0), else None (a bool, a string, 8.5, inf)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def read_args(args: list[Any], tile_width: int, tile_height: int) -> SdUpscale:
    """The script's settings from a request's script_args as the web UI sends them ([info, tile overlap, upscaler
    by name or index, scale factor]; those left off take the web UI's defaults), for tiles of tile_width x
    tile_height; an InputError with one line per bad value, each naming script_args."""
    if len(args) > len(ARGS):
        raise InputError(f"script_args: {len(args)} values; SD upscale takes at most {len(ARGS)}: {', '.join(ARGS)}")
    values = list(args) + list(DEFAULT_ARGS[len(args) :])
    problems = []
    side = min(tile_width, tile_height)
    overlap = _whole(values[1])
    if overlap is None or not 0 <= overlap < side:
        problems.append(
            f"script_args[1] (tile overlap): must be a whole number of pixels from 0 to {side - 1} (less than the "
            f"tile's side, the request's width x height {tile_width}x{tile_height}), got {_shown(values[1])}"
        )
    upscaler = _upscaler(values[2])
    if upscaler is None:
        listed = ", ".join(f"{name} ({index})" for index, name in enumerate(UPSCALERS))
        problems.append(
            f"script_args[2] (upscaler): must be one of {listed}, by name or index (GET /sdapi/v1/upscalers), "
            f"got {_shown(values[2])}"
        )
    scale = values[3]
    number = isinstance(scale, int | float) and not isinstance(scale, bool)
    if not number or not (math.isfinite(scale) and MIN_SCALE <= scale <= MAX_HIRES_SCALE):
        problems.append(
            f"script_args[3] (scale factor): must be a number from {MIN_SCALE:g} to {MAX_HIRES_SCALE:g}, "
            f"got {_shown(scale)}"
        )
    if problems:
        raise InputError(*problems)
    return SdUpscale(overlap, upscaler, float(scale))


def _upscaler(value: object) -> str | None:
    if isinstance(value, str):
        return next((name for name in UPSCALERS if name.lower() == value.strip().lower()), None)
    index = value if isinstance(value, int) and not isinstance(value, bool) else None
    return UPSCALERS[index] if index is not None and 0 <= index < len(UPSCALERS) else None


# ---------------------------------------------------------------- the tiles


def axis_count(length: int, tile: int, overlap: int) -> int:
    """How many tiles of `tile` pixels, overlapping by at least `overlap`, cover `length` pixels: one when the
    tile is as long as the side or longer."""
    if length <= tile:
        return 1
    return -(-(length - overlap) // (tile - overlap))


def axis_starts(length: int, tile: int, overlap: int) -> list[int]:
    """Where the tiles along one side start: the first at 0, the last flush with the far edge, the others
    spread evenly between (so neighbours overlap by `overlap` pixels or more, never less)."""
    count = axis_count(length, tile, overlap)
    if count == 1:
        return [0]
    # Floored even steps: each at most ceil((length - tile) / (count - 1)), which is at most tile - overlap.
    return [i * (length - tile) // (count - 1) for i in range(count)]


@dataclass(frozen=True)
class TileGrid:
    """The tiles an image of width x height is redrawn in: tile_width x tile_height each, at xs x ys. A side
    shorter than its tile has one tile there, reaching past the image (cut() pads it with the edge pixels)."""

    width: int
    height: int
    tile_width: int
    tile_height: int
    overlap: int
    xs: tuple[int, ...]
    ys: tuple[int, ...]

    @classmethod
    def of(cls, width: int, height: int, tile_width: int, tile_height: int, overlap: int) -> TileGrid:
        xs = tuple(axis_starts(width, tile_width, overlap))
        ys = tuple(axis_starts(height, tile_height, overlap))
        return cls(width, height, tile_width, tile_height, overlap, xs, ys)

    @property
    def positions(self) -> list[tuple[int, int]]:
        """(x, y) of each tile's top left corner, a row at a time (the order of cut() and blend())."""
        return [(x, y) for y in self.ys for x in self.xs]

    def cut(self, pixels: np.ndarray) -> list[np.ndarray]:
        """The tiles of `pixels` (height x width x channels), each tile_height x tile_width."""
        import numpy as np

        below, right = max(0, self.tile_height - self.height), max(0, self.tile_width - self.width)
        if below or right:
            pixels = np.pad(pixels, ((0, below), (0, right), (0, 0)), mode="edge")
        return [pixels[y : y + self.tile_height, x : x + self.tile_width] for x, y in self.positions]

    def blend(self, tiles: list[np.ndarray]) -> np.ndarray:
        """The tiles (in positions' order) put back together as one height x width image (float32): each pixel
        a sum of the tiles over it weighted by weights that add up to 1 (a linear ramp across each seam, 1 and 0
        elsewhere), so a pixel one tile alone holds is that tile's pixel exactly."""
        import numpy as np

        across = axis_weights(self.width, self.tile_width, self.overlap, self.xs)
        down = axis_weights(self.height, self.tile_height, self.overlap, self.ys)
        channels = tiles[0].shape[2]
        image = np.zeros((self.height, self.width, channels), np.float32)
        columns = len(self.xs)
        for index, tile in enumerate(tiles):
            row, column = divmod(index, columns)
            x, y = self.xs[column], self.ys[row]
            w, h = min(self.tile_width, self.width - x), min(self.tile_height, self.height - y)
            weight = down[row][y : y + h, None, None] * across[column][None, x : x + w, None]
            image[y : y + h, x : x + w] += weight * tile[:h, :w].astype(np.float32)
        return image


def seams(length: int, tile: int, overlap: int, starts: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(start, width) of the ramp between each pair of neighbouring tiles along one side: `overlap` pixels in
    the middle of the pixels the two share, narrowed where that would reach a ramp before it or past a tile."""
    found, end = [], 0
    for left, right in zip(starts[:-1], starts[1:], strict=True):
        low, high = right, min(left + tile, length)  # the pixels both tiles hold
        width = min(overlap, high - low)
        start = max(low + (high - low - width) // 2, end)
        width = max(0, min(width, high - start))
        found.append((start, width))
        end = start + width
    return found


def axis_weights(length: int, tile: int, overlap: int, starts: tuple[int, ...] | list[int]) -> list[np.ndarray]:
    """Each tile's weight at each pixel along one side (float32, `length` long): 1 between its seams, 0
    beyond them, and across a seam of w pixels the ramp (j + 1) / (w + 1) up for the tile on the right and
    its complement down for the one on the left, so the weights at every pixel add up to 1."""
    import numpy as np

    found = seams(length, tile, overlap, starts)
    weights = []
    for index in range(len(starts)):
        weight = np.zeros(length, np.float32)
        first = 0 if index == 0 else sum(found[index - 1])
        last = length if index == len(starts) - 1 else found[index][0]
        weight[first:last] = 1.0
        if index > 0:
            start, width = found[index - 1]
            weight[start : start + width] = _ramp(width)
        if index < len(starts) - 1:
            start, width = found[index]
            weight[start : start + width] = 1.0 - _ramp(width)
        weights.append(weight)
    return weights


def _ramp(width: int) -> np.ndarray:
    import numpy as np

    return (np.arange(1, width + 1, dtype=np.float64) / (width + 1)).astype(np.float32)
