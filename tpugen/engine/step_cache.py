"""compile.step_cache: diffusers' own step-cache hooks on the denoiser, whose schedule is known on the host."""

from __future__ import annotations

from tpugen.config.schema import StepCacheConfig

STEP_CACHE_HOOK = "step cache"


def step_cache_problem(config: StepCacheConfig, family, *, scan_blocks: bool) -> str | None:
    """Why this cache cannot run on this family's models the way the config runs them (None: it can)."""
    if config.method == "none":
        return None
    where = f"compile.step_cache.method: {config.method}"
    if family.step_cache_refusal:
        return f"{where}: {family.title}: {family.step_cache_refusal}"
    if scan_blocks:
        # A scan runs only the first block's code, so hooks on the other blocks would never run.
        return f"{where} hooks every block's attention, and compile.scan_blocks runs only the first block's code"
    return None


def schedule(config: StepCacheConfig, steps: int) -> tuple[str, ...]:
    """Each denoising step's kind, "full" or "cached", decided as diffusers' TaylorSeerCacheHook decides it
    (`_measure_should_compute`): from the step index alone, never from the data. So on XLA every kind of step
    is a graph of its own, all of them compiled by one warmup call with at least as many steps (the schedule
    of fewer steps is a prefix of it)."""
    if config.method == "none":
        return ("full",) * steps
    before, interval, after = config.disable_cache_before_step, config.cache_interval, config.disable_cache_after_step
    kinds = []
    for step in range(steps):
        full = step < before or (step - before - 1) % interval == 0 or (after is not None and step >= after)
        kinds.append("full" if full else "cached")
    return tuple(kinds)


def step_counts(config: StepCacheConfig, steps: int) -> dict[str, int]:
    """{"steps_full", "steps_cached"} of one pipeline call of `steps` steps."""
    kinds = schedule(config, steps)
    return {"steps_full": kinds.count("full"), "steps_cached": kinds.count("cached")}


def diffusers_config(config: StepCacheConfig):
    """The config as diffusers' own class for the method (TaylorSeerCacheConfig), to pass to enable_cache."""
    import torch
    from diffusers import TaylorSeerCacheConfig

    options = config.options()
    options["taylor_factors_dtype"] = getattr(torch, options["taylor_factors_dtype"])
    return TaylorSeerCacheConfig(**options)


def install_step_cache(pipe, family, config: StepCacheConfig, hooks) -> None:
    """diffusers' hooks on the denoiser (`enable_cache`), as the named hook "step cache".

    The hooks keep their state (step counter, Taylor factors) in Python objects holding device tensors: the
    per-step graph cut makes those tensors each step graph's outputs and the next one's inputs, and reads
    nothing back to the host. diffusers resets the state at the end of every pipeline call
    (maybe_free_model_hooks); `reset_step_cache` also resets it before one, for a call that failed halfway."""
    if config.method == "none":
        return
    denoiser = getattr(pipe, family.denoiser)
    denoiser.enable_cache(diffusers_config(config))
    hooks.add(STEP_CACHE_HOOK, denoiser.disable_cache)


def reset_step_cache(pipe, family) -> None:
    """Forget the cache state of an earlier call (a no-op without a cache)."""
    denoiser = getattr(pipe, family.denoiser, None)
    if getattr(denoiser, "is_cache_enabled", False):
        denoiser._reset_stateful_cache()
