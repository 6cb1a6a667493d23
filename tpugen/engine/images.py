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


def upscale(pixels, width: int, height: int):
    """A decoded image (a CHW tensor in [0, 1] on the host) as PIL, resized to width x height with Lanczos: the
    web UI's Lanczos upscaler for a hires fix (it too rounds to 8-bit pixels first)."""
    import numpy as np
    from PIL import Image

    array = (pixels.permute(1, 2, 0).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
    return Image.fromarray(array).resize((width, height), Image.Resampling.LANCZOS)


def as_tensor(pictures):
    """PIL images (RGB, one size) as an NCHW tensor in [0, 1] on the host: what a decode gives."""
    import numpy as np
    import torch

    array = np.stack([np.asarray(picture.convert("RGB"), dtype=np.float32) for picture in pictures]) / 255.0
    return torch.from_numpy(array).permute(0, 3, 1, 2)


def size_of(path: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as opened:
        return opened.size


# ---------------------------------------------------------------- the web UI's inpainting, on the host


def open_bytes(data: bytes, where: str, *, mask: bool = False, keep_alpha: bool = False):
    """An image a request sent, as PIL (RGB, or one channel for a mask; `keep_alpha`: RGBA where it has
    transparency); InputError naming `where` if it is none. Decoded once, at most DECODES_AT_ONCE at a time
    (tpugen.config.images)."""
    from tpugen.config.images import open_checked
    from tpugen.errors import InputError

    def converted(opened):
        if keep_alpha:
            has_alpha = opened.mode in ("RGBA", "LA", "PA") or "transparency" in opened.info
            return opened.convert("RGBA" if has_alpha else "RGB")
        if mask and opened.mode in ("RGBA", "LA"):
            # A mask drawn on a transparent layer: what is drawn (opaque) is what to repaint.
            return opened.getchannel("A").convert("L")
        return opened.convert("L" if mask else "RGB")

    image, problem = open_checked(data, converted)
    if problem:
        raise InputError(f"{where}: is {problem}" if problem.startswith("not") else f"{where}: {problem}")
    return image


def transparent_mask(image):
    """OpenAI's edit mask: white where `image` is transparent (to be repainted), or None if it has no transparent
    pixel."""
    if image is None or "A" not in image.getbands():
        return None
    alpha = image.getchannel("A")
    if alpha.getextrema()[0] == 255:
        return None
    return alpha.point(lambda value: 255 if value == 0 else 0)


def png_bytes(image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def web_ui_mask(mask, blur: int, *, invert: bool = False):
    """The mask as the web UI prepares it: inverted when asked (repaint what is black), then blurred by `blur`
    pixels, so the repainted area blends into the rest."""
    from PIL import ImageFilter, ImageOps

    mask = ImageOps.invert(mask) if invert else mask
    return mask.filter(ImageFilter.GaussianBlur(blur)) if blur > 0 else mask


def fill_masked(image, mask):
    """inpainting_fill 0 ("fill"): the masked area painted with the colours around it before it is noised: the
    unmasked pixels' Gaussian-weighted mean at a wide radius, then finer radii laid over it where enough
    unmasked pixels are near."""
    import numpy as np
    from PIL import Image
    from scipy.ndimage import gaussian_filter

    keep = 1.0 - np.asarray(mask, np.float64) / 255.0
    pixels = np.asarray(image, np.float64)
    filled = None
    for radius in (64, 16, 4, 1):
        weight = gaussian_filter(keep, radius)
        colour = np.stack([gaussian_filter(pixels[..., c] * keep, radius) for c in range(3)], axis=-1)
        colour /= np.maximum(weight, 1e-6)[..., None]
        cover = np.clip(weight * 4, 0, 1)[..., None]
        filled = colour if filled is None else filled * (1 - cover) + colour * cover
    out = pixels * keep[..., None] + filled * (1 - keep[..., None])
    return Image.fromarray(np.clip(out, 0, 255).round().astype(np.uint8))


def crop_region(mask, width: int, height: int, padding: int) -> tuple[int, int, int, int]:
    """inpaint_full_res: the box around the mask's painted pixels, `padding` more on each side, grown to the
    image's aspect ratio (so the crop fills width x height unstretched) and kept inside it."""
    import numpy as np

    painted = np.argwhere(np.asarray(mask) > 0)
    if not len(painted):
        return (0, 0, mask.width, mask.height)
    (top, left), (bottom, right) = painted.min(axis=0), painted.max(axis=0) + 1
    left, top = max(0, left - padding), max(0, top - padding)
    right, bottom = min(mask.width, right + padding), min(mask.height, bottom + padding)
    ratio = width / height
    box_w, box_h = right - left, bottom - top
    if box_w / box_h < ratio:
        box_w = min(mask.width, round(box_h * ratio))
    else:
        box_h = min(mask.height, round(box_w / ratio))
    centre_x, centre_y = (left + right) / 2, (top + bottom) / 2
    left = int(min(max(0, round(centre_x - box_w / 2)), mask.width - box_w))
    top = int(min(max(0, round(centre_y - box_h / 2)), mask.height - box_h))
    return (left, top, left + box_w, top + box_h)


def paste_back(pixels, image, mask, region):
    """An inpaint_full_res result (HxWx3 uint8 at the request's size) shrunk to its crop and laid over the whole
    image through the mask, as the web UI pastes it: the unmasked pixels stay the image's own."""
    import numpy as np
    from PIL import Image

    left, top, right, bottom = region
    made = Image.fromarray(pixels).resize((right - left, bottom - top), Image.Resampling.LANCZOS)
    whole = image.copy()
    whole.paste(made, (left, top), mask.crop(region))
    return np.asarray(whole)
