"""One image as a config's prompt or a server's request asks for it, and the one set of rules its values keep."""

from __future__ import annotations

import math
import random
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpugen.lines import unpaired_surrogate

if TYPE_CHECKING:
    from tpugen.families import Family

# Every side is a multiple of this: the VAE downsamples by 8 (a family may ask for more: Family.size_multiple).
SIDE_MULTIPLE = 8
# A request's smallest side: the web UI's width and height sliders start at 64. Configs keep any multiple of 8
# (tests run tiny models at 48 px), and a server allows the sides it keeps warm.
MIN_REQUEST_SIDE = 64
MIN_STEPS, MAX_STEPS = 1, 1000
# numpy's and torch's generators take a signed 64-bit seed.
MAX_SEED = 2**63 - 1
# A web UI request's seed for "a random one", drawn from the web UI's own range.
RANDOM_SEED = -1
RANDOM_SEEDS = 4294967294
# A request's largest guidance scale: the web UI's CFG slider stops at 30, and 1e308 is finite to JSON but
# infinite in the float32 or bfloat16 a model computes in. Configs keep any finite guidance.
MAX_GUIDANCE_SCALE = 30.0
# A request's prompt and negative prompt: far past what any text encoder reads (CLIP 77 tokens, T5 512).
MAX_PROMPT_CHARACTERS = 10_000


def side_ok(side: int, minimum: int = SIDE_MULTIPLE) -> bool:
    """A multiple of SIDE_MULTIPLE, at least `minimum`."""
    return side >= minimum and side % SIDE_MULTIPLE == 0


def steps_ok(steps: int) -> bool:
    return MIN_STEPS <= steps <= MAX_STEPS


def guidance_ok(scale: float) -> bool:
    """Finite and 0 or more (the upper bound is a request's: RequestLimits)."""
    try:
        return math.isfinite(scale) and scale >= 0
    except OverflowError:  # an integer past any float (JSON allows 1 followed by 400 zeros)
        return False


def strength_ok(strength: float) -> bool:
    """img2img's strength (the web UI's denoising strength): the share of the steps run on the noised image."""
    return math.isfinite(strength) and 0 < strength <= 1


def strength_to_run(steps: int, strength: float) -> float:
    """The strength an img2img call of `steps` steps is given: `strength`, or where steps x strength rounds below
    one step the least strength that runs one, as the web UI runs at least one step at any denoising strength
    (diffusers' Stable Diffusion pipelines run int(steps x strength) steps and fail on none; its flow-matching
    ones run one already, from the same last noise level)."""
    if int(steps * strength) >= 1:
        return strength
    least = 1.0 / steps
    while int(steps * least) < 1:  # 49 x (1 / 49) is 0.9999999999999999 in floating point
        least = math.nextafter(least, 2.0)
    return least


# How an input image is fitted to the run's size, as the web UI's resize_mode numbers them.
RESIZE_MODES = {0: "just resize", 1: "crop and resize", 2: "resize and fill"}
DEFAULT_STRENGTH = 0.75  # the web UI's denoising_strength default
# An input image's largest side and file size: past them it is no image a run could use (a decompression bomb).
MAX_INPUT_SIDE = 8192
MAX_INPUT_BYTES = 64 * 1024 * 1024
# Reference images one prompt may give (a family allows its own number: Family.max_references), and the least
# side an edit's image has: its references are fitted to its size, and FLUX.2's pipelines refuse references
# under 64 px a side.
MAX_REFERENCES = 10
MIN_REFERENCE_SIDE = 64


def cannot_edit_by_reference(family: Family) -> str:
    """Why a family without references refuses them: the one wording, after each caller's place."""
    from tpugen.families import FAMILIES

    editors = ", ".join(f.title for f in FAMILIES.values() if f.max_references)
    return f"{family.title} models do not edit by reference images ({editors} models do)"


def too_many_references(family: Family, count: int, noun: str = "images") -> str | None:
    """Why `count` references are too many for the family, or None."""
    if count <= family.max_references:
        return None
    return f"{count} {noun}; {family.title} models take at most {family.max_references}"


def references_too_small(height: int, width: int) -> str | None:
    """Why an image of this size cannot edit by reference (its references are fitted to it), or None."""
    if min(height, width) >= MIN_REFERENCE_SIDE:
        return None
    return (
        f"the image is {width}x{height} and its references are fitted to its size; an edit by reference needs at "
        f"least {MIN_REFERENCE_SIDE} px a side"
    )


def no_mask_for_references(family: Family) -> str:
    return f"{family.title} models edit by reference images, without a mask; send no mask"


def seed_ok(seed: int) -> bool:
    return 0 <= seed <= MAX_SEED


def seed_for(seed: int) -> int:
    """A web UI request's seed: -1 is a random one; any other is kept (and checked with the request)."""
    return random.randrange(RANDOM_SEEDS) if seed == RANDOM_SEED else seed


def _line_break(character: str) -> bool:
    # What str.splitlines() breaks at (\n, \r, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029): prompt files may hold
    # them inside a line (tpugen.lines.text_lines breaks at \n alone).
    return len(f"a{character}b".splitlines()) == 2


def control_character(text: str) -> str | None:
    """Why `text` is not prompt text because of a control character (NUL, ESC, DEL, a C1 control), or None. Line
    breaks and tabs are text: a NUL ends the string in C code (a PNG text chunk) and ESC starts a terminal
    sequence in a log."""
    for position, character in enumerate(text):
        if unicodedata.category(character) == "Cc" and character != "\t" and not _line_break(character):
            return (
                f"control character U+{ord(character):04X} at character {position} "
                "(only line breaks and tabs are allowed)"
            )
    return None


def text_problem(text: str, max_characters: int | None = None) -> str | None:
    """The first reason `text` cannot be a prompt or negative prompt (too long, not Unicode text, a control
    character), or None. One per text: the tokenizer, a PNG chunk and a log line would each fail on it."""
    if max_characters is not None and len(text) > max_characters:
        return f"{len(text)} characters; at most {max_characters}"
    return unpaired_surrogate(text) or control_character(text)


# ---------------------------------------------------------------- a config's prompts

# A prompt's own settings in a config (a .jsonl line, or a mapping in prompts): the type each key takes, its
# rule, and what the message says it must be.
_ENTRY_KEYS = {
    "negative_prompt": (str, lambda v: True, "a string"),
    "seed": (int, seed_ok, "an integer >= 0"),
    "steps": (int, steps_ok, f"an integer from {MIN_STEPS} to {MAX_STEPS}"),
    "guidance_scale": ((int, float), guidance_ok, "a finite number >= 0"),
    "height": (int, side_ok, f"a positive multiple of {SIDE_MULTIPLE}"),
    "width": (int, side_ok, f"a positive multiple of {SIDE_MULTIPLE}"),
    "init_image": (str, lambda v: bool(v.strip()), "a path to an image (relative to the config)"),
    "mask_image": (str, lambda v: bool(v.strip()), "a path to an image (relative to the config)"),
    "strength": ((int, float), strength_ok, "a number above 0 and at most 1"),
    "reference_images": (
        list,
        lambda v: 1 <= len(v) <= MAX_REFERENCES and all(isinstance(p, str) and p.strip() for p in v),
        f"a list of 1 to {MAX_REFERENCES} paths to images (relative to the config)",
    ),
    "resize_mode": (
        int,
        lambda v: v in RESIZE_MODES,
        f"one of {', '.join(f'{k} ({v})' for k, v in RESIZE_MODES.items())}",
    ),
}


def entry_problems(entry: dict) -> list[str]:
    """Every problem of a config's prompt entry whose 'prompt' is a string, one line each, in the config's words
    (the caller puts the entry's place before each)."""
    problems = []
    if not entry["prompt"].strip():
        problems.append("prompt is empty")
    for key in ("prompt", "negative_prompt"):
        if isinstance(entry.get(key), str) and (problem := text_problem(entry[key])):
            problems.append(f"{key}: {problem}")
    for key, (kind, ok, wanted) in _ENTRY_KEYS.items():
        if key in entry:
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
                shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)  # not every path
                problems.append(f"{key} must be {wanted}, got {shown}")
    if "reference_images" in entry:
        # An edit by reference starts from noise beside its references: no init image, no strength.
        for key in ("init_image", "mask_image", "strength"):
            if key in entry:
                problems.append(
                    f"{key}: a prompt with reference_images edits by reference (no init image, no strength); "
                    f"leave {key} out"
                )
        return problems
    for key in ("mask_image", "strength", "resize_mode"):
        if key in entry and "init_image" not in entry:
            problems.append(f"{key} is for a prompt with an init_image; give one or leave {key} out")
    return problems


# ---------------------------------------------------------------- a server's requests


@dataclass(frozen=True)
class RequestLimits:
    """The bounds a request keeps beyond a config's: its smallest side and largest guidance, its longest text."""

    min_side: int = MIN_REQUEST_SIDE
    max_guidance_scale: float = MAX_GUIDANCE_SCALE
    max_prompt_characters: int = MAX_PROMPT_CHARACTERS
    max_side: int | None = None  # a server's serve.max_side; None: no bound beyond a config's

    @classmethod
    def of_server(
        cls, sizes: Iterable[tuple[int, int]], guidance_scale: float, max_side: int | None = None
    ) -> RequestLimits:
        """A server's: the sizes it keeps warm and its config's guidance always pass (a config allows sides from
        8 and any finite guidance, and an OpenAI request takes the config's guidance as it is)."""
        sides = [side for size in sizes for side in size]
        return cls(min([MIN_REQUEST_SIDE, *sides]), max(MAX_GUIDANCE_SCALE, guidance_scale), max_side=max_side)


@dataclass(frozen=True, kw_only=True)
class ImageRequest:
    """One image a request asks for, in tpugen's words: what the rules below check."""

    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    guidance_scale: float
    height: int
    width: int

    def problems(
        self, family: Family, limits: RequestLimits | None = None, *, seeds: Iterable[int] | None = None
    ) -> list[str]:
        """Every problem with this image for a model of `family`, one line each, in a request's words. `seeds`:
        every seed of the request when it asks for more than this image (they differ in their seed alone); the
        first bad one is named."""
        limits = limits or RequestLimits()
        problems = []
        for name, text in (("prompt", self.prompt), ("negative_prompt", self.negative_prompt)):
            if problem := text_problem(text, limits.max_prompt_characters):
                problems.append(f"{name}: {problem}")
        if not self.prompt.strip():
            problems.append("prompt: is empty")
        size, step = f"size: {self.width}x{self.height}", family.size_multiple
        if not (side_ok(self.height, 1) and side_ok(self.width, 1)):
            problems.append(f"{size}: width and height must be positive multiples of {SIDE_MULTIPLE}")
        elif self.height < limits.min_side or self.width < limits.min_side:
            web_ui = limits.min_side == MIN_REQUEST_SIDE
            why = "the web UI's sliders start there" if web_ui else "the smallest side this server keeps warm"
            problems.append(f"{size}: width and height must be at least {limits.min_side} ({why})")
        elif limits.max_side is not None and max(self.height, self.width) > limits.max_side:
            problems.append(f"{size}: width and height must be at most {limits.max_side} (serve.max_side)")
        elif self.height % step or self.width % step:
            problems.append(f"{size}: {family.title} models need multiples of {step}")
        if not steps_ok(self.steps):
            problems.append(f"steps: must be from {MIN_STEPS} to {MAX_STEPS}, got {self.steps}")
        scale, most = self.guidance_scale, limits.max_guidance_scale
        if not guidance_ok(scale):
            problems.append(f"guidance scale: must be a finite number, 0 or more; got {scale}")
        elif scale > most:
            web_ui = most == MAX_GUIDANCE_SCALE
            why = "the web UI's CFG slider stops there" if web_ui else "this server's guidance_scale"
            problems.append(f"guidance scale: must be at most {most:g} ({why}); got {scale}")
        bad_seed = next((seed for seed in ([self.seed] if seeds is None else seeds) if not seed_ok(seed)), None)
        if bad_seed is not None:
            problems.append(f"seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got {bad_seed}")
        return problems
