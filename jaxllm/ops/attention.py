"""Attention on one device's arrays: the interface every caller uses (`attention`) and the dense reference.

Below both `models/` (the attention layer) and `parallel/` (the context-parallel islands): it imports
neither. q is [b, t, h, dk]; k is [b, s, kv, dk] and v [b, s, kv, dv] with h a multiple of kv (grouped
queries read their K/V head, never a repeated copy) and dv free (latent attention has dv ≠ dk).

The mask and the scores are `ops/masking.py`'s. Implementations: `dense` (the readable reference: the
whole [t, s] score array), `chunked` (`ops/chunked_attention.py`: blocks and an online softmax, O(t)
memory in both passes), JAX's fused Pallas kernels `pallas_tpu` and `pallas_gpu` (`ops/pallas_attention.py`)
and cuDNN's (`ops/cudnn_attention.py`); each fused kernel's module says what it can express (`supports`).

Attention sinks (gpt-oss's, `sinks` [h] fp32, one logit per query head): each query's softmax runs over its keys
and one more column, the head's sink, never masked, whose probability is then dropped, so a query may give less
than all of its weight to the values. `dense` and `chunked` compute them; the fused kernels cannot and refuse.
So with Llama 4's attention chunks (`Masking.chunk`: a query sees only keys of its own chunk of positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError
from jaxllm.ops import pallas_attention
from jaxllm.ops.chunked_attention import chunked_attention
from jaxllm.ops.cudnn_attention import cudnn_attention
from jaxllm.ops.masking import (CAUSAL, NEG_INF, Masking, grouped, grouped_sinks, is_off, scores_of, ungrouped,
                                visible)

IMPLEMENTATIONS = ("dense", "chunked", *pallas_attention.IMPLEMENTATIONS, "cudnn")
FUSED_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cudnn": "gpu"}  # the backend each fused kernel needs


def dot_product_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = CAUSAL, sinks=None,
                          kv_layout: str = "bskd"):
    """The dense reference: the whole score array, a softmax, the values. Returns [b, t, h, dv]. `sinks` [h]: each
    head's sink logit joins every query's softmax as one more column, dropped before the values. `kv_layout`
    "bksd": k and v are [b, kv, s, d] (the paged cache's gathered pages as the gather gives them), so both dots
    find their batch dimensions (b, kv) leading and neither the keys nor the values are transposed."""
    qg = grouped(q, k.shape[kv_layout.index("k")])
    mask = visible(q_pos, k_pos, q_seg, k_seg, masking.window, masking.chunk)
    scores = jnp.where(mask[:, None, None], scores_of(qg, k, masking, f"btkgd,{kv_layout}->bkgts"), NEG_INF)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # [b, kv, g, t, s + 1]: the sink's column last, never masked
        sink = jnp.broadcast_to(grouped_sinks(sinks, qg.shape[2])[None, :, :, None, None], (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    return ungrouped(jnp.einsum(f"bkgts,{kv_layout}->btkgd", probs, v))


SINK_IMPLEMENTATIONS = ("dense", "chunked")  # those that compute attention sinks
CHUNK_IMPLEMENTATIONS = ("dense", "chunked")  # those that mask by attention chunks (`Masking.chunk`)


def refuse_sinks(impl: str) -> ConfigError:
    """The one line refusing attention sinks on a kernel that cannot add them to its softmax."""
    return ConfigError(f"model.attn_sinks: the {impl} kernel cannot add a sink to the softmax; use "
                       "model.attention_impl=chunked or dense")


def refuse_chunk(impl: str) -> ConfigError:
    """The one line refusing chunked local attention on a kernel that cannot mask by chunks."""
    return ConfigError(f"model.attention_chunk: the {impl} kernel cannot mask by attention chunks; use "
                       "model.attention_impl=chunked or dense")


def attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = CAUSAL, impl: str = "dense", sinks=None,
              kv_layout: str = "bskd"):
    """Attention by the implementation `impl` names (`IMPLEMENTATIONS`); every caller comes through here.
    `sinks` [h] fp32 (None: none): attention sinks, on `dense` and `chunked` only (ConfigError elsewhere); so are
    attention chunks (`masking.chunk`). `kv_layout`: "bskd", k and v [b, s, kv, d] (training's), or "bksd",
    [b, kv, s, d], which `dense` reads as they are and the others after a transpose."""
    if sinks is not None and impl not in SINK_IMPLEMENTATIONS:
        raise refuse_sinks(impl)
    if not is_off(masking.chunk) and impl not in CHUNK_IMPLEMENTATIONS:
        raise refuse_chunk(impl)
    if impl == "dense":
        return dot_product_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, sinks, kv_layout)
    if kv_layout == "bksd":
        k, v = (jnp.swapaxes(a, 1, 2) for a in (k, v))
    if impl == "chunked":
        return chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, sinks=sinks)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    if impl in pallas_attention.IMPLEMENTATIONS:
        return getattr(pallas_attention, impl)(q, k, v, q_pos, k_pos, q_seg, k_seg, masking)
    raise ValueError(f"attention implementation '{impl}' is not one of {', '.join(IMPLEMENTATIONS)}")
