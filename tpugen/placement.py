"""Whole components on different chips: which chip each component of a pipeline goes to (pure)."""

from __future__ import annotations

from tpugen.errors import InputError
from tpugen.memory import HEADROOM


def assign_components(
    sizes: dict[str, int], capacities: list[float], explicit: dict[str, int] | None = None
) -> dict[str, int]:
    """Chip index per component: the named ones where the config says, the rest greedily.

    Greedy: the biggest component first, each onto the chip with the most memory left, so the denoiser and
    the text encoders land on different chips when they do not fit together. Sizes and capacities are bytes;
    each component needs its size with the memory plan's headroom. Raises InputError, naming the component,
    when a chip index does not exist or a component fits no chip.
    """
    explicit = dict(explicit or {})
    chips = len(capacities)
    problems = []
    for name, chip in explicit.items():
        if name not in sizes:
            problems.append(
                f"execution.placement.{name}: the model has no such component (it has {', '.join(sorted(sizes))})"
            )
        elif chip >= chips:
            problems.append(
                f"execution.placement.{name}: chip {chip} does not exist; this machine has {chips} (0 to {chips - 1})"
            )
    if problems:
        raise InputError(*problems)

    free = list(capacities)
    placed: dict[str, int] = {}
    for name, chip in explicit.items():
        free[chip] -= sizes[name] * HEADROOM
        placed[name] = chip
    for name in sorted((n for n in sizes if n not in placed), key=lambda n: (-sizes[n], n)):
        chip = max(range(chips), key=lambda i: (free[i], -i))
        free[chip] -= sizes[name] * HEADROOM
        placed[name] = chip
    overfull = [i for i in range(chips) if free[i] < 0]
    if overfull:
        chip = overfull[0]
        on_it = sorted((n for n, c in placed.items() if c == chip), key=lambda n: -sizes[n])
        need = sum(sizes[n] for n in on_it) * HEADROOM / 1e9
        raise InputError(
            f"execution.placement: chip {chip} would hold {', '.join(on_it)} ({need:.3g} GB with headroom) but has "
            f"{capacities[chip] / 1e9:.3g} GB; no placement over {chips} chips fits: use execution.sharding: spmd "
            "or execution.offload: model"
        )
    return dict(sorted(placed.items()))
