"""Attention on one device's arrays: the interface every caller uses (`attention`) and the dense reference.

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
