"""A weight matmul whose output is wider than its operands (the head's fp32 logits from bf16 activations and
weights), differentiated as the matmul in the operands' dtype followed by a widening cast.

JAX's own transpose of `einsum(..., preferred_element_type=float32)` multiplies the fp32 cotangent by the bf16
operands, widened: two fp32 × fp32 GEMMs, which XLA runs on a GPU as Triton fusions at about a quarter of cuBLAS's
bf16 speed (the LLaMA-1B head's backward at 4,096 tokens: 21.9 of the step's 119.7 ms, BENCHMARKS.md). Here the
cotangent is rounded to the operands' dtype first, as the backward of `einsum(...).astype(float32)` rounds it (and
as Megatron's and torchtitan's bf16 heads do), and both products are GEMMs in that dtype accumulating in fp32.
The forward's output keeps its fp32 accumulation, unrounded. Where the operands are already as wide as the output
(fp32 compute, CPU's default) nothing is rounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def transposed(spec: str) -> tuple[str, str]:
    """The einsums of the two operands' gradients for "x,w->y": "y,w->x" and "x,y->w"."""
    ins, out = spec.split("->")
    x, w = ins.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


def einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """jnp.einsum(spec, x, w, preferred_element_type=out_dtype); where out_dtype is wider than x and w (of one
    dtype), the backward multiplies the cotangent rounded to their dtype."""
    if out_dtype is None or x.dtype != w.dtype or jnp.dtype(out_dtype).itemsize <= x.dtype.itemsize:
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    return _widened(spec, x, w, jnp.dtype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _widened(spec: str, x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _forward(spec, x, w, out_dtype):
    return _widened(spec, x, w, out_dtype), (x, w)


def gradients(spec: str, x: jax.Array, w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx in x's dtype, dw in fp32) of einsum(spec, x, w) for its output's cotangent g, rounded to w's dtype
    first: both products GEMMs in that dtype accumulating in fp32."""
    g = g.astype(w.dtype)
    dx_spec, dw_spec = transposed(spec)
    return (jnp.einsum(dx_spec, g, w, preferred_element_type=jnp.float32).astype(x.dtype),
            jnp.einsum(dw_spec, x, g, preferred_element_type=jnp.float32))


def _backward(spec, out_dtype, saved, g):
    x, w = saved
    dx, dw = gradients(spec, x, w, g)
    return dx, dw.astype(w.dtype)


_widened.defvjp(_forward, _backward)
