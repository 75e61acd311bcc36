"""The head and the loss over chunks of positions (`train.loss_chunk`), with a backward pass written out.

Only one chunk's [batch, chunk, vocab] fp32 logits exist at a time, forward and backward: the forward sums each
chunk's objective terms in a scan and keeps no logits; the backward scans the chunks again, recomputes each
chunk's logits, and
- rounds their cotangent to the compute dtype before the two matmuls (as `ops/wide_einsum` does for a whole
  head), so both run as bf16 GEMMs accumulating in fp32;
- sums the head weight's gradient over the chunks in fp32, in the scan's carry, and rounds it once at the end.

Under JAX's own transpose of a rematerialised scan each chunk's weight gradient came out rounded to bf16 by its
GEMM, was widened and added to an fp32 sum in a pass of its own over [d_model, vocab], and the weight was cast from
fp32 again in every chunk: on the H200, LLaMA-1B at 4,096 tokens (8 chunks), 4.8 and 3.3 ms of a 105 ms step
(BENCHMARKS.md). Here the weight enters as the matmul uses it (cast and laid out once, outside the scan), so its
gradient leaves the same way and the cast's and the layout's transposes run once, after the scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.ops import wide_einsum


def _logits(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunk_sum(tail, spec: str, w: jax.Array, xs: jax.Array, batches: dict):
    """Σ over chunks (the leading axis of xs and of each field of batches) of tail(logits, batch chunk), the
    logits einsum(spec, x chunk, w) in fp32; tail returns a pytree of fp32 sums (an objective's terms)."""
    def body(total, piece):
        x, batch = piece
        return jax.tree.map(jnp.add, total, tail(_logits(spec, x, w), batch)), None

    first = jax.eval_shape(lambda x, b: tail(_logits(spec, x, w), b), *jax.tree.map(lambda a: a[0], (xs, batches)))
    total, _ = jax.lax.scan(body, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), first), (xs, batches))
    return total


def _forward(tail, spec, w, xs, batches):
    return chunk_sum(tail, spec, w, xs, batches), (w, xs, batches)


def _backward(tail, spec, saved, ct):
    w, xs, batches = saved

    def body(dw, piece):
        x, batch = piece
        _, pull = jax.vjp(lambda logits: tail(logits, batch), _logits(spec, x, w))
        dx, dw_chunk = wide_einsum.gradients(spec, x, w, pull(ct)[0])
        return dw + dw_chunk, dx

    dw, dxs = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, batches))
    return dw.astype(w.dtype), dxs, None  # the batch is data: no cotangent


chunk_sum.defvjp(_forward, _backward)
