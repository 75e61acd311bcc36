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


def attend(q, k, v, positions, segment_ids):
    """The attention kernel for this run: the dispatch point for context parallelism.

    With the sequence split over `sp`, the layout's `context_attention` strategy
    (`model.cp_strategy`: ring, allgather or ulysses) runs as a shard_map island.
    """
    from jaxllm.sharding import current_layout

    layout = current_layout()
    if layout is not None and layout.mesh.shape["sp"] > 1:
        # imported here: parallel/ builds on this module
        from jaxllm.parallel import allgather_attention, ring_attention, ulysses_attention

        strategy = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
        return strategy[layout.context_attention].attend(q, k, v, positions, segment_ids, layout)
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
