"""File names, PNG parameters and writes that stay inside the run directory."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tpugen.outputs import a1111_parameters, image_filename, inside, read_manifest, save_png, slug


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("A Red Fox, in SNOW!", "a-red-fox-in-snow"),
        ("../../etc/passwd", "etc-passwd"),
        ('"; rm -rf ~ #', "rm-rf"),
        (".hidden", "hidden"),
        ("café crème brûlée", "cafe-creme-brulee"),
        ("🦊🌲", "image"),
        ("مرحبا بالعالم", "image"),
        ("x" * 10_000, "x" * 40),
        ("word " * 20, "word-word-word-word-word-word-word-word"),
    ],
)
def test_slug_is_safe_ascii(prompt, expected):
    assert slug(prompt) == expected
    assert "/" not in slug(prompt) and ".." not in slug(prompt) and not slug(prompt).startswith(".")


def test_image_filename():
    assert image_filename(7, 1234, "A cat") == "00007-1234-a-cat.png"


RECORD = {
    "prompt": "a cat, on a mat",
    "negative_prompt": "blurry",
    "steps": 20,
    "scheduler": "DPM++ 2M Karras",
    "guidance_scale": 7.5,
    "seed": 42,
    "width": 512,
    "height": 768,
    "model": "org/model:v1",
    "tpugen_version": "0.1.0",
}


def test_a1111_parameters_quote_values_with_separators():
    assert a1111_parameters(RECORD) == (
        "a cat, on a mat\n"
        "Negative prompt: blurry\n"
        'Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7.5, Seed: 42, Size: 512x768, Model: "org/model:v1", '
        "Version: tpugen 0.1.0"
    )
    assert "Negative prompt" not in a1111_parameters({**RECORD, "negative_prompt": ""})


def test_png_carries_both_chunks_even_for_non_latin_text(tmp_path):
    record = {**RECORD, "prompt": "a fox 🦊 مرحبا"}
    path = tmp_path / "x.png"
    save_png(path, Image.new("RGB", (8, 8)), record)
    image = Image.open(path)
    assert image.text["parameters"].startswith("a fox 🦊 مرحبا\n")
    assert json.loads(image.text["tpugen"]) == record
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]  # no temporary file left behind


def test_inside_refuses_escapes(tmp_path):
    assert inside(tmp_path, "a.png") == tmp_path / "a.png"
    for name in ("../a.png", "/etc/passwd", "sub/a.png"):
        with pytest.raises(ValueError):
            inside(tmp_path, name)


def test_torn_manifest_line_is_skipped(tmp_path):
    path = tmp_path / "manifest.jsonl"
    path.write_text('{"index": 0}\n{"index": 1}\n{"ind')
    assert read_manifest(path) == [{"index": 0}, {"index": 1}]
