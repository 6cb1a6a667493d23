"""Attention on JAX as torch computes it: torch's scaled_dot_product_attention gives a query whose every key is
masked zeros (its safe softmax), where a plain softmax gives NaN; a text encoder that pads on the left (FLUX.2's
Mistral) has such rows. On a TPU, the calls JAX's Pallas flash-attention kernel takes (no mask, tokens in whole
blocks) go to it instead (FlashKernel). The override goes through torchax's own hook for an op's JAX definition."""

from __future__ import annotations

import contextlib
import math

BLOCK = 128  # the kernel's blocks of tokens are whole multiples of the TPU's 128 lanes


class FlashKernel:
    """JAX's Pallas flash-attention kernel for TPUs (jax.experimental.pallas.ops.tpu.flash_attention) for the
    attention calls it takes: 4-D (batch, heads, tokens, head dim), no mask, not causal, as many key heads as query
    heads, tokens a multiple of 128 on both sides; any other call runs plain attention. On a mesh the kernel runs on
    each device's share (shard_map: the batch over the data axis, the heads over the model axis where they divide).
    `interpret`: Pallas's TPU interpret mode, which runs the kernel's own code off a TPU (slowly): how it is checked
    on the CPU. Counts the calls traced each way (a trace's, not a step's)."""

    def __init__(self, mesh=None, *, interpret: bool = False) -> None:
        self.mesh = mesh
        self.interpret = interpret
        self.traced_kernel = 0
        self.traced_plain = 0

    def identity(self) -> tuple:
        """What the kernel changes in a traced program (part of a stored program's key)."""
        return ("pallas flash_attention", BLOCK, self.interpret, dict(self.mesh.shape) if self.mesh else None)

    def takes(self, query, key, value, attn_mask, is_causal: bool) -> bool:
        if attn_mask is not None or is_causal or not query.ndim == key.ndim == value.ndim == 4:
            return False
        if key.shape[1] != query.shape[1] or not query.shape[-1] == key.shape[-1] == value.shape[-1]:
            return False
        return query.shape[-2] % BLOCK == 0 and key.shape[-2] % BLOCK == 0

    def __call__(self, query, key, value, scale: float):
        import jax
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu import flash_attention as pallas

        blocks = pallas.BlockSizes(
            block_q=_block(query.shape[-2]),
            block_k_major=_block(key.shape[-2]),
            block_k=_block(key.shape[-2]),
            block_b=1,
        )

        def run(q, k, v):
            return pallas.flash_attention(q, k, v, sm_scale=scale, block_sizes=blocks)

        if self.mesh is not None:
            from jax.sharding import PartitionSpec

            model = self.mesh.shape.get("model", 1)
            heads = "model" if model > 1 and query.shape[1] % model == 0 else None
            data = "data" if query.shape[0] % self.mesh.shape["data"] == 0 else None
            spec = PartitionSpec(data, heads, None, None)
            run = jax.shard_map(run, mesh=self.mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
        with pltpu.force_tpu_interpret_mode() if self.interpret else contextlib.nullcontext():
            return run(query, key, value)


def _block(tokens: int) -> int:
    """The largest of 512, 256 and 128 tokens that divides `tokens`."""
    return next(size for size in (512, 256, BLOCK) if tokens % size == 0)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention on JAX arrays (batch..., heads, tokens, head dim), inference only: the scores
    in float32, a fully masked row all zeros."""
    import jax.numpy as jnp

    if dropout_p:
        raise ValueError("attention dropout does not run on backend jax (inference only)")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = jnp.repeat(key, repeat, axis=-3), jnp.repeat(value, repeat, axis=-3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp.einsum("...qd,...kd->...qk", query, key, preferred_element_type=jnp.float32) * factor
    allowed = None
    if is_causal:
        allowed = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            scores = scores + attn_mask.astype(jnp.float32)
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total == 0.0, 1.0, total)
    return jnp.einsum("...qk,...kd->...qd", weights.astype(value.dtype), value)


def install(env, runtime) -> None:
    """The definition of torch's scaled_dot_product_attention (function and aten op) in `env`: the runtime's
    FlashKernel (`runtime.kernel`, where one is set) for a call it takes, else `attention`."""
    import torch
    from torchax.ops import ops_registry

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        kernel = runtime.kernel
        if kernel is not None and not dropout_p:
            if kernel.takes(query, key, value, attn_mask, is_causal):
                kernel.traced_kernel += 1
                return kernel(query, key, value, 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
            kernel.traced_plain += 1
        return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(
            op,
            scaled_dot_product_attention,
            is_jax_function=True,
            is_user_defined=True,
            needs_env=False,
            is_view_op=False,
        )
