"""The ControlNet extension's weight-free preprocessors (sd-webui-controlnet 1.1.455) as tpugen runs them: each equal,
byte for byte, to what the extension's own code made of the same pictures. tests/data/controlnet_extension_modules.npz
holds three pictures (a drawing, a noisy gradient, flat shapes; sides not multiples of 64) and each module's output
on each (tile_resample's smaller than the picture, as the extension's /controlnet/detect answers), made by running the extension's preprocessor classes (its scripts/preprocessor and annotator code at commit
56cec5b, A1111 stubbed out) at the picture's own size, as /controlnet/detect returns them. Device-free."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, tiny_config, write_config
from PIL import Image

from tpugen.config.controls import CONTROL_MODULES, control_types, module_name
from tpugen.engine.controls import preprocess

MADE = Path(__file__).parent / "data" / "controlnet_extension_modules.npz"


def _cases() -> list[tuple[str, float | None, str]]:
    with np.load(MADE) as made:
        keys = [key for key in made.files if not key.startswith("image/")]
    cases = []
    for key in keys:
        module, threshold, picture = key.split("|")
        cases.append((module, float(threshold) if threshold else None, picture))
    return sorted(cases, key=lambda case: (case[0], case[1] or 0.0, case[2]))


@pytest.mark.parametrize(("module", "threshold_a", "picture"), _cases())
def test_a_weight_free_module_makes_what_the_extension_makes(module, threshold_a, picture):
    with np.load(MADE) as made:
        image, expected = (
            made[f"image/{picture}"],
            made[f"{module}|{'' if threshold_a is None else threshold_a}|{picture}"],
        )
    named = module_name(module)  # the extension's name (its label where it has one), as a request sends it
    assert named in CONTROL_MODULES, module
    ours = np.asarray(preprocess(Image.fromarray(image), named, threshold_a))
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    apart = np.abs(ours.astype(np.int16) - expected.astype(np.int16))
    assert int(apart.max()) == 0, (module, threshold_a, picture, int(apart.max()), float((apart > 0).mean()))
    if module == "tile_resample" and (threshold_a or 1.0) < 1.1:  # the picture as it is, at the default rate
        assert np.array_equal(ours, image)
    elif module not in ("blur_gaussian", "color"):  # these keep the picture's colours; the rest are drawn anew
        assert ours.shape != image.shape or not np.array_equal(ours, image)


@pytest.mark.parametrize(
    ("module", "threshold", "expected"),
    [
        ("threshold", 300, "control_threshold_a: threshold's threshold must be from 0 to 255, got 300"),
        ("blur_gaussian", 0, "control_threshold_a: blur_gaussian's sigma must be from 0.01 to 64, got 0"),
        ("recolor_luminance", 5, "control_threshold_a: recolor_luminance's gamma must be from 0.1 to 2, got 5"),
        ("scribble_xdog", 0.5, "control_threshold_a: scribble_xdog's threshold must be from 1 to 64, got 0.5"),
        ("t2ia_color_grid", 3, "control_threshold_a: module color takes no threshold_a"),
    ],
)
def test_a_threshold_outside_the_modules_range_is_refused_naming_it(tmp_path, module, threshold, expected):
    Image.new("RGB", (64, 64), (200, 200, 200)).save(tmp_path / "c.png")
    config = tiny_config(
        tmp_path,
        model={"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet"}]},
        prompts=[
            {
                "prompt": "a cat",
                "control_image": str(tmp_path / "c.png"),
                "control_module": module,
                "control_threshold_a": threshold,
            }
        ],
    )
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_control_types_pick_controlnets_by_the_words_their_names_hold():
    """The extension's select_control_type on names: the type's own name or its filters (T2I-Adapter's t2ia,
    Tile's blur, a Union ControlNet for the types it covers), "None" first, the default the first with "11" in its
    name (before any hash), else the first."""
    names = [
        "control_sd15_canny [aa11bb22]",
        "control_v11p_sd15_canny [d14c016b]",
        "t2iadapter_color_sd14v1",
        "controlnet-union-sdxl-1.0",
        "blur_tile_xl",
    ]
    types = control_types(["none", "canny", "tile", "color"], names)["control_types"]
    canny = types["Canny"]
    assert canny["model_list"] == ["None", names[0], names[1], names[3]]
    assert canny["default_model"] == names[1]  # "11" in the name before its hash; the first's is in its hash
    assert (
        types["T2I-Adapter"]["model_list"] == ["None", names[2]] and types["T2I-Adapter"]["default_model"] == names[2]
    )
    assert types["T2I-Adapter"]["module_list"] == ["none", "t2ia_color_grid"]
    assert types["Tile"]["model_list"] == ["None", names[3], names[4]]
    assert types["Shuffle"] == {
        "module_list": ["none"],
        "model_list": ["None"],
        "default_option": "none",
        "default_model": "None",
    }
    assert types["All"]["model_list"] == ["None", *names]


def test_module_detail_gives_the_extensions_sliders_for_the_thresholds_read():
    from tpugen.config.controls import ANNOTATORS, SLIDERS, THRESHOLD_A_RANGES, module_detail, module_thresholds

    # The extension's canny sliders (its modules_test), less its resolution one: tpugen does not read processor_res.
    assert module_detail("canny") == {
        "model_free": False,
        "sliders": [
            {"name": "Low Threshold", "value": 100, "min": 1, "max": 255, "step": 1},
            {"name": "High Threshold", "value": 200, "min": 1, "max": 255, "step": 1},
        ],
    }
    assert module_detail("invert") == {"model_free": False, "sliders": []}
    for name in [*CONTROL_MODULES, *ANNOTATORS]:
        detail, defaults = module_detail(name), module_thresholds(name)
        # One slider per threshold the module reads, none for one it does not; each default inside its range.
        assert len(detail["sliders"]) == sum(value is not None for value in defaults), name
        assert set(SLIDERS) <= {*CONTROL_MODULES, *ANNOTATORS}
        for slider, value in zip(detail["sliders"], defaults, strict=False):
            assert slider["value"] == value and slider["min"] <= value <= slider["max"], (name, slider)
        if name in THRESHOLD_A_RANGES:  # the range a request is held to is the one the slider shows
            assert THRESHOLD_A_RANGES[name][:2] == (detail["sliders"][0]["min"], detail["sliders"][0]["max"])


def test_tile_resamples_map_is_scaled_back_to_the_generations_size(tmp_path):
    """The extension's tile_resample map is smaller than its image; the ControlNet takes it scaled back up to the
    generation's size, by cubic interpolation (the extension's choice for a map of many colours)."""
    import cv2

    from tpugen.config.controls import ControlUnit
    from tpugen.config.images import InputImage
    from tpugen.engine.controls import control_image

    with np.load(MADE) as made:
        photo = made["image/photo"]  # 80x64
    Image.fromarray(photo).save(tmp_path / "photo.png")
    unit = ControlUnit(
        InputImage(str(tmp_path / "photo.png"), "0" * 64), "tile_resample", threshold_a=3.7, resize_mode=0
    )
    control = np.asarray(control_image(unit, 80, 64))
    small = cv2.resize(photo, (21, 17), interpolation=cv2.INTER_AREA)  # int(80 / 3.7), int(64 / 3.7)
    assert np.array_equal(control, cv2.resize(small, (80, 64), interpolation=cv2.INTER_CUBIC))
    # At the default rate the control is the image as it is.
    same = ControlUnit(
        InputImage(str(tmp_path / "photo.png"), "0" * 64), "tile_resample", threshold_a=1.0, resize_mode=0
    )
    assert np.array_equal(np.asarray(control_image(same, 80, 64)), photo)
