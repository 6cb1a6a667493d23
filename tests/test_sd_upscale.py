"""The web UI's SD upscale script on the host (tpugen.modes.serve.sd_upscale): its script_args, the tile grid
and the blend back into one image. The server's side of it: tests/test_serve_sd_upscale.py."""

from __future__ import annotations

import numpy as np
import pytest

from tpugen.errors import InputError
from tpugen.modes.serve.sd_upscale import (
    SdUpscale,
    TileGrid,
    axis_count,
    axis_starts,
    axis_weights,
    named,
    read_args,
    seams,
)

# (side, tile, overlap): the web UI's test (128 in 64 by 8), a side shorter than its tile, no overlap, an
# overlap wider than a step (three tiles over one pixel), one pixel past the tile, odd sizes.
AXES = [(128, 64, 8), (48, 64, 8), (64, 64, 8), (200, 64, 0), (72, 64, 60), (100, 64, 32), (65, 64, 8), (517, 96, 40)]


@pytest.mark.parametrize("length,tile,overlap", AXES)
def test_tiles_cover_every_pixel_overlap_as_asked_and_the_last_is_flush(length, tile, overlap):
    starts = axis_starts(length, tile, overlap)
    assert len(starts) == axis_count(length, tile, overlap)
    assert starts[0] == 0 and starts == sorted(set(starts))
    if length <= tile:
        assert starts == [0]  # one tile, reaching past the side
        return
    assert starts[-1] + tile == length  # flush with the far edge
    steps = np.diff(starts)
    assert steps.max() <= tile - overlap  # neighbours share `overlap` pixels or more
    covered = np.zeros(length, int)
    for start in starts:
        covered[start : start + tile] += 1
    assert covered.min() >= 1
    # No more tiles than it takes: one fewer could not cover the side at that overlap.
    assert (len(starts) - 1) * (tile - overlap) + overlap < length


def test_the_web_uis_request_is_three_by_three_tiles_row_by_row():
    grid = TileGrid.of(128, 128, 64, 64, 8)
    assert grid.xs == grid.ys == (0, 32, 64)
    assert grid.positions[:4] == [(0, 0), (32, 0), (64, 0), (0, 32)]
    tiles = grid.cut(np.zeros((128, 128, 3), np.uint8))
    assert len(tiles) == 9 and {tile.shape for tile in tiles} == {(64, 64, 3)}


@pytest.mark.parametrize("length,tile,overlap", AXES)
def test_the_weights_add_up_to_one_and_are_one_or_zero_off_the_seams(length, tile, overlap):
    starts = axis_starts(length, tile, overlap)
    weights = np.stack(axis_weights(length, tile, overlap, starts))
    assert np.abs(weights.sum(axis=0) - 1).max() < 1e-6
    off_seams = np.ones(length, bool)
    for start, width in seams(length, tile, overlap, starts):
        off_seams[start : start + width] = False
        assert width <= overlap
    assert set(np.unique(weights[:, off_seams])) <= {0.0, 1.0}
    for weight, start in zip(weights, starts, strict=True):  # no tile weighs anything outside itself
        assert not weight[:start].any() and not weight[start + tile :].any()


@pytest.mark.parametrize(
    "size,tile,overlap",
    [((128, 128), (64, 64), 8), ((100, 72), (64, 48), 16), ((200, 130), (64, 64), 0), ((40, 56), (64, 64), 8)],
)
def test_tiles_cut_from_one_image_blend_back_into_that_image(size, tile, overlap):
    width, height = size
    image = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    grid = TileGrid.of(width, height, *tile, overlap)
    blended = grid.blend(grid.cut(image))
    assert blended.shape == (height, width, 3) and blended.dtype == np.float32
    assert np.array_equal(np.rint(blended).astype(np.uint8), image)
    # Exact off the seams, where one tile alone holds a pixel: its weight is 1 and every other's 0.
    rows = np.ones(height, bool)
    for start, size_ in seams(height, grid.tile_height, overlap, grid.ys):
        rows[start : start + size_] = False
    columns = np.ones(width, bool)
    for start, size_ in seams(width, grid.tile_width, overlap, grid.xs):
        columns[start : start + size_] = False
    assert np.array_equal(blended[np.ix_(rows, columns)], image[np.ix_(rows, columns)].astype(np.float32))


def test_a_seam_is_a_linear_ramp_from_one_tile_to_the_next():
    grid = TileGrid.of(112, 64, 64, 64, 16)  # two tiles side by side sharing 16 columns: 48 to 63
    assert grid.xs == (0, 48) and seams(112, 64, 16, grid.xs) == [(48, 16)]
    black, white = np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 255, np.uint8)
    row = grid.blend([black, white])[10, :, 0].astype(np.float64)
    assert (row[:48] == 0).all() and (row[64:] == 255).all()
    ramp = row[47:65]  # the last black pixel, the 16 of the seam, the first white one
    assert np.allclose(np.diff(ramp), 255 / 17, atol=1e-3)  # equal steps: linear


def test_the_web_uis_script_args_and_its_defaults():
    assert read_args(["", 8, "Lanczos", 2.0], 64, 64) == SdUpscale(8, "Lanczos", 2.0)
    assert read_args(["", 16.0, 2, 3], 64, 64) == SdUpscale(16, "Nearest", 3.0)  # by index, as GET /upscalers
    assert read_args([None, 0, " lanczos ", 1], 64, 64) == SdUpscale(0, "Lanczos", 1.0)
    assert read_args([], 512, 512) == SdUpscale(64, "None", 2.0)  # the web UI's own defaults
    assert SdUpscale(8, "Lanczos", 2.0).size(64, 64) == (128, 128)
    assert SdUpscale(8, "Nearest", 1.5).size(100, 60) == (144, 88)  # floored to multiples of 8
    assert SdUpscale(8, "None", 4.0).size(100, 60) == (100, 60)
    assert named("sd upscale") and named("SD upscale") and named(" SD Upscale")
    assert not any(named(name) for name in ("x/y/z plot", "", None, 5, ["sd upscale"]))


@pytest.mark.parametrize(
    "args,words",
    [
        (["", 8, "Lanczos", 1e9], ["script_args[3] (scale factor): must be a number from 1 to 4, got 1000000000.0"]),
        (["", 64, "Lanczos", 2], ["script_args[1] (tile overlap): must be a whole number of pixels from 0 to 63"]),
        (["", "8", "Lanczos", "2"], ["script_args[1] (tile overlap):", "script_args[3] (scale factor):"]),
        (
            ["", True, "R-ESRGAN 4x+", None],
            ["script_args[1]", "script_args[2] (upscaler): must be one of None (0)", "script_args[3]"],
        ),
        (["", 8.5, 3, float("nan")], ["script_args[1]", "script_args[2]", "script_args[3]"]),
        (["", -1, {"name": "Lanczos"}, [2]], ["script_args[1]", "script_args[2]", "script_args[3]"]),
        (["", 8, "Lanczos", 0.5], ["script_args[3] (scale factor): must be a number from 1 to 4, got 0.5"]),
        ([0] * 10_000, ["script_args: 10000 values; SD upscale takes at most 4: info (ignored), tile overlap"]),
    ],
)
def test_bad_script_args_are_one_line_each_naming_script_args(args, words):
    with pytest.raises(InputError) as refused:
        read_args(args, 64, 64)
    lines = refused.value.lines
    assert len(lines) == len(words) and all(line.startswith("script_args") and "\n" not in line for line in lines)
    assert all(word in line for word, line in zip(words, lines, strict=True)), lines
    assert all(len(line) < 300 for line in lines)
