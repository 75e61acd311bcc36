"""Blockwise symmetric int8 quantization, as ZeRO++ moves weights and gradients (`parallel/zeropp.py`).

An array is flattened in C order, padded with zeros to a multiple of `block` and cut into blocks of
`block` elements; each block keeps one fp32 scale, max|block| · (1/127), and int8 values round(x · (1/scale))
in [-127, 127]. Both are written as products because XLA turns a division by a broadcast scale into a
product with its reciprocal anyway (87.5 as x / scale, 87.49999 as XLA computed it, rounding to 88 and 87):
written so, every program and a NumPy reference compute the same codes. Rounding to nearest makes the error
of each element at most half a step (and an ulp of the reciprocal):

    |ŵ - w| ≤ max|block| / 254.

A block of zeros has scale 0 and gives zeros back, never NaN. A sum of dequantised blocks (the
quantized reduce-scatter adds one block from each of D devices) is off by at most the sum of their
bounds, Σ_d max|g_d,block| / 254. On the wire a block costs `block` bytes plus 4 for its scale:
(1 + 4/block) / 4 of its fp32 size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

QMAX = 127


def blocks_of(size: int, block: int) -> int:
    """How many blocks an array of `size` elements takes."""
    return -(-size // block)


def quantize(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x (any shape) -> (int8 [blocks, block], fp32 scales [blocks]), blocks over x flattened in C order."""
    flat = x.astype(jnp.float32).reshape(-1)
    flat = jnp.pad(flat, (0, blocks_of(flat.size, block) * block - flat.size))
    rows = flat.reshape(-1, block)
    scale = jnp.max(jnp.abs(rows), axis=1) * jnp.float32(1 / QMAX)
    inverse = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1.0), 0.0)  # a zero block stays zero
    q = jnp.clip(jnp.round(rows * inverse[:, None]), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The fp32 array of `shape` that (q [..., blocks, block], scale [..., blocks]) stands for; leading
    dimensions of q (one per device after a collective) stay in front."""
    lead = q.shape[:-2]
    x = (q.astype(jnp.float32) * scale[..., None]).reshape(*lead, -1)
    return x[..., :math.prod(shape)].reshape(*lead, *shape)
