"""File names, PNG parameters and writes that stay inside the run directory."""

from __future__ import annotations

import json
import os
import stat

import pytest
from PIL import Image

from tpugen.files import inside
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import a1111_parameters, image_filename, save_png, slug


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


def test_a1111_parameters_name_each_lora_by_its_short_hash_as_the_web_ui_does():
    loras = [
        {"name": "water: color, v2", "scale": 0.8, "hash": "0123456789ab"},
        {"name": "pixel", "scale": 1.0, "hash": "ba9876543210"},
    ]
    settings = a1111_parameters({**RECORD, "loras": loras}).splitlines()[-1]
    # extensions-builtin/Lora: "NAME: HASH" joined by ", ", ':' and ',' taken out of names; the value quoted.
    assert settings.endswith(
        'Model: "org/model:v1", Lora hashes: "water color v2: 0123456789ab, pixel: ba9876543210", Version: tpugen 0.1.0'
    )


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


def parse_like_the_web_ui(text: str) -> tuple[str, str, str]:
    """(prompt, negative prompt, settings line) as AUTOMATIC1111's parse_generation_parameters splits them:
    the last line is the settings if it holds at least three `key: value` pairs; a line that starts with
    "Negative prompt:" begins the negative prompt."""
    import re

    *lines, last = text.strip().split("\n")
    if len(re.findall(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)', last)) < 3:
        lines.append(last)
        last = ""
    prompt, negative, in_negative = "", "", False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[16:].strip()
        if in_negative:
            negative += ("" if not negative else "\n") + line
        else:
            prompt += ("" if not prompt else "\n") + line
    return prompt, negative, last


@pytest.mark.parametrize(
    "prompt,negative",
    [
        ("a cat\nNegative prompt: a dog", ""),
        ("a cat\nSteps: 99, Sampler: Fake, Seed: 1", "blurry"),
        ("a cat", "ugly\nSteps: 99, Sampler: Fake, Seed: 1, Size: 8x8"),
        ("a cat\u2028Negative prompt: x\r\ny", "z\x85w"),
    ],
)
def test_a_prompt_cannot_forge_the_negative_prompt_or_the_settings(prompt, negative):
    record = {**RECORD, "prompt": prompt, "negative_prompt": negative}
    read_prompt, read_negative, settings = parse_like_the_web_ui(a1111_parameters(record))
    assert read_prompt == " ".join(prompt.splitlines())  # line breaks became spaces, nothing else changed
    assert read_negative == " ".join(negative.splitlines())
    assert settings.startswith("Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7.5, Seed: 42")


def test_files_get_the_mode_an_ordinary_new_file_gets(tmp_path):
    mask = os.umask(0o022)
    os.umask(mask)
    save_png(tmp_path / "x.png", Image.new("RGB", (8, 8)), RECORD)
    assert stat.S_IMODE((tmp_path / "x.png").stat().st_mode) == 0o666 & ~mask


def test_manifest_lines_end_at_newlines_only_and_non_records_are_skipped(tmp_path):
    path = tmp_path / "manifest.jsonl"
    path.write_text(
        '{"index": 0, "prompt": "a\u2028b\x85c"}\r\n[1, 2]\nnull\n{"file": "x.png"}\n{"index": 1}\n',
        encoding="utf-8",
        newline="",
    )
    assert read_manifest(path) == [{"index": 0, "prompt": "a\u2028b\x85c"}, {"index": 1}]
