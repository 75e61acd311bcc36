"""MXFP8 (`precision.matmul = "mxfp8"`): the OCP microscaling format Blackwell GPUs multiply natively.

Every operand is E4M3 in blocks of 32 along its contraction, each block scaled by a power of two (an E8M0
scale): the block's amax / 448 rounded up to the next power of two, as `jax.nn.scaled_dot_general`'s `mxfp8`
configuration quantizes, for the forward and both gradients (each gradient's operands blocked again along its
own contraction: the output's gradient along the outputs for the input's gradient; the input and the output's
gradient along the tokens, all rows' tokens in a row, for the weight's). A power-of-two scale makes x / scale
exact, so only the E4M3 rounding (and the clip at ±448 a rounded-up scale never reaches) is lost.

On a GPU (`platform` gpu or cuda) the product is `jax.nn.scaled_dot_general`: cuDNN's block-scaled dot
(`__op$block_scaled_dot`), which only Blackwell-class GPUs run natively, so its speed cannot be measured on the
H100/H200 lent here. Elsewhere it is jaxllm's emulation of the same arithmetic: each operand rounded in its blocks
and scaled back, then an fp32 dot (no speed, the numbers). Contracted dimensions are zero-padded to whole blocks
(cuDNN requires them; zeros add nothing), the operands put in `fp8_block.einsum`'s canonical form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops import fp8_block

BLOCK = 32
_DOT = {"preferred_element_type": jnp.float32, "precision": "highest"}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def power_of_two_scale(amax):
    """The smallest power of two ≥ amax / 448 (1 for an all-zero block), computed from amax's exponent and
    mantissa (amax = m·2^q, m in [0.5, 1); 448 = 0.875·2^9), so no division's rounding can move it."""
    m, q = jnp.frexp(amax)
    scale = jnp.ldexp(jnp.ones_like(amax), q - 9 + (m > 0.875).astype(q.dtype))
    return jnp.where(amax > 0, scale, 1.0)


def _rounded(x):
    """x [.., L] as its E4M3 blocks of 32 along L give it back (fp32, padded to whole blocks)."""
    return fp8_block.tiles_value(*fp8_block.quantize_tiles(x, BLOCK, power_of_two_scale))


@jax.custom_vjp
def emulated(x, w):
    """x [B, R, T, K] · w [B, K, N] -> fp32 [B, R, T, N], as the module docstring says (padded K)."""
    return _forward(x, w)[0]


def _forward(x, w):
    y = jnp.einsum("bmk,bnk->bmn", _rounded(_rows(x)), _rounded(jnp.swapaxes(w, 1, 2)), **_DOT)
    return y.reshape(*x.shape[:3], -1), (x, w)


def _rows(x):
    """x [B, R, T, K] as [B, R·T, K]: the tokens of all rows, as the scaled dot flattens them."""
    return x.reshape(x.shape[0], -1, x.shape[3])


def _backward(saved, dy):
    x, w = saved
    rows = _rows(dy)  # [B, M, N]
    dx = jnp.einsum("bmn,bkn->bmk", _rounded(rows), _rounded(w), **_DOT)[..., :x.shape[3]]
    dw = jnp.einsum("bkm,bnm->bkn", _rounded(jnp.swapaxes(_rows(x), 1, 2)), _rounded(jnp.swapaxes(rows, 1, 2)),
                    **_DOT)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


emulated.defvjp(_forward, _backward)


def scaled(x, w):
    """The same product by `jax.nn.scaled_dot_general` (a GPU's cuDNN block-scaled dot)."""
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    rows = fp8_block.pad(fp8_block.pad(_rows(x), 2, BLOCK), 1, BLOCK)  # every contraction, the gradients' too
    padded = fp8_block.pad(fp8_block.pad(w, 1, BLOCK), 2, BLOCK)
    y = jax.nn.scaled_dot_general(rows, padded, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                                  configs=[config, config, config])
    return y[:, :x.shape[1] * x.shape[2], :w.shape[2]].reshape(*x.shape[:3], -1)


def einsum(spec: str, x, w, out_dtype, platform: str | None):
    """jnp.einsum(spec, x, w) of a weight matmul in MXFP8: on a GPU platform the scaled dot, else the emulation."""
    return fp8_block.einsum(spec, x, w, out_dtype, scaled if platform in GPU_PLATFORMS else emulated)


def weight_grad(x, dy):
    """Σ over the rows (x's and dy's leading two dimensions) of x ⊗ dy in x's dtype, blocked as the emulation's
    weight gradient (the tokens of all rows along the contraction)."""
    b, t = x.shape[:2]
    xs = jnp.swapaxes(x.reshape(1, b * t, -1), 1, 2)
    dys = jnp.swapaxes(dy.reshape(1, b * t, -1), 1, 2)
    dw = jnp.einsum("bkm,bnm->kn", _rounded(xs), _rounded(dys), **_DOT)
    return dw.reshape(*x.shape[2:], *dy.shape[2:]).astype(x.dtype)
