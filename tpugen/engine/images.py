"""Input images on the host: read, and fitted to a batch's size as the web UI's resize modes do, so a shape key's
graphs never see another size."""

from __future__ import annotations

from tpugen.logs import logger

_log = logger("images")


def fit(image, width: int, height: int, mode: int):
    """`image` (PIL) at width x height. 0: just resize; 1: crop and resize (scaled to cover, the middle kept);
    2: resize and fill (scaled to fit, the bands beside it filled by stretching its edge rows or columns)."""
    from PIL import Image

    lanczos = Image.Resampling.LANCZOS
    if mode == 0 or image.size == (width, height):
        return image.resize((width, height), lanczos)
    ratio, source = width / height, image.width / image.height
    if mode == 1:
        scale = max(width / image.width, height / image.height)
        scaled = image.resize(
            (max(width, round(image.width * scale)), max(height, round(image.height * scale))), lanczos
        )
        left, top = (scaled.width - width) // 2, (scaled.height - height) // 2
        return scaled.crop((left, top, left + width, top + height))
    scale = min(width / image.width, height / image.height)
    inner = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), lanczos)
    canvas = Image.new(image.mode, (width, height))
    left, top = (width - inner.width) // 2, (height - inner.height) // 2
    canvas.paste(inner, (left, top))
    if ratio < source and top > 0:  # bands above and below: the first and last rows stretched over them
        canvas.paste(inner.crop((0, 0, inner.width, 1)).resize((inner.width, top)), (left, 0))
        bottom = height - top - inner.height
        if bottom > 0:
            last = inner.crop((0, inner.height - 1, inner.width, inner.height))
            canvas.paste(last.resize((inner.width, bottom)), (left, top + inner.height))
    elif ratio > source and left > 0:  # bands left and right: the first and last columns
        canvas.paste(inner.crop((0, 0, 1, inner.height)).resize((left, inner.height)), (0, top))
        right = width - left - inner.width
        if right > 0:
            last = inner.crop((inner.width - 1, 0, inner.width, inner.height))
            canvas.paste(last.resize((right, inner.height)), (left + inner.width, top))
    return canvas


def load(path: str, width: int, height: int, mode: int, *, mask: bool = False, image_size=None):
    """The input image at `path`, fitted to width x height: RGB, or for a mask one channel (white: repaint). A mask
    of another size than its image is fitted all the same, and the log says so."""
    from PIL import Image

    with Image.open(path) as opened:
        image = opened.convert("L" if mask else "RGB")
    if mask and image_size is not None and image.size != image_size:
        _log.warning(
            f"mask_image {path} is {image.width}x{image.height}, its init_image {image_size[0]}x{image_size[1]}: "
            f"both fitted to {width}x{height}"
        )
    return fit(image, width, height, mode)


def size_of(path: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as opened:
        return opened.size
