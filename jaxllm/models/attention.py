"""Multi-head / grouped-query self-attention.

`attention_layer` projects, applies RoPE where the family uses it, and calls
`attend`, the one dispatch point for the attention kernel (context-parallel
strategies plug in there, so model files carry no parallelism branches). The math
itself (scores, mask, softmax) is `ops/attention.py`, shared with those strategies.
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

from jaxllm.models.layers import column_parallel, row_parallel
from jaxllm.ops.attention import dot_product_attention
from jaxllm.ops.rope import rope
from jaxllm.parallel import allgather_attention, ring_attention, ulysses_attention
from jaxllm.sharding import constrain, current_layout, weight

CONTEXT_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def attend(q, k, v, positions, segment_ids):
    """The attention kernel for this run: the dispatch point for context parallelism.

    With the sequence split over `sp`, the layout's `context_attention` strategy
    (`model.cp_strategy`: ring, allgather or ulysses) runs as a shard_map island.
    """
    layout = current_layout()
    if layout is not None and layout.mesh.shape["sp"] > 1:
        return CONTEXT_ATTENTION[layout.context_attention].attend(q, k, v, positions, segment_ids, layout)
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
