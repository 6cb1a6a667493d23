"""Each sampler's loop as the linear recurrence backend jax runs in one call, read off diffusers' own scheduler:
stepped on numbers, it gives what the scheduler's own steps give (host only, no device)."""

from __future__ import annotations

import copy

import pytest
import torch

from tpugen.engine.linear_schedule import NotLinear, derive, noise_like
from tpugen.schedulers import SCHEDULER_NAMES, find_scheduler

# Stable Diffusion 1.5's scheduler config (what tiny-sd ships), from which every sampler is made.
SD_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}


def _scheduler(name: str, **config):
    import diffusers

    choice = find_scheduler(name)
    return getattr(diffusers, choice.class_name).from_config({**SD_SCHEDULER, **config}, **choice.options)


def _loop(scheduler, timesteps, x, outputs, generators):
    """diffusers' own loop on numbers: the model's answers given, noise from each row's generator."""
    import inspect

    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    for j, t in enumerate(timesteps):
        extra = {"generator": generators} if takes_generator else {}
        x = scheduler.step(outputs[j], t, x, return_dict=False, **extra)[0]
    return x


def _check(scheduler, timesteps, *, shape=(3, 4, 5, 2), seed=0):
    schedule = derive(copy.deepcopy(scheduler), timesteps)
    generator = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    outputs = [torch.randn(shape, generator=generator) * 2 for _ in timesteps]
    theirs = _loop(
        copy.deepcopy(scheduler), timesteps, x, outputs, [torch.Generator().manual_seed(40 + r) for r in range(3)]
    )
    ours_generators = [torch.Generator().manual_seed(40 + r) for r in range(3)]
    mine = schedule.run(x, lambda j, x_in, t: outputs[j], lambda j, d: noise_like(shape, ours_generators, x.dtype))
    assert float((mine - theirs).abs().max()) <= 1e-4 * max(1.0, float(theirs.abs().max()))
    return schedule


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
@pytest.mark.parametrize("steps", [1, 2, 7, 25])
@pytest.mark.filterwarnings("ignore:The `scale_model_input` function should be called")  # LMS: the raw step is meant
def test_every_sampler_steps_as_its_recurrence(name, steps):
    scheduler = _scheduler(name)
    scheduler.set_timesteps(steps)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    schedule = _check(scheduler, list(scheduler.timesteps))
    assert schedule.calls == len(scheduler.timesteps)  # Heun calls the model twice a step
    ancestral = name in ("Euler a", "DPM++ 2M SDE", "LCM")
    assert bool(any(schedule.draws)) == (ancestral and (steps > 1 or name != "LCM"))


@pytest.mark.parametrize("name", ["DDIM", "Euler", "DPM++ 2M Karras", "UniPC", "Euler a"])
def test_an_img2img_loop_from_its_begin_index_steps_as_its_recurrence(name):
    scheduler = _scheduler(name)
    scheduler.set_timesteps(20)
    start = 8 * scheduler.order
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    _check(scheduler, list(scheduler.timesteps[start:]), seed=3)


def test_flow_matching_with_a_shift_and_with_dynamic_shifting_steps_as_its_recurrence():
    import diffusers
    import numpy as np

    shifted = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3's
    shifted.set_timesteps(9)
    shifted.set_begin_index(0)
    _check(shifted, list(shifted.timesteps), shape=(2, 16, 8))
    dynamic = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    dynamic.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=0.8)  # Flux.1's
    dynamic.set_begin_index(0)
    _check(dynamic, list(dynamic.timesteps), shape=(2, 16, 8))


@pytest.mark.parametrize(
    ("make", "noising"),
    [
        (lambda: _scheduler("DDIM"), "add_noise"),
        (lambda: _scheduler("Euler"), "add_noise"),
        (lambda: __import__("diffusers").FlowMatchEulerDiscreteScheduler(shift=3.0), "scale_noise"),
    ],
)
def test_an_inpainting_blends_levels_are_the_schedulers_own_noising(make, noising):
    scheduler = make()
    scheduler.set_timesteps(6)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    timesteps = list(scheduler.timesteps)
    schedule = derive(copy.deepcopy(scheduler), timesteps, noising=noising)
    image, noise = torch.randn(1, 4, 3, 3), torch.randn(1, 4, 3, 3)
    live, x = copy.deepcopy(scheduler), torch.randn(1, 4, 3, 3)
    for j, t in enumerate(timesteps):
        x = live.step(torch.randn(1, 4, 3, 3), t, x, return_dict=False)[0]
        if j + 1 < len(timesteps):
            at = timesteps[j + 1].reshape(1)
            theirs = (
                live.scale_noise(image, at, noise) if noising == "scale_noise" else live.add_noise(image, noise, at)
            )
        else:
            theirs = image
        mine = schedule.image_levels[j] * image + schedule.noise_levels[j] * noise
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_a_sampler_that_is_not_linear_is_named_and_refused():
    thresholding = _scheduler("DDIM", thresholding=True)
    thresholding.set_timesteps(4)
    with pytest.raises(NotLinear, match="thresholds its samples"):
        derive(thresholding, list(thresholding.timesteps))
    clipping = _scheduler("DDIM", clip_sample=True)
    clipping.set_timesteps(4)
    with pytest.raises(NotLinear, match="clips its samples"):
        derive(clipping, list(clipping.timesteps))


def test_a_data_dependent_step_is_caught_by_the_check_on_numbers():
    scheduler = _scheduler("Euler")
    scheduler.set_timesteps(5)
    scheduler.set_begin_index(0)
    original = type(scheduler).step

    def clamped(self, model_output, timestep, sample, **kwargs):  # a rule on the data's values: not linear
        out = original(self, model_output, timestep, sample, **kwargs)
        return (out[0].clamp(-0.5, 0.5),)

    scheduler.step = clamped.__get__(scheduler)
    with pytest.raises(NotLinear):
        derive(scheduler, list(scheduler.timesteps))


def test_noise_is_drawn_per_row_from_each_generator_as_diffusers_draws_it():
    from diffusers.utils.torch_utils import randn_tensor

    shape = (3, 4, 2, 2)
    theirs = randn_tensor(shape, generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    mine = noise_like(shape, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], torch.float32)
    assert torch.equal(theirs, mine)
    one = randn_tensor((1, 4, 2, 2), generator=[torch.Generator().manual_seed(9)])
    assert torch.equal(one, noise_like((1, 4, 2, 2), [torch.Generator().manual_seed(9)], torch.float32))
