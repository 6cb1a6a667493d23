"""compile.step_cache: diffusers' TaylorSeer, MagCache and Pyramid Attention Broadcast on a static schedule,
against diffusers' own cached images, and `tpugen calibrate` for MagCache's ratios."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import forked_tpugen, plain_diffusers_images, run_cli, tiny_config, with_prompts_file, write_config
from PIL import Image

from tpugen.config.schema import StepCacheConfig
from tpugen.engine.step_cache import (
    covers,
    pab_decisions,
    pab_warm_timesteps,
    schedule,
    step_cache_problem,
    step_counts,
    step_graphs,
    warm_call_steps,
    warm_steps,
)
from tpugen.families import family

TAYLORSEER = {
    "method": "taylorseer",
    "cache_interval": 3,
    "disable_cache_before_step": 2,
    "taylor_factors_dtype": "float32",
}
TAYLORSEER_HASH = "3e326981"
# The bound for "diffusers' method, not a look-alike": a cached XLA image against diffusers' own cached
# image on the CPU (uncached, the family tests hold 2/255).
CACHED_VS_DIFFUSERS = 3


def test_the_schedule_is_diffusers_rule_from_the_step_index():
    cache = StepCacheConfig(**TAYLORSEER)
    full, cached = "full", "cached"
    assert schedule(cache, 12) == (full, full, cached, full, cached, cached, full, cached, cached, full, cached, cached)
    assert step_counts(cache, 12) == {"steps_full": 5, "steps_cached": 7}
    assert schedule(cache, 5) == schedule(cache, 12)[:5]  # fewer steps: a prefix, so warmup at the most covers all
    later = StepCacheConfig(**{**TAYLORSEER, "disable_cache_after_step": 7})
    assert schedule(later, 10)[7:] == ("full",) * 3
    assert schedule(StepCacheConfig(), 4) == ("full",) * 4


def test_refused_methods_and_families_say_why_in_one_line(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, model={"id": "tiny-flux"}))
    for method, words in [
        ("first_block_cache", "cannot run as static graphs"),
        ("fastercache", "splits one CFG batch into halves, and these families have none to split"),
    ]:
        result = run_cli("validate", config, f"compile.step_cache.method={method}")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith(f"error: compile.step_cache.method: {method} ") and words in result.stderr
    result = run_cli("validate", config, "compile.step_cache.cache_interval=3")
    assert result.exit_code == 2
    assert (
        "compile.step_cache: cache_interval: taylorseer's option(s), not for no step cache; set method: taylorseer"
        in result.stderr
    )
    result = run_cli("validate", config, "compile.step_cache.method=magcache", "compile.step_cache.max_order=2")
    assert "max_order: taylorseer's option(s), not for method magcache" in result.stderr
    result = run_cli(
        "validate",
        config,
        "compile.step_cache.method=taylorseer",
        "compile.step_cache.spatial_attention_block_skip_range=3",
    )
    assert (
        "spatial_attention_block_skip_range: pyramid_attention_broadcast's option(s), not for method taylorseer"
        in result.stderr
    )
    result = run_cli(
        "validate",
        config,
        "compile.step_cache.method=pyramid_attention_broadcast",
        "compile.step_cache.spatial_attention_timestep_skip_range=[800, 100]",
    )
    assert result.exit_code == 2 and "must be [low, high] with low below high, got [800, 100]" in result.stderr
    assert run_cli("validate", config, "compile.step_cache.method=pyramid_attention_broadcast").exit_code == 0
    result = run_cli("validate", config, "compile.step_cache.method=magcache")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "magcache needs the model's mag_ratios: measure them with `tpugen calibrate CONFIG`" in result.stderr
    for value, words in [([], "a non-empty list"), ([1.0, -2], "each above 0"), ("dev", "'dev' is neither flux")]:
        step_cache = {"method": "magcache", "mag_ratios": value}
        given = tiny_config(tmp_path, model={"id": "tiny-flux"}, compile={"step_cache": step_cache})
        result = run_cli("validate", write_config(tmp_path / "m.yaml", given))
        assert result.exit_code == 2 and words in result.stderr, result.output
    result = run_cli(
        "validate", config, "compile.step_cache.method=magcache", "compile.step_cache.mag_ratios=gone.yaml"
    )
    assert result.exit_code == 2 and "compile.step_cache.mag_ratios: " in result.stderr
    assert "gone.yaml: config file does not exist" in result.stderr

    cache = StepCacheConfig(**TAYLORSEER)
    for name in ("sd", "sdxl"):
        assert "UNet2DConditionModel has no enable_cache" in step_cache_problem(cache, family(name), scan_blocks=False)
    assert "SD3Transformer2DModel" in step_cache_problem(cache, family("sd3"), scan_blocks=False)
    assert step_cache_problem(cache, family("flux"), scan_blocks=False) is None
    for name in ("flux2_klein", "qwenimage"):
        assert step_cache_problem(cache, family(name), scan_blocks=False) is None
    assert "Flux2Pipeline calls its transformer outside a cache_context" in step_cache_problem(
        cache, family("flux2"), scan_blocks=False
    )
    assert "compile.scan_blocks" in step_cache_problem(cache, family("flux"), scan_blocks=True)


def test_no_step_cache_keeps_the_config_hash_and_a_cache_changes_it(tmp_path):
    from tpugen.config import load_config

    def hash_of(name: str, **compile_section) -> str:
        # trace_once at its default (true), as a config that never names it: tiny_config turns it off.
        config = tiny_config(tmp_path, model={"id": "tiny-flux"}, compile={"trace_once": True, **compile_section})
        return load_config(write_config(tmp_path / name, config)).config_hash

    plain = hash_of("a.yaml")
    # A TaylorSeer config hashes by its method and its own options alone: as it did before MagCache and PAB
    # added theirs, and before compile.trace_once (the figure is the hash tpugen 7c60096 gave this config).
    assert hash_of("t.yaml", step_cache=TAYLORSEER) == TAYLORSEER_HASH
    assert hash_of("b.yaml", step_cache={"method": "none"}) == plain  # configs from before the key hash as they did
    assert hash_of("c.yaml", step_cache=TAYLORSEER) != plain


def diffusers_images(run_dir, cache: dict | None, model: str = "tiny-flux", steps: int = 28, decisions=None):
    """Each image of a `model` run made again by plain diffusers on the CPU (eager, no tpugen patch) from the
    same noise, with `cache` (compile.step_cache) passed to transformer.enable_cache as diffusers' own config
    (for calls of `steps`: MagCache's num_inference_steps). `decisions`: a list MagCache's own head hook's
    choice (compute or skip) is appended to at each step of the conditional pass."""
    from tpugen.engine.step_cache import diffusers_config

    def enable(pipe) -> None:
        if cache is None:
            return
        pipe.transformer.enable_cache(diffusers_config(StepCacheConfig(**cache), steps))
        if decisions is not None:
            head = next(m for m in pipe.transformer.modules() if _hook(m, "mag_cache_leader_block_hook"))
            hook = _hook(head, "mag_cache_leader_block_hook")

            def record(module, args, output) -> None:
                if hook.state_manager.context.name == "cond":
                    decisions.append("full" if hook.state_manager.get_state().should_compute else "cached")

            head.register_forward_hook(record)

    return plain_diffusers_images(model, run_dir, prepare=enable)


def _tpugen_in_a_process_of_its_own(command: str, path) -> None:
    """`tpugen COMMAND PATH --quiet` in a fresh process: exact graph counts whatever this process compiled, and
    none of its XLA state (the full suite once crashed in-process, rc 139, compiling Qwen-Image near its end)."""
    argv = [forked_tpugen(), command, str(path), "--quiet"]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr


def _generate_in_a_process_of_its_own(path):
    _tpugen_in_a_process_of_its_own("generate", path)
    return path.parent / "outputs" / "run"


def _hook(module, name: str):
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook(name) if registry is not None else None


def _differences(run_dir, reference: dict) -> tuple[int, float]:
    """(the largest pixel difference, the share of pixel values that differ) between the run's images and
    `reference`'s, over all of them."""
    diffs = [
        np.abs(np.asarray(Image.open(run_dir / name).convert("RGB"), np.int16) - ref.astype(np.int16))
        for name, ref in reference.items()
    ]
    return max(int(d.max()) for d in diffs), float(np.mean([(d > 0).mean() for d in diffs]))


# Flux.1: two batches, the second of more steps than the first (warmup takes the most) and padded: each call
# starts its cache afresh, or the second batch's images would not be diffusers' own. FLUX.2 [klein] and
# Qwen-Image (both with CFG: the cache keeps a state per cond and uncond pass): one batch of 2 at 6 steps.
STEPS_OF = {"tiny-flux": (6, 6, 8), "tiny-flux2-klein": (6, 6), "tiny-qwen-image": (6, 6)}


@pytest.mark.xla
@pytest.mark.parametrize("model", list(STEPS_OF))
def test_taylorseer_on_xla_is_diffusers_own_with_no_compile_after_warmup(model, tmp_path):
    prompts = ["a lighthouse at dawn", "a red fox in snow", "an astronaut on a horse"]
    lines = [
        json.dumps({"prompt": prompt, "steps": steps}) for prompt, steps in zip(prompts, STEPS_OF[model], strict=False)
    ]
    base = tiny_config(tmp_path, model={"id": model}, steps=6, batch_size=2, compile={"step_cache": TAYLORSEER})
    config = with_prompts_file(tmp_path, base, lines, "p.jsonl")
    # In a process of its own: the step graphs the later steps add are counted by their first compile.
    run_dir = _generate_in_a_process_of_its_own(write_config(tmp_path / "c.yaml", config))
    report = json.loads((run_dir / "report.json").read_text())

    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    # Each kind of step is a graph, all compiled in warmup (at the most steps): the first full step, a full step
    # one step after the last (a difference divided by 1, which XLA takes as a constant), one further after, a
    # predicted step one step after a full one and one further after; as step_graphs counts them.
    kinds = len(set(step_graphs(StepCacheConfig(**TAYLORSEER), max(STEPS_OF[model]))))
    assert kinds == 5
    assert warm["graphs_per_phase"] == {
        "text encoding": 1,
        "first denoising step": 1,
        "later denoising steps": kinds - 1,
        "decoding": 1,
    }
    batches = report["timed_phase"]["batches"]
    counts = {6: (6, 3, 3), 8: (8, 4, 4)}
    assert [(b["steps"], b["steps_full"], b["steps_cached"]) for b in batches] == [
        counts[steps] for steps in sorted(set(STEPS_OF[model]))
    ]
    # One read back to the host per batch, as without a cache: the schedule is the host's, not the data's.
    assert [b["transfers_to_host"] for b in batches] == [1] * len(batches)
    assert report["device"]["step_cache"] == {
        "method": "taylorseer",
        "options": StepCacheConfig(**TAYLORSEER).options(),
    }
    markdown = (run_dir / "report.md").read_text()
    assert "- step cache: taylorseer (cache_interval 3, disable_cache_before_step 2, " in markdown
    assert f"{sum(b['steps_full'] for b in batches)} steps ran full and " in markdown

    png = Image.open(next(run_dir.glob("00000-*.png")))
    assert json.loads(png.text["tpugen"])["step_cache"]["cache_interval"] == 3
    assert "Step cache: taylorseer cache_interval=3 disable_cache_before_step=2 " in png.text["parameters"]

    cached = _differences(run_dir, diffusers_images(run_dir, TAYLORSEER, model))
    uncached = _differences(run_dir, diffusers_images(run_dir, None, model))
    assert cached[0] <= CACHED_VS_DIFFUSERS, cached
    # The cache really ran: a tiny random Flux moves its pixels little (measured: the uncached images within
    # 1/255 of the cached ones, on 6% of the values; diffusers' cached images equal to the last bit here), so
    # what shows it is how many values differ from the uncached images against from diffusers' cached ones.
    assert uncached[1] > 0.01 and uncached[1] > 10 * cached[1], (cached, uncached)


@pytest.mark.xla
def test_taylorseer_with_trace_once_is_traced_by_dynamo_and_is_diffusers_own(tmp_path):
    """compile.trace_once with TaylorSeer on xla: the denoiser's step, hooks and all, traced by dynamo (the hooks'
    two torch.compiler.disable methods run undecorated), a trace per step index made by warmup (at the most
    steps) and read from dynamo's cache after; nothing compiled after warmup, one host read a batch, the images
    diffusers' own TaylorSeer's."""
    prompts = ["a lighthouse at dawn", "a red fox in snow", "an astronaut on a horse"]
    steps = STEPS_OF["tiny-flux"]
    lines = [json.dumps({"prompt": p, "steps": n}) for p, n in zip(prompts, steps, strict=True)]
    base = tiny_config(
        tmp_path,
        model={"id": "tiny-flux"},
        steps=6,
        batch_size=2,
        compile={"step_cache": TAYLORSEER, "trace_once": True},
    )
    config = with_prompts_file(tmp_path, base, lines, "p.jsonl")
    run_dir = _generate_in_a_process_of_its_own(write_config(tmp_path / "c.yaml", config))
    report = json.loads((run_dir / "report.json").read_text())
    assert report["device"]["trace_once"]["state"] == "on", report["device"]["trace_once"]
    assert report["compiles_after_warmup"] == 0
    batches = report["timed_phase"]["batches"]
    assert [(b["steps"], b["steps_full"], b["steps_cached"]) for b in batches] == [(6, 3, 3), (8, 4, 4)]
    assert [b["transfers_to_host"] for b in batches] == [1] * len(batches)
    cached = _differences(run_dir, diffusers_images(run_dir, TAYLORSEER, "tiny-flux"))
    uncached = _differences(run_dir, diffusers_images(run_dir, None, "tiny-flux"))
    assert cached[0] <= CACHED_VS_DIFFUSERS, cached
    assert uncached[1] > 0.01 and uncached[1] > 10 * cached[1], (cached, uncached)


@pytest.mark.xla  # diffusers' own ratio stretching (diffusers imports torch_xla); no device work
def test_the_magcache_schedule_is_its_head_hooks_rule_on_the_ratios():
    from tpugen.engine.step_cache import warm_call_steps, warm_steps

    flat = StepCacheConfig(method="magcache", mag_ratios=[1.0] * 8, max_skip_steps=2)
    full, cached = "full", "cached"
    # Steps 0 and 1 retained (0.2 of 8, rounded); then at most 2 skipped in a row, and a full step after them.
    assert schedule(flat, 8) == (full, full, cached, cached, full, cached, cached, full)
    assert step_graphs(flat, 8) == tuple((kind,) for kind in schedule(flat, 8))
    assert step_counts(flat, 8) == {"steps_full": 4, "steps_cached": 4}
    # Ratios far from 1 add up past the threshold at once: from then on every step runs full.
    rising = StepCacheConfig(method="magcache", mag_ratios=[1.0, 2.0])
    assert schedule(rising, 2) == (full, full)  # stretched to 2 steps: [1, 2]; step 0 has no residual yet
    assert schedule(rising, 3) == (full, cached, full)  # to 3: [1, 1, 2]
    assert warm_call_steps(rising, [2]) == 2 and warm_call_steps(rising, [2, 3]) == 3
    assert warm_call_steps(flat, [8, 2]) == 8
    assert warm_steps(rising, 2) == 3  # a server warmed at 2 steps would compile the skipped step later
    assert warm_steps(StepCacheConfig(), 2) == 2


# MagCache: the ratios `tpugen calibrate` measures on Flux.1; FLUX.2 [klein] and Qwen-Image (with CFG, one state
# per pass) with ratios given. A threshold under which some steps are skipped and some not.
MAGCACHE = {"method": "magcache", "threshold": 0.1, "max_skip_steps": 2, "retention_ratio": 0.2}
MAG_STEPS = 8


@pytest.mark.xla
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-flux2-klein", "tiny-qwen-image"])
def test_magcache_on_xla_is_diffusers_own_with_no_compile_after_warmup(model, tmp_path):
    prompts = ["a lighthouse at dawn", "a red fox in snow"]
    cache = dict(MAGCACHE)
    if model == "tiny-flux":
        cache["mag_ratios"] = "ratios.yaml"
    else:
        cache["mag_ratios"] = [1.0, 0.99, 1.04, 1.02, 0.97, 1.01, 0.96, 0.95]
    # Calibration and the run each in a process of their own, so the graph counts are exact whatever this process
    # compiled before.
    config = tiny_config(tmp_path, model={"id": model}, prompts=prompts, steps=MAG_STEPS, batch_size=2)
    config["compile"] = {"step_cache": cache}
    path = write_config(tmp_path / "c.yaml", config)
    if model == "tiny-flux":
        # Calibration first: the file the config names does not exist yet, so only calibrate can read the config.
        assert run_cli("validate", path).exit_code == 2
        _tpugen_in_a_process_of_its_own("calibrate", path)
        written = (tmp_path / "ratios.yaml").read_text()
        assert "mag_ratios:" in written and f"steps: {MAG_STEPS}" in written
        from tpugen.config import load_config

        ratios = load_config(path).config.compile.step_cache.mag_ratios
        assert len(ratios) == MAG_STEPS and ratios[0] == 1.0 and ratios != [1.0] * MAG_STEPS
        cache["mag_ratios"] = ratios
    run_dir = _generate_in_a_process_of_its_own(path)
    report = json.loads((run_dir / "report.json").read_text())
    kinds = schedule(StepCacheConfig(**cache), MAG_STEPS)
    assert "cached" in kinds and kinds.count("full") > 1, kinds

    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    # The kinds of step (a full one, which keeps its residual, and a skipped one) compiled in warmup, all of them
    # before the timed phase; counted in this run's own process, so by their first compile: the first step's
    # full graph, then the skipped step's in the later steps.
    expected = {"text encoding": 1, "first denoising step": 1, "later denoising steps": 1, "decoding": 1}
    assert warm["graphs_per_phase"] == expected, (warm, kinds)
    assert len(set(step_graphs(StepCacheConfig(**cache), MAG_STEPS))) == 2  # what tpugen's plan of graphs says
    (batch,) = report["timed_phase"]["batches"]
    assert (batch["steps_full"], batch["steps_cached"]) == (kinds.count("full"), kinds.count("cached"))
    assert batch["transfers_to_host"] == 1
    assert report["device"]["step_cache"]["options"]["mag_ratios"] == cache["mag_ratios"]
    png = Image.open(next(run_dir.glob("00000-*.png")))
    assert json.loads(png.text["tpugen"])["step_cache"]["mag_ratios"] == cache["mag_ratios"]
    assert (
        "Step cache: magcache threshold=0.1 max_skip_steps=2 retention_ratio=0.2 mag_ratios=[8 values],"
        in png.text["parameters"]
    )

    decisions: list[str] = []
    cached = _differences(run_dir, diffusers_images(run_dir, cache, model, MAG_STEPS, decisions))
    # diffusers' own hook decided each step as tpugen's schedule did, for each image.
    assert decisions == list(kinds) * len(prompts), decisions
    uncached = _differences(run_dir, diffusers_images(run_dir, None, model))
    assert cached[0] <= CACHED_VS_DIFFUSERS, cached
    assert uncached[1] > 0.01 and uncached[1] > 10 * cached[1], (cached, uncached)


# Pyramid Attention Broadcast: its defaults (every other call inside timesteps 100..800).
PAB = {"method": "pyramid_attention_broadcast"}


def test_the_pab_schedule_is_its_hooks_rule_on_the_call_count_and_the_timesteps():
    cache = StepCacheConfig(**PAB)
    timesteps = [1000.0, 875.0, 750.0, 625.0, 500.0, 375.0, 250.0, 125.0]  # tiny Flux.1's 8 steps
    computed, reused = "computed", "reused"
    # One transformer call a step (Flux.1): from 750 on, inside the range, every odd call reuses attention.
    assert pab_decisions(cache, timesteps) == ((computed,),) * 3 + ((reused,), (computed,)) * 2 + ((reused,),)
    assert schedule(cache, 8, timesteps=timesteps) == ("full",) * 3 + ("cached", "full") * 2 + ("cached",)
    assert step_counts(cache, 8, timesteps=timesteps) == {"steps_full": 5, "steps_cached": 3}
    # CFG as two calls a step (Qwen-Image, FLUX.2 [klein]): the one count per module goes up twice a step, so
    # with a skip range of 2 the unconditional call reuses what the conditional one just computed.
    two = pab_decisions(cache, timesteps, calls=2)
    assert two == ((computed, computed),) * 2 + ((computed, reused),) * 6
    assert step_graphs(cache, 8, timesteps=timesteps, calls=2) == two
    three = StepCacheConfig(**PAB, spatial_attention_block_skip_range=3)
    assert pab_decisions(three, [900.0, 500.0, 400.0, 300.0], calls=2) == (
        (computed, computed),
        (reused, computed),
        (reused, reused),
        (computed, reused),
    )
    # The range is open at both ends (diffusers' `low < t < high`).
    assert pab_decisions(cache, [1000.0, 800.0, 100.0, 500.0]) == ((computed,),) * 3 + ((reused,),)
    try:
        schedule(cache, 8)
    except ValueError as exc:
        assert "needs the call's 8 timesteps" in str(exc)
    else:
        raise AssertionError("a PAB schedule without timesteps")


def test_a_pab_warmup_makes_every_kind_of_step_any_call_makes():
    for every in (1, 2, 3, 4):
        cache = StepCacheConfig(**PAB, spatial_attention_block_skip_range=every)
        warm = pab_warm_timesteps(cache, warm_steps(cache, 2))
        assert warm_steps(cache, 2) == 1 + every == warm_call_steps(cache, [2]) and warm_call_steps(cache, [9]) == 9
        for calls in (1, 2):
            warmed = set(pab_decisions(cache, warm, calls))
            # Any timesteps of any length: here every pattern of inside and outside the range over 7 steps.
            for pattern in range(2**7):
                timesteps = [500.0 if pattern >> step & 1 else 900.0 for step in range(7)]
                assert set(pab_decisions(cache, timesteps, calls)) <= warmed, (every, calls, timesteps)
        assert covers(cache, 1 + every, 50) and not covers(cache, every, 2)


# Flux.1: a second image at 4 steps, whose schedule is not a prefix of 8 steps' (its timesteps differ): warm
# all the same. FLUX.2 [klein] and Qwen-Image (CFG, two transformer calls a step): one image at 8 steps.
PAB_STEPS_OF = {"tiny-flux": (8, 4), "tiny-flux2-klein": (8,), "tiny-qwen-image": (8,)}


@pytest.mark.xla
@pytest.mark.parametrize("model", list(PAB_STEPS_OF))
def test_pab_on_xla_is_diffusers_own_with_no_compile_after_warmup(model, tmp_path):
    # A negative prompt as long as the prompt in tokens: plain diffusers' Qwen-Image does not pad its text, and
    # its PAB hands the unconditional call the conditional call's attention output, text part included (tpugen
    # pads both to 512 tokens).
    prompts, negative = ["a red fox in snow", "a lighthouse at dawn"], "a dim grey blur"
    lines = [json.dumps({"prompt": p, "steps": n}) for p, n in zip(prompts, PAB_STEPS_OF[model], strict=False)]
    base = tiny_config(tmp_path, model={"id": model}, negative_prompt=negative, steps=8, batch_size=2)
    config = with_prompts_file(tmp_path, {**base, "compile": {"step_cache": PAB}}, lines, "p.jsonl")
    # In a process of its own: the step graph the later steps add is counted by its first compile.
    run_dir = _generate_in_a_process_of_its_own(write_config(tmp_path / "c.yaml", config))
    report = json.loads((run_dir / "report.json").read_text())

    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]
    # Two kinds of step, every call computing and some call reusing attention, both made by the warmup's
    # stand-in timesteps (the first step outside PAB's range, the next two inside).
    assert warm["graphs_per_phase"] == {
        "text encoding": 1,
        "first denoising step": 1,
        "later denoising steps": 1,
        "decoding": 1,
    }
    batches = report["timed_phase"]["batches"]
    # The hooks test a host timestep on every call: still one read back to the host per batch.
    assert [b["transfers_to_host"] for b in batches] == [1] * len(PAB_STEPS_OF[model])
    assert report["device"]["step_cache"] == {"method": PAB["method"], "options": StepCacheConfig(**PAB).options()}
    markdown = (run_dir / "report.md").read_text()
    assert (
        "- step cache: pyramid_attention_broadcast (spatial_attention_block_skip_range 2, "
        "spatial_attention_timestep_skip_range [100, 800]); timed phase: " in markdown
    )
    per_step = sum(b["seconds"] for b in batches) / sum(b["steps"] for b in batches)
    assert f"cached, {per_step:.3f} s per step" in markdown
    png = Image.open(next(run_dir.glob("00000-*.png")))
    assert json.loads(png.text["tpugen"])["step_cache"]["method"] == "pyramid_attention_broadcast"
    # Quoted, as A1111 quotes a value holding a comma.
    assert (
        'Step cache: "pyramid_attention_broadcast spatial_attention_block_skip_range=2 '
        'spatial_attention_timestep_skip_range=[100, 800]"' in png.text["parameters"]
    )

    # diffusers' own PAB, enabled as its docs do, its first hooked attention's choice and timestep at each call.
    calls = 1 if model == "tiny-flux" else 2
    seen: list[tuple[float, str]] = []

    def enable(pipe) -> None:
        from diffusers import PyramidAttentionBroadcastConfig

        options = StepCacheConfig(**PAB).options()
        pipe.transformer.enable_cache(
            PyramidAttentionBroadcastConfig(**options, current_timestep_callback=lambda: pipe.current_timestep)
        )
        attention = next(m for m in pipe.transformer.modules() if _hook(m, "pyramid_attention_broadcast"))
        hook = _hook(attention, "pyramid_attention_broadcast")
        compute = hook.fn_ref.original_forward
        ran: list[bool] = []

        def computing(*args, **kwargs):
            ran.append(True)
            return compute(*args, **kwargs)

        def record(module, args, output) -> None:
            seen.append((float(pipe.current_timestep), "computed" if ran else "reused"))

        hook.fn_ref.original_forward = computing
        attention.register_forward_pre_hook(lambda module, args: ran.clear())
        attention.register_forward_hook(record)

    cached = _differences(run_dir, plain_diffusers_images(model, run_dir, prepare=enable))
    # diffusers' hooks decided each call as tpugen's schedule does from the call's timesteps, image by image
    # (the manifest's order), and the report counts each batch's steps by it.
    manifest = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    counted = {}
    for record in manifest:
        calls_of_image, seen = seen[: record["steps"] * calls], seen[record["steps"] * calls :]
        timesteps = [t for t, _ in calls_of_image[::calls]]
        expected = pab_decisions(StepCacheConfig(**PAB), timesteps, calls)
        assert [d for _, d in calls_of_image] == [d for step in expected for d in step], (record, calls_of_image)
        kinds = schedule(StepCacheConfig(**PAB), record["steps"], timesteps=timesteps, calls=calls)
        assert "cached" in kinds, kinds
        counted[record["steps"]] = (kinds.count("full"), kinds.count("cached"))
    assert not seen
    assert {b["steps"]: (b["steps_full"], b["steps_cached"]) for b in batches} == counted
    uncached = _differences(run_dir, diffusers_images(run_dir, None, model))
    assert cached[0] <= CACHED_VS_DIFFUSERS, cached
    assert uncached[1] > 0.01 and uncached[1] > 10 * cached[1], (cached, uncached)


@pytest.mark.xla
def test_a_step_cache_with_img2img_is_refused_in_one_line(tmp_path):
    # diffusers 0.42's FluxImg2ImgPipeline has no cache_context around its transformer call and no
    # current_timestep, and an img2img loop runs strength x steps: refused before anything is generated.
    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "init.png")
    prompts = [{"prompt": "a red square", "init_image": "init.png", "strength": 0.7}]
    config = tiny_config(tmp_path, model={"id": "tiny-flux"}, prompts=prompts, steps=4, batch_size=5)
    config["compile"] = {"step_cache": PAB}
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code != 0
    assert result.stderr.startswith(
        "error: compile.step_cache.method: pyramid_attention_broadcast runs for txt2img only, not img2img: "
    ), result.stderr
    assert "0 new images" in result.stderr
