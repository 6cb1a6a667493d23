"""compile.step_cache: diffusers' own step-cache hooks on the denoiser, whose schedule is known on the host."""

from __future__ import annotations

import contextlib
import math

from tpugen.config.request import MAX_STEPS
from tpugen.config.schema import KNOWN_MAG_RATIOS, StepCacheConfig
from tpugen.errors import RunError

STEP_CACHE_HOOK = "step cache"
PAB = "pyramid_attention_broadcast"


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
    if config.method == PAB and not family.timesteps_on_host:
        # PAB's hooks test the current timestep on every call: on the device, that is a read back each time.
        return f"{where}: {family.title} keeps its timesteps on the device, and PAB tests one at every call"
    return None


def schedule(config: StepCacheConfig, steps: int, *, timesteps=None, calls: int = 1) -> tuple[str, ...]:
    """Each denoising step's kind, "full" or "cached", decided as diffusers' hooks decide it, from the step index
    (for MagCache its calibrated ratios, for PAB the call's `timesteps`, host numbers, and its transformer
    `calls` per step) alone, never from the data. So on XLA every kind of step is a graph of its own, all
    compiled by warmup. A PAB step is cached where any of its calls reused attention."""
    if config.method == "taylorseer":
        return _taylorseer_kinds(config, steps)
    if config.method == "magcache":
        return _magcache_kinds(config, steps)
    if config.method == PAB:
        decisions = pab_decisions(config, _steps_of(timesteps, steps), calls)
        return tuple("full" if "reused" not in step else "cached" for step in decisions)
    return ("full",) * steps


def _steps_of(timesteps, steps: int) -> list[float]:
    if timesteps is None or len(timesteps) != steps:
        raise ValueError(f"pyramid_attention_broadcast's schedule needs the call's {steps} timesteps")
    return [float(t) for t in timesteps]


def pab_decisions(config: StepCacheConfig, timesteps, calls: int = 1) -> tuple[tuple[str, ...], ...]:
    """PyramidAttentionBroadcastHook's choice, "computed" or "reused", for each transformer call of each step.
    Its state is one per attention module, not per cache context: the count of calls goes up on every call,
    so under CFG (two calls a step) it goes up twice a step and the unconditional call may reuse what the
    conditional one just computed. Every hooked attention is called once per transformer call, so all decide
    alike. A call computes when it is the first, when the timestep is not strictly inside the range, or when
    its count is a multiple of spatial_attention_block_skip_range."""
    low, high = config.spatial_attention_timestep_skip_range
    every = config.spatial_attention_block_skip_range
    decisions, iteration = [], 0
    for t in timesteps:
        inside = low < float(t) < high
        step = []
        for _ in range(calls):
            step.append("computed" if iteration == 0 or not inside or iteration % every == 0 else "reused")
            iteration += 1
        decisions.append(tuple(step))
    return tuple(decisions)


def pab_warm_timesteps(config: StepCacheConfig, steps: int) -> list[float]:
    """The stand-in timesteps a warmup call hands PAB's hooks (`warming`) so that their own rule makes every kind
    of step any call can make: step 0 outside the range (every call computes), then skip-range steps inside
    it, whose call counts run through every remainder the counts of a real call can have (the kind of a step
    inside the range depends on nothing else), then outside again."""
    low, high = config.spatial_attention_timestep_skip_range
    inside = config.spatial_attention_block_skip_range
    return [float(low)] + [(low + high) / 2] * min(inside, steps - 1) + [float(low)] * max(steps - 1 - inside, 0)


def _pab_warm_steps(config: StepCacheConfig) -> int:
    return 1 + config.spatial_attention_block_skip_range


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


def step_graphs(config: StepCacheConfig, steps: int, *, timesteps=None, calls: int = 1) -> tuple[tuple, ...]:
    """What tells each step's graph from the others' under the cache, step by step, following TaylorSeerState:
    a full step after the first also updates the Taylor factors (divided differences, divided by the steps since
    the last full one), a cached step sums the factors it holds times offset**order / order!. The graph depends
    on how many factors there are and on which of those numbers torch_xla bakes in as constants (`_as_traced`),
    not on the other numbers' values. Without a cache every step is one kind (the step count compiles nothing).
    MagCache has two: a full step (which also keeps its residual), and a skipped one (the input plus that
    residual). PAB: which of the step's calls computed attention and which reused it (`pab_decisions`; the
    output a reuse reads is an earlier step graph's, or this one's, whichever step it came from)."""
    if config.method == "none":
        return (("step",),) * steps
    if config.method == PAB:
        return pab_decisions(config, _steps_of(timesteps, steps), calls)
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
    if config.method == PAB:
        # Its warmup made every kind of step any call can make (`pab_warm_timesteps`), whatever the timesteps.
        return warmed_steps >= _pab_warm_steps(config)
    return set(step_graphs(config, steps)) <= set(step_graphs(config, warmed_steps))


def warm_steps(config: StepCacheConfig, steps: int, most: int = MAX_STEPS, *, per_count: bool = False) -> int:
    """The steps a server's warmup call runs so that a request of any step count up to `most` compiles nothing:
    `steps`, or more where a cache's step graphs appear only later (TaylorSeer at interval 3 from step 2: all 5
    by 6 steps; MagCache, whose two kinds of step any count with a skipped step compiles: the first such).
    `per_count`: each step count is a program of its own (a whole loop traced call by call): `steps`."""
    if per_count:
        return steps
    if config.method == "taylorseer":
        graphs = step_graphs(config, most)  # the schedule of fewer steps is a prefix of that of more
        first_seen = {graph: index for index, graph in reversed(list(enumerate(graphs)))}
        return max(steps, max(first_seen.values()) + 1)
    if config.method == "magcache":
        return next((count for count in range(steps, most + 1) if "cached" in schedule(config, count)), steps)
    if config.method == PAB:
        return max(steps, _pab_warm_steps(config))  # one step outside the timestep range, skip-range inside
    return steps


def warm_call_steps(config: StepCacheConfig, counts) -> int:
    """The steps of one warmup call that compiles every step graph that calls of each of `counts` steps run: the
    largest count where it does (always, under TaylorSeer), else the first count past it that does (MagCache
    stretches its ratios to each count, so 8 steps may skip where 12 do not)."""
    counts = sorted(set(counts))
    largest = counts[-1]
    if config.method == "none":
        return largest
    if config.method == PAB:
        return max(largest, _pab_warm_steps(config))
    every = set().union(*(step_graphs(config, count) for count in counts))
    return next((n for n in range(largest, MAX_STEPS + 1) if set(step_graphs(config, n)) >= every), largest)


def step_counts(config: StepCacheConfig, steps: int, *, timesteps=None, calls: int = 1) -> dict[str, int]:
    """{"steps_full", "steps_cached"} of one pipeline call of `steps` steps (PAB: of these timesteps and calls)."""
    kinds = schedule(config, steps, timesteps=timesteps, calls=calls)
    return {"steps_full": kinds.count("full"), "steps_cached": kinds.count("cached")}


def diffusers_config(config: StepCacheConfig, steps: int, *, calibrate: bool = False, pipe=None):
    """The config as diffusers' own class for the method (TaylorSeerCacheConfig, MagCacheConfig,
    PyramidAttentionBroadcastConfig), to pass to enable_cache, for calls of `steps` steps (MagCache's
    num_inference_steps; `prepare_call` changes it for a call of other steps). `calibrate`: MagCache's
    calibration mode, which skips nothing and measures ratios. `pipe`: PAB's, whose current timestep its
    hooks read (`CurrentTimestep`)."""
    import torch

    options = config.options()
    if config.method == PAB:
        from diffusers import PyramidAttentionBroadcastConfig

        if pipe is None:
            raise ValueError("pyramid_attention_broadcast reads the pipeline's current timestep: pass its pipe")
        options["spatial_attention_timestep_skip_range"] = tuple(options["spatial_attention_timestep_skip_range"])
        return PyramidAttentionBroadcastConfig(**options, current_timestep_callback=CurrentTimestep(pipe))
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
    denoiser.enable_cache(diffusers_config(config, steps, pipe=pipe))
    hooks.add(STEP_CACHE_HOOK, denoiser.disable_cache)


TRACED_STEP_CACHE_HOOK = "step cache traced by dynamo"


def traceable_step_cache(pipe, family, config: StepCacheConfig, hooks) -> None:
    """TaylorSeer's hooks as dynamo traces them (compile.trace_once on xla): diffusers marks the two methods that
    decide and predict torch.compiler.disable (a graph break, and trace once would fall back); here each hook runs
    their own undecorated code, so the denoiser's step, hooks and all, is one dynamo graph. Its decisions are
    Python numbers of the step's index, which dynamo guards on: a trace per step index, made by warmup and read
    from dynamo's cache after; each kind of step one XLA graph. As the named hook TRACED_STEP_CACHE_HOOK (a no-op
    for another method)."""
    if config.method != "taylorseer":
        return
    import types

    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState

    class TracedState(TaylorSeerState):
        predict = TaylorSeerState.predict.__wrapped__

    decide = TaylorSeerCacheHook._measure_should_compute.__wrapped__
    changed = []
    for module in getattr(pipe, family.denoiser).modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook("taylorseer_cache") if registry is not None else None
        if hook is None:
            continue
        changed.append((hook, hook.state_manager._state_cls))
        hook._measure_should_compute = types.MethodType(decide, hook)
        hook.state_manager._state_cls = TracedState
        hook.state_manager.reset()

    def restore() -> None:
        for hook, state_cls in changed:
            vars(hook).pop("_measure_should_compute", None)
            hook.state_manager._state_cls = state_cls
            hook.state_manager.reset()

    hooks.add(TRACED_STEP_CACHE_HOOK, restore)


class CurrentTimestep:
    """PAB's current_timestep_callback: `pipe.current_timestep`, as diffusers' own example passes it (a CPU
    tensor in these families' loops, so every hook's range test is host arithmetic, no read from the device).
    It keeps each step's value of the call (`seen`, for the report's step counts); in a warmup call
    (`warming`) it hands the hooks stand-in values instead."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.stand_ins: list[float] | None = None
        self.seen: list[float] = []
        self._last = None

    def start_call(self, pipe) -> None:
        """Before each call: `pipe` is the one that runs it (an img2img pipeline shares this denoiser)."""
        self.pipe, self.seen, self._last = pipe, [], None

    def __call__(self):
        timestep = self.pipe.current_timestep
        # The loop sets a new tensor object each step and the same one for every call within it (both CFG
        # passes); holding the last one keeps its id from being reused.
        if timestep is not self._last:
            self._last = timestep
            self.seen.append(float(timestep))
        if self.stand_ins is not None:
            return self.stand_ins[min(len(self.seen), len(self.stand_ins)) - 1]
        return timestep


def _timestep_callback(pipe, family) -> CurrentTimestep | None:
    cache_config = getattr(getattr(pipe, family.denoiser, None), "_cache_config", None)
    callback = getattr(cache_config, "current_timestep_callback", None)
    return callback if isinstance(callback, CurrentTimestep) else None


@contextlib.contextmanager
def warming(pipe, family, config: StepCacheConfig, steps: int):
    """Around a warmup call of `steps` steps: PAB's hooks get the stand-in timesteps `pab_warm_timesteps`, so
    the call compiles every kind of step any later call makes (a no-op for the other methods, whose warmup
    calls are real ones)."""
    callback = _timestep_callback(pipe, family) if config.method == PAB else None
    if callback is None:
        yield
        return
    callback.stand_ins = pab_warm_timesteps(config, steps)
    try:
        yield
    finally:
        callback.stand_ins = None


def call_step_counts(pipe, family, config: StepCacheConfig, batch) -> dict[str, int]:
    """How many steps of the call just made ran full and cached ({} without a cache); PAB's from the timesteps
    its hooks were handed and the transformer calls a step makes (two under CFG: these families run the
    unconditional pass as a call of its own)."""
    if config.method == "none":
        return {}
    if config.method != PAB:
        return step_counts(config, batch.steps)
    seen = _timestep_callback(pipe, family).seen
    return step_counts(config, len(seen), timesteps=seen, calls=2 if batch.shape.cfg else 1)


def prepare_call(pipe, family, config: StepCacheConfig, steps: int, *, task: str = "txt2img") -> None:
    """Before a call by `pipe` (the loaded pipeline, or an img2img one made from its components, with the same
    denoiser): MagCache's hooks count steps up to their config's num_inference_steps (then start over) and read
    ratios stretched to it, so the config they share is set to this call's steps and its ratios; PAB's timestep
    callback reads this call's pipe and starts its record afresh. A step cache runs for txt2img only (`task`)."""
    if config.method != "none" and task != "txt2img":
        raise RunError(
            f"compile.step_cache.method: {config.method} runs for txt2img only, not {task}: an {task} call's loop "
            "runs only strength x steps of its steps, which tpugen's schedule does not count yet, and diffusers "
            "0.42's Flux.1 img2img and inpaint pipelines give the hooks no cache_context nor current_timestep"
        )
    denoiser = getattr(pipe, family.denoiser, None)
    cache_config = getattr(denoiser, "_cache_config", None)
    if config.method == PAB and (callback := _timestep_callback(pipe, family)) is not None:
        if not hasattr(type(pipe), "current_timestep"):
            raise RunError(
                f"compile.step_cache.method: {PAB}: diffusers 0.42's {type(pipe).__name__} has no "
                "current_timestep, which PAB's hooks read each call: it runs for txt2img only"
            )
        callback.start_call(pipe)
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
