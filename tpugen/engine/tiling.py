"""Seamless tiling as the AUTOMATIC1111 web UI's `tiling` makes it: every padded Conv2d pads circularly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator


def padded_convolutions(modules: Iterable) -> list:
    """The torch.nn.Conv2d layers inside `modules` (torch modules, each walked whole) that pad their input: the
    ones whose padding mode changes what they compute. Each layer once, in the modules' order."""
    import torch

    found: dict[int, torch.nn.Conv2d] = {}
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, torch.nn.Conv2d) and _pads(layer):
                found.setdefault(id(layer), layer)
    return list(found.values())


def _pads(conv) -> bool:
    padding = conv.padding
    return padding == "same" if isinstance(padding, str) else any(padding)


@contextlib.contextmanager
def circular_padding(modules: Iterable) -> Iterator[int]:
    """Inside the block every padded Conv2d of `modules` pads circularly, as the web UI sets
    `padding_mode = "circular"`: what leaves an edge comes back in at the opposite one, so the image wraps round
    and tiles seamlessly. Afterwards each layer has its own padding mode again, whatever the block raised.
    Yields how many layers it switched.

    A padding mode is part of the traced graph (torch_xla records the padding as ops, and dynamo guards on the
    attribute), so a tiled call is a shape key of its own: switched once per call, never per step."""
    layers = padded_convolutions(modules)
    modes = [layer.padding_mode for layer in layers]
    try:
        for layer in layers:
            layer.padding_mode = "circular"
        yield len(layers)
    finally:
        for layer, mode in zip(layers, modes, strict=True):
            layer.padding_mode = mode
