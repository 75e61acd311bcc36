"""Small building blocks: norms, rotary embeddings, feed-forward layers.

Pure functions over parameter dicts. Statistics are computed in fp32; outputs come
back in the compute dtype of their input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxllm.sharding import constrain, weight


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * p["scale"]
    return y.astype(x.dtype)


def norm(family: str, p: dict, x: jax.Array, eps: float) -> jax.Array:
    return layer_norm(p, x, eps) if family == "gpt2" else rms_norm(p, x, eps)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] at explicit positions (half-split form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [batch, seq, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def gelu_mlp(p: dict, x: jax.Array, dtype) -> jax.Array:
    """GPT-2 feed-forward: column-parallel in, GELU, row-parallel out."""
    h = jnp.einsum("bsd,df->bsf", x, weight(p["w_in"], ("embed", "mlp"), dtype)) + p["b_in"].astype(dtype)
    h = checkpoint_name(constrain(jax.nn.gelu(h, approximate=True), ("batch", "seq", "mlp")), "mlp_hidden")
    return jnp.einsum("bsf,fd->bsd", h, weight(p["w_out"], ("mlp", "embed"), dtype)) + p["b_out"].astype(dtype)


def swiglu_mlp(p: dict, x: jax.Array, dtype) -> jax.Array:
    """LLaMA feed-forward: silu(x W_gate) * (x W_up), then W_down."""
    gate = jnp.einsum("bsd,df->bsf", x, weight(p["w_gate"], ("embed", "mlp"), dtype))
    up = jnp.einsum("bsd,df->bsf", x, weight(p["w_up"], ("embed", "mlp"), dtype))
    h = checkpoint_name(constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp")), "mlp_hidden")
    return jnp.einsum("bsf,fd->bsd", h, weight(p["w_down"], ("mlp", "embed"), dtype))
