"""compile.step_cache: diffusers' TaylorSeer on a static schedule, against diffusers' own cached images."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import plain_diffusers_images, run_cli, tiny_config, with_prompts_file, write_config
from PIL import Image

from tpugen.config.schema import StepCacheConfig
from tpugen.engine.step_cache import schedule, step_cache_problem, step_counts, step_graphs
from tpugen.families import family

TAYLORSEER = {
    "method": "taylorseer",
    "cache_interval": 3,
    "disable_cache_before_step": 2,
    "taylor_factors_dtype": "float32",
}
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
        ("magcache", "mag_ratios"),
        ("first_block_cache", "cannot run as static graphs"),
        ("fastercache", "not supported yet"),
        ("pyramid_attention_broadcast", "not supported yet"),
    ]:
        result = run_cli("validate", config, f"compile.step_cache.method={method}")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith(f"error: compile.step_cache.method: {method} ") and words in result.stderr
    result = run_cli("validate", config, "compile.step_cache.cache_interval=3")
    assert result.exit_code == 2
    assert "compile.step_cache: cache_interval: TaylorSeer's options; set method: taylorseer" in result.stderr

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
        config = tiny_config(tmp_path, model={"id": "tiny-flux"}, compile=compile_section)
        return load_config(write_config(tmp_path / name, config)).config_hash

    plain = hash_of("a.yaml")
    assert hash_of("b.yaml", step_cache={"method": "none"}) == plain  # configs from before the key hash as they did
    assert hash_of("c.yaml", step_cache=TAYLORSEER) != plain


def diffusers_images(run_dir, cache: dict | None, model: str = "tiny-flux") -> dict[str, np.ndarray]:
    """Each image of a `model` run made again by plain diffusers on the CPU (eager, no tpugen patch) from the
    same noise, with `cache` (compile.step_cache) passed to transformer.enable_cache as diffusers' own config."""
    from tpugen.engine.step_cache import diffusers_config

    def enable(pipe) -> None:
        if cache is not None:
            pipe.transformer.enable_cache(diffusers_config(StepCacheConfig(**cache)))

    return plain_diffusers_images(model, run_dir, prepare=enable)


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
    # Batch 4: a shape key no other test compiles for these models (text encoding depends on the batch alone,
    # decoding on the batch and size), so the graph counts below are exact whatever ran before in this process.
    base = tiny_config(tmp_path, model={"id": model}, steps=6, batch_size=4, compile={"step_cache": TAYLORSEER})
    config = with_prompts_file(tmp_path, base, lines, "p.jsonl")
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
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
