"""torch.compile of the denoiser as data: the same code serves cpu, cuda and TorchTPU's compile mode."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileSpec:
    """One torch.compile call on the denoiser."""

    method: str  # "compile", or "compile_repeated_blocks" under CPU offload (its hooks cannot be traced)
    backend: str  # torch.compile backend: "tpu" (TorchTPU) or "inductor"

    def arguments(self) -> dict:
        # Static shapes: a new size compiles once; a new step count does not compile (the diffusers guide).
        return {"backend": self.backend, "fullgraph": True, "dynamic": False}

    def apply(self, pipe, family, hooks) -> None:
        denoiser = getattr(pipe, family.denoiser)
        getattr(denoiser, self.method)(**self.arguments())
        hooks.add("torch.compile", lambda: _uncompile(denoiser))


def _uncompile(module) -> None:
    # nn.Module.compile keeps the compiled call beside the module (on each block for compile_repeated_blocks);
    # without it the module calls its own forward again.
    for sub in module.modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            sub._compiled_call_impl = None


def compile_spec(backend: str, *, torch_compile: bool, tpu_mode: str, offload: bool) -> CompileSpec | None:
    """What to compile for a run, or None for eager."""
    if backend == "torch_tpu":
        if tpu_mode != "compile":
            return None
        compiler = "tpu"
    elif backend in ("cpu", "cuda") and torch_compile:
        compiler = "inductor"
    else:
        return None
    return CompileSpec("compile_repeated_blocks" if offload else "compile", compiler)
