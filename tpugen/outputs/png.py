"""Images as files: safe names, the A1111 `parameters` chunk and tpugen's own chunk with the full record."""

from __future__ import annotations

import io
import json
import re
import unicodedata
from pathlib import Path

from PIL import Image, PngImagePlugin

from tpugen.config.hires import HiresFix
from tpugen.config.schema import step_cache_options_text
from tpugen.files import atomic_write_bytes

SLUG_MAX = 40


def slug(prompt: str) -> str:
    """ASCII lowercase words joined by '-', at most 40 characters; never a separator, '..' or leading dot."""
    ascii_text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode("ascii").lower()
    words = re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")
    return words[:SLUG_MAX].rstrip("-") or "image"


def image_filename(index: int, seed: int, prompt: str) -> str:
    return f"{index:05d}-{seed}-{slug(prompt)}.png"


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
    }
    if record.get("strength") is not None:  # made from an init image (img2img, inpainting)
        fields["Denoising strength"] = record["strength"]
    if record.get("reference_images_sha256"):
        # Not an A1111 key (the web UI has no edit by reference): each reference's first 10 hex digits, in order,
        # as the web UI shortens a model's hash; the tpugen chunk has them whole.
        fields["Reference images"] = " ".join(sha[:10] for sha in record["reference_images_sha256"])
    if record.get("clip_skip"):  # the web UI writes its clip skip where it is not the last layer
        fields["Clip skip"] = record["clip_skip"]
    if record.get("tiling"):  # seamless tiling: the web UI writes "Tiling: True" before its hires keys
        fields["Tiling"] = True
    if record.get("hires"):  # hires fix: the web UI's own keys for its second pass
        fields.update(
            HiresFix(**{k: v for k, v in record["hires"].items() if k not in ("height", "width")}).parameters()
        )
    if record.get("loras"):
        # As the web UI writes it (extensions-builtin/Lora): "NAME: HASH" pairs joined by ", ", each name without
        # ':' or ',', the hash its 12-digit short hash; the whole value then quoted, since it holds ':'.
        fields["Lora hashes"] = ", ".join(
            f"{lora['name'].replace(':', '').replace(',', '')}: {lora['hash']}" for lora in record["loras"]
        )
    for n, unit in enumerate(record.get("controlnet_units") or ()):
        fields[f"ControlNet {n}"] = controlnet_unit_text(unit)
    if record.get("step_cache"):
        # Not an A1111 key (the web UI has no step cache): its images are not the uncached ones, so say which.
        cache = record["step_cache"]
        options = step_cache_options_text({k: v for k, v in cache.items() if k != "method"}, pair="{}={}", sep=" ")
        fields["Step cache"] = f"{cache['method']} {options}"
    fields["Version"] = f"tpugen {record['tpugen_version']}"
    lines.append(", ".join(f"{key}: {_a1111_value(value)}" for key, value in fields.items()))
    return "\n".join(lines)


def controlnet_unit_text(unit: dict) -> str:
    """A ControlNet unit as the web UI's ControlNet extension writes it into `parameters` (its value then quoted,
    since it holds ':' and ','): the model by its folder's or built-in's name."""
    from tpugen.config.controls import CONTROL_MODES, control_name
    from tpugen.config.request import RESIZE_MODES

    resize = RESIZE_MODES[unit.get("resize_mode", 1)].title().replace(" And ", " and ")
    parts = {"Module": unit["module"], "Model": control_name(unit["controlnet"]), "Weight": unit["scale"]}
    parts["Resize Mode"] = resize
    if unit.get("threshold_a") is not None:
        parts["Threshold A"] = unit["threshold_a"]
    if unit.get("threshold_b") is not None:
        parts["Threshold B"] = unit["threshold_b"]
    parts.update({"Guidance Start": unit["start"], "Guidance End": unit["end"]})
    parts["Control Mode"] = CONTROL_MODES[unit.get("control_mode", 0)]
    return ", ".join(f"{key}: {value}" for key, value in parts.items())


def png_bytes(image: Image.Image, record: dict) -> bytes:
    """A PNG with a `parameters` tEXt chunk (A1111 format) and a `tpugen` chunk holding the full record."""
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", a1111_parameters(record))
    info.add_text("tpugen", json.dumps(record, ensure_ascii=False))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def save_png(path: Path, image: Image.Image, record: dict) -> None:
    """png_bytes written atomically to `path`."""
    atomic_write_bytes(path, png_bytes(image, record))


def is_valid_png(path: Path) -> bool:
    """Whether `path` is a whole, readable image (a resume makes anything else again)."""
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except Exception:  # missing, torn or not an image: all the same to a resume
        return False
