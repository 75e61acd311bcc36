"""Rotary position embeddings (RoPE) at explicit positions, so reordered and packed sequences work."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def frequencies(head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None) -> jax.Array:
    """[head_dim / 2] fp32 rotation frequencies theta^(-2i/head_dim); with `llama3` = (factor, low_freq_factor,
    high_freq_factor, original_context), Llama 3.1's bands: wavelengths longer than original/low are slowed by
    `factor`, shorter than original/high kept, and those between interpolated smoothly."""
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if llama3 is None:
        return freqs
    factor, low, high, original = llama3
    wavelength = 2 * math.pi / freqs
    smooth = (original / wavelength - low) / (high - low)
    between = (1 - smooth) * freqs / factor + smooth * freqs
    return jnp.where(wavelength > original / low, freqs / factor,
                     jnp.where(wavelength < original / high, freqs, between))


def rope(x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] at explicit positions (half-split form)."""
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [batch, seq, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
