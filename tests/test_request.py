"""One image's rules (tpugen.config.request), device-free: each bound and its words, a config's prompts and a
server's request checked by the same rules, and valid input as it was."""

from __future__ import annotations

import math

import pytest
from conftest import tiny_config, with_prompts_file, write_config

from tpugen.config import load_config
from tpugen.errors import InputError
from tpugen.families import FAMILIES

SD, FLUX = FAMILIES["sd"], FAMILIES["flux"]
FINE = {"prompt": "a cat", "negative_prompt": "blurry", "seed": 7, "steps": 3, "guidance_scale": 7.5}


def problems(family=SD, limits=None, **changes) -> list[str]:
    from tpugen.config.request import ImageRequest

    return ImageRequest(**{**FINE, "height": 64, "width": 64, **changes}).problems(family, limits)


# ---------------------------------------------------------------- each rule and its words


@pytest.mark.parametrize(
    "changes,lines",
    [
        ({"width": 0}, ["size: 0x64: width and height must be positive multiples of 8"]),
        ({"height": -64}, ["size: 64x-64: width and height must be positive multiples of 8"]),
        ({"width": 60}, ["size: 60x64: width and height must be positive multiples of 8"]),
        ({"width": 56}, ["size: 56x64: width and height must be at least 64 (the web UI's sliders start there)"]),
        (
            {"height": 8, "width": 8},
            ["size: 8x8: width and height must be at least 64 (the web UI's sliders start there)"],
        ),
        ({"steps": 0}, ["steps: must be from 1 to 1000, got 0"]),
        ({"steps": 1001}, ["steps: must be from 1 to 1000, got 1001"]),
        ({"guidance_scale": -1.0}, ["guidance scale: must be a finite number, 0 or more; got -1.0"]),
        ({"guidance_scale": math.inf}, ["guidance scale: must be a finite number, 0 or more; got inf"]),
        ({"guidance_scale": math.nan}, ["guidance scale: must be a finite number, 0 or more; got nan"]),
        (
            {"guidance_scale": 30.5},
            ["guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 30.5"],
        ),
        (
            {"guidance_scale": 1e308},
            ["guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 1e+308"],
        ),
        ({"seed": 2**63}, ["seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got 9223372036854775808"]),
        # -1 is the web UI's "a random one", replaced before an image is made: an image's seed is never -1.
        ({"seed": -1}, ["seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got -1"]),
        ({"prompt": "x" * 10_001}, ["prompt: 10001 characters; at most 10000"]),
        ({"negative_prompt": "x" * 10_001}, ["negative_prompt: 10001 characters; at most 10000"]),
        ({"prompt": " \n\t"}, ["prompt: is empty"]),
        ({"prompt": ""}, ["prompt: is empty"]),
        (
            {"prompt": "a \ud83d cat"},
            ["prompt: unpaired surrogate U+D83D at character 2 (not valid Unicode text)"],
        ),
        (
            {"prompt": "a cat\x00"},
            ["prompt: control character U+0000 at character 5 (only line breaks and tabs are allowed)"],
        ),
        (
            {"negative_prompt": "\x1b[31mred"},
            ["negative_prompt: control character U+001B at character 0 (only line breaks and tabs are allowed)"],
        ),
        (
            {"prompt": "a\x7fcat"},
            ["prompt: control character U+007F at character 1 (only line breaks and tabs are allowed)"],
        ),
        (
            {"prompt": "a\x9bcat"},  # a C1 control: a terminal's CSI on its own
            ["prompt: control character U+009B at character 1 (only line breaks and tabs are allowed)"],
        ),
        (
            {"prompt": "a\x1fcat"},  # the unit separator is no line break
            ["prompt: control character U+001F at character 1 (only line breaks and tabs are allowed)"],
        ),
    ],
    ids=[
        "width 0",
        "negative height",
        "not a multiple of 8",
        "below 64",
        "8 px",
        "steps 0",
        "steps 1001",
        "negative guidance",
        "infinite guidance",
        "nan guidance",
        "guidance past 30",
        "guidance 1e308",
        "seed 2**63",
        "seed -1",
        "long prompt",
        "long negative prompt",
        "blank prompt",
        "empty prompt",
        "half a UTF-16 pair",
        "NUL",
        "ESC",
        "DEL",
        "C1 control",
        "unit separator",
    ],
)
def test_each_rule_of_a_request_in_one_line(changes, lines):
    assert problems(**changes) == lines


def test_the_bounds_themselves_pass():
    for changes in (
        {"height": 64, "width": 64},
        {"height": 2048, "width": 72},
        {"steps": 1},
        {"steps": 1000},
        {"guidance_scale": 0.0},
        {"guidance_scale": 30.0},
        {"guidance_scale": 30},  # an integer from JSON
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"prompt": "x" * 10_000, "negative_prompt": "y" * 10_000},
        # Line breaks (what str.splitlines breaks at) and tabs are text; so are format characters.
        {"prompt": "a cat\ton a mat\r\nin\x0bthe\x0csun\x1c\x1d\x1e\x85\u2028\u2029", "negative_prompt": "\u200b"},
    ):
        assert problems(**changes) == [], changes


def test_a_familys_size_multiple_is_named_with_the_family():
    assert problems(FLUX, height=72) == ["size: 64x72: Flux.1 (schnell, dev) models need multiples of 16"]
    assert problems(FLUX, height=80) == []
    # Below 8's rule, the family's is not asked (one line per size).
    assert problems(FLUX, height=60) == ["size: 64x60: width and height must be positive multiples of 8"]


def test_every_problem_at_once_in_order():
    assert problems(
        prompt="\x00", negative_prompt="x" * 10_001, height=0, steps=0, guidance_scale=1e308, seed=2**63
    ) == [
        "prompt: control character U+0000 at character 0 (only line breaks and tabs are allowed)",
        "negative_prompt: 10001 characters; at most 10000",
        "size: 64x0: width and height must be positive multiples of 8",
        "steps: must be from 1 to 1000, got 0",
        "guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 1e+308",
        "seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got 9223372036854775808",
    ]


def test_a_requests_seeds_name_the_first_bad_one():
    from tpugen.config.request import ImageRequest

    image = ImageRequest(
        prompt="a cat", negative_prompt="", seed=2**63 - 2, steps=3, guidance_scale=7.5, height=64, width=64
    )
    assert image.problems(SD, seeds=range(2**63 - 2, 2**63 + 2)) == [
        "seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got 9223372036854775808"
    ]


def test_a_server_allows_the_sizes_and_guidance_it_keeps():
    from tpugen.config.request import RequestLimits

    # A server's config may warm 48 px and guide at 40 (a config allows both): its own requests pass.
    limits = RequestLimits.of_server([(48, 64), (64, 64)], 40.0)
    assert (limits.min_side, limits.max_guidance_scale) == (48, 40.0)
    assert problems(limits=limits, height=48, guidance_scale=40.0) == []
    assert problems(limits=limits, height=40, guidance_scale=40.5) == [
        "size: 64x40: width and height must be at least 48 (the smallest side this server keeps warm)",
        "guidance scale: must be at most 40 (this server's guidance_scale); got 40.5",
    ]
    assert RequestLimits.of_server([(512, 512)], 7.5) == RequestLimits()


def test_seed_minus_one_is_a_random_one_in_the_web_uis_range():
    from tpugen.config.request import RANDOM_SEEDS, seed_for

    assert all(0 <= seed_for(-1) < RANDOM_SEEDS for _ in range(100))
    assert (seed_for(0), seed_for(5), seed_for(-5)) == (0, 5, -5)  # -5 stays, and is refused with the request


# ---------------------------------------------------------------- a config's prompts


def _config_problems(tmp_path, config: dict) -> list[str]:
    with pytest.raises(InputError) as refused:
        load_config(write_config(tmp_path / "c.yaml", config))
    return refused.value.lines


def test_a_config_with_a_control_character_in_a_prompt_is_refused_with_its_path(tmp_path):
    config = tiny_config(
        tmp_path,
        prompts=["a cat", "a dog", "an owl\x00", {"prompt": "a \x1b[2Jfox", "negative_prompt": "dull\x07"}],
        negative_prompt="blurry\x1b",
    )
    assert _config_problems(tmp_path, config) == [
        "prompts[2]: control character U+0000 at character 6 (only line breaks and tabs are allowed)",
        "negative_prompt: control character U+001B at character 6 (only line breaks and tabs are allowed)",
    ]
    config["prompts"][2], config["negative_prompt"] = "an owl", "blurry"  # then the mapping's own are found
    assert _config_problems(tmp_path, config) == [
        "prompts[3]: prompt: control character U+001B at character 2 (only line breaks and tabs are allowed)",
        "prompts[3]: negative_prompt: control character U+0007 at character 4 (only line breaks and tabs are allowed)",
    ]


def test_a_prompts_file_with_a_control_character_is_refused_with_its_line(tmp_path):
    txt = with_prompts_file(tmp_path, tiny_config(tmp_path), ["a cat", "a \x1b[31mred fox"])
    assert _config_problems(tmp_path, txt) == [
        "prompts_file:2: prompt: control character U+001B at character 2 (only line breaks and tabs are allowed)"
    ]
    lines = ['{"prompt": "a cat"}', '{"prompt": "an owl\\u0000", "steps": 0, "seed": -1}']
    jsonl = with_prompts_file(tmp_path, tiny_config(tmp_path), lines, name="p.jsonl")
    assert _config_problems(tmp_path, jsonl) == [  # every problem of the line at once
        "prompts_file:2: prompt: control character U+0000 at character 6 (only line breaks and tabs are allowed)",
        "prompts_file:2: seed must be an integer >= 0, got -1",
        "prompts_file:2: steps must be an integer from 1 to 1000, got 0",
    ]


def test_a_configs_valid_prompts_sizes_and_guidance_load_as_before(tmp_path):
    # A config keeps what a request may not: 48-px sides (quick test models), guidance past 30, long prompts.
    long = "a cat, " * 2000
    config = tiny_config(
        tmp_path,
        prompts=["a cat\ton a mat\nat noon", {"prompt": long, "height": 48, "guidance_scale": 31.0, "seed": 5}],
        negative_prompt="blurry\x0cdull",
        guidance_scale=1000.5,
        height=48,
    )
    run = load_config(write_config(tmp_path / "c.yaml", config))
    assert [(p.prompt, p.negative_prompt, p.seed, p.guidance_scale, p.sizes) for p in run.prompts] == [
        ("a cat\ton a mat\nat noon", "blurry\x0cdull", None, 1000.5, ((48, 64),)),
        (long, "blurry\x0cdull", 5, 31.0, ((48, 64),)),
    ]


# ---------------------------------------------------------------- a server's requests (no device)


def _service(tmp_path, **changes):
    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service

    config = tiny_config(tmp_path, **changes)
    config["serve"] = {"new_shapes": "compile", **config.get("serve", {})}
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    return Service(run, [], output_root=tmp_path / "runs", display=Display())  # no engine: check needs none


def _web_ui_request(service, **fields):
    """The web UI's request as the server reads it: its images, then the check generate makes."""
    from tpugen.modes.serve.a1111 import Txt2Img, images_for

    images = images_for(service, Txt2Img(**{"prompt": "a cat", "seed": 3, **fields}))
    service.check(images)
    return images


@pytest.mark.parametrize(
    "fields,line",
    [
        ({"cfg_scale": 1e308}, "guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 1e+308"),
        ({"width": 0}, "size: 0x64: width and height must be positive multiples of 8"),
        (
            {"prompt": "a\x00cat"},
            "prompt: control character U+0000 at character 1 (only line breaks and tabs are allowed)",
        ),
        ({"seed": -5}, "seed: must be from 0 to 2**63 - 1 (or -1 for a random one), got -5"),
        ({"height": 32}, "size: 64x32: width and height must be at least 64 (the web UI's sliders start there)"),
    ],
    ids=["cfg 1e308", "width 0", "NUL prompt", "seed -5", "32 px"],
)
def test_a_web_ui_request_is_refused_by_the_same_rules(tmp_path, fields, line):
    with pytest.raises(InputError) as refused:
        _web_ui_request(_service(tmp_path), **fields)
    assert refused.value.lines == [line]


def test_every_problem_of_a_web_ui_request_at_once(tmp_path):
    service = _service(tmp_path)
    with pytest.raises(InputError) as refused:
        _web_ui_request(service, prompt="\x1b", n_iter=0, cfg_scale=1e308, width=0)
    assert refused.value.lines == [
        "batch_size and n_iter: must be at least 1, got 1 and 0",
        "prompt: control character U+001B at character 0 (only line breaks and tabs are allowed)",
        "size: 0x64: width and height must be positive multiples of 8",
        "guidance scale: must be at most 30 (the web UI's CFG slider stops there); got 1e+308",
    ]


def test_a_valid_web_ui_request_makes_the_images_it_made_before(tmp_path):
    from tpugen.plan import ImageWork

    service = _service(tmp_path)
    # The LoRA tag reader joins lines, as before; image i of the request gets seed + i.
    assert _web_ui_request(service, batch_size=2, cfg_scale=30, steps=1000, prompt="a cat\non a mat") == [
        ImageWork(
            prompt="a cat on a mat",
            negative_prompt="blurry",
            seed=seed,
            steps=1000,
            guidance_scale=30.0,
            height=64,
            width=64,
        )
        for seed in (3, 4)
    ]
    (image,) = _web_ui_request(service, seed=-1)  # the server's own size, steps and guidance
    assert (image.height, image.width, image.steps, image.guidance_scale) == (64, 64, 3, 7.5)
    assert 0 <= image.seed < 4294967294


def test_a_server_warming_small_sizes_and_strong_guidance_serves_them(tmp_path):
    # A config allows both; an OpenAI request takes the config's guidance as it is.
    service = _service(tmp_path, serve={"sizes": [[48, 48]]}, guidance_scale=40.0)
    (image,) = _web_ui_request(service)
    assert (image.height, image.width, image.guidance_scale) == (48, 48, 40.0)
    with pytest.raises(InputError) as refused:
        _web_ui_request(service, width=40, cfg_scale=41)
    assert refused.value.lines == [
        "size: 40x48: width and height must be at least 48 (the smallest side this server keeps warm)",
        "guidance scale: must be at most 40 (this server's guidance_scale); got 41.0",
    ]
