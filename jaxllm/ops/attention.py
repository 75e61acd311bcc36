"""Attention on one device's arrays: the interface every caller uses (`attention`), the dense reference,
and the pieces of an online softmax the context-parallel islands fold (`attention_block`, `merge_blocks`).

Below both `models/` (the attention layer) and `parallel/` (the context-parallel islands): it imports
neither. q is [b, t, h, dk]; k is [b, s, kv, dk] and v [b, s, kv, dv] with h a multiple of kv (grouped
queries read their K/V head, never a repeated copy) and dv free (latent attention has dv ≠ dk).

The mask and the scores are `ops/masking.py`'s. Implementations: `dense` (the readable reference: the
whole [t, s] score array), `chunked` (`ops/chunked_attention.py`: blocks and an online softmax, O(t)
memory in both passes), JAX's fused Pallas kernels `pallas_tpu` and `pallas_gpu` (`ops/pallas_attention.py`)
and cuDNN's (`ops/cudnn_attention.py`); each fused kernel's module says what it can express (`supports`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from jaxllm.ops import pallas_attention
from jaxllm.ops.chunked_attention import chunked_attention
from jaxllm.ops.cudnn_attention import cudnn_attention
from jaxllm.ops.masking import CAUSAL, NEG_INF, Masking, grouped, scores_of, ungrouped, visible

IMPLEMENTATIONS = ("dense", "chunked", *pallas_attention.IMPLEMENTATIONS, "cudnn")
FUSED_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cudnn": "gpu"}  # the backend each fused kernel needs


def dot_product_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = CAUSAL):
    """The dense reference: the whole score array, a softmax, the values. Returns [b, t, h, dv]."""
    qg = grouped(q, k.shape[2])
    mask = visible(q_pos, k_pos, q_seg, k_seg, masking.window)
    scores = jnp.where(mask[:, None, None], scores_of(qg, k, masking), NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return ungrouped(jnp.einsum("bkgts,bskd->btkgd", probs, v))


def attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = CAUSAL, impl: str = "dense"):
    """Attention by the implementation `impl` names (`IMPLEMENTATIONS`); every caller comes through here."""
    if impl == "dense":
        return dot_product_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    if impl == "chunked":
        return chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    if impl in pallas_attention.IMPLEMENTATIONS:
        return getattr(pallas_attention, impl)(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    raise ValueError(f"attention implementation '{impl}' is not one of {', '.join(IMPLEMENTATIONS)}")


def attention_block(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """Unnormalised attention of q against one K/V block, for an online softmax.

    Returns (out [b, t, h, d] fp32 = Σ exp(score - max)·v, max [b, t, h], sum [b, t, h]) over
    this block's keys; fully masked rows give max = -1e30, which `merge_blocks` weighs as zero
    against any real block.
    """
    qg = grouped(q, k.shape[2])
    mask = visible(q_pos, k_pos, q_seg, k_seg)
    scores = jnp.where(mask[:, None, None], scores_of(qg, k, CAUSAL), NEG_INF)
    peak = scores.max(-1)
    p = jnp.exp(scores - peak[..., None])
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    heads = lambda a: rearrange(a, "b k g t -> b t (k g)")
    return ungrouped(out), heads(peak), heads(p.sum(-1))


def merge_blocks(a, b):
    """Combine two (out, max, sum) partial results of an online softmax."""
    (o1, m1, l1), (o2, m2, l2) = a, b
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * w1[..., None] + o2 * w2[..., None], m, l1 * w1 + l2 * w2
