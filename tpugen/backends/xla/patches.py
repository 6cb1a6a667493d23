"""Process-wide changes XLA needs from torch and diffusers; each is installed once and changes nothing else."""

from __future__ import annotations


def let_diffusers_offload_to_xla() -> None:
    """diffusers' model offload empties the device's allocator cache through `torch.xla`, which torch_xla does
    not register, so it fails on XLA. XLA frees a buffer when its last tensor dies: there is nothing to empty."""
    import diffusers.pipelines.pipeline_utils as pipeline_utils

    empty = pipeline_utils.empty_device_cache
    if getattr(empty, "tpugen_xla", False):
        return

    def empty_device_cache(device_type: str | None = None) -> None:
        if device_type != "xla":
            empty(device_type)

    empty_device_cache.tpugen_xla = True
    pipeline_utils.empty_device_cache = empty_device_cache


def solve_small(a, b):
    """torch.linalg.solve for a system of 1 to 3 unknowns, in plain tensor arithmetic (the adjugate).

    XLA has no linear solver of its own: torch_xla runs `torch.linalg.solve` on the host, a read back to the
    host per call. UniPC solves a 2x2 (or 3x3) system every step, so that was 2 host reads per step.
    """
    import torch

    n = a.shape[-1]
    if n == 1:
        inverse = 1 / a
    elif n == 2:
        inverse = torch.stack([torch.stack([a[1, 1], -a[0, 1]]), torch.stack([-a[1, 0], a[0, 0]])])
        inverse = inverse / (a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0])
    else:

        def minor(r0, r1, c0, c1):
            return a[r0, c0] * a[r1, c1] - a[r0, c1] * a[r1, c0]

        cofactors = [
            [minor(1, 2, 1, 2), -minor(1, 2, 0, 2), minor(1, 2, 0, 1)],
            [-minor(0, 2, 1, 2), minor(0, 2, 0, 2), -minor(0, 2, 0, 1)],
            [minor(0, 1, 1, 2), -minor(0, 1, 0, 2), minor(0, 1, 0, 1)],
        ]
        determinant = sum(a[0, j] * cofactors[0][j] for j in range(3))
        adjugate = torch.stack([torch.stack([cofactors[r][c] for r in range(3)]) for c in range(3)])
        inverse = adjugate / determinant
    return inverse @ b


def solve_small_systems_on_xla() -> None:
    """Route torch.linalg.solve of XLA tensors with up to 3 unknowns through solve_small (once per process).

    Every other call goes to the real solver, so nothing else changes.
    """
    import torch

    real = torch.linalg.solve
    if getattr(real, "tpugen_xla", False):
        return

    def solve(a, b, *args, **kwargs):
        if a.device.type == "xla" and a.dim() == 2 and a.shape[-1] <= 3 and not args and not kwargs:
            return solve_small(a, b)
        return real(a, b, *args, **kwargs)

    solve.tpugen_xla = True
    torch.linalg.solve = solve
