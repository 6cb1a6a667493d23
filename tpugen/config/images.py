"""Input images of a run (img2img's init_image, inpainting's mask_image, an edit's reference_images): checked at
the door, named by content."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpugen.config.request import MAX_INPUT_BYTES, MAX_INPUT_SIDE


@dataclass(frozen=True)
class ImageSource:
    """What an img2img or inpainting image starts from, as a prompt, a work item and a server's request hold it:
    the init image (absolute path) and its sha256, how far it is noised (strength: the share of the steps run) and
    how it is fitted to the size (tpugen.config.request.RESIZE_MODES), and inpainting's mask (white: repaint)."""

    init_image: str
    init_image_sha256: str
    strength: float
    resize_mode: int = 0
    mask_image: str | None = None
    mask_image_sha256: str | None = None

    @property
    def task(self) -> str:
        """img2img, or inpaint with a mask (tpugen.plan.WorkItem.task)."""
        return "inpaint" if self.mask_image else "img2img"

    def record(self) -> dict:
        """What an image record says of it, by content (a path is where it was, not what it was)."""
        record = {
            "init_image_sha256": self.init_image_sha256,
            "strength": self.strength,
            "resize_mode": self.resize_mode,
        }
        if self.mask_image:
            record["mask_image_sha256"] = self.mask_image_sha256
        return record

    def files(self) -> list[tuple[str, str, str]]:
        """(key, path, sha256) of each image file it reads."""
        files = [("init_image", self.init_image, self.init_image_sha256)]
        if self.mask_image:
            files.append(("mask_image", self.mask_image, self.mask_image_sha256))
        return files


@dataclass(frozen=True)
class InputImage:
    """An image file a prompt names: where it is (absolute) and its sha256, which is what names the images made
    from it (the config hash, the PNG record) and what `tpugen resume` checks it against."""

    path: str
    sha256: str


@dataclass(frozen=True)
class References:
    """The reference images an edit by reference takes (FLUX.2: "the cat from image 1 on the sofa of image 2"),
    in the prompt's order, each fitted to the image's size (resize_mode, the web UI's numbers: by default cropped
    and resized, as FLUX.2's pipelines fit a reference of another shape)."""

    images: tuple[InputImage, ...]
    resize_mode: int = 1

    @property
    def count(self) -> int:
        return len(self.images)

    def record(self) -> dict:
        """What an image record says of them, by content."""
        return {
            "reference_images_sha256": [image.sha256 for image in self.images],
            "reference_resize_mode": self.resize_mode,
        }

    def files(self) -> list[tuple[str, str, str]]:
        """(key, path, sha256) of each reference."""
        return [(f"reference_images[{n}]", image.path, image.sha256) for n, image in enumerate(self.images)]

    @classmethod
    def from_record(cls, fields: dict) -> References:
        """The references as a run record holds them (dataclasses.asdict)."""
        return cls(tuple(InputImage(**image) for image in fields["images"]), fields.get("resize_mode", 1))


# Images decoded at once, in the whole process: each may be 8192 x 8192 (MAX_INPUT_SIDE, 200 MB as RGB), so
# concurrent requests wait their turn to decode rather than add their pixels up (four such requests at once
# added 2 GB before).
DECODES_AT_ONCE = 2
_decoding = threading.BoundedSemaphore(DECODES_AT_ONCE)


def image_problem(data: bytes) -> str | None:
    """Why these bytes are not an input image tpugen can use (not an image, too big), or None."""
    return open_checked(data)[1]


def open_checked(data: bytes, convert: Callable | None = None) -> tuple[Any, str | None]:
    """(`convert` of the decoded image, None), or (None, why these bytes are no input image tpugen can use):
    decoded whole (a truncated file is refused), at most DECODES_AT_ONCE at a time."""
    import io

    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_INPUT_BYTES:
        return None, f"{len(data)} bytes; at most {MAX_INPUT_BYTES}"
    with _decoding:
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if max(width, height) > MAX_INPUT_SIDE:
                    return None, f"{width}x{height}; at most {MAX_INPUT_SIDE} pixels a side"
                image.load()
                return (convert(image) if convert else None), None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            return None, f"not an image PIL can read ({type(exc).__name__})"
        except Image.DecompressionBombError:
            return None, f"over {MAX_INPUT_SIDE} pixels a side"


def read_input_image(value: str, base_dir: Path, where: str, problems: list[str]) -> InputImage | None:
    """The prompt's image `value` (a path, relative to the config's folder), or None with its problem noted."""
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        problems.append(
            f"{where}: {str(path)!r} does not exist" if not path.exists() else f"{where}: {str(path)!r} is not a file"
        )
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.append(f"{where}: cannot read {str(path)!r}: {exc.strerror}")
        return None
    problem = image_problem(data)
    if problem:
        problems.append(
            f"{where}: {str(path)!r} is {problem}"
            if problem.startswith("not")
            else f"{where}: {str(path)!r}: {problem}"
        )
        return None
    return InputImage(str(path.resolve()), hashlib.sha256(data).hexdigest())


def sha256_of(path: str) -> str | None:
    """The file's sha256 now (None: it is gone or unreadable)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# ---------------------------------------------------------------- input images for other machines


def shipped_name_problem(where: str, what: str, name: str, pattern, named: dict[str, int], key: str) -> str | None:
    """Why pod-run cannot ship a file or folder named `name` beside the config (`what`: "LoRA files", "ControlNet
    folders"...): a name a worker's shell would read as something else (gcloud scp hands the remote path to it;
    `pattern` is what may ship), or one already shipped (`named`: name -> its number under `key`). None: it can."""
    noun = what.split()[-1].removesuffix("s")
    if not pattern.fullmatch(name):
        return (
            f"{where}: pod-run ships {what} by name, and {name!r} holds characters a shell reads (use letters, "
            f"digits, '.', '_' and '-'); rename the {noun}"
        )
    if name in named:
        return f"{where}: pod-run ships {what} side by side, and {key}[{named[name]}] is a {noun} named {name!r} too; rename one"
    return None


# A prompt's input images, each a path relative to the config's folder (or a list of them: references, the
# control images of several ControlNets).
IMAGE_KEYS = ("init_image", "mask_image", "reference_images", "control_image")


def shipped_images(entries: list, base_dir: Path, known: dict[str, str], folder: str) -> tuple[list, dict[str, Path]]:
    """The prompt entries as pod-run ships them, each input image (init and mask images, references, control
    images) named by a file in `folder` beside the shipped config, and those files' names with the local files they
    are copies of. A name is the image's content, `image-<16 hex of its sha256><suffix>`, by the sha256 the config's
    check read (`known`: resolved path -> sha256, so one image named by 10,000 prompts is not read again): one file
    for an image two prompts name, nothing a worker's shell reads as anything else, and the records' and the config
    hash's sha256 of each image what they were. Entries without images are left as they are."""
    files: dict[str, Path] = {}

    def ship(value: str) -> str:
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        sha256 = known.get(str(path.resolve())) or hashlib.sha256(path.read_bytes()).hexdigest()
        suffix = path.suffix.lower()
        suffix = suffix if suffix[1:].isalnum() and suffix[1:].isascii() and len(suffix) <= 6 else ""
        name = f"image-{sha256[:16]}{suffix}"
        files[name] = path
        return f"{folder}/{name}"

    shipped = []
    for entry in entries:
        if isinstance(entry, dict) and any(key in entry for key in IMAGE_KEYS):
            entry = dict(entry)
            for key in IMAGE_KEYS:
                value = entry.get(key)
                if isinstance(value, str):
                    entry[key] = ship(value)
                elif isinstance(value, list):
                    entry[key] = [ship(item) for item in value]
        shipped.append(entry)
    return shipped, files
