"""Multi-head / grouped-query self-attention.

`attention_layer` projects, applies RoPE where the family uses it, and calls
`attend`, the one dispatch point for the attention kernel (context-parallel
strategies plug in there, so model files carry no parallelism branches).
Scores, softmax and the mask are fp32; the mask is causal by *position* and
restricted to equal segment ids, so reordered sequences and packed documents work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from jaxllm.models.layers import column_parallel, rope, row_parallel
from jaxllm.sharding import constrain, weight

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


def attend(q, k, v, positions, segment_ids):
    """The attention kernel for this run (the dispatch point for context-parallel strategies)."""
    return dot_product_attention(q, k, v, positions, positions, segment_ids, segment_ids)


def attention_layer(p: dict, x, positions, segment_ids, *, family: str, rope_theta: float, dtype):
    """Column-parallel Q/K/V (heads split over tp), attention, row-parallel output."""
    q, k, v = column_parallel(x, [(p["wq"], ("embed", "heads", "head_dim")),
                                  (p["wk"], ("embed", "kv_heads", "head_dim")),
                                  (p["wv"], ("embed", "kv_heads", "head_dim"))], dtype)
    if family == "gpt2":
        q = q + weight(p["bq"], ("heads", "head_dim"), dtype)
        k = k + weight(p["bk"], ("kv_heads", "head_dim"), dtype)
        v = v + weight(p["bv"], ("kv_heads", "head_dim"), dtype)
    else:
        q, k = rope(q, positions, rope_theta), rope(k, positions, rope_theta)
    q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "head_dim")), "query")
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "key")
    v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "head_dim")), "value")
    out = checkpoint_name(attend(q, k, v, positions, segment_ids), "attention")
    out = constrain(out, ("batch", "seq", "heads", "head_dim"))
    y = row_parallel(out, p["wo"], ("heads", "head_dim", "embed"), dtype)
    if family == "gpt2":
        y = y + p["bo"].astype(dtype)
    return y
