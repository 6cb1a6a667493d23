"""The whole denoising loop as one compiled call: the denoiser's steps in a `lax.fori_loop`, each update the
schedule's linear combination (tpugen.engine.linear_schedule), the step count a number handed in, so any steps of
any linear sampler run the same program."""

from __future__ import annotations

import threading

# Calls one loop program holds: MAX_STEPS (1000) steps of a sampler that calls the model twice a step (Heun).
CAPACITY = 2048
WINDOW = 4  # the latents and model outputs an update may read (the schedule's windows are at most this)
# The names diffusers' pipelines give their denoiser's calls of a step (the conditional one, then CFG's second),
# under which its step-cache hooks keep their state.
CACHE_CONTEXTS = ("cond", "uncond")


def noise_bucket(calls: int) -> int:
    """How many calls of noise an ancestral sampler's program takes: the next power of two from 16, so most
    step counts share a program (the noise is drawn on the host, per call and image, as diffusers draws it)."""
    bucket = 16
    while bucket < calls:
        bucket *= 2
    return bucket


class LoopPrograms:
    """The loop programs of one denoiser, one per body, input layout and noise bucket (JAX adds one per shape)."""

    def __init__(self, runtime, denoiser, mesh=None, beside: dict | None = None) -> None:
        self.runtime = runtime
        self.denoiser = denoiser  # tpugen.backends.jax.modules.JaxModule
        # The modules that run beside the denoiser (ControlNets), by the torch module's id: their JaxModules.
        self.beside = beside if beside is not None else {}
        # A data-parallel mesh (execution.mode: multi): each call's rows split over its devices, the latents and
        # the noise by their batch axis (the rest of the inputs follow: XLA's partitioner splits the program).
        self.rows = self.noise_rows = None
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            self.rows = NamedSharding(mesh, PartitionSpec("data"))
            self.noise_rows = NamedSharding(mesh, PartitionSpec(None, None, "data"))
        self._programs: dict = {}
        self._tables: dict = {}
        self._lock = threading.Lock()

    def run(self, work):
        """Start `work` (tpugen.engine.whole_loop.LoopWork) on the device: returns the final latents as a device
        array, at once (JAX runs it asynchronously)."""
        import numpy as np
        import torch
        from torch.utils import _pytree as pytree

        from tpugen.backends.jax.modules import _hashable, to_jax

        schedule = work.schedule
        if schedule.calls > CAPACITY:
            raise ValueError(f"a loop of {schedule.calls} calls is longer than the {CAPACITY} a program holds")
        draws = work.noise.shape[1] if work.noise is not None else 0
        if schedule.sample_window > WINDOW or schedule.output_window > WINDOW or schedule.noise_draws > draws:
            raise ValueError("the schedule reads further back, or draws more noise, than a loop program holds")
        leaves, spec = pytree.tree_flatten(work.inputs)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        fixed = tuple(None if i in positions else leaf for i, leaf in enumerate(leaves))
        numbers = sorted(work.per_call)
        beside = self._beside(work.control)
        control_key = (type(work.control).__name__, tuple(m.label for m in beside)) if beside else None
        # Under a step cache the loop is traced call by call, its calls fixed in the program (a program per count).
        unrolled = schedule.calls if work.step_cache else None
        key = (work.body.key, spec, _hashable(fixed), tuple(numbers), draws, control_key, unrolled)
        with self._lock:
            if key not in self._programs:
                self._programs[key] = self._program(
                    work.body, spec, fixed, positions, numbers, draws, work.control, beside, unrolled
                )
        program = self._programs[key]

        table = self._table(schedule, draws, tuple((name, tuple(work.per_call[name])) for name in numbers))
        arrays = [to_jax(leaves[i]) for i in positions]
        noise = to_jax(work.noise, self.noise_rows) if draws else None
        calls = np.int32(schedule.calls)
        latents = program(
            self.denoiser.weights,
            to_jax(work.latents, self.rows),
            arrays,
            table,
            noise,
            calls,
            np.float32(work.guidance),
            [module.weights for module in beside],
        )
        self.runtime.executed()
        return latents

    def _beside(self, control) -> list:
        """The JaxModules of the ControlNets `control` (one, or diffusers' multi-ControlNet of several) calls."""
        if control is None:
            return []
        nets = list(getattr(control, "nets", [control]))
        missing = [net for net in nets if id(net) not in self.beside]
        if missing:
            raise ValueError(f"a ControlNet of the loop ({type(missing[0]).__name__}) is not on the device")
        return [self.beside[id(net)] for net in nets]

    def _table(self, schedule, draws: int, numbers: tuple):
        """The schedule as one device array, a row per call (kept for the schedules used lately: a batch of a
        schedule seen before hands nothing new to the device for it)."""
        import numpy as np

        key = (schedule, draws, numbers)
        with self._lock:
            if key in self._tables:
                return self._tables[key]
        table = np.zeros((CAPACITY, 2 + 2 * WINDOW + draws + len(numbers)), dtype=np.float32)
        for j in range(schedule.calls):
            row = [schedule.timesteps[j], schedule.input_scales[j]]
            row += _padded(schedule.sample_coefficients[j], WINDOW)
            row += _padded(schedule.output_coefficients[j], WINDOW)
            row += _padded(schedule.noise_coefficients[j], draws)
            row += [values[j] for _, values in numbers]
            table[j] = row
        on_device = self.runtime.jax.device_put(table)
        with self._lock:
            if len(self._tables) >= 64:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = on_device
        return on_device

    def _program(
        self,
        body,
        spec,
        fixed: tuple,
        positions: list[int],
        numbers: list[str],
        draws: int,
        control,
        beside: list,
        unrolled: int | None = None,
    ):
        import contextlib

        jax = self.runtime.jax
        jnp = jax.numpy
        env = self.runtime.env
        denoiser, method = self.denoiser, body.method
        own = denoiser.module  # the torch module, whose step-cache hooks run as it is traced
        extra = 2 + 2 * WINDOW + draws
        step_calls = [0]  # the denoiser's calls in the step being traced (a step cache's context: cond, uncond)

        def program(weights, latents, arrays, table, noise, calls, guidance, beside_weights):
            from torch.utils import _pytree as pytree

            leaves = list(fixed)
            for i, array in zip(positions, arrays, strict=True):
                leaves[i] = env.j2t_iso(array)
            inputs = pytree.tree_unflatten(leaves, spec)

            def denoise(*args, **kwargs):
                if unrolled is None:
                    return denoiser.traced(weights, method, *args, **kwargs)
                # The step cache's hooks keep a state per context, as the pipeline names its calls of a step.
                context = CACHE_CONTEXTS[min(step_calls[0], len(CACHE_CONTEXTS) - 1)]
                step_calls[0] += 1
                with own.cache_context(context):
                    return denoiser.traced(weights, method, *args, **kwargs)

            def controlled(*args, **kwargs):
                with contextlib.ExitStack() as stack:
                    for module, module_weights in zip(beside, beside_weights, strict=True):
                        stack.enter_context(module.as_traced(module_weights))
                    return control(*args, **kwargs)

            def step(j, state):
                step_calls[0] = 0
                samples, outputs = state
                row = table[j]
                x = samples[0]
                per_call = {name: row[extra + n] for n, name in enumerate(numbers)}
                with env:
                    out = body.model_output(
                        denoise,
                        env.j2t_iso(x),
                        env.j2t_iso(row[0]),
                        env.j2t_iso(row[1]),
                        env.j2t_iso(guidance),
                        inputs,
                        env.j2t_iso(per_call),
                        controlled if beside else None,
                    )
                m = env.t2j_iso(out).astype(jnp.float32)
                new = jnp.zeros(x.shape, jnp.float32)
                for a in range(WINDOW):
                    new = new + row[2 + a] * samples[a].astype(jnp.float32)
                new = new + row[2 + WINDOW] * m
                for b in range(1, WINDOW):
                    new = new + row[2 + WINDOW + b] * outputs[b - 1]
                for d in range(draws):
                    new = new + row[2 + 2 * WINDOW + d] * noise[j, d].astype(jnp.float32)
                new = new.astype(x.dtype)
                if body.blends:
                    with env:
                        new = env.t2j_iso(body.after_update(env.j2t_iso(new), env.j2t_iso(per_call), inputs))
                samples = jnp.concatenate([new[None], samples[:-1]])
                outputs = jnp.concatenate([m[None], outputs[:-1]])
                return samples, outputs

            samples = jnp.zeros((WINDOW, *latents.shape), latents.dtype).at[0].set(latents)
            outputs = jnp.zeros((WINDOW - 1, *latents.shape), jnp.float32)
            if unrolled is None:
                samples, _ = jax.lax.fori_loop(0, calls, step, (samples, outputs))
                return samples[0]
            # The step cache's hooks decide at each call, on the host, from the call's index, which blocks run and
            # which are predicted: traced call by call from a fresh state, which is forgotten again after (it holds
            # this trace's values).
            own._reset_stateful_cache()
            try:
                state = (samples, outputs)
                for j in range(unrolled):
                    state = step(j, state)
                return state[0][0]
            finally:
                own._reset_stateful_cache()

        program.__name__ = f"{body.key[0]}_loop".replace(" ", "_")

        def identity() -> tuple:
            return (
                "loop",
                repr(body.key),
                str(spec),
                repr(fixed),
                tuple(numbers),
                draws,
                WINDOW,
                denoiser.label,
                denoiser.description(),
                type(control).__name__ if beside else None,
                tuple((module.label, module.description()) for module in beside),
                unrolled,
                _cache_identity(getattr(own, "_cache_config", None)) if unrolled is not None else None,
            )

        return self.runtime.store.program(program, identity)


def _cache_identity(config) -> tuple:
    """A step cache's config as its hooks read it, every value whole (a tensor of ratios as its list: its repr
    rounds them)."""
    if config is None:
        return ()
    values = []
    for name, value in sorted(vars(config).items()):
        value = value.tolist() if hasattr(value, "tolist") else value
        values.append((name, value if isinstance(value, (int, float, str, bool, list, type(None))) else repr(value)))
    return (type(config).__name__, tuple(values))


def _padded(values, width: int) -> list[float]:
    return list(values) + [0.0] * (width - len(values))
