"""Eager PyTorch on an NVIDIA GPU, optionally with torch.compile, for users with GPUs."""

from __future__ import annotations

from tpugen.backends.base import EagerBackend
from tpugen.errors import InputError


class CudaBackend(EagerBackend):
    name = "cuda"

    def __init__(self, *, compile_spec=None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise InputError("execution.backend: cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
        super().__init__(torch.device("cuda"), compile_spec=compile_spec)
        self._torch = torch

    def memory(self) -> dict:
        return {
            "bytes_in_use": self._torch.cuda.memory_allocated(self.device),
            "peak_bytes": self._torch.cuda.max_memory_allocated(self.device),
        }

    def wait(self) -> None:
        self._torch.cuda.synchronize()

    def describe(self) -> dict:
        return {**super().describe(), "device_kind": self._torch.cuda.get_device_name(self.device)}
