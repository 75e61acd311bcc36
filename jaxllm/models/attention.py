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
from jaxllm.errors import ConfigError
from jaxllm.sharding import constrain, current_layout, weight

CONTEXT_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def kv_heads(m) -> int:
    """Key/value heads (`model.n_kv_heads`, 0 meaning as many as the query heads)."""
    return m.n_kv_heads or m.n_heads


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


def check_config(m, shape: dict) -> list[str]:
    """The attention keys against the mesh: ConfigError (one line) for what cannot run."""
    sp, tp = shape["sp"], shape["tp"]
    if m.cp_strategy not in CONTEXT_ATTENTION:
        raise ConfigError(f"model.cp_strategy: '{m.cp_strategy}' is not one of {', '.join(CONTEXT_ATTENTION)}")
    if m.seq_len % sp:
        raise ConfigError(f"model.seq_len={m.seq_len} is not divisible by mesh.sp={sp}; change one of them")
    if sp > 1 and m.cp_load_balance and m.seq_len % (2 * sp):
        raise ConfigError(f"model.cp_load_balance: model.seq_len={m.seq_len} must divide into 2×mesh.sp={2 * sp} "
                          "chunks; change seq_len or set model.cp_load_balance=false")
    if sp > 1 and m.cp_strategy == "ulysses":
        if m.n_heads % (sp * tp):
            raise ConfigError(f"model.cp_strategy=ulysses needs model.n_heads={m.n_heads} divisible by "
                              f"mesh.sp×mesh.tp={sp * tp}; use ring or allgather, or change sp/tp")
        kv_local = max(kv_heads(m), tp) // tp
        if kv_local % sp and sp % kv_local:
            raise ConfigError(f"model.cp_strategy=ulysses: {kv_local} KV head(s) per tp rank and mesh.sp={sp}: one "
                              "must divide the other; use ring or allgather, or change sp")
    return []
