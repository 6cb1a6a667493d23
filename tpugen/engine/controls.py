"""ControlNets on the device and their control images on the host: the ControlNets of model.controlnets read from
disk, each step's conditioning scale handed to the device as data (one step graph for any scale, and for the steps
a unit sits out), and the preprocessors that need no weights."""

from __future__ import annotations

import contextlib
import functools
import io
import threading

from tpugen.config.controls import ANNOTATORS, ANNOTATORS_NEED, Annotator, ControlUnit, module_descriptions
from tpugen.errors import InputError, RunError, one_line
from tpugen.models import classify_controlnet_id, hub_failure

SCALE_AS_DATA = "controlnet scale handed in as data"


def read_controlnets(model, family, base_dir=None) -> list:
    """The config's model.controlnets (their ids resolved at the door) read onto the host in the model's dtype, as
    the family's ControlNet class."""
    import diffusers
    import torch

    parts = family.controlnet
    if parts is None:
        if model.controlnets:  # refused at the door (model.controlnets): never run without them
            raise RunError(f"model.controlnets: {family.title} models: {family.controlnet_refusal}")
        return []
    controlnet_class = getattr(diffusers, parts.model_class)

    found = []
    for n, controlnet in enumerate(model.controlnets):
        source = classify_controlnet_id(controlnet.id, base_dir)
        if isinstance(source, str):
            raise RunError(f"model.controlnets[{n}].id: {source}")
        if source.kind == "builtin":
            from tpugen.tiny import builtin_path

            location = str(builtin_path(source.ref))
        else:
            location = source.ref
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                found.append(controlnet_class.from_pretrained(location, torch_dtype=getattr(torch, model.dtype)))
        except Exception as exc:  # any loader failure becomes one line naming the ControlNet
            why = hub_failure(exc, from_hub=source.kind == "hub")
            raise RunError(f"model.controlnets[{n}].id: cannot load {controlnet.id!r}: {why}") from exc
    # Known once loaded (a hub ControlNet's config is read here): a kind tpugen cannot run, or kinds its family's
    # pipelines cannot mix.
    for n, controlnet in enumerate(found):
        if why := parts.unsupported(dict(controlnet.config)):
            raise RunError(f"model.controlnets[{n}].id: {family.title} models: {why}")
    if len(found) > 1 and (why := parts.mixed([dict(c.config) for c in found])):
        raise RunError(f"model.controlnets: {family.title} models: {why}")
    return found


def combined(controlnets: list, family):
    """What diffusers' pipelines take as `controlnet`: the one ControlNet, or several as the family's multi-ControlNet
    class (MultiControlNetModel, FluxMultiControlNetModel)."""
    if len(controlnets) == 1:
        return controlnets[0]
    import diffusers

    return getattr(diffusers, family.controlnet.multi_class)(controlnets)


class ResidualWeights:
    """What one ControlNet's residuals are multiplied by beside its scale in a pipeline call, as the web UI
    extension weighs them (tpugen.config.controls.residual_factors): set before each call (`unit`, the call's unit
    of this ControlNet, and `rows`, the batch's rows), read at each of its steps. `always`: weigh them at Balanced
    too (by ones), so that every mode runs the same graph (a UNet ControlNet on XLA); otherwise only a unit that
    asks for it is weighed."""

    def __init__(self, always: bool) -> None:
        self.always = always
        self.unit = None
        self.rows = 0
        self._on_device: dict = {}  # (what, dtype, device): its tensor there, moved once, not at every step

    def apply(self, out):
        """The ControlNet's (down residuals, mid residual), each weighed; anything else as it is."""
        weighed = self.unit is not None and (self.unit.mode or self.unit.layer_weights is not None)
        if not (weighed or self.always) or not (isinstance(out, tuple) and len(out) == 2):
            return out
        down, mid = out
        if not isinstance(down, (list, tuple)) or not hasattr(mid, "shape"):
            return out
        from tpugen.config.controls import residual_factors

        count, batch = len(down) + 1, mid.shape[0]
        unit = self.unit
        factors = residual_factors(unit, count) if unit is not None else (1.0,) * count
        # "ControlNet is more important": the conditional rows of a CFG batch (diffusers puts them second) alone
        # keep the residuals, as the extension's cfg injection does.
        half = unit is not None and unit.mode == 2 and self.rows and batch == 2 * self.rows
        rows = (0.0,) * (batch // 2) + (1.0,) * (batch // 2) if half else (1.0,) * batch
        weights = self._tensor(factors, mid)
        mask = self._tensor(rows, mid).reshape(batch, *([1] * (mid.ndim - 1)))
        down = tuple(d * (weights[i] * mask) for i, d in enumerate(down))
        return down, mid * (weights[count - 1] * mask)

    def _tensor(self, values: tuple, like):
        import torch

        key = (values, like.dtype, str(like.device))
        if key not in self._on_device:
            if len(self._on_device) >= SCALES_KEPT:
                self._on_device.clear()
            self._on_device[key] = torch.tensor(values, dtype=like.dtype).to(like.device)
        return self._on_device[key]


def install_scale_as_data(controlnets: list, hooks, *, weigh_always: bool = False) -> list[ResidualWeights]:
    """Each ControlNet's `conditioning_scale` (a Python number diffusers computes per step: the unit's scale, or 0
    on the steps outside its start and end) moved to the device as a 0-d tensor. A number would be baked into the
    step's graph by torch_xla where it is 0 or 1 (any other is data): another step graph for the steps a unit sits
    out, and for a scale of 1 against any other. Its residuals then weighed (ResidualWeights, one per ControlNet,
    returned: a call sets them)."""
    weights = [ResidualWeights(weigh_always) for _ in controlnets]
    for n, controlnet in enumerate(controlnets):
        hooks.wrap(
            controlnet, "forward", f"{SCALE_AS_DATA} ({n})", functools.partial(_scale_as_data, weighs=weights[n])
        )
    return weights


SCALES_KEPT = 16  # device copies of scales kept per ControlNet (a run's units use a few: each scale, and 0)


def _scale_as_data(forward, weighs: ResidualWeights | None = None):
    on_device: dict = {}  # (scale, dtype, device): its one-element tensor there, moved once, not at every step

    @functools.wraps(forward)
    def forward_with_scale_as_data(*args, conditioning_scale=1.0, **kwargs):
        import torch

        # The latents: SD's and SDXL's pipelines hand them first (sample), Flux.1's by name (hidden_states),
        # Z-Image's first as a list of one tensor per row.
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        if isinstance(sample, list):
            sample = sample[0]
        if not isinstance(conditioning_scale, torch.Tensor) and sample.device.type != "cpu":
            # Through a one-element tensor: a 0-d one moved to the device is a constant at 0 and 1, as a number is.
            key = (float(conditioning_scale), sample.dtype, str(sample.device))
            if key not in on_device:
                if len(on_device) >= SCALES_KEPT:
                    on_device.clear()
                on_device[key] = torch.tensor([key[0]], dtype=sample.dtype).to(sample.device)
            conditioning_scale = on_device[key].reshape(())
        out = forward(*args, conditioning_scale=conditioning_scale, **kwargs)
        return out if weighs is None else weighs.apply(out)

    return forward_with_scale_as_data


# ---------------------------------------------------------------- control images on the host


def control_image(unit: ControlUnit, width: int, height: int, annotators: str | None = None):
    """A unit's control image as the ControlNet takes it (PIL RGB, width x height): the image fitted to the size as
    the unit says (the web UI's ControlNet default: crop and resize), then its preprocessor (`annotators`: the
    folder of model.annotators_dir, for one that runs an annotator model)."""
    from tpugen.engine import images

    fitted = images.load(unit.image.path, width, height, unit.resize_mode)
    made = preprocess(fitted, unit.module, unit.threshold_a, unit.threshold_b, annotators)
    if made.size != (width, height):  # a map smaller than its image (tile_resample's): cubic, as the extension's
        import cv2
        import numpy as np
        from PIL import Image

        made = Image.fromarray(cv2.resize(np.asarray(made), (width, height), interpolation=cv2.INTER_CUBIC))
    return made


def preprocess(
    image,
    module: str,
    threshold_a: float | None = None,
    threshold_b: float | None = None,
    annotators: str | None = None,
):
    """The control a preprocessor makes of a PIL image (tpugen.config.controls.CONTROL_MODULES, or ANNOTATORS from
    the weights in the folder `annotators`), as PIL RGB of the image's size (tile_resample's smaller, as the
    extension's /controlnet/detect gives it)."""
    import numpy as np
    from PIL import Image

    if module in ANNOTATORS:
        return _annotate(image, ANNOTATORS[module], threshold_a, threshold_b, annotators)
    rgb = np.asarray(image.convert("RGB"))
    if module == "none":
        out = rgb
    elif module == "canny":
        import cv2

        low = threshold_a if threshold_a is not None else 100
        edges = cv2.Canny(rgb, low, threshold_b if threshold_b is not None else 200)
        out = np.repeat(edges[:, :, None], 3, axis=2)
    elif module == "invert":
        out = 255 - rgb
    elif module == "scribble":
        import cv2

        gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        strokes = np.where(gray < (threshold_a if threshold_a is not None else 127), 255, 0).astype(np.uint8)
        strokes = cv2.dilate(strokes, np.ones((3, 3), np.uint8))
        out = np.repeat(strokes[:, :, None], 3, axis=2)
    elif module == "tile":
        factor = threshold_a if threshold_a is not None else 4.0
        small = image.convert("RGB").resize(
            (max(1, round(image.width / factor)), max(1, round(image.height / factor))), Image.Resampling.BOX
        )
        return small.resize(image.size, Image.Resampling.BICUBIC)
    elif module in EXTENSION_MODULES:
        out = EXTENSION_MODULES[module](rgb, threshold_a)
    else:
        raise ValueError(f"unknown ControlNet module {module!r}")
    return Image.fromarray(np.ascontiguousarray(out))


# ---------------------------------------------------------------- the ControlNet extension's weight-free modules
# As sd-webui-controlnet 1.1.455 computes them, at the image's own size (the extension's resolution: the image's
# shorter side), on the image padded at its right and bottom edges to whole 64 pixels where the extension pads it.


def _padded(rgb):
    """The image with its last rows and columns repeated up to multiples of 64, and how to cut it back."""
    import numpy as np

    height, width = rgb.shape[:2]
    padded = np.pad(rgb, [[0, -height % 64], [0, -width % 64], [0, 0]], mode="edge")
    return padded, lambda x: np.ascontiguousarray(x[:height, :width])


def _threshold(rgb, a):
    import numpy as np

    padded, cut = _padded(rgb)
    out = np.zeros_like(padded)
    out[np.min(padded, axis=2) > (127.0 if a is None else a)] = 255
    return cut(out)


def _blur_gaussian(rgb, a):
    import cv2

    return cv2.GaussianBlur(rgb, (0, 0), 9.0 if a is None else float(a))


def _color(rgb, a):
    import cv2

    height, width = rgb.shape[:2]
    small = cv2.resize(rgb, (max(1, width // 64), max(1, height // 64)), interpolation=cv2.INTER_CUBIC)
    return cv2.resize(small, (width, height), interpolation=cv2.INTER_NEAREST)


def _recolor(channel):
    def recolor(rgb, a):
        import cv2
        import numpy as np

        # The extension hands OpenCV RGB as BGR: its luminance weighs red and blue the other way round.
        code, index = (cv2.COLOR_BGR2LAB, 0) if channel == "luminance" else (cv2.COLOR_BGR2HSV, 2)
        grey = cv2.cvtColor(rgb, code)[:, :, index].astype(np.float32) / 255.0
        grey = ((grey ** (1.0 if a is None else a)) * 255.0).clip(0, 255).astype(np.uint8)
        return cv2.cvtColor(grey, cv2.COLOR_GRAY2RGB)

    return recolor


def _scribble_xdog(rgb, a):
    import cv2
    import numpy as np

    padded, cut = _padded(rgb)
    near = cv2.GaussianBlur(padded.astype(np.float32), (0, 0), 0.5)
    far = cv2.GaussianBlur(padded.astype(np.float32), (0, 0), 5.0)
    dog = (255 - np.min(far - near, axis=2)).clip(0, 255).astype(np.uint8)
    out = np.zeros_like(padded)
    # The extension's 2 * (255 - dog) is uint8 arithmetic: it wraps at 256, and so does this.
    out[(2 * (255 - dog.astype(np.int32))) % 256 > (32.0 if a is None else a)] = 255
    return cut(out)


def _lineart_standard(rgb, a):
    import cv2
    import numpy as np

    padded, cut = _padded(rgb)
    x = padded.astype(np.float32)
    strength = np.min(cv2.GaussianBlur(x, (0, 0), 6.0) - x, axis=2).clip(0, 255)
    bright = strength[strength > 8]
    median = np.median(bright) if bright.size else np.float32("nan")
    strength /= max(16, median)  # the extension's max(16, m): 16 unless the median is above it (nan: 16)
    strength *= 127
    grey = cut(strength.clip(0, 255).astype(np.uint8))
    return np.repeat(grey[:, :, None], 3, axis=2)


def _tile_resample(rgb, a):
    """The extension's tile_resample: the image as it is below a rate of 1.1, else area-averaged down to its sides
    over the rate (truncated). Smaller than the image: control_image scales it back to the generation's size."""
    import cv2

    rate = 1.0 if a is None else float(a)
    if rate < 1.1:
        return rgb
    height, width = rgb.shape[:2]
    return cv2.resize(rgb, (int(float(width) / rate), int(float(height) / rate)), interpolation=cv2.INTER_AREA)


EXTENSION_MODULES = {
    "threshold": _threshold,
    "blur_gaussian": _blur_gaussian,
    "color": _color,
    "recolor_luminance": _recolor("luminance"),
    "recolor_intensity": _recolor("intensity"),
    "scribble_xdog": _scribble_xdog,
    "lineart_standard": _lineart_standard,
    "tile_resample": _tile_resample,
}


# The sides an annotator runs at: at most ANNOTATOR_MAX_SIDE (an 8192-pixel image sent to /controlnet/detect would
# take an annotator tens of gigabytes of activations on the host; the web UI's processor_res stops at 2048, its default
# is 512), at least ANNOTATOR_MIN_SIDE (controlnet_aux rounds each side to a multiple of 64: a smaller one would be 0).
ANNOTATOR_MAX_SIDE = 1024
ANNOTATOR_MIN_SIDE = 64
ANNOTATOR_MAX_RATIO = ANNOTATOR_MAX_SIDE // ANNOTATOR_MIN_SIDE
# One annotator runs at a time in a process (a server's /controlnet/detect requests run on its thread pool).
_ANNOTATING = threading.Lock()


def _annotate(image, annotator: Annotator, threshold_a, threshold_b, folder: str | None):
    """An annotator's control of a PIL image, run on the host by controlnet_aux with the image scaled so that its
    sides lie from ANNOTATOR_MIN_SIDE to ANNOTATOR_MAX_SIDE (its detect and image resolution: the shorter side so
    scaled), then fitted to the image's size. InputError: an image longer than ANNOTATOR_MAX_RATIO times its width,
    which no such scale fits."""
    import torch
    from PIL import Image

    width, height = image.size
    if max(width, height) > ANNOTATOR_MAX_RATIO * min(width, height):
        raise InputError(
            f"{width}x{height}: an annotator takes images at most {ANNOTATOR_MAX_RATIO} times as long as wide"
        )
    scale = max(min(1.0, ANNOTATOR_MAX_SIDE / max(width, height)), ANNOTATOR_MIN_SIDE / min(width, height))
    side = max(ANNOTATOR_MIN_SIDE, min(round(min(width, height) * scale), ANNOTATOR_MAX_SIDE))
    options = dict(annotator.options)
    for spec, value in ((annotator.threshold_a, threshold_a), (annotator.threshold_b, threshold_b)):
        if spec is not None:
            options[spec[0]] = spec[1] if value is None else value
    detector = _detector(annotator.detector, folder)
    with _ANNOTATING, torch.no_grad():
        made = detector(
            image.convert("RGB"), detect_resolution=side, image_resolution=side, output_type="pil", **options
        )
    made = made.convert("RGB")
    return made if made.size == image.size else made.resize(image.size, Image.Resampling.BILINEAR)


def load_annotators(folder: str) -> list[str]:
    """Every annotator whose weights `folder` holds, loaded now (a server's start): the modules, by name."""
    runnable = [name for name in module_descriptions(folder) if name in ANNOTATORS]
    for name in runnable:
        _detector(ANNOTATORS[name].detector, folder)
    return runnable


@functools.lru_cache(maxsize=8)
def _detector(name: str, folder: str | None):
    """controlnet_aux's detector `name` loaded once per process from the weights in `folder` (on the host)."""
    import warnings

    if folder is None:
        raise RunError(f"{name} needs model.annotators_dir (a folder of its weights)")
    with warnings.catch_warnings():  # its import re-registers timm's models, with a warning for each
        warnings.simplefilter("ignore")
        try:
            import controlnet_aux
        except ImportError:
            raise RunError(f"model.annotators_dir: {ANNOTATORS_NEED}") from None
    try:
        return getattr(controlnet_aux, name).from_pretrained(folder)
    except Exception as exc:  # a weights file of another model, or none: one line naming it
        raise RunError(
            f"model.annotators_dir: {name} cannot load its weights from {folder!r}: {one_line(exc)}"
        ) from exc
