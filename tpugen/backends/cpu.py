"""Eager PyTorch on the host CPU: the reference every other backend is compared against."""

from __future__ import annotations

from tpugen.backends.base import EagerBackend


class CpuBackend(EagerBackend):
    name = "cpu"

    def __init__(self, *, compile_spec=None) -> None:
        import torch

        super().__init__(torch.device("cpu"), compile_spec=compile_spec)
