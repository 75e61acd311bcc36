"""Attention math on one device's arrays: scores, the causal-by-position and same-segment mask,
softmax, and the pieces of an online softmax (`attention_block`, `merge_blocks`).

Below both `models/` (the attention layer) and `parallel/` (the context-parallel islands):
it imports neither. Scores and softmax are fp32; the mask is causal by *position* and
restricted to equal segment ids, so reordered sequences and packed documents work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

NEG_INF = -1e30  # finite, so fully masked rows never produce NaN


def dot_product_attention(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """Plain causal attention. q: [b, t, h, d]; k, v: [b, s, kv, d]; h a multiple of kv."""
    groups = q.shape[2] // k.shape[2]
    q = rearrange(q, "b t (k g) d -> b t k g d", g=groups) * (q.shape[-1] ** -0.5)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return rearrange(out, "b t k g d -> b t (k g) d")


def attention_block(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """Unnormalised attention of q against one K/V block, for an online softmax.

    Returns (out [b, t, h, d] fp32 = Σ exp(score - max)·v, max [b, t, h], sum [b, t, h]) over
    this block's keys; fully masked rows give max = -1e30, which `merge_blocks` weighs as zero
    against any real block.
    """
    groups = q.shape[2] // k.shape[2]
    q = rearrange(q, "b t (k g) d -> b t k g d", g=groups) * (q.shape[-1] ** -0.5)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    peak = scores.max(-1)
    p = jnp.exp(scores - peak[..., None])
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    heads = lambda a: rearrange(a, "b k g t -> b t (k g)")
    return rearrange(out, "b t k g d -> b t (k g) d"), heads(peak), heads(p.sum(-1))


def merge_blocks(a, b):
    """Combine two (out, max, sum) partial results of an online softmax."""
    (o1, m1, l1), (o2, m2, l2) = a, b
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * w1[..., None] + o2 * w2[..., None], m, l1 * w1 + l2 * w2
