"""The server's hardening rules that need no device: the strength that runs one step, the steps a sampler runs,
the Host and Origin rules, and an engine that keeps its warm shapes through a flash-attention failure."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tpugen.config.request import strength_to_run
from tpugen.errors import InputError
from tpugen.modes.serve.browsers import host_name, host_problem, is_loopback, origin_problem


@pytest.mark.parametrize(
    "steps,strength,runs",
    [(2, 0.4, 1), (10, 0.05, 1), (49, 0.001, 1), (3, 0.01, 1), (20, 0.75, 15), (2, 1.0, 2), (1000, 1e-9, 1)],
)
def test_an_img2img_strength_runs_at_least_one_step_as_the_web_ui_does(steps, strength, runs):
    given = strength_to_run(steps, strength)
    assert int(steps * given) == runs  # diffusers' Stable Diffusion rule: int(steps x strength) steps
    assert given == strength or given <= 1.0 / steps + 1e-15  # raised no further than one step needs
    # A flow-matching pipeline runs steps - int(steps - steps x strength): one step from the same clamp.
    assert steps - int(max(steps - steps * given, 0)) == runs


def _fox(**changes):
    """The image the checks below send (a server's ImageWork), with `changes`."""
    from tpugen.plan import ImageWork

    fields = {"prompt": "a fox", "negative_prompt": "", "seed": 1, "steps": 3, "guidance_scale": 7.5}
    return ImageWork(**{**fields, "height": 64, "width": 64, **changes})


def test_the_most_steps_a_sampler_runs_is_what_indexes_its_tables():
    from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    from tpugen.engine.pipeline import _most_steps

    ddim = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1}
    # DDIM's 1000 steps of 1000, offset by 1, ask for timestep 1000 (its step's IndexError).
    assert _most_steps(lambda: DDIMScheduler(**ddim)) == 999
    assert _most_steps(lambda: DDIMScheduler(**{**ddim, "steps_offset": 0})) == 1000
    assert _most_steps(lambda: EulerAncestralDiscreteScheduler(**ddim)) == 1000
    assert _most_steps(lambda: FlowMatchEulerDiscreteScheduler(shift=3.0)) == 1000  # no tables to index
    # Flux's: set_timesteps needs the pipeline's mu, which only the pipeline knows; it is not judged here.
    assert _most_steps(lambda: FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) == 1000


@pytest.mark.parametrize(
    "header,name",
    [("127.0.0.1:7860", "127.0.0.1"), ("[::1]:80", "::1"), ("LocalHost", "localhost"), ("a:b:c", ""), ("[::1", "")],
)
def test_a_host_header_s_name(header, name):
    assert host_name(header) == name


def test_a_loopback_server_answers_loopback_names_and_the_allowed_ones_only():
    for host in ("127.0.0.1:7860", "localhost:7860", "[::1]:7860", "127.8.9.10", "tpugen.internal:80"):
        assert host_problem(host, loopback_only=True, allowed=["TPUGEN.internal"]) is None, host
    for host in ("attacker.example:7860", "", None, "127.0.0.1.attacker.example", "0.0.0.0:7860"):
        problem = host_problem(host, loopback_only=True, allowed=[])
        assert problem is not None and problem.startswith("Host: ") and "serve.allowed_hosts" in problem, host
    assert host_problem("attacker.example", loopback_only=False, allowed=[]) is None  # bound elsewhere: key needed
    assert is_loopback("::1") and is_loopback("[::1]") and not is_loopback("10.0.0.1")


def test_only_the_server_s_own_page_and_the_allowed_origins_may_call_it():
    own = "127.0.0.1:7860"
    assert origin_problem(None, own, "http", []) is None  # curl, the openai client: no Origin
    assert origin_problem("http://127.0.0.1:7860", own, "http", []) is None  # the server's own page
    assert origin_problem("https://studio.example", own, "http", ["https://studio.example"]) is None
    for origin in ("https://attacker.example", "null", "http://127.0.0.1:7861", "http://localhost:7860"):
        problem = origin_problem(origin, own, "http", [])
        assert (
            problem == f"Origin: {origin!r} may not call this server (serve.allowed_origins lists the pages that may)"
        )


def test_a_call_that_fails_with_flash_attention_keeps_the_warm_shapes_warm():
    """A failure with the kernel on: its processors come off and the call is made again, and every shape warmed
    before stays warm (a server keeps serving it, compiling it once more), warmed again by the next warmup."""
    from conftest import Recording

    from tpugen.backends.base import FlashAttention
    from tpugen.engine.engine import Engine

    calls, removed = [], []

    class Loaded:
        hooks = SimpleNamespace(remove=removed.append)

        def generate(self, batch, census=False):
            calls.append(batch)
            if len(calls) == 1:
                raise RuntimeError("Mosaic: the kernel does not fit this shape")
            return "pixels"

    engine = object.__new__(Engine)
    engine.loaded, engine.backend = Loaded(), SimpleNamespace(counters=lambda: None)
    engine.flash_attention = FlashAttention(True, ("unet",))
    warm = {("64x64 b2 cfg", "DDIM"): {"shape_key": "64x64 b2 cfg"}, ("96x96 b2 cfg", "DDIM"): {}}
    engine.warm, engine._warmed_stale = dict(warm), set()
    display = Recording()
    assert engine._call_with_flash(SimpleNamespace(shape="96x96 b2 cfg"), display) == "pixels"
    assert len(calls) == 2 and removed == ["flash attention"] and not engine.flash_attention.on
    assert engine.warm == warm and engine._warmed_stale == set(warm)
    assert display.warnings == ["flash attention: off -- RuntimeError: Mosaic: the kernel does not fit this shape"]


def _compile_service(tmp_path, **serve):
    from conftest import tiny_config, write_config

    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service

    config = tiny_config(tmp_path, serve={"new_shapes": "compile", **serve})
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    return Service(run, [], output_root=tmp_path / "runs", display=Display())


def test_under_new_shapes_compile_a_side_past_serve_max_side_is_refused(tmp_path):
    from tpugen.errors import InputError

    service = _compile_service(tmp_path)
    service.check([_fox(height=2048)])  # the default bound, 2048, is fine
    with pytest.raises(InputError) as refused:
        service.check([_fox(width=8192)])
    assert refused.value.lines == ["size: 8192x64: width and height must be at most 2048 (serve.max_side)"]
    assert _compile_service(tmp_path, max_side=512).admission.max_side == 512


def test_under_new_shapes_compile_the_warm_shapes_are_capped(tmp_path):
    from tpugen.modes.serve.service import NotWarm

    service = _compile_service(tmp_path, max_warm_shapes=2)

    class Warm:  # what check() reads of an engine: the (shape key, sampler) pairs it keeps warm
        warm = {("64x64 b2 cfg", "DDIM"): {}, ("64x64 b2 cfg", "Euler a"): {}, ("96x64 b2 cfg", "DDIM"): {}}
        loaded = SimpleNamespace(max_steps=lambda scheduler: 999, default_scheduler="DDIM")
        embeddings = ()  # the textual-inversion embeddings its text encoders hold

        def warm_programs(self) -> set[str]:  # each program warm: a shape key (no step cache on jax here)
            return {shape for shape, _ in self.warm}

        def program_key(self, shape, steps: int) -> str:
            return str(shape)

    service.engines = [Warm()]
    service.check([_fox(height=96)])  # warm (height x width): compiles no new shape
    with pytest.raises(NotWarm) as refused:
        service.check([_fox(height=128)])
    assert refused.value.lines[0].startswith(
        "128x64 b2 cfg would be compiled, and this server keeps at most 2 shapes warm (serve.max_warm_shapes)"
    )
    with pytest.raises(Exception) as steps:
        service.check([_fox(steps=1000)])
    assert steps.value.lines == ["steps: 1000; sampler DDIM runs at most 999 on this model"]


@pytest.mark.parametrize(
    "name,problem",
    [
        (None, None),
        ("pytorch_lora_weights.safetensors", None),
        ("sdxl/style.safetensors", None),
        ("/etc/passwd", "'/etc/passwd': a file of the LoRA's repo, not a path out of it"),
        ("../../secret.safetensors", "'../../secret.safetensors': a file of the LoRA's repo, not a path out of it"),
        ("a\\..\\..\\b", "'a\\\\..\\\\..\\\\b': a file of the LoRA's repo, not a path out of it"),
        ("~/x.safetensors", "'~/x.safetensors': a file of the LoRA's repo, not a path out of it"),
        ("C:/x.safetensors", "'C:/x.safetensors': a file of the LoRA's repo, not a path out of it"),
        (7, "a file name in the LoRA's repo"),
    ],
)
def test_a_hub_lora_s_weight_name_cannot_leave_its_repo(name, problem):
    from tpugen.modes.serve.run_configs import weight_name_problem

    assert weight_name_problem(name) == problem


def test_a_run_may_name_a_hub_lora_only_where_the_operator_allows_downloads(tmp_path):
    from tpugen.errors import InputError
    from tpugen.modes.serve.run_configs import run_loras

    service = _compile_service(tmp_path)
    with pytest.raises(InputError) as refused:
        run_loras([{"id": "someone/style-lora", "scale": 0.8}], service.serve)
    assert refused.value.lines == [
        "model.loras[0].id: 'someone/style-lora' is a hub repo; this server takes the LoRAs of serve.lora_dir only "
        "(serve.hub_loras: true lets runs download hub LoRAs with the server's token)"
    ]
    allowing = _compile_service(tmp_path, hub_loras=True)
    assert run_loras([{"id": "someone/style-lora"}], allowing.serve) == [{"id": "someone/style-lora"}]
    with pytest.raises(InputError) as outside:
        run_loras([{"id": "someone/style-lora", "weight_name": "/root/.cache/token"}], allowing.serve)
    assert outside.value.lines == [
        "model.loras[0].weight_name: '/root/.cache/token': a file of the LoRA's repo, not a path out of it"
    ]


def test_at_most_two_images_decode_at_once(monkeypatch):
    import io
    import threading
    import time

    from PIL import Image

    from tpugen.config import images as checks
    from tpugen.engine import images

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    opened, inside, most = Image.open, [0], [0]
    lock = threading.Lock()

    def slow_open(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return opened(*args, **kwargs)

    monkeypatch.setattr(Image, "open", slow_open)
    # A route's decode (open_bytes) and the check of an image stored for a run (image_problem) share the bound.
    threads = [threading.Thread(target=images.open_bytes, args=(png.getvalue(), "image")) for _ in range(3)]
    threads += [threading.Thread(target=checks.image_problem, args=(png.getvalue(),)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert checks.DECODES_AT_ONCE == 2 and 1 <= most[0] <= 2  # six threads at once: without the bound, 6


def test_input_images_past_their_cap_go_least_recently_used_first_save_those_in_use(tmp_path):
    """Before, every image a request or run sent stayed under .inputs for good. Now past serve.max_input_mb the
    least recently used go, save those a live run holds and those used within keep_s."""
    import io
    import os
    import time

    from PIL import Image

    from tpugen.modes.serve.input_images import InputImages

    def png(seed: int) -> bytes:
        pixels = (np.random.default_rng(seed).random((32, 32, 3)) * 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    images = [png(seed) for seed in range(6)]
    size = max(len(data) for data in images)
    held: set[str] = set()
    store = InputImages(tmp_path, max_bytes=3 * size, keep_s=0, held=lambda: set(held))
    paths = []
    for number, data in enumerate(images[:3]):
        paths.append(store.store(data, "image")[0])
        os.utime(paths[-1], (time.time() - 100 + number,) * 2)  # used in this order, a second apart
    held.add(paths[0])  # a run reads the oldest
    assert store.store(images[1], "image")[0] == paths[1]  # stored again: used now, not written twice
    paths.append(store.store(images[3], "image")[0])  # over the cap: the least recently used not held goes
    assert [os.path.exists(path) for path in paths] == [True, True, False, True]
    assert sum(os.path.getsize(path) for path in paths if os.path.exists(path)) <= 3 * size
    recent = InputImages(tmp_path, max_bytes=size, keep_s=3600)  # all used within keep_s: none may go
    recent.store(images[4], "image")
    assert len(list((tmp_path / ".inputs").glob("*.img"))) == 4
    with pytest.raises(InputError, match="^image: is not an image"):
        store.store(b"<svg/>", "image")


QWEN_IMAGE_REFUSAL = (
    "ControlNet units with an image: Qwen-Image models: diffusers 0.42's AutoPipeline makes no ControlNet img2img "
    "or inpainting pipeline for Qwen-Image; a controlled prompt starts from noise"
)
Z_IMAGE_REFUSAL = (
    "ControlNet units with an image: Z-Image models: diffusers 0.42 has no ControlNet img2img pipeline for Z-Image; "
    "a controlled prompt starts from noise, or inpaints with a mask_image"
)


@pytest.mark.parametrize(
    ("model", "warm", "img2img", "inpaint"),
    [
        ("tiny-qwen-image", ["txt2img"], QWEN_IMAGE_REFUSAL, QWEN_IMAGE_REFUSAL),
        # Z-Image's ControlNet inpaints (ZImageControlNetInpaintPipeline), from noise: strength 1 only.
        (
            "tiny-z-image",
            ["txt2img", "inpaint"],
            Z_IMAGE_REFUSAL,
            "denoising_strength with ControlNet units: Z-Image models: ControlNet inpainting starts from noise "
            "(diffusers 0.42's ZImageControlNetInpaintPipeline takes no strength: the ControlNet is given the masked "
            "image); set the strength to 1",
        ),
    ],
)
def test_a_server_refuses_controlnet_units_its_family_cannot_run_and_warms_none_of_them(
    tmp_path, model, warm, img2img, inpaint
):
    # Qwen-Image's and Z-Image's ControlNets have no img2img pipeline in diffusers 0.42 (and Qwen-Image's no
    # inpainting one): such a request is refused in one line (a 422 over HTTP), and the server never warms the key
    # it could not run.
    from conftest import tiny_config, write_config

    from tpugen.config import load_config
    from tpugen.config.controls import Controls, ControlUnit
    from tpugen.config.images import ImageSource, InputImage
    from tpugen.engine import Display
    from tpugen.errors import InputError
    from tpugen.modes.serve.service import Service

    config = tiny_config(tmp_path, serve={"tasks": ["txt2img", "img2img", "inpaint"], "new_shapes": "compile"})
    config["model"] = {"id": model, "controlnets": [{"id": f"{model}-controlnet"}]}
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    assert service.warm.controlled_tasks == warm
    controls = Controls((ControlUnit(InputImage(str(tmp_path / "c.png"), "0" * 64)),))
    service.check([_fox(guidance_scale=4.0, controls=controls)])  # txt2img: fine
    mask = (str(tmp_path / "m.png"), "1" * 64)
    for source, wanted in (
        (ImageSource(str(tmp_path / "i.png"), "0" * 64, 0.5), img2img),
        (ImageSource(str(tmp_path / "i.png"), "0" * 64, 0.5, 0, *mask), inpaint),
    ):
        with pytest.raises(InputError) as refused:
            service.check([_fox(guidance_scale=4.0, source=source, controls=controls)])
        assert refused.value.lines == [wanted]
    if "inpaint" in warm:  # at strength 1 it runs
        source = ImageSource(str(tmp_path / "i.png"), "0" * 64, 1.0, 0, *mask)
        service.check([_fox(guidance_scale=4.0, source=source, controls=controls)])
