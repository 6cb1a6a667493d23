"""Attention on JAX as torch computes it: torch's scaled_dot_product_attention gives a query whose every key is
masked zeros (its safe softmax), where a plain softmax gives NaN; a text encoder that pads on the left (FLUX.2's
Mistral) has such rows. The override goes through torchax's own hook for an op's JAX definition."""

from __future__ import annotations

import math


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


def install(env) -> None:
    """`attention` as the definition of torch's scaled_dot_product_attention (function and aten op) in `env`."""
    import torch
    from torchax.ops import ops_registry

    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(
            op, attention, is_jax_function=True, is_user_defined=True, needs_env=False, is_view_op=False
        )
