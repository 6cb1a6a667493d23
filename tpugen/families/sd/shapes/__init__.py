"""tiny-shapes: a small SD 1.x pipeline trained here (scripts/train_tiny_shapes.py) to draw one coloured shape on a
coloured background, `a red circle on a blue background`, at 64x64; its weights ship in weights/."""

from __future__ import annotations

from pathlib import Path

# The colours it knows, with the RGB values the training images use.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
SIZE = 64
WEIGHTS = Path(__file__).parent / "weights"
MANIFEST = WEIGHTS / "manifest.json"


def prompt(colour: str, shape: str, background: str) -> str:
    """The prompt it was trained on for that picture."""
    return f"a {colour} {shape} on a {background} background"


# Every word of its prompts, each one token of its tokenizer.
WORDS = sorted({w for c in COLOURS for s in SHAPES for w in prompt(c, s, c).split()})


def control_held_out(text: str) -> bool:
    """Whether the tiny-shapes ControlNet never trained on this prompt: 12 of its 90, by a fixed rule
    (scripts/train_tiny_shapes.py --controlnet), so a test can place shapes for prompts it never saw."""
    words = text.split()
    if len(words) != 7 or words[1] not in COLOURS or words[2] not in SHAPES or words[5] not in COLOURS:
        return False
    names = list(COLOURS)
    return (names.index(words[1]) * 3 + SHAPES.index(words[2]) + names.index(words[5]) * 5) % 7 == 3
