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


def yarn(freqs: jax.Array, head_dim: int, theta: float, factor: float, original: int, beta_fast: float,
         beta_slow: float, truncate: bool) -> jax.Array:
    """YaRN's frequencies from the plain ones, as transformers' `_compute_yarn_parameters`: dimensions that turn
    more than `beta_fast` times over the original context are kept, fewer than `beta_slow` times divided by
    `factor`, and a linear ramp over the dimensions between (its ends rounded outward with `truncate`)."""
    def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # as transformers: no zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin multiplier: 0.1·mscale·ln(factor) + 1 (1 for factor ≤ 1); transformers' `get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope(x: jax.Array, positions: jax.Array, freqs: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary position embedding on the first 2·len(freqs) dimensions of x [batch, seq, heads, head_dim] at
    explicit positions (half-split form over those dimensions, transformers' `rotate_half`); the dimensions after
    them pass unchanged (partial RoPE, transformers' `partial_rotary_factor`); cos and sin multiplied by `scale`
    (YaRN's attention factor)."""
    width = 2 * freqs.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [batch, seq, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x[..., :width].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return rotated if width == x.shape[-1] else jnp.concatenate([rotated, x[..., width:]], axis=-1)
