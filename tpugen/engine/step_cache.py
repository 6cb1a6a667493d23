"""compile.step_cache: diffusers' own step-cache hooks on the denoiser, whose schedule is known on the host."""

from __future__ import annotations

import contextlib
import math

from tpugen.config.request import MAX_STEPS
from tpugen.config.schema import KNOWN_MAG_RATIOS, StepCacheConfig

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
    """Each denoising step's kind, "full" or "cached", decided as diffusers' hooks decide it, from the step index
    (and for MagCache its calibrated ratios) alone, never from the data. So on XLA every kind of step is a graph
    of its own, all compiled by warmup."""
    if config.method == "taylorseer":
        return _taylorseer_kinds(config, steps)
    if config.method == "magcache":
        return _magcache_kinds(config, steps)
    return ("full",) * steps


def _taylorseer_kinds(config: StepCacheConfig, steps: int) -> tuple[str, ...]:
    """TaylorSeerCacheHook's `_measure_should_compute`: a rule on the step index (the schedule of fewer steps is a
    prefix of that of more)."""
    before, interval, after = config.disable_cache_before_step, config.cache_interval, config.disable_cache_after_step
    kinds = []
    for step in range(steps):
        full = step < before or (step - before - 1) % interval == 0 or (after is not None and step >= after)
        kinds.append("full" if full else "cached")
    return tuple(kinds)


def mag_ratios(config: StepCacheConfig, steps: int):
    """The ratios MagCacheConfig holds for a call of `steps` steps: the config's (or diffusers' own, by name),
    stretched to the step count by diffusers' own nearest-neighbour rule, as a float32 tensor."""
    import torch
    from diffusers.hooks import mag_cache

    ratios = config.mag_ratios
    if isinstance(ratios, str):
        ratios = getattr(mag_cache, KNOWN_MAG_RATIOS[ratios])
    ratios = ratios if torch.is_tensor(ratios) else torch.tensor(ratios)
    return ratios if len(ratios) == steps else mag_cache.nearest_interp(ratios, steps)


def _magcache_kinds(config: StepCacheConfig, steps: int) -> tuple[str, ...]:
    """MagCacheHeadHook's decision, step by step, in the same float32 arithmetic as its 0-d tensors: after the
    retained first steps, the ratios multiply up; a step is skipped while the error they add up to stays at or
    under the threshold and at most max_skip_steps were skipped in a row, and a full step starts over."""
    import numpy as np

    ratios = mag_ratios(config, steps).numpy()
    one, threshold = np.float32(1.0), np.float32(config.threshold)
    retention = int(config.retention_ratio * steps + 0.5)
    ratio, skipped_in_row, error, residual = one, 0, np.float32(0.0), False
    kinds = []
    for step in range(steps):
        compute = True
        if step >= retention:
            ratio = ratio * (ratios[step] if step < len(ratios) else one)
            skipped_in_row += 1
            error = error + abs(one - ratio)
            if residual and error <= threshold and skipped_in_row <= config.max_skip_steps:
                compute = False
            else:
                ratio, skipped_in_row, error = one, 0, np.float32(0.0)
        residual = residual or compute
        kinds.append("full" if compute else "cached")
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
    not on the other numbers' values. Without a cache every step is one kind (the step count compiles nothing).
    MagCache has two: a full step (which also keeps its residual), and a skipped one (the input plus that
    residual)."""
    if config.method == "none":
        return (("step",),) * steps
    if config.method == "magcache":
        return tuple((kind,) for kind in _magcache_kinds(config, steps))
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
    """Whether a call of `warmed_steps` steps compiled every step graph a call of `steps` steps runs (TaylorSeer:
    always for fewer, the schedule of fewer steps being a prefix of that of more; MagCache stretches its ratios
    to each step count, so its schedule is not, and the graphs are compared)."""
    if config.method == "taylorseer" and steps <= warmed_steps:
        return True
    return set(step_graphs(config, steps)) <= set(step_graphs(config, warmed_steps))


def warm_steps(config: StepCacheConfig, steps: int, most: int = MAX_STEPS) -> int:
    """The steps a server's warmup call runs so that a request of any step count up to `most` compiles nothing:
    `steps`, or more where a cache's step graphs appear only later (TaylorSeer at interval 3 from step 2: all 5
    by 6 steps; MagCache, whose two kinds of step any count with a skipped step compiles: the first such)."""
    if config.method == "taylorseer":
        graphs = step_graphs(config, most)  # the schedule of fewer steps is a prefix of that of more
        first_seen = {graph: index for index, graph in reversed(list(enumerate(graphs)))}
        return max(steps, max(first_seen.values()) + 1)
    if config.method == "magcache":
        return next((count for count in range(steps, most + 1) if "cached" in schedule(config, count)), steps)
    return steps


def warm_call_steps(config: StepCacheConfig, counts) -> int:
    """The steps of one warmup call that compiles every step graph that calls of each of `counts` steps run: the
    largest count where it does (always, under TaylorSeer), else the first count past it that does (MagCache
    stretches its ratios to each count, so 8 steps may skip where 12 do not)."""
    counts = sorted(set(counts))
    largest = counts[-1]
    if config.method == "none":
        return largest
    every = set().union(*(step_graphs(config, count) for count in counts))
    return next((n for n in range(largest, MAX_STEPS + 1) if set(step_graphs(config, n)) >= every), largest)


def step_counts(config: StepCacheConfig, steps: int) -> dict[str, int]:
    """{"steps_full", "steps_cached"} of one pipeline call of `steps` steps."""
    kinds = schedule(config, steps)
    return {"steps_full": kinds.count("full"), "steps_cached": kinds.count("cached")}


def diffusers_config(config: StepCacheConfig, steps: int, *, calibrate: bool = False):
    """The config as diffusers' own class for the method (TaylorSeerCacheConfig, MagCacheConfig), to pass to
    enable_cache, for calls of `steps` steps (MagCache's num_inference_steps; `prepare_call` changes it for a
    call of other steps). `calibrate`: MagCache's calibration mode, which skips nothing and measures ratios."""
    import torch

    options = config.options()
    if config.method == "magcache":
        from diffusers import MagCacheConfig

        del options["mag_ratios"]
        ratios = None if calibrate else mag_ratios(config, steps)
        return MagCacheConfig(**options, num_inference_steps=steps, mag_ratios=ratios, calibrate=calibrate)
    from diffusers import TaylorSeerCacheConfig

    options["taylor_factors_dtype"] = getattr(torch, options["taylor_factors_dtype"])
    return TaylorSeerCacheConfig(**options)


def install_step_cache(pipe, family, config: StepCacheConfig, hooks, steps: int = 28) -> None:
    """diffusers' hooks on the denoiser (`enable_cache`), as the named hook "step cache".

    The hooks keep their state (step counter, Taylor factors) in Python objects holding device tensors: the
    per-step graph cut makes those tensors each step graph's outputs and the next one's inputs, and reads
    nothing back to the host. diffusers resets the state at the end of every pipeline call
    (maybe_free_model_hooks); `reset_step_cache` also resets it before one, for a call that failed halfway."""
    if config.method == "none":
        return
    denoiser = getattr(pipe, family.denoiser)
    denoiser.enable_cache(diffusers_config(config, steps))
    hooks.add(STEP_CACHE_HOOK, denoiser.disable_cache)


def prepare_call(pipe, family, config: StepCacheConfig, steps: int) -> None:
    """Before a call: MagCache's hooks count steps up to their config's num_inference_steps (then start over) and
    read ratios stretched to it, so the config they share is set to this call's steps and its ratios."""
    denoiser = getattr(pipe, family.denoiser, None)
    cache_config = getattr(denoiser, "_cache_config", None)
    if config.method != "magcache" or cache_config is None or cache_config.calibrate:
        return
    if cache_config.num_inference_steps != steps:
        cache_config.num_inference_steps = steps
        cache_config.mag_ratios = mag_ratios(config, steps)


@contextlib.contextmanager
def calibrating(pipe, family, steps: int):
    """diffusers' MagCache in its calibration mode on the denoiser for the calls inside (which skips nothing and
    measures, after each step, how the last block's residual's magnitude changed): yields the list its ratios
    fill (`record_calibration`), and takes the hooks off again."""
    from diffusers import MagCacheConfig

    denoiser = getattr(pipe, family.denoiser)
    denoiser.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    try:
        yield record_calibration(pipe, family)
    finally:
        denoiser.disable_cache()


def record_calibration(pipe, family) -> list[float]:
    """The list MagCache's calibration (diffusers' own `_perform_calibration_step` on the last block) fills with
    one ratio per step of the next calls: of the first cache context each step runs in (the conditional pass,
    where a pipeline runs two)."""
    denoiser = getattr(pipe, family.denoiser)
    tails = [
        hook
        for module in denoiser.modules()
        if (registry := getattr(module, "_diffusers_hook", None)) is not None
        and (hook := registry.get_hook("mag_cache_block_hook")) is not None
        and hook.is_tail
    ]
    if len(tails) != 1:
        raise RuntimeError(
            f"MagCache calibration: expected one tail block hook on the {family.denoiser}, found {len(tails)}"
        )
    (tail,) = tails
    ratios: list[float] = []
    measure = tail._perform_calibration_step
    first_context: list[str] = []

    def recording(state, residual) -> None:
        before = len(state.calibration_ratios)
        measure(state, residual)
        context = tail.state_manager.context.name
        first_context[:] = first_context or [context]
        if context == first_context[0] and len(state.calibration_ratios) > before:
            ratios.append(float(state.calibration_ratios[-1]))

    tail._perform_calibration_step = recording
    return ratios


def reset_step_cache(pipe, family) -> None:
    """Forget the cache state of an earlier call (a no-op without a cache)."""
    denoiser = getattr(pipe, family.denoiser, None)
    if getattr(denoiser, "is_cache_enabled", False):
        denoiser._reset_stateful_cache()
