"""A sampler's whole loop as a linear recurrence, read off diffusers' own scheduler on the host.

Every scheduler tpugen offers (with thresholding and sample clipping off) updates the latents by a linear
combination of the latents it has seen, the model outputs it has been given and the noise it draws, with
coefficients that depend only on the step. So the loop can run on the device as one call: the coefficients are
worked out here, once per schedule, by running the scheduler's own `step` on symbols (each latent a vector of
coefficients over the starting latents, every model output and every noise draw), and checked by running it again
on numbers. The numbers are diffusers': nothing here restates a sampler's formula.
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from dataclasses import dataclass

# Noise tensors a call may draw (no diffusers scheduler draws more than one a step): the noise a loop takes has
# this many slots per call.
DRAW_SLOTS = 2
# The most latents and model outputs, before the current ones, that one update may read (a 3rd-order multistep
# sampler reads two back).
_MAX_WINDOW = 3
_EXACT = 1e-5  # relative residual under which a recurrence is taken as exact (the scheduler steps in float32)


@dataclass(frozen=True, kw_only=True)
class LinearSchedule:
    """The loop's calls: at call j the model is given the latents x_j times `input_scales[j]` at `timesteps[j]`
    and answers m_j; then x_{j+1} = sum_a sample_coefficients[j][a] x_{j-a} + sum_b output_coefficients[j][b]
    m_{j-b} + sum_d noise_coefficients[j][d] n_{j,d}, n_{j,d} the d-th noise the scheduler draws at call j."""

    timesteps: tuple[float, ...]
    input_scales: tuple[float, ...]
    sample_coefficients: tuple[tuple[float, ...], ...]
    output_coefficients: tuple[tuple[float, ...], ...]
    noise_coefficients: tuple[tuple[float, ...], ...]
    # Noise tensors the scheduler draws at each call, used or not (Euler a draws one at its last step and adds it
    # times 0): the host draws as many, so that each image's generator stays where diffusers leaves it.
    draws: tuple[int, ...]
    # An inpainting loop's blend after each call (derive's `noising`): the init image's latents noised to the next
    # call's level are image_levels[j] x image + noise_levels[j] x noise (the last call: the image itself).
    image_levels: tuple[float, ...] = ()
    noise_levels: tuple[float, ...] = ()

    @property
    def calls(self) -> int:
        return len(self.timesteps)

    @property
    def sample_window(self) -> int:
        return len(self.sample_coefficients[0]) if self.sample_coefficients else 1

    @property
    def output_window(self) -> int:
        return len(self.output_coefficients[0]) if self.output_coefficients else 1

    @property
    def noise_draws(self) -> int:
        """Noise tensors drawn per call (0: a deterministic sampler)."""
        return len(self.noise_coefficients[0]) if self.noise_coefficients else 0

    def run(self, x, model, draw=None):
        """The recurrence on the host: `model(j, x_scaled, t)` answers each call, `draw(j, d)` gives each noise
        (used to check a schedule against its scheduler; the device runs the same sums)."""
        samples, outputs = [x], []
        for j in range(self.calls):
            outputs.append(model(j, samples[-1] * self.input_scales[j], self.timesteps[j]))
            new = 0
            for a, c in enumerate(self.sample_coefficients[j]):
                if c and len(samples) > a:
                    new = new + c * samples[-1 - a]
            for b, c in enumerate(self.output_coefficients[j]):
                if c and len(outputs) > b:
                    new = new + c * outputs[-1 - b]
            for d in range(self.draws[j]):
                noise = draw(j, d)
                if self.noise_coefficients[j][d]:
                    new = new + self.noise_coefficients[j][d] * noise
            samples.append(new)
        return samples[-1]


class NotLinear(Exception):
    """The scheduler's step is not a fixed linear combination (thresholding, clipping, a data-dependent rule)."""


def derive(scheduler, timesteps, *, noising: str | None = None) -> LinearSchedule:
    """The schedule of `scheduler` (as the pipeline left it just before its loop: timesteps set, begin index
    set) over the pipeline's `timesteps`. `noising` ("add_noise" or "scale_noise"): also the levels an inpainting
    pipeline noises its init image to after each call, by that method of the scheduler as it stands then. Raises
    NotLinear, naming why, where its step is not linear."""
    import torch

    timesteps = [t for t in timesteps]
    if getattr(scheduler.config, "thresholding", False):
        raise NotLinear(f"{type(scheduler).__name__} thresholds its samples (config thresholding: true)")
    if getattr(scheduler.config, "clip_sample", False):
        raise NotLinear(f"{type(scheduler).__name__} clips its samples (config clip_sample: true)")
    calls = len(timesteps)
    symbols = 1 + calls + calls * DRAW_SLOTS

    def unit(index: int):
        vector = torch.zeros((1, symbols, 1, 1), dtype=torch.float64)
        vector[0, index] = 1.0
        return vector

    probe = copy.deepcopy(scheduler)
    draws: list[list[int]] = [[] for _ in range(calls)]
    samples, scales, levels = [unit(0)], [], []
    current = {"call": 0}

    def symbolic_noise(shape, generator=None, device=None, dtype=None, layout=None):
        j = current["call"]
        if len(draws[j]) >= DRAW_SLOTS:
            raise NotLinear(f"{type(scheduler).__name__} draws more than {DRAW_SLOTS} noise tensors in a step")
        index = 1 + calls + j * DRAW_SLOTS + len(draws[j])
        draws[j].append(index)
        return unit(index)

    with _noise_drawn_by(probe, symbolic_noise):
        for j, t in enumerate(timesteps):
            current["call"] = j
            scales.append(_input_scale(probe, t))
            out = probe.step(unit(1 + j), t, samples[-1], return_dict=False)[0]
            samples.append(out.to(torch.float64))
            if noising:
                levels.append(_noise_levels(probe, noising, timesteps[j + 1]) if j + 1 < calls else (1.0, 0.0))

    rows = [_solve(samples, j, 1 + j, draws[j]) for j in range(calls)]
    wa = max(len(r[0]) for r in rows)
    wb = max(len(r[1]) for r in rows)
    wd = max((len(r[2]) for r in rows), default=0)
    schedule = LinearSchedule(
        timesteps=tuple(float(t) for t in timesteps),
        input_scales=tuple(scales),
        sample_coefficients=tuple(_padded(r[0], wa) for r in rows),
        output_coefficients=tuple(_padded(r[1], wb) for r in rows),
        noise_coefficients=tuple(_padded(r[2], wd) for r in rows),
        draws=tuple(len(d) for d in draws),
        image_levels=tuple(level[0] for level in levels),
        noise_levels=tuple(level[1] for level in levels),
    )
    _check(schedule, scheduler, timesteps)
    return schedule


def _noise_levels(scheduler, noising: str, t) -> tuple[float, float]:
    """(a, b) such that the scheduler's `noising` of an image x with noise n at timestep t is a x + b n."""
    import torch

    ones, zeros = torch.ones((1, 1, 1, 1), dtype=torch.float64), torch.zeros((1, 1, 1, 1), dtype=torch.float64)
    t = torch.as_tensor(t).reshape(1)
    noise = getattr(scheduler, noising)
    if noising == "scale_noise":  # scale_noise(sample, timestep, noise)
        return float(noise(ones, t, zeros).flatten()[0]), float(noise(zeros, t, ones).flatten()[0])
    return float(noise(ones, zeros, t).flatten()[0]), float(noise(zeros, ones, t).flatten()[0])


def _padded(values: list[float], width: int) -> tuple[float, ...]:
    return tuple(values) + (0.0,) * (width - len(values))


def _input_scale(scheduler, t) -> float:
    """What scale_model_input multiplies the latents by at this step (1 for a scheduler without it)."""
    import torch

    scale = getattr(scheduler, "scale_model_input", None)
    if scale is None:
        return 1.0
    ones = torch.ones((1, 1, 1, 1), dtype=torch.float64)
    return float(scale(ones, t).flatten()[0])


def _solve(samples: list, j: int, output_symbol: int, noise_symbols: list[int]) -> tuple[list, list, list]:
    """x_{j+1} as the fewest of x_j, x_{j-1}, ... and m_j, m_{j-1}, ... (plus the call's noise) that give it
    exactly: (coefficients of the samples, of the outputs, of the noise)."""
    import torch

    target = samples[j + 1].flatten()
    scale = max(float(target.abs().max()), 1.0)
    tried = []
    for total in range(2 * _MAX_WINDOW + 1):
        for wa in range(min(total, _MAX_WINDOW) + 1):
            wb = total - wa
            if wb > _MAX_WINDOW or wa > j or wb > j:
                continue
            columns = [samples[j - a].flatten() for a in range(wa + 1)]
            columns += [_unit_like(target, output_symbol - b) for b in range(wb + 1)]
            columns += [_unit_like(target, s) for s in noise_symbols]
            matrix = torch.stack(columns, dim=1)
            solution = torch.linalg.lstsq(matrix, target.unsqueeze(1), driver="gelsd").solution.flatten()
            residual = float((matrix @ solution - target).abs().max())
            tried.append(residual)
            if residual <= _EXACT * scale:
                values = [float(v) for v in solution]
                return values[: wa + 1], values[wa + 1 : wa + wb + 2], values[wa + wb + 2 :]
    raise NotLinear(
        f"its step {j} is no linear combination of the last {_MAX_WINDOW + 1} latents and model outputs "
        f"(smallest residual {min(tried) if tried else float('nan'):.2g})"
    )


def _unit_like(vector, index: int):
    import torch

    out = torch.zeros_like(vector)
    out[index] = 1.0
    return out


@contextmanager
def _noise_drawn_by(scheduler, draw):
    """The scheduler's module draws its noise with `draw` for the duration (diffusers' schedulers draw with the
    randn_tensor their module imports)."""
    module = sys.modules[type(scheduler).__module__]
    original = getattr(module, "randn_tensor", None)
    if original is None:
        yield
        return
    module.randn_tensor = draw
    try:
        yield
    finally:
        module.randn_tensor = original


def _check(schedule: LinearSchedule, scheduler, timesteps) -> None:
    """The recurrence run on random numbers against the scheduler itself, model outputs random too, noise from
    generators seeded alike on both sides: NotLinear where they part."""
    import torch

    shape = (2, 3, 2, 2)
    torch_generator = torch.Generator("cpu").manual_seed(1234)
    x0 = torch.randn(shape, generator=torch_generator, dtype=torch.float32)
    outputs = [torch.randn(shape, generator=torch_generator, dtype=torch.float32) for _ in timesteps]

    reference = copy.deepcopy(scheduler)
    generators = [torch.Generator("cpu").manual_seed(7 + row) for row in range(shape[0])]
    x = x0
    for j, t in enumerate(timesteps):
        x_in = _scaled(reference, x, t)
        del x_in  # the model answers `outputs[j]` whatever it is given; only the update is checked here
        x = reference.step(outputs[j], t, x, return_dict=False, **_generator_argument(reference, generators))[0]

    ours = [torch.Generator("cpu").manual_seed(7 + row) for row in range(shape[0])]

    def draw(j: int, d: int):
        return noise_like(shape, ours, torch.float32)

    mine = schedule.run(x0, lambda j, x_scaled, t: outputs[j], draw)
    error = float((mine - x).abs().max())
    bound = 1e-4 * max(1.0, float(x.abs().max()))
    if not error <= bound:
        raise NotLinear(f"{type(scheduler).__name__}'s steps on numbers differ from its recurrence by {error:.3g}")


def _generator_argument(scheduler, generators) -> dict:
    """The generators, for a scheduler whose step takes them (as a pipeline's extra_step_kwargs pass them)."""
    import inspect

    return {"generator": generators} if "generator" in inspect.signature(scheduler.step).parameters else {}


def _scaled(scheduler, x, t):
    scale = getattr(scheduler, "scale_model_input", None)
    return scale(x, t) if scale is not None else x


def noise_like(shape, generators: list, dtype):
    """One noise tensor of `shape` as diffusers' randn_tensor draws it from one CPU generator per row."""
    import torch

    if len(generators) == 1:
        return torch.randn(tuple(shape), generator=generators[0], dtype=dtype)
    row = (1, *shape[1:])
    return torch.cat([torch.randn(row, generator=g, dtype=dtype) for g in generators])
