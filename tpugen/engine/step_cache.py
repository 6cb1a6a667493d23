"""compile.step_cache: diffusers' own step-cache hooks on the denoiser, whose schedule is known on the host."""

from __future__ import annotations

import math

from tpugen.config.request import MAX_STEPS
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


def _as_traced(value: float) -> float | str:
    """A Python number as torch_xla traces it: 0 and +-1 are constants baked into the graph, any other value is
    the graph's input (so two such values share one graph)."""
    return value if value in (0, 1, -1) else "input"


def step_graphs(config: StepCacheConfig, steps: int) -> tuple[tuple, ...]:
    """What tells each step's graph from the others' under the cache, step by step, following TaylorSeerState:
    a full step after the first also updates the Taylor factors (divided differences, divided by the steps since
    the last full one), a cached step sums the factors it holds times offset**order / order!. The graph depends
    on how many factors there are and on which of those numbers torch_xla bakes in as constants (`_as_traced`),
    not on the other numbers' values. Without a cache every step is one kind (the step count compiles nothing)."""
    if config.method == "none":
        return (("step",),) * steps
    graphs: list[tuple] = []
    factors, last_full = 0, None
    for step, kind in enumerate(schedule(config, steps)):
        if kind == "full":
            if last_full is None:
                graphs.append(("full", "first"))
                factors = 1
            else:
                differences = min(factors, config.max_order)
                graphs.append(("full", differences, _as_traced(step - last_full) if differences else None))
                factors = 1 + differences
            last_full = step
        else:
            offset = step - last_full
            coefficients = tuple(_as_traced(offset**order / math.factorial(order)) for order in range(factors))
            graphs.append(("cached", factors, coefficients))
    return tuple(graphs)


def covers(config: StepCacheConfig, warmed_steps: int, steps: int) -> bool:
    """Whether a call of `warmed_steps` steps compiled every step graph a call of `steps` steps runs (always,
    for fewer: the schedule of fewer steps is a prefix of that of more)."""
    return steps <= warmed_steps or set(step_graphs(config, steps)) <= set(step_graphs(config, warmed_steps))


def warm_steps(config: StepCacheConfig, steps: int, most: int = MAX_STEPS) -> int:
    """The steps a server's warmup call runs so that a request of any step count up to `most` compiles nothing:
    `steps`, or more where a cache's step graphs appear only later (interval 3 from step 2: all 5 by 6 steps)."""
    graphs = step_graphs(config, most)
    first_seen = {graph: index for index, graph in reversed(list(enumerate(graphs)))}
    return max(steps, max(first_seen.values()) + 1)


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
