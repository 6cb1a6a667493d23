"""A judge of tiny-shapes' pictures: which colour the background is (the border's), which colour the shape is (the
pixels far from the background) and which kind (how much of its bounding box it fills)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpugen.families.sd.shapes import COLOURS

# How much of its bounding box each kind fills, drawn ideally: a circle pi/4, a square all, a triangle half.
FILL = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}
FAR = 80  # RGB distance from the background beyond which a pixel is the shape's (the closest two colours: 160)
MIN_PIXELS = 40  # a smaller blob is no shape (the smallest drawn is 16 px across)


@dataclass(frozen=True)
class Verdict:
    background: str
    colour: str | None  # None: no shape found
    shape: str | None
    fill: float  # the shape's share of its bounding box


def nearest_colour(rgb) -> str:
    return min(COLOURS, key=lambda name: float(np.sum((np.asarray(COLOURS[name], float) - rgb) ** 2)))


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    labels, count = ndimage.label(mask)
    if count == 0:
        return mask
    sizes = np.bincount(labels.ravel())[1:]
    return labels == 1 + int(np.argmax(sizes))


def judge(image) -> Verdict:
    """What an RGB picture (PIL image or H x W x 3 array) shows."""
    pixels = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.float64)
    border = np.concatenate([pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3)])
    border = np.concatenate([border, pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)])
    background_rgb = np.median(border, axis=0)
    background = nearest_colour(background_rgb)
    far = np.sqrt(((pixels - background_rgb) ** 2).sum(-1)) > FAR
    blob = _largest_blob(far)
    if blob.sum() < MIN_PIXELS:
        return Verdict(background, None, None, 0.0)
    shape_rgb = np.median(pixels[blob], axis=0)
    colour = nearest_colour(shape_rgb)
    # The shape's outline where a soft edge is halfway from the background to the shape's colour, as a drawn edge
    # antialiases: a cut nearer the background takes in the halo, which rounds corners.
    toward = shape_rgb - background_rgb
    share = ((pixels - background_rgb) @ toward) / max(float(toward @ toward), 1.0)
    blob = _largest_blob(share > 0.5)
    rows, cols = np.nonzero(blob)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    fill = float(blob.sum() / box)
    shape = min(FILL, key=lambda kind: abs(FILL[kind] - fill))
    return Verdict(background, colour, shape, fill)


def score(verdicts: list[Verdict], asked: list[tuple[str, str, str]]) -> dict[str, float]:
    """The share of pictures whose shape colour, background and shape kind are those asked
    ((colour, shape, background) each)."""
    n = len(asked)
    return {
        "colour": sum(v.colour == c for v, (c, _, _) in zip(verdicts, asked, strict=True)) / n,
        "background": sum(v.background == b for v, (_, _, b) in zip(verdicts, asked, strict=True)) / n,
        "shape": sum(v.shape == s for v, (_, s, _) in zip(verdicts, asked, strict=True)) / n,
    }
