"""Shared fixtures and helpers: one tiny-sd build, reference runs shared by the session, one image comparison."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before anything imports torch_xla: tests always run on XLA:CPU, with a cache of their own.
os.environ["PJRT_DEVICE"] = "CPU"
os.environ.setdefault("TPUGEN_CACHE", tempfile.mkdtemp(prefix="tpugen-test-cache-"))
# XLA:CPU compiles the tests' graphs without LLVM's optimizations and with its older fusion emitters: 3-5x less
# compile time and a fifth fewer memory maps per executable (tiny-sd at 64x128, measured side by side), images
# within 1/255 of the optimized code's on 0.01% of pixels; every test process and the processes they start
# (subprocesses, Ray workers) inherit it. Compiles dominate the suite's time; the tiny models' execution does not.
# Each executable's code in one object, not split for parallel codegen (which two busy cores cannot use): a
# quarter (tiny-sd) to nearly half (tiny-flux) fewer memory maps per executable, compile time the same or less
# (2026-12-04: tiny-sd's 3 graphs added 1,050 maps against 770, tiny-flux's 620 against 345, 2.0-2.4 s either way).
# Tried and left out (2026-12-04): one thread a process (--xla_cpu_multi_thread_eigen=false, OMP_NUM_THREADS=1).
# Three test files in two processes took 125 and 116 s against 146 and 140, but the whole suite took 22 min 24 s
# against 22 min 17 s, and each executable held ~40% more memory maps (one process ended at 54,696 of the 55,000).
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# JAX (execution.backend: jax) on the CPU in every test process and the processes they start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test reaches the hub (none is reachable from CI, and a refused connection is retried for 20 s).
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
import zygote  # noqa: E402  (before any test changes the environment it starts with)
from PIL import Image  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tpugen.cli import app  # noqa: E402

TPUGEN = str(Path(sys.executable).parent / "tpugen")
FAKES = Path(__file__).parent / "fakes"
PROMPTS = [
    "a lighthouse on a cliff at dawn, oil painting",
    "a red fox in fresh snow",
    "an astronaut riding a horse",
]

# How far two runs' images may be apart (the largest difference of any pixel channel, in 1/255), by what
# differs between the runs. One policy for every test:
SAME_SETUP = 0  # same backend, same devices per process: bit for bit
OTHER_DEVICE_COUNT = 1  # XLA:CPU with another CPU_NUM_DEVICES, or ranks in processes of their own (FACTS.md)
OTHER_GRAPH = 1  # the same computation traced as another graph (scanned blocks, SPMD, components placed apart)
COMPILED_VS_EAGER = 2  # a compiled graph (XLA:CPU, or inductor) against eager PyTorch on the CPU


def save_disc(path: Path) -> Path:
    """A control image at `path`: a white disc on black, 64x64, upper left."""
    from PIL import ImageDraw

    disc = Image.new("RGB", (64, 64))
    ImageDraw.Draw(disc).ellipse((8, 8, 40, 40), fill=(255, 255, 255))
    disc.save(path)
    return path


def annotator_weights(folder: Path, *, depth: bool = False, pose: bool = False) -> Path:
    """A model.annotators_dir with random weights of each annotator tpugen runs, under the file names
    lllyasviel/Annotators gives them (controlnet_aux's own architectures, seeded): what they make means nothing,
    but it is what controlnet_aux makes of the same files. MiDaS's (490 MB) and OpenPose's (510 MB) only with
    `depth` and `pose`."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from controlnet_aux.hed import ControlNetHED_Apache2
        from controlnet_aux.lineart import Generator
        from controlnet_aux.mlsd.models.mbv2_mlsd_large import MobileV2_MLSD_Large
        from controlnet_aux.pidi.model import pidinet

    def weights(make, drop_prefix: bool = False) -> dict:
        """A random state dict of the architecture `make` builds (on the meta device, so no initialisation runs):
        normal values scaled by each tensor's fan-in, positive running variances, zero counters; `drop_prefix`:
        named without their first part, as OpenPose's checkpoints are."""
        with torch.device("meta"):
            shapes = {name: (t.shape, t.dtype) for name, t in make().state_dict().items()}
        state = {}
        for name, (shape, dtype) in shapes.items():
            name = name.split(".", 1)[1] if drop_prefix else name
            if not dtype.is_floating_point:
                state[name] = torch.zeros(shape, dtype=dtype)
            elif name.endswith("running_var"):
                state[name] = torch.rand(shape, generator=seed) + 0.5
            else:
                fan_in = max(1, math.prod(shape[1:]))
                state[name] = torch.randn(shape, generator=seed) / math.sqrt(fan_in)
        return state

    folder.mkdir(parents=True, exist_ok=True)
    seed = torch.Generator().manual_seed(0)
    torch.save(weights(ControlNetHED_Apache2), folder / "ControlNetHED.pth")
    torch.save({"state_dict": weights(pidinet)}, folder / "table5_pidinet.pth")
    torch.save(weights(lambda: Generator(3, 1, 3)), folder / "sk_model.pth")
    torch.save(weights(lambda: Generator(3, 1, 3)), folder / "sk_model2.pth")
    torch.save(weights(MobileV2_MLSD_Large), folder / "mlsd_large_512_fp32.pth")
    if depth:
        from controlnet_aux.midas.midas.dpt_depth import DPTDepthModel

        midas = weights(lambda: DPTDepthModel(path=None, backbone="vitb_rn50_384", non_negative=True))
        torch.save(midas, folder / "dpt_hybrid-midas-501f0c75.pt")
    if pose:
        from controlnet_aux.open_pose.face import FaceNet
        from controlnet_aux.open_pose.model import bodypose_model, handpose_model

        torch.save(weights(bodypose_model, drop_prefix=True), folder / "body_pose_model.pth")
        torch.save(weights(handpose_model, drop_prefix=True), folder / "hand_pose_model.pth")
        torch.save(weights(FaceNet), folder / "facenet.pth")
    return folder


def assert_same_images(run_dir: Path, reference: Path, max_diff: int, names: list[str] | None = None) -> None:
    """The images of `run_dir` are those of `reference` (the same file names, pixels within `max_diff`)."""
    expected = sorted(p.name for p in reference.glob("[0-9]*.png")) if names is None else sorted(names)
    if names is None:
        assert sorted(p.name for p in run_dir.glob("[0-9]*.png")) == expected
    for name in expected:
        a = np.asarray(Image.open(run_dir / name).convert("RGB"), dtype=np.int16)
        b = np.asarray(Image.open(reference / name).convert("RGB"), dtype=np.int16)
        assert a.shape == b.shape and int(np.abs(a - b).max()) <= max_diff, (name, int(np.abs(a - b).max()))


# A first call's graphs by phase, lazily traced: text encoding, one step (replayed for the later ones), decoding.
FIRST_CALL = {"text encoding": 1, "first denoising step": 1, "later denoising steps": 0, "decoding": 1}


def cold_graphs(warm: dict) -> dict:
    """The graphs a fresh process compiles in each phase of this warmup entry, whatever this process compiled
    before. A phase that runs each of its graphs once (text encoding, the first step, decoding) counts the graphs
    it looked up in the compile cache, compiled or found there (report.json's graphs_run_per_phase). A phase of
    later steps replays its graphs, so it counts what it compiled: 0 whatever ran before when the steps reuse the
    first step's graphs, and only then; a test that expects new graphs there measures in a fresh process."""
    run = warm["graphs_run_per_phase"]
    return {phase: warm["graphs_per_phase"][phase] if "later" in phase else count for phase, count in run.items()}


def image_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("[0-9]*.png"))}


def tiny_config(tmp: Path, **overrides) -> dict:
    """The smallest config that still exercises batching, padding, CFG and negative prompts."""
    config = {
        "model": {"id": "tiny-sd", "dtype": "float32"},
        "prompts": list(PROMPTS),
        "negative_prompt": "blurry",
        "height": 64,
        "width": 64,
        "steps": 3,
        "guidance_scale": 7.5,
        "seed": 7,
        "batch_size": 2,
        "execution": {"backend": "xla"},
        # The graph counts these tests pin are those of the lazy path (one graph per denoising step); the
        # default, trace_once: true, is tested by tests/test_trace_once.py, which sets it back on.
        "compile": {"trace_once": False},
        "output": {"dir": str(tmp / "outputs"), "run_id": "run"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    return config


def with_prompts_file(tmp: Path, config: dict, lines: list[str], name: str = "p.txt") -> dict:
    """`config` reading its prompts from a file `name` beside it, holding `lines` (.txt or .jsonl lines)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / name).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    config = {k: v for k, v in config.items() if k != "prompts"}
    config["prompts_file"] = name
    return config


def work_item(**changes):
    """One image's work at its place (tpugen.plan.WorkItem), at the tiny models' size, with `changes`."""
    from tpugen.plan import WorkItem

    fields = {"index": 0, "prompt": "a cat", "negative_prompt": "", "seed": 3, "steps": 2, "guidance_scale": 7.5}
    return WorkItem(**{**fields, "height": 64, "width": 64, **changes})


def one_call(*items, batch_size: int | None = None):
    """A pipeline call of `items` (tpugen.plan.Batch) at the first one's shape, padded to `batch_size` rows."""
    from tpugen.plan import Batch

    rows = batch_size or len(items)
    return Batch(number=0, shape=items[0].shape(rows), items=items, padding=rows - len(items))


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def generate(tmp: Path, **overrides) -> Path:
    """Run `tpugen generate` in this process on a tiny config; returns the run directory."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tmp, **overrides)
    path = write_config(tmp / "run.yaml", config)
    result = run_cli("generate", path, "--quiet")
    assert result.exit_code == 0, result.output
    return Path(config["output"]["dir"]) / config["output"]["run_id"]


@pytest.fixture(scope="session")
def known_models_counted() -> None:
    """Every known hub model's parameters counted on the meta device once for the whole suite, in one process
    that never imports torch_xla, into the tests' TPUGEN_CACHE (shared by the test processes), which `tpugen
    plan` then reads as a second plan does. Each test that planned a hub model counted it cold in a process of
    its own (6-13 s each, mostly importing diffusers and transformers); all of them at once take about 14 s.
    The first test process to ask counts them, the other waits on the lock and finds them kept. A cold plan is
    still tested (tests/test_cli_light.py, a cache of its own)."""
    cache = Path(os.environ["TPUGEN_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    done = cache / "known-models-counted"
    with open(cache / "known-models-counted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if done.exists():
            return
        code = (
            "from tpugen.families import KNOWN_MODELS; "
            "from tpugen.memory import _without_torch_xla, known_components, meta_parameters; "
            "import sys; _without_torch_xla(); [meta_parameters(c) for m in KNOWN_MODELS if (c := known_components(m))]; "
            "assert 'torch_xla' not in sys.modules"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        done.touch()


FORKED_TPUGEN = str(zygote.CLIENT)  # forked_tpugen's path, without starting the zygote


def forked_tpugen() -> str:
    """A `tpugen` that runs each command in a process of its own, forked from one that imported torch, torch_xla,
    diffusers and tpugen already (tests/zygote.py): its XLA runtime, compile cache and counters as fresh as the
    console script's, without ~15 s of imports. For tests that need a process of their own, not a check of how
    tpugen starts (those run TPUGEN)."""
    return zygote.command()[0]


def forked_python() -> list[str]:
    """`python` for `-c CODE ARGS...` in a process of its own, forked as forked_tpugen's (its first import of torch
    and tpugen already made: not for code that checks what an import does)."""
    return zygote.command("python")


def generate_in_new_process(tmp: Path, *args: str, env: dict | None = None, timeout: float = 600, **overrides):
    """`tpugen generate` in a fresh process (its XLA runtime and compile cache fresh too; forked_tpugen); returns
    (the finished process, the run directory)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tmp, **overrides)
    path = write_config(tmp / "run.yaml", config)
    proc = subprocess.run(
        [forked_tpugen(), "generate", str(path), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PJRT_DEVICE": "CPU", **(env or {})},
    )
    return proc, Path(config["output"]["dir"]) / config["output"]["run_id"]


# The modules LoRA trainers target by default (sd-scripts for SD): the UNet's attention, feed-forward and
# projections, CLIP's attention and MLP.
_CLIP = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
LORA_TARGETS = {
    "unet": ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"),
    "text_encoder": _CLIP,
    "text_encoder_2": _CLIP,  # SDXL's second CLIP (Flux's is T5, which its LoRA loader leaves alone)
    "transformer": (
        *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj"),
        *("attn.add_v_proj", "attn.to_add_out", "proj_mlp", "ff.net.0.proj", "ff.net.2", "ff_context.net.2"),
    ),
}
# The new transformer families' modules, by built-in (transformer only: their text encoders are not CLIP, and
# diffusers' loaders for them load LoRAs into the transformer alone). Other models take LORA_TARGETS.
_FLUX2 = (
    *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj"),
    *("attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in"),
    "ff_context.linear_out",
    *("attn.to_qkv_mlp_proj", "attn.to_out"),  # the single-stream blocks' fused projections
)
MODEL_LORA_TARGETS = {
    "tiny-flux2-klein": {"transformer": _FLUX2},
    "tiny-flux2": {"transformer": _FLUX2},
    "tiny-z-image": {
        "transformer": (
            *("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"),
            *("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
        ),
    },
    "tiny-qwen-image": {
        "transformer": (
            *("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj"),
            *("attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj"),
            "txt_mlp.net.2",
        ),
    },
}
MODEL_LORA_TARGETS["tiny-qwen-image-edit-plus"] = MODEL_LORA_TARGETS["tiny-qwen-image"]  # the same transformer
# sd-scripts' prefixes: one text encoder is lora_te_, two are lora_te1_ and lora_te2_.
_KOHYA_ONE = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
_KOHYA_TWO = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def make_lora(path: Path, fmt: str, *, seed: int, model: str = "tiny-sd", rank: int = 4, std: float = 0.3) -> Path:
    """A LoRA file for a built-in model's denoiser (UNet or transformer) and CLIP text encoders with random
    non-zero factors, named after the model's own modules and shaped by their weights (read from its safetensors
    headers). `fmt`: "peft" (diffusers/PEFT: unet.X.lora_A.weight, text_encoder.text_model.X.lora_B.weight,
    transformer.X...) or "kohya" (sd-scripts, UNet models: lora_unet_X.lora_down.weight,
    lora_te_text_model_X.lora_up.weight or lora_te1_/lora_te2_ with two encoders, X.alpha). The modules are
    MODEL_LORA_TARGETS' for the built-ins it names, else LORA_TARGETS'. Builds the model if needed."""
    from safetensors.numpy import save_file

    from tpugen.config.loras import safetensors_header
    from tpugen.tiny import builtin_path

    rng = np.random.default_rng(seed)
    root = builtin_path(model)
    targets = MODEL_LORA_TARGETS.get(model, LORA_TARGETS)
    headers = {
        component: safetensors_header(next((root / component).glob("*.safetensors")))
        for component in targets
        if (root / component).is_dir()
    }
    # CLIP encoders only (they hold a position embedding): Flux's T5 has none.
    headers = {c: h for c, h in headers.items() if "text_encoder" not in c or any("position_embedding" in k for k in h)}
    kohya = _KOHYA_TWO if "text_encoder_2" in headers else _KOHYA_ONE
    tensors = {}
    for component, header in headers.items():
        for key, info in sorted(header.items()):
            module = key.removesuffix(".weight")
            if not key.endswith(".weight") or not module.endswith(targets[component]):
                continue
            shape = info["shape"]
            down = rng.normal(0, std, (rank, shape[1], *shape[2:])).astype(np.float32)
            up = rng.normal(0, std, (shape[0], rank, *[1] * (len(shape) - 2))).astype(np.float32)
            if component.startswith("text_encoder") and not module.startswith("text_model."):
                module = f"text_model.{module}"  # LoRA files name CLIP's inner model, whatever the weights file does
            if fmt == "peft":
                tensors[f"{component}.{module}.lora_A.weight"] = down
                tensors[f"{component}.{module}.lora_B.weight"] = up
            else:
                if component not in kohya:
                    raise ValueError(f"no kohya naming for {model}'s {component} here")
                stem = kohya[component] + module.replace(".", "_")
                tensors[f"{stem}.lora_down.weight"] = down
                tensors[f"{stem}.lora_up.weight"] = up
                tensors[f"{stem}.alpha"] = np.array(rank / 2, dtype=np.float32)
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="session")
def xla_run(tmp_path_factory) -> Path:
    """The reference XLA run: 3 prompts at batch 2 (one padded batch), 3 steps, CFG on. Made in a process of
    its own, so its compile counts are exact whatever this process compiled before."""
    proc, run_dir = generate_in_new_process(tmp_path_factory.mktemp("xla"))
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.fixture(scope="session")
def cpu_run(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("cpu"), execution={"backend": "cpu"})


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The session's `tpugen serve` (url, service), in this process (so it shares the compile cache), on a thread
    of its own: one for every tests/test_serve*.py module that speaks to it (helpers: tests/serve_support.py)."""
    from serve_support import KEY, running_server, serve_config, wait_ready

    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "loras").mkdir()
    make_lora(tmp / "loras" / "style.safetensors", "kohya", seed=1)
    make_lora(tmp / "loras" / "subject.safetensors", "peft", seed=2)
    tasks = ["txt2img", "img2img", "inpaint"]  # /sdapi/v1/img2img, with and without a mask
    # Connection deadlines short enough for tests/test_serve_hardened.py to see them pass.
    deadlines = {"read_timeout_s": 3, "idle_timeout_s": 3}
    styles = [  # the web UI's saved styles (tests/test_serve_a1111.py)
        {"name": "oil", "prompt": "{prompt}, oil painting", "negative_prompt": "blurry"},
        {"name": "moody", "prompt": "dark, moody"},
    ]
    path = serve_config(
        tmp,
        max_images_per_request=9,  # the web UI's SD upscale test: 3 x 3 tiles (tests/test_serve_sd_upscale.py)
        lora_dir="loras",
        schedulers=["Euler a"],
        tasks=tasks,
        prompt_styles=styles,
        **deadlines,
    )
    with running_server(path, tmp / "runs", KEY) as (url, service):
        wait_ready(url, seconds=400)  # 5 shape keys to compile; on a loaded 2-core machine, minutes
        yield url, service


@pytest.fixture
def client(server):
    """An HTTP client of the session's server, with its key."""
    import httpx
    from serve_support import AUTH

    with httpx.Client(base_url=server[0], headers=AUTH, timeout=120) as http:
        yield http


def sigterm_after_a_rank_image(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """Wait until some rank has written a manifest line, send SIGTERM, and return stderr once it exits."""
    deadline = time.perf_counter() + timeout
    while not any(p.stat().st_size for p in run_dir.glob("manifest.rank*.jsonl")):
        assert proc.poll() is None and time.perf_counter() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout)[1]


def cut_last_image(run_dir: Path) -> None:
    """What a kill before the last batch leaves: its image and manifest line are missing."""
    lines = (run_dir / "manifest.jsonl").read_text().splitlines(keepends=True)
    (run_dir / json.loads(lines[-1])["file"]).unlink()
    (run_dir / "manifest.jsonl").write_text("".join(lines[:-1]))


def failing_rank_env(rank: int, pythonpath: str = "") -> dict[str, str]:
    """The environment under which rank `rank` of a multi run fails after writing its first batch: a test
    fake (tests/fakes/fail_rank) loaded at start-up by every process of the run."""
    path = os.pathsep.join(p for p in (str(FAKES / "fail_rank"), pythonpath) if p)
    return {"PYTHONPATH": path, "TPUGEN_TEST_FAIL_RANK": str(rank)}


@pytest.fixture(autouse=True)
def _device_free_unless_marked(request):
    """A test not marked `xla` must not import torch_xla (diffusers imports it whenever it is installed):
    `pytest -m "not xla"` then touches no device."""
    before = "torch_xla" in sys.modules
    torchax_before = "torchax" in sys.modules
    if "ray_cluster" in request.fixturenames and request.node.get_closest_marker("xla") is None:
        pytest.fail("this test starts a Ray cluster: mark it @pytest.mark.xla (the light tier starts none)")
    yield
    if not before and "torch_xla" in sys.modules and request.node.get_closest_marker("xla") is None:
        pytest.fail("this test imported torch_xla (directly or through diffusers): mark it @pytest.mark.xla")
    if not torchax_before and "torchax" in sys.modules and COLD_CHILD not in os.environ:
        # torchax names torch's privateuse1 device "jax" for good: later tests of the process would see a device
        # that is not theirs (diffusers' offload and the TorchTPU tests fail on it).
        pytest.fail("this test imported torchax (backend jax) in a shared test process: mark it cold_process")


def diffusers_remakes(model: str, run_dir, arguments, prepare=None) -> dict[str, object]:
    """Each image of `run_dir` made again by the family's plain diffusers pipeline on the CPU (no tpugen patch),
    from the same seed, noise, prompt, size and steps, decoded by the pipeline itself, by file name:
    `arguments(pipe, family, record)` gives the rest of each call (guidance, negative prompt, references);
    `prepare(pipe)` runs first, where given (a step cache enabled on it, say)."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from tpugen.families import BUILTINS
    from tpugen.tiny import builtin_path

    family = BUILTINS[model][1]
    pipe = DiffusionPipeline.from_pretrained(str(builtin_path(model)))
    pipe.set_progress_bar_config(disable=True)
    if prepare is not None:
        prepare(pipe)
    images = {}
    for line in (run_dir / "manifest.jsonl").read_text().splitlines():
        record = json.loads(line)
        generator = torch.Generator("cpu").manual_seed(record["seed"])
        (noise,) = family.noise(pipe, [generator], record["height"], record["width"])
        with torch.no_grad():
            image = pipe(
                prompt=record["prompt"],
                height=record["height"],
                width=record["width"],
                num_inference_steps=record["steps"],
                latents=noise,
                generator=generator,
                output_type="np",
                **arguments(pipe, family, record),
            ).images[0]
        images[record["file"]] = (image * 255).round().clip(0, 255).astype(np.uint8)
    return images


def plain_diffusers_images(model: str, run_dir, prepare=None) -> dict[str, object]:
    """diffusers_remakes with the family's own call arguments (its negative prompt, Qwen-Image's true CFG)."""

    def arguments(pipe, family, record) -> dict:
        row = WorkItemRow(record["negative_prompt"])
        made = {"guidance_scale": record["guidance_scale"], **reference_negative(family, record)}
        for key, value in family.call_arguments(pipe, [row], record["guidance_scale"]).items():
            if key != "max_sequence_length":  # the pipeline's own text handling, not tpugen's fixed length
                made[key] = value[0] if isinstance(value, list) else value
        return made

    return diffusers_remakes(model, run_dir, arguments, prepare)


def reference_negative(family, record: dict) -> dict:
    """The negative prompt of a diffusers call made as a reference for a tpugen image: none for an empty one,
    which diffusers' SDXL pipeline then makes zeros (force_zeros_for_empty_prompt), as the web UI's reading,
    tpugen's default, does; an empty string to the others, as their default."""
    if not family.negative_prompt:
        return {}
    return {"negative_prompt": record["negative_prompt"] or None}


class WorkItemRow:
    def __init__(self, negative_prompt: str) -> None:
        self.negative_prompt = negative_prompt


# ---------------------------------------------------------------- the suite as a system (docs/internals.md)

# Memory maps one test process may hold at its end. Each XLA:CPU executable holds hundreds (its JIT-compiled
# kernels: about 450 a tiny-sd graph with TEST_XLA_FLAGS), freed only when the compile cache lets it go; past the
# kernel's default vm.max_map_count (65,530) a process crashes (rc 139). Two processes ended the suite at 29,238
# to 46,205 over four runs (which groups share a process moves it); four at 22,082-27,097, but 6.7 min slower
# (each compiles the common graphs again). 55,000 stays 10,000 below the kernel's limit.
# TPUGEN_TEST_MAPS_BUDGET overrides.
MAPS_BUDGET = int(os.environ.get("TPUGEN_TEST_MAPS_BUDGET", "55000"))


# Tests go to the two processes one at a time (pytest-xdist --dist load), the files that take longest first
# (seconds summed over their tests, a full run on 2 cores, 2026-12-03: 19 min 40 s), so that neither process
# ends running a long file alone; the rest follow in collection order. Grouping every file's tests in one process
# (--dist loadgroup, each module's fixtures built once) took 27 min 0 s the same day: the groups that start
# processes of their own (Ray workers, pod workers, ranks, CLI runs) then ran side by side, and the machine did
# 46 CPU-minutes of work against 33.
SLOWEST_FILES = [
    "test_cluster.py",  # 330
    "test_jax.py",  # 190 (2026-12-07: each JAX test in a process of its own)
    "test_step_cache.py",  # 217
    "test_trace_once.py",  # 217
    "test_pod.py",  # 189
    "test_resume.py",  # 106
    "test_scan.py",  # 106
    "test_multi.py",  # 106
    "test_dist.py",  # 97
    "test_backends.py",  # 88
    "test_serve_process.py",  # 84
    "test_serve_lifecycle.py",  # 84
    "test_families.py",  # 76
]

# The fixtures that cost a process minutes to build: the session's server (its warm shapes compiled), a Ray
# cluster (its workers compile again), the reference runs. Handed out one at a time, their tests made each
# process build them. The tests that use one go to one process together, as one unit of work, first (in this
# order), so each is built once; every other test still goes alone. Found from the tests' own fixtures at
# collection, so a new test joins its group by asking for the fixture.
SHARED_FIXTURES = ("ray_cluster", "server", "xla_run", "cpu_run", "controlnet_server", "plain_run")
GROUPS_FILE = "TPUGEN_TEST_GROUPS_FILE"  # where the test processes tell the scheduler which test is in which group


def _shared_fixture(item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((name for name in SHARED_FIXTURES if name in names), None)


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput") and GROUPS_FILE not in os.environ:  # the controller, before its workers
        config._tpugen_groups = Path(tempfile.mkdtemp(prefix="tpugen-test-groups-"))
        os.environ[GROUPS_FILE] = str(config._tpugen_groups / "groups.json")


def pytest_unconfigure(config) -> None:
    made = getattr(config, "_tpugen_groups", None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(GROUPS_FILE, None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The shared fixtures' groups first, then the slowest files' tests (SLOWEST_FILES), each file's in
    collection order; a test process writes down each grouped test's group for the scheduler."""
    rank = {name: number for number, name in enumerate(SLOWEST_FILES)}
    group_rank = {name: number for number, name in enumerate(SHARED_FIXTURES)}

    def order(item):
        group = _shared_fixture(item)
        return (0, group_rank[group], 0) if group else (1, 0, rank.get(item.path.name, len(rank)))

    items.sort(key=order)  # stable: collection order otherwise
    where = os.environ.get(GROUPS_FILE)
    if hasattr(config, "workerinput") and where:
        groups = {item.nodeid: group for item in items if (group := _shared_fixture(item))}
        part = Path(f"{where}.{os.getpid()}")
        part.write_text(json.dumps(groups))
        part.replace(where)  # whole or not there: both processes write the same map


def pytest_xdist_make_scheduler(config, log):
    """--dist load, with each shared fixture's tests as one unit of work (SHARED_FIXTURES)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the processes have collected, which is when this is asked
                where = Path(os.environ.get(GROUPS_FILE, "-"))
                self.groups = json.loads(where.read_text()) if where.is_file() else {}
            group = self.groups.get(nodeid)
            return f"shared fixture {group}" if group else nodeid

    config.option.loadscopereorder = False  # the order the tests were collected in (above)
    return SharedFixtureScheduling(config, log)


# The test a child pytest process runs for a `cold_process` test (its node id), set in the child only.
COLD_CHILD = "TPUGEN_TEST_COLD_CHILD"


def plain_nodeid(nodeid: str) -> str:
    """A test's node id without an "@group" pytest-xdist's --dist loadgroup would append (an "@" inside a
    parameter stays), so that a child process can find the test whichever way the suite is spread."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group else nodeid


def pytest_pyfunc_call(pyfuncitem):
    """A test marked `cold_process` runs in a child pytest process of its own, whose compile cache (XLA's and
    dynamo's) starts empty: for counts that only a first compile shows (graphs a later phase adds, graphs one
    engine shares with another). Its fixtures are the child's; the parent's are set up and not used."""
    nodeid = plain_nodeid(pyfuncitem.nodeid)
    if pyfuncitem.get_closest_marker("cold_process") is None or os.environ.get(COLD_CHILD) == nodeid:
        return None
    config = pyfuncitem.config
    proc = subprocess.run(  # forked like forked_tpugen: a child whose XLA and dynamo state start empty
        [*zygote.command("pytest"), nodeid, "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=config.rootpath,
        capture_output=True,
        text=True,
        timeout=float(config.getini("timeout") or 600) - 30,  # within the parent's own limit
        env={**os.environ, COLD_CHILD: nodeid, "PJRT_DEVICE": "CPU"},
    )
    if proc.returncode != 0 or " passed" not in proc.stdout:
        pytest.fail(f"in a process of its own (rc {proc.returncode}):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}")
    return True


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--slowest-files", type=int, default=0, metavar="N", help="list the N test files that took longest"
    )


def _memory_maps() -> int | None:
    try:
        return Path("/proc/self/maps").read_text().count("\n")
    except OSError:
        return None


_processes: dict[str, int] = {}  # memory maps at the end, by test process ("main" without xdist)
_forks: dict[str, dict[str, int]] = {}  # what each test process's zygote did: forked, or the script and why
_graphs_held: dict[str, int] = {}  # compiled graphs torch_xla's cache held then (its cap: 2,048), by test process


def _compiled_graphs() -> int | None:
    """How many executables torch_xla's in-memory compile cache holds in this process (None: it never compiled)."""
    xla = sys.modules.get("torch_xla")
    if xla is None or not xla._XLAC._xla_computation_cache_is_initialized():
        return None
    return xla._XLAC._xla_get_num_cached_compilation_graph()


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Seconds per test file (setup, call and teardown), summed in the process that reports (xdist's controller)."""
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    timeline = os.environ.get("TPUGEN_TEST_TIMELINE")  # a file: each phase of each test, where and when it ran
    if timeline and not os.environ.get("PYTEST_XDIST_WORKER"):  # written by xdist's controller (or the one process)
        node = getattr(report, "node", None)
        where = node.gateway.id if node is not None else "main"
        with open(timeline, "a") as out:
            out.write(json.dumps([where, report.nodeid, report.when, report.start, report.stop]) + "\n")


_file_maps: dict[str, int] = {}  # memory maps each test file left its process holding (compiled graphs, mostly)
# Variables a test left changed that the zygote compares (tests/zygote.py: drifted), each with the first test after
# which it differed: from then on every forked process of that test process runs the console script instead.
_drifts: dict[str, str] = {}
_maps_seen: list[int] = []


def pytest_sessionstart(session) -> None:
    maps = _memory_maps()
    if maps is not None:
        _maps_seen.append(maps)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test (and its module fixtures' teardown): the maps it added to this process, and any
    variable the zygote compares that it left changed (tests/zygote.py: drifted)."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        for key in zygote.drifted():
            _drifts.setdefault(key, item.nodeid)
        maps = _memory_maps()
        if maps is not None:
            before = _maps_seen[-1] if _maps_seen else maps
            _maps_seen.append(maps)
            path = item.nodeid.split("::")[0]
            _file_maps[path] = _file_maps.get(path, 0) + maps - before
    return result


def pytest_testnodedown(node, error) -> None:
    """A worker's end (xdist's controller): the maps it reported."""
    output = getattr(node, "workeroutput", {})
    if output.get("memory_maps") is not None:
        _processes[node.gateway.id] = output["memory_maps"]
    if output.get("compiled_graphs") is not None:
        _graphs_held[node.gateway.id] = output["compiled_graphs"]
    for path, maps in output.get("file_maps", {}).items():
        _file_maps[path] = _file_maps.get(path, 0) + maps
    if output.get("zygote"):
        _forks[node.gateway.id] = output["zygote"]
    for key, nodeid in output.get("drifts", {}).items():
        _drifts.setdefault(key, nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """Every process's memory maps at its end; past the budget the suite fails, before it grows into a crash."""
    forks = zygote.tally()
    zygote.stop()
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker: tell the controller
        config.workeroutput["zygote"] = forks
        config.workeroutput["drifts"] = _drifts
        config.workeroutput["memory_maps"] = _memory_maps()
        config.workeroutput["compiled_graphs"] = _compiled_graphs()
        config.workeroutput["file_maps"] = _file_maps
        return
    if not _processes:  # no workers: this one process ran the tests
        _forks["main"] = forks
        maps = _memory_maps()
        if maps is not None:
            _processes["main"] = maps
        if (graphs := _compiled_graphs()) is not None:
            _graphs_held["main"] = graphs
    over = any(maps > MAPS_BUDGET for maps in _processes.values())
    if (over or _drifts) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config) -> None:
    if hasattr(config, "workeroutput"):
        return
    slowest = config.getoption("slowest_files")
    if slowest and _file_seconds:
        terminalreporter.write_sep("-", f"the {slowest} slowest test files (seconds, summed over their tests)")
        for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:slowest]:
            terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    if slowest and _file_maps:
        most = sorted(_file_maps.items(), key=lambda kv: -kv[1])[:slowest]
        terminalreporter.write_line("memory maps added by file: " + ", ".join(f"{p} {m}" for p, m in most))
    for process, maps in sorted(_processes.items()):
        over = f" -- OVER the budget of {MAPS_BUDGET}" if maps > MAPS_BUDGET else ""
        held = f" ({_graphs_held[process]} compiled graphs held)" if process in _graphs_held else ""
        terminalreporter.write_line(f"memory maps of test process {process} at the end: {maps}{held}{over}")
    for process, counts in sorted(
        (p, c) for p, c in _forks.items() if c
    ):  # a "script" line: an environment that drifted from the zygote's
        done = ", ".join(f"{how} {n}" for how, n in sorted(counts.items()))
        terminalreporter.write_line(f"processes started by test process {process}'s zygote: {done}")
    for key, nodeid in sorted(_drifts.items()):
        terminalreporter.write_line(
            f"the suite fails: {key} changed in a test process after {nodeid} and stayed so: its later forked "
            "processes ran the console script (tests/zygote.py: drifted)"
        )
    if any(maps > MAPS_BUDGET for maps in _processes.values()):
        terminalreporter.write_line(
            f"the suite fails: a test process ended with more than {MAPS_BUDGET} memory maps (TPUGEN_TEST_MAPS_BUDGET)"
        )


class Recording:
    """A Display that keeps what it was told."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.warnings: list[str] = []

    def phase(self, text: str) -> None:
        self.phases.append(text)

    def warning(self, text: str) -> None:
        self.warnings.append(text)

    def batches_started(self, total: int) -> None: ...

    def batch_done(self, batch, seconds: float) -> None: ...

    def progress(self, done: int, total: int) -> None: ...

    def finished(self) -> None: ...
