"""2-D convolutions in the layout XLA:CPU's fast kernel takes, for JAX's CPU only.

XLA:CPU runs a convolution through its Eigen kernel only when the operands are channels-last; its layout pass makes
them so in a program's top level, but not inside a while loop's body, where a channels-first convolution falls to a
generic loop nest about ten times slower (measured: 8 3x3 convolutions of 4x32x16x16, 0.74 ms in one call, 7.4 ms
per iteration of a `lax.fori_loop`; a tiny-sd UNet 3.2 ms a call, 24 ms a loop step). The whole denoising loop is such
a body, so on the CPU tpugen's definition of torch's 2-D convolution transposes to channels-last itself (0.73 ms per
iteration in the loop). TPUs choose their own layouts and keep torchax's definition."""

from __future__ import annotations


def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution on JAX arrays: a 2-D, non-transposed one channels-last, any other as torchax has it."""
    import jax

    if transposed or weight.ndim != 4 or input.ndim != 4:
        from torchax.ops.jaten import _aten_convolution

        return _aten_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    padding, stride, dilation = _pair(padding), _pair(stride), _pair(dilation)
    out = jax.lax.conv_general_dilated(
        input.transpose(0, 2, 3, 1),
        weight.transpose(2, 3, 1, 0),
        tuple(stride),
        [(p, p) for p in padding],
        rhs_dilation=tuple(dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )
    if bias is not None:
        out = out + bias
    return out.transpose(0, 3, 1, 2)


def _pair(value) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    return values * 2 if len(values) == 1 else values


def install(env) -> None:
    """`convolution` as the definition of aten.convolution in `env` (torch's conv2d reaches the device as it)."""
    import torch
    from torchax.ops import ops_registry

    op = torch.ops.aten.convolution
    env._ops[op] = ops_registry.Operator(
        op, convolution, is_jax_function=True, is_user_defined=True, needs_env=False, is_view_op=False
    )
