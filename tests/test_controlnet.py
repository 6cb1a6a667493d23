"""ControlNet: model.controlnets and a prompt's control images, run through diffusers' own ControlNet pipelines made
from the loaded components, against those pipelines on the CPU; the built-in preprocessors against OpenCV."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import annotator_weights, generate_in_new_process, run_cli, tiny_config, write_config
from PIL import Image, ImageDraw

from tpugen.config import load_config
from tpugen.config.controls import ANNOTATORS, CONTROL_MODULES, module_name
from tpugen.engine.controls import load_annotators, preprocess
from tpugen.errors import RunError
from tpugen.outputs.png import a1111_parameters
from tpugen.plan import plan_run

# Uncached tiny pipelines on XLA:CPU hold 2/255 of diffusers' eager CPU images (tests/test_img2img.py); so do these.
WITHIN = 2


def _control_images(tmp_path) -> None:
    """disc.png (a white disc on black, low left), drawing.png (black strokes on white), photo.png (noise with a
    red square: an init image), mask.png (its left part repainted), and ControlNet folders holding a config alone:
    sdxl-controlnet/, flux-controlnet/ (InstantX's kind), xlabs-controlnet/ (XLabs' Flux.1 kind), flux-union/ (a
    Flux.1 ControlNet-Union), zimage-1.0/ (a Z-Image ControlNet with a 16-channel control)."""
    disc = Image.new("RGB", (64, 64))
    ImageDraw.Draw(disc).ellipse((8, 30, 30, 52), fill=(255, 255, 255))
    disc.save(tmp_path / "disc.png")
    (tmp_path / "sdxl-controlnet").mkdir()
    sdxl = {"_class_name": "ControlNetModel", "addition_embed_type": "text_time", "cross_attention_dim": 2048}
    (tmp_path / "sdxl-controlnet" / "config.json").write_text(json.dumps(sdxl))
    (tmp_path / "flux-controlnet").mkdir()
    (tmp_path / "flux-controlnet" / "config.json").write_text(json.dumps({"_class_name": "FluxControlNetModel"}))
    xlabs = {"_class_name": "FluxControlNetModel", "conditioning_embedding_channels": 16}
    (tmp_path / "xlabs-controlnet").mkdir()
    (tmp_path / "xlabs-controlnet" / "config.json").write_text(json.dumps(xlabs))
    (tmp_path / "flux-union").mkdir()
    union = {"_class_name": "FluxControlNetModel", "num_mode": 10}
    (tmp_path / "flux-union" / "config.json").write_text(json.dumps(union))
    (tmp_path / "zimage-1.0").mkdir()
    zimage = {"_class_name": "ZImageControlNetModel", "control_in_dim": 16, "control_layers_places": [0]}
    (tmp_path / "zimage-1.0" / "config.json").write_text(json.dumps(zimage))
    drawing = Image.new("RGB", (96, 64), (255, 255, 255))
    ImageDraw.Draw(drawing).line((10, 10, 80, 50), fill=(0, 0, 0), width=2)
    drawing.save(tmp_path / "drawing.png")
    rng = np.random.default_rng(0)
    photo = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    photo[16:48, 16:48] = (220, 30, 30)
    Image.fromarray(photo).save(tmp_path / "photo.png")
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 40, 63), fill=255)  # repaint the left part
    mask.save(tmp_path / "mask.png")


def _config(tmp_path, prompts, **overrides) -> dict:
    return tiny_config(
        tmp_path, model={"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet"}]}, prompts=prompts, **overrides
    )


# ---------------------------------------------------------------- the preprocessors (no device)


def test_canny_is_opencvs_own_with_the_web_uis_thresholds():
    import cv2

    rng = np.random.default_rng(3)
    picture = (rng.random((40, 56, 3)) * 255).astype(np.uint8)
    picture[10:30, 12:40] = 250
    image = Image.fromarray(picture)
    for low, high in ((100, 200), (20, 60)):
        made = np.asarray(preprocess(image, "canny", low, high))
        edges = cv2.Canny(picture, low, high)
        assert made.shape == (40, 56, 3) and (made == edges[:, :, None]).all()
    # A white square on black has its edges, and nothing else, in white.
    square = np.zeros((32, 32, 3), np.uint8)
    square[8:24, 8:24] = 255
    edges = np.asarray(preprocess(Image.fromarray(square), "canny", 100, 200))[:, :, 0]
    assert edges[8:24, 7:9].any() and edges[12:20, 12:20].max() == 0 and edges[:4].max() == 0


def test_the_other_preprocessors():
    drawing = Image.new("RGB", (32, 32), (255, 255, 255))
    ImageDraw.Draw(drawing).line((4, 16, 28, 16), fill=(0, 0, 0), width=1)
    inverted = np.asarray(preprocess(drawing, "invert"))
    assert inverted[16, 10].tolist() == [255, 255, 255] and inverted[4, 4].tolist() == [0, 0, 0]
    scribble = np.asarray(preprocess(drawing, "scribble", 127))
    assert scribble[15:18, 10].min() == 255 and scribble[4, 4].max() == 0  # thickened to 3 px, white on black
    assert np.array_equal(np.asarray(preprocess(drawing, "none")), np.asarray(drawing))
    checker = Image.fromarray((np.indices((32, 32)).sum(0) % 2 * 255).astype(np.uint8)).convert("RGB")
    tiled = np.asarray(preprocess(checker, "tile", 4.0)).astype(int)
    assert tiled.shape == (32, 32, 3) and abs(tiled.mean() - 127.5) < 3 and tiled.std() < 10  # detail gone
    # And the extension's own weight-free ones (tests/test_control_modules.py checks each against its code).
    extension = {"threshold", "blur_gaussian", "color", "recolor_luminance", "recolor_intensity", "scribble_xdog"}
    extension |= {"tile_resample"}
    assert set(CONTROL_MODULES) == {"none", "canny", "invert", "scribble", "tile", "lineart_standard", *extension}


def test_annotators_are_controlnet_auxs_own_detectors_run_from_the_weights_folder(tmp_path):
    # Each annotator module is controlnet_aux's detector loaded from model.annotators_dir, called with the module's
    # options and thresholds at the image's shorter side, then fitted back to the image's size (64x96 here: its
    # output rounds to multiples of 64). The weights are random: the point is what runs, not what it sees.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import controlnet_aux

    from controlnet_aux.processor import MODEL_PARAMS, MODELS

    from tpugen.errors import InputError

    folder = str(annotator_weights(tmp_path / "annotators"))
    rng = np.random.default_rng(5)
    photo = Image.fromarray((rng.random((64, 96, 3)) * 255).astype(np.uint8))
    made, detectors = {}, {}
    runnable = {name: a for name, a in ANNOTATORS.items() if module_name(name, folder)}  # the next test: the rest
    assert {a.detector for name, a in ANNOTATORS.items() if name not in runnable} == {
        "MidasDetector",
        "OpenposeDetector",
    }
    for name, annotator in runnable.items():
        made[name] = np.asarray(preprocess(photo, name, None, None, folder))
        # Each module as controlnet_aux's own processor table runs it (its name for pidisafe is pidsafe).
        theirs = name.replace("pidisafe", "pidsafe")
        assert MODELS[theirs]["class"].__name__ == annotator.detector, name
        if annotator.detector not in detectors:
            detectors[annotator.detector] = getattr(controlnet_aux, annotator.detector).from_pretrained(folder)
        detector = detectors[annotator.detector]
        options = {
            **MODEL_PARAMS[theirs],
            **dict(spec for spec in (annotator.threshold_a, annotator.threshold_b) if spec),
        }
        own = detector(photo, detect_resolution=64, image_resolution=64, output_type="pil", **options)
        own = np.asarray(own.convert("RGB").resize((96, 64), Image.Resampling.BILINEAR))
        assert made[name].shape == (64, 96, 3) and np.array_equal(made[name], own), name
    assert made["softedge_hed"].std() > 1 and made["lineart_realistic"].std() > 1  # not blank
    # The options reach the detector: HED's safe steps and scribbles, and the coarse line-art model, differ.
    assert not np.array_equal(made["softedge_hed"], made["softedge_hedsafe"])
    assert not np.array_equal(made["softedge_hed"], made["scribble_hed"])
    assert not np.array_equal(made["lineart_realistic"], made["lineart_coarse"])
    assert module_name("hed", folder) == "softedge_hed" and module_name("hed") is None
    # Sizes a request may send: a tiny image runs at the least side (controlnet_aux would round it to 0), a large
    # one at most 1024 pixels a side; one too long for both is refused in one line.
    assert preprocess(Image.new("RGB", (1, 1)), "softedge_pidinet", annotators=folder).size == (1, 1)
    assert preprocess(Image.new("RGB", (2048, 128)), "softedge_pidinet", annotators=folder).size == (2048, 128)
    with pytest.raises(InputError, match="^10x300: an annotator takes images at most 16 times as long as wide$"):
        preprocess(Image.new("RGB", (10, 300)), "softedge_pidinet", annotators=folder)
    # A weights file that is not the model's is one line naming the detector and the folder (a server's start).
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "table5_pidinet.pth").write_bytes(b"not weights")
    with pytest.raises(RunError, match=r"^model.annotators_dir: PidiNetDetector cannot load its weights from '/"):
        load_annotators(str(tmp_path / "other"))


def test_the_config_hash_counts_the_annotator_weights_a_run_reads_by_content(tmp_path):
    import shutil

    _control_images(tmp_path)
    folder = annotator_weights(tmp_path / "a")
    shutil.copytree(folder, tmp_path / "b")

    def hash_of(annotators: str, module: str) -> str:
        config = _config(tmp_path, [{"prompt": "a cat", "control_image": "disc.png", "control_module": module}])
        config["model"]["annotators_dir"] = annotators
        return load_config(write_config(tmp_path / "run.yaml", config)).config_hash

    hed = hash_of("a", "softedge_hed")
    assert hash_of("b", "softedge_hed") == hed  # another folder of the same files
    assert hash_of("a", "canny") == hash_of("b", "canny")  # a run that reads none
    (tmp_path / "b" / "ControlNetHED.pth").write_bytes(b"other weights")
    assert hash_of("b", "softedge_hed") != hed
    assert hash_of("b", "mlsd") == hash_of("a", "mlsd")  # a file the run does not read changed

    # A resume compares them so too: another folder of the same weights goes on, weights changed in place do not.
    from tpugen.errors import InputError
    from tpugen.outputs.run_record import check_resumable, write_run_record

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hash_of("a", "softedge_hed")
    shutil.copy(tmp_path / "run.yaml", run_dir / "config.yaml")
    write_run_record(run_dir, load_config(tmp_path / "run.yaml"), "run")
    shutil.rmtree(tmp_path / "b")
    shutil.copytree(folder, tmp_path / "b")
    hash_of("b", "softedge_hed")
    assert check_resumable(load_config(tmp_path / "run.yaml"), run_dir) is None
    (tmp_path / "b" / "ControlNetHED.pth").write_bytes(b"other weights")
    with pytest.raises(InputError, match="in keys that change images: model.annotators_dir"):
        check_resumable(load_config(tmp_path / "run.yaml"), run_dir)


# ---------------------------------------------------------------- configs at the door (no device)


@pytest.mark.parametrize(
    "model, prompt, wanted",
    [
        ({}, {"control_image": "disc.png"}, "prompts[0]: control_image: the model has no ControlNet; name one in"),
        (None, {"control_scale": 0.5}, "prompts[0]: control_scale is for a prompt with a control_image"),
        (
            None,
            {"control_image": "disc.png", "control_module": "normal_bae"},
            "'normal_bae' needs an annotator model tpugen does not run yet (it runs softedge_hed, softedge_hedsafe",
        ),
        (
            None,
            {"control_image": "disc.png", "control_module": "softedge_hed"},
            "'softedge_hed' runs an annotator model (controlnet_aux's HEDdetector) from its weights on this machine: "
            "name a folder holding ControlNetHED.pth in model.annotators_dir",
        ),
        (  # a folder without the weights
            {"controlnets": [{"id": "tiny-sd-controlnet"}], "annotators_dir": "."},
            {"control_image": "disc.png", "control_module": "lineart_coarse"},
            "control_module: 'lineart_coarse' needs sk_model.pth, sk_model2.pth in model.annotators_dir (/",
        ),
        (
            {"controlnets": [{"id": "tiny-sd-controlnet"}], "annotators_dir": "nothere"},
            {"control_image": "disc.png"},
            "/nothere' is not a folder",
        ),
        (None, {"control_image": "disc.png", "control_module": "sketchy"}, "unknown module 'sketchy'; built in: none"),
        (None, {"control_image": "disc.png", "control_start": 0.6, "control_end": 0.5}, "control_start (0.6) must"),
        (None, {"control_image": "disc.png", "control_scale": 2.5}, "control_scale must be a number from 0 to 2"),
        (None, {"control_image": "disc.png", "control_scale": 10**400}, "control_scale must be a number from 0 to 2"),
        (None, {"control_image": ["disc.png", "disc.png"]}, "control_image: a list of 2; model.controlnets has 1"),
        (None, {"control_image": "../" * 40 + "etc/passwd"}, "is not an image PIL can read"),
        (None, {"control_image": "nothere.png"}, "prompts[0]: control_image: "),
        (None, {"control_image": "disc.png", "control_module": "none", "control_threshold_a": 5}, "takes no"),
        (None, {"control_image": "disc.png", "control_module": "tile", "control_threshold_a": 0}, "factor must be"),
        (None, {"control_image": "disc.png", "control_mode": 3}, "control_mode must be one of Balanced (0), My prompt"),
        (None, {"control_image": "disc.png", "control_mode": "Louder"}, "control_mode must be one of Balanced (0)"),
        (None, {"control_image": "disc.png", "control_mode": True}, "control_mode must be one of Balanced (0)"),
        (
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}]},
            {"control_image": "disc.png", "control_mode": 1},
            "prompts[0].control_mode: Z-Image models: the control modes but Balanced and per-residual weights",
        ),
        (
            {"id": "tiny-sd3", "controlnets": [{"id": "tiny-sd-controlnet"}]},
            {"control_image": "disc.png"},
            "models: tpugen drives ControlNets for Stable Diffusion 1.x/2.x, SDXL, Flux.1, Qwen-Image and Z-Image",
        ),
        (
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-sd-controlnet"}]},
            {"control_image": "disc.png"},
            "tiny-sd-controlnet is for Stable Diffusion 1.x/2.x models, not Z-Image",
        ),
        (  # ZImageControlNetPipeline runs its ControlNet at every step
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}]},
            {"control_image": "disc.png", "control_end": 0.5},
            "prompts[0]: control_start and control_end: Z-Image models: the ControlNet runs at every step",
        ),
        (
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}]},
            {"control_image": "disc.png", "init_image": "photo.png"},
            "control_image: with an init image, Z-Image models: diffusers 0.42 has no ControlNet img2img pipeline",
        ),
        (  # a 1.0 Z-Image ControlNet (16-channel control) has no room for the mask and the masked image
            {"id": "tiny-z-image", "controlnets": [{"id": "./zimage-1.0"}]},
            {"control_image": "disc.png", "init_image": "photo.png", "mask_image": "mask.png", "strength": 1},
            "prompts[0].control_image: inpainting, Z-Image models: a ControlNet whose control has 16 channels",
        ),
        (  # XLabs' Flux.1 ControlNet (an input hint block) beside InstantX's: refused before anything loads
            {"id": "tiny-flux", "controlnets": [{"id": "./flux-controlnet"}, {"id": "./xlabs-controlnet"}]},
            {"control_image": ["disc.png", "disc.png"]},
            "model.controlnets: Flux.1 (schnell, dev) models: XLabs' ControlNets (with an input hint block) and",
        ),
        (  # an InstantX Flux.1 ControlNet-Union needs a control type per unit
            {"id": "tiny-flux", "controlnets": [{"id": "./flux-union"}]},
            {"control_image": "disc.png"},
            "model.controlnets: Flux.1 (schnell, dev) models: a ControlNet-Union (its config's num_mode) needs",
        ),
        (  # Z-Image's ControlNet inpaints from noise: strength 1 only
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}]},
            {"control_image": "disc.png", "init_image": "photo.png", "mask_image": "mask.png", "strength": 0.75},
            "prompts[0].strength: with a control_image, Z-Image models: ControlNet inpainting starts from noise",
        ),
        (
            {"id": "tiny-z-image", "controlnets": [{"id": "tiny-z-image-controlnet"}] * 2},
            {"control_image": ["disc.png", "disc.png"]},
            "model.controlnets: Z-Image models: one ControlNet at a time (diffusers 0.42's ZImageControlNetPipeline",
        ),
        (  # a Flux.1 ControlNet's folder under a Z-Image model
            {"id": "tiny-z-image", "controlnets": [{"id": "./flux-controlnet"}]},
            {"control_image": "disc.png"},
            "is a FluxControlNetModel; Z-Image models take a ZImageControlNetModel",
        ),
        (
            {"id": "tiny-flux", "controlnets": [{"id": "tiny-sd-controlnet"}]},
            {"control_image": "disc.png"},
            "tiny-sd-controlnet is for Stable Diffusion 1.x/2.x models, not Flux.1 (schnell, dev)",
        ),
        (  # an SD-style ControlNet folder under a Flux.1 model
            {"id": "tiny-flux", "controlnets": [{"id": "./sdxl-controlnet"}]},
            {"control_image": "disc.png"},
            "is a ControlNetModel; Flux.1 (schnell, dev) models take a FluxControlNetModel",
        ),
        (
            {"id": "tiny-qwen-image", "controlnets": [{"id": "tiny-qwen-image-controlnet"}]},
            {"control_image": "disc.png", "init_image": "photo.png"},
            "control_image: with an init image, Qwen-Image models: diffusers 0.42's AutoPipeline makes no ControlNet",
        ),
        (
            {"id": "tiny-qwen-image", "controlnets": [{"id": "tiny-qwen-image-controlnet"}] * 2},
            {"control_image": ["disc.png", "disc.png"]},
            "model.controlnets: Qwen-Image models: one ControlNet at a time (diffusers 0.42's "
            "QwenImageMultiControlNetModel runs a single ControlNet-Union only",
        ),
        (
            {"id": "tiny-sdxl", "controlnets": [{"id": "tiny-sd-controlnet"}]},
            {"control_image": "disc.png"},
            "model.controlnets[0].id: tiny-sd-controlnet is for Stable Diffusion 1.x/2.x models, not Stable Diffusion XL",
        ),
        (  # a folder of an SDXL ControlNet (its config says text-time embeddings) under an SD model
            {"id": "tiny-sd", "controlnets": [{"id": "./sdxl-controlnet"}]},
            {"control_image": "disc.png"},
            "is another family's ControlNet (its config's addition_embed_type is 'text_time'; a Stable Diffusion",
        ),
        (
            {"id": "tiny-sd", "controlnets": [{"id": "./photo.png"}]},
            {"control_image": "disc.png"},
            "model.controlnets[0].id: ControlNet directory",
        ),
        (
            {"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet", "scale": -1}]},
            {"control_image": "disc.png"},
            "model.controlnets[0].scale: must be from 0 to 2",
        ),
    ],
)
def test_bad_control_settings_are_one_line_each(tmp_path, model, prompt, wanted):
    _control_images(tmp_path)
    config = _config(tmp_path, [{"prompt": "a cat", **prompt}])
    if model is not None:
        config["model"] = {"id": "tiny-sd", **model}
    result = run_cli("validate", write_config(tmp_path / "run.yaml", config))
    assert result.exit_code == 2 and wanted in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 + result.stderr.count("\n  ")


def test_models_lists_the_built_in_controlnets():
    listed = run_cli("models").output
    builtins = ("tiny-sd-controlnet", "tiny-shapes-controlnet", "tiny-sdxl-controlnet", "tiny-flux-controlnet")
    builtins += ("tiny-qwen-image-controlnet", "tiny-z-image-controlnet")
    assert all(name in listed for name in builtins)
    assert listed.index("ControlNets (model.controlnets ids") < listed.index("tiny-shapes-controlnet")


def test_offload_and_hires_with_controlnets_are_refused(tmp_path):
    _control_images(tmp_path)
    prompts = [{"prompt": "a cat", "control_image": "disc.png"}]
    for extra, wanted in (
        ({"execution": {"offload": "model"}}, "model.controlnets: with execution.offload: model: not built yet"),
        ({"hires": {"scale": 2}}, "model.controlnets: with hires: the second pass would run without"),
    ):
        path = write_config(tmp_path / "run.yaml", _config(tmp_path, prompts, **extra))
        result = run_cli("validate", path)
        assert result.exit_code == 2 and wanted in result.stderr, result.stderr


def test_units_plan_hash_and_parameters(tmp_path):
    _control_images(tmp_path)
    prompts = [
        {"prompt": "a cat", "control_image": "disc.png"},
        {"prompt": "a dog", "control_image": "drawing.png", "control_module": "scribble", "control_start": 0.5},
        {"prompt": "a fox", "control_image": "disc.png", "seed": 3},
        "a plain one",
    ]
    path = write_config(tmp_path / "run.yaml", _config(tmp_path, prompts))
    run = load_config(path)
    unit = run.prompts[1].controls.units[0]
    assert (unit.module, unit.scale, unit.start, unit.end, unit.threshold_a) == ("scribble", 1.0, 0.5, 1.0, 127.0)
    assert unit.image.sha256 == hashlib.sha256((tmp_path / "drawing.png").read_bytes()).hexdigest()
    # A call has one scale, start and end: the second prompt is a batch of its own; the plain one another key.
    plan = plan_run(run)
    assert [(str(b.shape), [i.prompt for i in b.items]) for b in plan.batches] == [
        ("64x64 b2 cfg 1 controlnet", ["a cat", "a fox"]),
        ("64x64 b2 cfg 1 controlnet", ["a dog"]),
        ("64x64 b2 cfg", ["a plain one"]),
    ]
    # The config hash counts the control image by content: another picture under the same name changes it.
    before = run.config_hash
    Image.new("RGB", (64, 64), (9, 9, 9)).save(tmp_path / "disc.png")
    assert load_config(path).config_hash != before
    # A run without ControlNets hashes as it did before they existed.
    plain = write_config(tmp_path / "plain.yaml", tiny_config(tmp_path, prompts=["a cat"]))
    assert "controlnets" not in json.dumps(load_config(plain).config.model_dump(exclude_defaults=True))
    record = {
        "prompt": "a dog",
        "steps": 3,
        "scheduler": "DDIM",
        "guidance_scale": 7.5,
        "seed": 1,
        "width": 64,
        "height": 64,
        "model": "tiny-sd",
        "tpugen_version": "0",
        "controlnet_units": [{"controlnet": "tiny-sd-controlnet", **unit.record()}],
    }
    assert a1111_parameters(record).splitlines()[-1] == (
        'Steps: 3, Sampler: DDIM, CFG scale: 7.5, Seed: 1, Size: 64x64, Model: tiny-sd, ControlNet 0: "Module: '
        "scribble, Model: tiny-sd-controlnet, Weight: 1.0, Resize Mode: Crop and Resize, Threshold A: 127.0, "
        'Guidance Start: 0.5, Guidance End: 1.0, Control Mode: Balanced", Version: tpugen 0'
    )


# ---------------------------------------------------------------- on the device


def _diffusers_controlled(
    record: dict,
    control: Image.Image,
    init: Image.Image | None = None,
    model: str = "tiny-sd",
    mask: Image.Image | None = None,
    residual_hook=None,
) -> np.ndarray:
    """The image diffusers' own ControlNet pipeline (txt2img, img2img from `init`, or inpainting of `init` under
    `mask`) makes on the CPU, eager and unpatched, from the record's prompt, seed and settings, with `control` as
    its control image; `model`'s built-in ControlNet is `model`-controlnet. The unit's scale is always passed: SD's
    ControlNet inpainting pipeline's default is 0.5, not 1. `residual_hook`: a forward hook on the ControlNet."""
    import diffusers
    import torch
    from diffusers import (
        AutoPipelineForImage2Image,
        AutoPipelineForInpainting,
        AutoPipelineForText2Image,
        DiffusionPipeline,
    )

    from tpugen.families import CONTROLNETS
    from tpugen.tiny import builtin_path

    family = CONTROLNETS[f"{model}-controlnet"][1]
    base = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
    controlnet_class = getattr(diffusers, family.controlnet.model_class)
    controlnet = controlnet_class.from_pretrained(str(builtin_path(f"{model}-controlnet")))
    if residual_hook is not None:  # what its outputs become before the denoiser takes them
        controlnet.register_forward_hook(residual_hook)
    auto = AutoPipelineForInpainting if mask else AutoPipelineForImage2Image if init else AutoPipelineForText2Image
    if mask and "inpaint" in family.controlnet.pipelines:  # Z-Image's, which AutoPipeline does not make
        auto = getattr(diffusers, family.controlnet.pipelines["inpaint"])
    pipe = auto.from_pipe(base, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    unit = record["controlnet_units"][0]
    true_cfg = {"true_cfg_scale": record["guidance_scale"]} if model == "tiny-qwen-image" else {}  # as tpugen's
    images = (
        {"image": init, "control_image": control, "strength": record["strength"]}
        if init
        else {family.controlnet.image_argument: control}
    )
    if not family.controlnet.window_refusal:  # Z-Image's pipeline takes no window (its units run 0 to 1)
        images.update(control_guidance_start=unit["start"], control_guidance_end=unit["end"])
    if mask and family.controlnet.inpaint_strength_refusal:  # nor a strength (it inpaints from noise)
        del images["strength"]
    if mask:
        images["mask_image"] = mask
    with torch.no_grad():
        made = pipe(
            prompt=record["prompt"],
            **({"negative_prompt": record["negative_prompt"]} if family.negative_prompt else {}),
            height=64,
            width=64,
            num_inference_steps=record["steps"],
            guidance_scale=record["guidance_scale"],
            generator=torch.Generator("cpu").manual_seed(record["seed"]),
            controlnet_conditioning_scale=unit["scale"],
            output_type="np",
            **images,
            **true_cfg,
        ).images[0]
    return (made * 255).round().clip(0, 255).astype(np.uint8)


def weighing(mode: int, weights: list | None = None):
    """A forward hook that weighs a UNet ControlNet's residuals as the web UI extension's hook.py does: per-residual
    weights in place of the scale; in the modes but Balanced the i-th residual (the mid block's last) times
    0.825 ** (12 - i), and in "ControlNet is more important" only the conditional rows keep them (diffusers' CFG
    batch puts the unconditional half first)."""
    import torch

    def hook(module, args, out):
        down, mid = out
        factors = list(weights) if weights is not None else [0.825 ** float(12 - i) for i in range(len(down) + 1)]
        keep = torch.ones(mid.shape[0], 1, 1, 1, dtype=mid.dtype)
        if mode == 2:
            keep[: mid.shape[0] // 2] = 0
        return tuple(d * factors[i] * keep for i, d in enumerate(down)), mid * factors[len(down)] * keep

    return hook


@pytest.mark.xla
def test_a_prompts_control_mode_weighs_the_residuals_as_the_extension_does(tmp_path):
    """A run config's control_mode: the image diffusers' pipeline makes with its ControlNet's residuals weighed as
    the extension weighs them (within 2/255), recorded and written into the PNG's parameters; on jax, one line."""
    _control_images(tmp_path)
    prompt = {"prompt": "a red circle", "seed": 3, "control_image": "disc.png", "control_module": "canny"}
    prompt.update(control_scale=0.8, control_mode="ControlNet is more important")
    config = _config(tmp_path, [prompt], height=64, width=64, steps=2)
    assert run_cli("generate", write_config(tmp_path / "run.yaml", config), "--quiet").exit_code == 0
    record = json.loads((tmp_path / "outputs" / "run" / "manifest.jsonl").read_text().splitlines()[0])
    assert record["controlnet_units"][0]["control_mode"] == 2
    made = np.asarray(Image.open(tmp_path / "outputs" / "run" / record["file"]).convert("RGB")).astype(np.int16)
    assert (
        "Control Mode: ControlNet is more important"
        in Image.open(tmp_path / "outputs" / "run" / record["file"]).info["parameters"]
    )
    control = Image.open(tmp_path / "disc.png").convert("RGB")
    from tpugen.engine.controls import preprocess

    expected = _diffusers_controlled(record, preprocess(control, "canny", 100, 200), residual_hook=weighing(2))
    assert int(np.abs(made - expected).max()) <= WITHIN
    config["execution"] = {"backend": "jax"}
    refused = run_cli("validate", write_config(tmp_path / "jax.yaml", config))
    assert (
        refused.exit_code == 2
        and "prompts[0].control_mode: a ControlNet unit's control mode but Balanced" in refused.stderr
    )


@pytest.mark.xla
def test_controlled_runs_are_diffusers_own_in_one_step_graph_with_no_compile_after_warmup(tmp_path):
    import cv2

    _control_images(tmp_path)
    prompts = [
        {"prompt": "a cat", "control_image": "disc.png"},
        # Another scale and start: a batch of its own at the same shape key, its steps outside [0.5, 1] given a
        # scale of 0 as data, so nothing compiles again.
        {
            "prompt": "a dog",
            "control_image": "drawing.png",
            "control_module": "canny",
            "control_start": 0.5,
            "control_scale": 0.7,
        },
        {"prompt": "a red square", "init_image": "photo.png", "strength": 0.7, "control_image": "disc.png"},
    ]
    # In a process of its own: the counts below are what each key compiles after the ones before it in this run.
    proc, run_dir = generate_in_new_process(tmp_path, model=_config(tmp_path, [])["model"], prompts=prompts)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    warm = {entry["shape_key"]: entry["graphs_per_phase"] for entry in report["warmup"]}
    # The ControlNet runs inside the step graph: one graph for every step of the key, as without it.
    assert warm == {
        "64x64 b2 cfg 1 controlnet": {
            "text encoding": 1,
            "first denoising step": 1,
            "later denoising steps": 0,
            "decoding": 1,
        },
        # img2img's image encoding joins the text's graph; its steps and decoding are the key above's.
        "64x64 b2 cfg img2img 1 controlnet": {
            "text encoding": 1,
            "first denoising step": 0,
            "later denoising steps": 0,
            "decoding": 0,
        },
    }
    batches = report["timed_phase"]["batches"]
    assert [b["transfers_to_host"] for b in batches] == [1, 1, 1] and [b["compiles"] for b in batches] == [0, 0, 0]

    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    disc = hashlib.sha256((tmp_path / "disc.png").read_bytes()).hexdigest()
    assert records[0]["controlnet_units"][0]["image_sha256"] == disc
    assert records[1]["controlnet_units"][0] | {"image_sha256": ""} == {
        "controlnet": "tiny-sd-controlnet",
        "image_sha256": "",
        "module": "canny",
        "scale": 0.7,
        "start": 0.5,
        "end": 1.0,
        "threshold_a": 100.0,
        "threshold_b": 200.0,
        "resize_mode": 1,
    }
    png = Image.open(run_dir / records[1]["file"])
    assert ', ControlNet 0: "Module: canny, Model: tiny-sd-controlnet, Weight: 0.7,' in png.text["parameters"]

    disc_image = Image.open(tmp_path / "disc.png").convert("RGB")
    drawing = np.asarray(Image.open(tmp_path / "drawing.png").convert("RGB").resize((96, 64)))[:, 16:80]
    canny = Image.fromarray(np.repeat(cv2.Canny(np.ascontiguousarray(drawing), 100, 200)[:, :, None], 3, axis=2))
    expected = [
        _diffusers_controlled(records[0], disc_image),
        _diffusers_controlled(records[1], canny),
        _diffusers_controlled(records[2], disc_image, Image.open(tmp_path / "photo.png").convert("RGB")),
    ]
    made = [np.asarray(Image.open(run_dir / r["file"]).convert("RGB"), np.int16) for r in records]
    apart = [int(np.abs(m - e.astype(np.int16)).max()) for m, e in zip(made, expected, strict=True)]
    assert max(apart) <= WITHIN, apart
    # The control steers: the first image without its ControlNet's residuals is another image.
    plain = _diffusers_controlled(
        {**records[0], "controlnet_units": [{**records[0]["controlnet_units"][0], "scale": 0.0}]}, disc_image
    )
    assert np.abs(made[0] - plain.astype(np.int16)).mean() > 1

    # resume refuses a run whose control image changed since it started, naming it; nothing is written.
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "disc.png")
    before = sorted(p.name for p in run_dir.iterdir())
    result = run_cli("resume", run_dir)
    assert result.exit_code == 2 and "prompt 0's control_image[0]" in result.stderr, result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.xla
@pytest.mark.parametrize(
    ("model", "guidance", "cfg", "tasks", "traced"),
    [
        ("tiny-sdxl", 7.5, "cfg", ("img2img", "inpaint"), None),
        # Flux.1's ControlNet takes its control image as VAE latents, encoded once before the loop.
        ("tiny-flux", 7.5, "nocfg", ("img2img", "inpaint"), None),
        # Qwen-Image's, as latents of its 5-D VAE; txt2img only (diffusers 0.42's AutoPipeline makes no ControlNet
        # img2img for it: refused at the door, test_bad_control_settings_are_one_line_each).
        ("tiny-qwen-image", 4.0, "cfg", (), None),
        # Z-Image's, as latents padded to its 33 channels, through its fixed-length path (the embedders and refiners
        # the transformer lends it), at every step (no window: refused at the door); it inpaints from noise, the
        # mask and the masked image's latents filling the other 17 channels (ZImageControlNetInpaintPipeline: no
        # img2img). Traced once (compile.trace_once), the ControlNet beside the transformer: the first step's
        # graphs are the CFG batch and the timestep's scaling, the ControlNet's, the transformer's, the guidance and
        # scheduler's step after it, and its first call's scale moved to the device.
        ("tiny-z-image", 4.0, "cfg", ("inpaint",), 5),
    ],
)
def test_each_familys_controlled_runs_are_diffusers_own_in_one_step_graph(
    tmp_path, model, guidance, cfg, tasks, traced
):
    from tpugen.families import CONTROLNETS

    _control_images(tmp_path)
    family = CONTROLNETS[f"{model}-controlnet"][1]
    windows = not family.controlnet.window_refusal
    prompts = [
        {"prompt": "a cat", "control_image": "disc.png"},
        # Another scale (and a unit that sits out the first half) in the same key: the scale is data.
        {
            "prompt": "a dog",
            "control_image": "disc.png",
            "control_scale": 0.7,
            **({"control_start": 0.5} if windows else {}),
        },
    ]
    if "img2img" in tasks:
        prompts.append(
            {"prompt": "a red square", "init_image": "photo.png", "strength": 0.7, "control_image": "disc.png"}
        )
    if "inpaint" in tasks:
        prompts.append(
            {
                "prompt": "a blue circle",
                "init_image": "photo.png",
                "mask_image": "mask.png",
                "strength": 1.0 if family.controlnet.inpaint_strength_refusal else 0.8,
                "control_image": "disc.png",
            }
        )
    controlled = {"id": model, "controlnets": [{"id": f"{model}-controlnet"}]}
    proc, run_dir = generate_in_new_process(
        tmp_path,
        model=controlled,
        prompts=prompts,
        batch_size=1,
        guidance_scale=guidance,
        compile={"trace_once": traced is not None},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    if traced:
        assert report["device"]["trace_once"]["beside"] == ["controlnet"], report["device"]["trace_once"]
    warm = {entry["shape_key"]: entry["graphs_per_phase"] for entry in report["warmup"]}
    # One step graph a key (recorded every step; traced, `traced` graphs in the first step); Flux.1's, Qwen-Image's
    # and Z-Image's control latents join the text encoding's graph (before the loop); the img2img key after it adds
    # its encoding alone.
    expected = {
        f"64x64 b1 {cfg} 1 controlnet": {
            "text encoding": 1,
            "first denoising step": traced or 1,
            "later denoising steps": 0,
            "decoding": 1,
        },
    }
    if "img2img" in tasks:
        expected[f"64x64 b1 {cfg} img2img 1 controlnet"] = {
            "text encoding": 1,
            "first denoising step": 0,
            "later denoising steps": 0,
            "decoding": 0,
        }
    if "inpaint" in tasks:
        # Inpainting blends the init image back after the last step (one more graph); Z-Image's ControlNet
        # inpainting blends nothing: its steps are the txt2img key's, the masked image encoded before the loop.
        blends = not family.controlnet.inpaint_strength_refusal
        expected[f"64x64 b1 {cfg} inpaint 1 controlnet"] = {
            "text encoding": 1,
            "first denoising step": int(blends),
            "later denoising steps": int(blends),
            "decoding": 0,
        }
    assert warm == expected, warm
    batches = report["timed_phase"]["batches"]
    assert [b["transfers_to_host"] for b in batches] == [1] * len(prompts)
    assert [b["compiles"] for b in batches] == [0] * len(prompts)
    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    disc = Image.open(tmp_path / "disc.png").convert("RGB")
    photo = Image.open(tmp_path / "photo.png").convert("RGB")
    mask = Image.open(tmp_path / "mask.png")
    expected_images = [
        _diffusers_controlled(
            record,
            disc,
            photo if "init_image" in prompt else None,
            model=model,
            mask=mask if "mask_image" in prompt else None,
        )
        for record, prompt in zip(records, prompts, strict=True)
    ]
    made = [np.asarray(Image.open(run_dir / r["file"]).convert("RGB"), np.int16) for r in records]
    apart = [int(np.abs(m - e.astype(np.int16)).max()) for m, e in zip(made, expected_images, strict=True)]
    assert max(apart) <= WITHIN, apart
    plain = _diffusers_controlled(
        {**records[0], "controlnet_units": [{**records[0]["controlnet_units"][0], "scale": 0.0}]}, disc, model=model
    )
    assert np.abs(made[0] - plain.astype(np.int16)).mean() > 1  # it steers


@pytest.mark.xla
@pytest.mark.parametrize(
    ("model", "cfg"),
    [
        ("tiny-sd", "cfg"),
        ("tiny-sdxl", "cfg"),  # SD's MultiControlNetModel too, with SDXL's text-time embeddings in each ControlNet
        # Flux.1's FluxMultiControlNetModel takes its control images one list per ControlNet (SD's, one per row).
        ("tiny-flux", "nocfg"),
    ],
)
def test_two_controlnets_at_once_traced_once_as_diffusers_multi_controlnet(tmp_path, model, cfg):
    import inspect

    import cv2
    import diffusers
    import torch
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForText2Image, DiffusionPipeline

    from tpugen.families import CONTROLNETS
    from tpugen.tiny import builtin_path

    _control_images(tmp_path)
    family = CONTROLNETS[f"{model}-controlnet"][1]
    two = {"id": model, "controlnets": [{"id": f"{model}-controlnet"}, {"id": f"{model}-controlnet", "scale": 0.5}]}
    units = {"control_image": ["disc.png", "drawing.png"], "control_module": ["none", "canny"]}
    prompts = [
        {"prompt": "a cat", **units},
        {"prompt": "a dog", **units, "control_start": [0.0, 0.5], "control_end": [0.5, 1.0]},
        # From an init image: diffusers' ControlNet img2img pipelines take a batch per ControlNet (SD's and SDXL's a
        # tensor, Flux.1's a list: ControlNets.multi_layout_from_image).
        {"prompt": "a red square", "init_image": "photo.png", "strength": 0.7, **units},
    ]
    # compile.trace_once on (tiny_config turns it off): the denoiser and both ControlNets under dynamo.
    proc, run_dir = generate_in_new_process(
        tmp_path, model=two, prompts=prompts, batch_size=1, compile={"trace_once": True}
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["device"]["trace_once"]["state"] == "on"
    assert report["device"]["trace_once"]["beside"] == ["controlnet 0", "controlnet 1"]
    keys = [f"64x64 b1 {cfg} 2 controlnets", f"64x64 b1 {cfg} img2img 2 controlnets"]
    assert [e["shape_key"] for e in report["warmup"]] == keys
    # The second prompt's units sit out half the steps each: their scales are data, nothing compiles again.
    assert report["compiles_after_warmup"] == 0
    assert [b["transfers_to_host"] for b in report["timed_phase"]["batches"]] == [1, 1, 1]

    base = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
    controlnet = getattr(diffusers, family.controlnet.model_class).from_pretrained(
        str(builtin_path(f"{model}-controlnet"))
    )
    pipe = AutoPipelineForText2Image.from_pipe(base, controlnet=[controlnet, controlnet])
    assert type(pipe.controlnet).__name__ == family.controlnet.multi_class
    pipe.set_progress_bar_config(disable=True)
    from_image = AutoPipelineForImage2Image.from_pipe(base, controlnet=[controlnet, controlnet])
    from_image.set_progress_bar_config(disable=True)
    photo = Image.open(tmp_path / "photo.png").convert("RGB")
    drawing = np.asarray(Image.open(tmp_path / "drawing.png").convert("RGB"))[:, 16:80]
    canny = Image.fromarray(np.repeat(cv2.Canny(np.ascontiguousarray(drawing), 100, 200)[:, :, None], 3, axis=2))
    controls = [Image.open(tmp_path / "disc.png").convert("RGB"), canny]
    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert [u["scale"] for u in records[0]["controlnet_units"]] == [1.0, 0.5]
    made = [np.asarray(Image.open(run_dir / r["file"]).convert("RGB"), np.int16) for r in records]
    for record, image in zip(records, made, strict=True):
        starts = [u["start"] for u in record["controlnet_units"]]
        ends = [u["end"] for u in record["controlnet_units"]]
        negative = {"negative_prompt": record["negative_prompt"]} if family.negative_prompt else {}
        started = "strength" in record and record.get("init_image_sha256")
        images = {"image": photo, "control_image": controls, "strength": record["strength"]} if started else {}
        if started and "control_mode" in inspect.signature(type(from_image).__call__).parameters:
            images["control_mode"] = [None, None]  # Flux.1's img2img runs no ControlNet without a mode for each
        with torch.no_grad():
            expected = (from_image if started else pipe)(
                prompt=record["prompt"],
                **negative,
                **(images or {family.controlnet.image_argument: controls}),
                height=64,
                width=64,
                num_inference_steps=record["steps"],
                guidance_scale=record["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(record["seed"]),
                controlnet_conditioning_scale=[1.0, 0.5],
                control_guidance_start=starts,
                control_guidance_end=ends,
                output_type="np",
            ).images[0]
        expected = (expected * 255).round().clip(0, 255).astype(np.int16)
        assert int(np.abs(image - expected).max()) <= WITHIN, record["file"]
    # Both ControlNets steer: the second one's scale at 0 gives another image.
    with torch.no_grad():
        first_only = pipe(
            prompt=records[0]["prompt"],
            **({"negative_prompt": records[0]["negative_prompt"]} if family.negative_prompt else {}),
            **{family.controlnet.image_argument: controls},
            height=64,
            width=64,
            num_inference_steps=records[0]["steps"],
            guidance_scale=records[0]["guidance_scale"],
            generator=torch.Generator("cpu").manual_seed(records[0]["seed"]),
            controlnet_conditioning_scale=[1.0, 0.0],
            output_type="np",
        ).images[0]
    assert np.abs(made[0] - (first_only * 255).round().astype(np.int16)).mean() > 1


@pytest.mark.xla
def test_plan_counts_what_each_familys_controlnet_hands_its_denoiser(tmp_path):
    # ControlNets.residuals against what diffusers' own ControlNet returns, eager on the CPU, one step at
    # 64x96 (no CFG: one row): a UNet ControlNet's down and mid residuals, the transformer ones' block hints.
    # Z-Image's joint sequence pads the text to 32 tokens here (diffusers' real caption length; tpugen's is 512).
    import diffusers
    import torch
    from diffusers import AutoPipelineForText2Image, DiffusionPipeline

    from tpugen import app
    from tpugen.families import CONTROLNETS
    from tpugen.memory import denoiser_config
    from tpugen.models import classify_model_id
    from tpugen.tiny import builtin_path

    def elements(output) -> int:
        if isinstance(output, torch.Tensor):
            return output.numel()
        values = output.values() if isinstance(output, dict) else output
        return sum(elements(value) for value in values)

    for model in ("tiny-sd", "tiny-sdxl", "tiny-flux", "tiny-qwen-image", "tiny-z-image"):
        family = CONTROLNETS[f"{model}-controlnet"][1]
        base = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
        folder = builtin_path(f"{model}-controlnet")
        controlnet = getattr(diffusers, family.controlnet.model_class).from_pretrained(str(folder))
        pipe = AutoPipelineForText2Image.from_pipe(base, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        handed: list[int] = []
        controlnet.register_forward_hook(lambda module, args, output, seen=handed: seen.append(elements(output)))
        with torch.no_grad():
            pipe(
                prompt="a cat",
                height=64,
                width=96,
                num_inference_steps=1,
                guidance_scale=0.0 if model == "tiny-z-image" else 1.0,
                **{family.controlnet.image_argument: Image.new("RGB", (96, 64))},
                output_type="latent",
            )
        config = json.loads((folder / "config.json").read_text())
        _, vae_scale = denoiser_config(classify_model_id(model), family.denoiser)
        counted = family.controlnet.residuals(config, 64, 96, vae_scale=vae_scale, text_tokens=32)
        assert counted == handed[0], (model, counted, handed[0])

    # tpugen plan says it for the largest controlled key: tiny-sd's two rows of CFG, float32.
    _control_images(tmp_path)
    config = _config(tmp_path, [{"prompt": "a cat", "control_image": "disc.png"}, "a plain prompt"])
    view = app.plan(load_config(write_config(tmp_path / "run.yaml", config)))
    residuals = CONTROLNETS["tiny-sd-controlnet"][1].controlnet.residuals(
        json.loads((builtin_path("tiny-sd-controlnet") / "config.json").read_text()), 64, 64, vae_scale=8, text_tokens=0
    )
    assert view.controlnets["bytes"] == 2 * 2 * residuals * 4  # batch 2, doubled by CFG, float32
    assert view.controlnets["note"].startswith("controlnets: the ControlNet's residuals, handed to the unet")


@pytest.mark.xla  # no device, but 1 GB of weights and two real-size models: the slow tier
def test_depth_and_pose_are_controlnet_auxs_own_from_the_weights_folder(tmp_path):
    # MiDaS (DPT-hybrid, 123M parameters) and OpenPose (body, hand and face models): 1 GB of random weights of their
    # real architectures written here, each module run as controlnet_aux's processor table runs it (the extension's
    # openpose_hand draws the body too, where controlnet_aux's does not).
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import controlnet_aux
        from controlnet_aux.processor import MODEL_PARAMS

    folder = str(annotator_weights(tmp_path / "annotators", depth=True, pose=True))
    photo = Image.fromarray((np.random.default_rng(6).random((64, 96, 3)) * 255).astype(np.uint8))
    assert module_name("depth", folder) == "depth_midas"  # the extension's older name
    detectors = {}
    for name in ("depth_midas", "openpose", "openpose_hand", "openpose_face", "openpose_faceonly", "openpose_full"):
        annotator = ANNOTATORS[name]
        if annotator.detector not in detectors:
            detectors[annotator.detector] = getattr(controlnet_aux, annotator.detector).from_pretrained(folder)
        options = {**MODEL_PARAMS.get(name, {}), **({"include_body": True} if name == "openpose_hand" else {})}
        assert dict(annotator.options) == options, name
        made = preprocess(photo, name, None, None, folder)
        own = detectors[annotator.detector](
            photo, detect_resolution=64, image_resolution=64, output_type="pil", **options
        )
        assert made.size == (96, 64) and own.size == (128, 64), name  # controlnet_aux rounds to multiples of 64
        own = own.convert("RGB").resize((96, 64), Image.Resampling.BILINEAR)
        assert np.array_equal(np.asarray(made), np.asarray(own)), name


@pytest.mark.xla
def test_two_kinds_of_flux_controlnet_are_refused_when_loaded(tmp_path):
    # An XLabs Flux.1 ControlNet (an input hint block: it takes pixels) beside an InstantX one (VAE latents): diffusers'
    # multi-ControlNet pipeline would give both the first one's kind of control. Known once both are loaded (a hub
    # ControlNet's config is read only then): one line, before any warmup.
    from diffusers import FluxControlNetModel

    from tpugen.tiny import builtin_path

    _control_images(tmp_path)
    instantx = dict(FluxControlNetModel.load_config(str(builtin_path("tiny-flux-controlnet"))))
    FluxControlNetModel.from_config({**instantx, "conditioning_embedding_channels": 16}).save_pretrained(
        tmp_path / "xlabs"
    )
    config = _config(tmp_path, [{"prompt": "a cat", "control_image": ["disc.png", "disc.png"]}])
    config["model"] = {"id": "tiny-flux", "controlnets": [{"id": "tiny-flux-controlnet"}, {"id": "./xlabs"}]}
    result = run_cli("generate", write_config(tmp_path / "run.yaml", config), "--quiet")
    assert result.exit_code != 0 and "warmup" not in result.output, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model.controlnets: Flux.1 (schnell, dev) models: XLabs' ControlNets (with an input hint block) and "
        "InstantX's (without) cannot run together: diffusers 0.42's FluxMultiControlNetModel gives every ControlNet "
        "the first one's kind of control image"
    ), result.stderr


@pytest.mark.parametrize(
    ("model", "task", "layout"),
    [
        ("tiny-sd", "txt2img", "rows"),
        ("tiny-flux", "txt2img", "controlnets"),
        ("tiny-sdxl", "txt2img", "controlnet batches"),
        ("tiny-sd", "img2img", "controlnet batches"),
        ("tiny-sdxl", "inpaint", "controlnet batches"),
        ("tiny-flux", "inpaint", "controlnets"),
    ],
)
def test_two_rows_of_two_units_reach_the_pipeline_in_its_own_layout(tmp_path, model, task, layout):
    """SD's multi-ControlNet txt2img pipeline takes a list per row, Flux.1's pipelines a list per ControlNet, SDXL's
    txt2img and SD's and SDXL's img2img and inpaint ones a batch tensor per ControlNet: with two rows and two
    ControlNets (the square case, where a wrong layout would swap images silently), each image lands where the
    family's pipeline reads it; from an init image, with a control mode per ControlNet (Flux.1's need one)."""
    from types import SimpleNamespace

    from tpugen.engine.pipeline import LoadedPipeline
    from tpugen.families import CONTROLNETS

    _control_images(tmp_path)
    colours = {(row, unit): (60 * row + 20 * unit + 10, 0, 0) for row in (0, 1) for unit in (0, 1)}
    for (row, unit), colour in colours.items():
        Image.new("RGB", (64, 64), colour).save(tmp_path / f"r{row}u{unit}.png")
    controlnet = f"{model}-controlnet"
    start = {"init_image": "photo.png", "strength": 0.7} if task != "txt2img" else {}
    start.update({"mask_image": "mask.png"} if task == "inpaint" else {})
    prompts = [{"prompt": f"p {row}", "control_image": [f"r{row}u0.png", f"r{row}u1.png"], **start} for row in (0, 1)]
    config = _config(tmp_path, prompts)
    config["model"] = {"id": model, "controlnets": [{"id": controlnet}, {"id": controlnet}]}
    config["batch_size"] = 2
    run = load_config(write_config(tmp_path / "run.yaml", config))
    [batch] = plan_run(run).batches
    assert batch.shape.task == task
    family = CONTROLNETS[controlnet][1]
    assert (
        family.controlnet.multi_layout if task == "txt2img" else family.controlnet.multi_layout_from_image
    ) == layout
    loaded = SimpleNamespace(family=family, annotators=None, _residual_weights=[])
    arguments = LoadedPipeline._control_arguments(loaded, batch, "image")
    images = arguments["image"]
    assert arguments.get("control_mode") == (None if task == "txt2img" else [None, None])

    def red(image) -> int:
        return int(np.asarray(image)[0, 0, 0])

    if layout == "rows":
        assert [[red(image) for image in row] for row in images] == [[10, 30], [70, 90]]
    elif layout == "controlnets":
        assert [[red(image) for image in column] for column in images] == [[10, 70], [30, 90]]
    else:  # a (rows, 3, height, width) tensor in [0, 1] per ControlNet
        assert [tuple(batch.shape) for batch in images] == [(2, 3, 64, 64)] * 2
        assert [[round(float(batch[row, 0, 0, 0]) * 255) for row in (0, 1)] for batch in images] == [[10, 70], [30, 90]]


def test_a_run_record_holds_the_units_and_a_plain_prompt_as_before(tmp_path):
    from tpugen.outputs.run_record import prompts_data, recorded_prompts

    _control_images(tmp_path)
    prompts = [
        {"prompt": "a cat", "control_image": "disc.png", "control_module": "none", "control_threshold_a": None},
        "a plain one",
    ]
    run = load_config(write_config(tmp_path / "run.yaml", _config(tmp_path, prompts)))
    data = json.loads(json.dumps(prompts_data(run.prompts)))
    assert "controls" in data[0] and "controls" not in data[1]  # a run from before ControlNets resumes as it was
    assert recorded_prompts({"prompts": data}) == run.prompts
