"""Multi-head latent attention (DeepSeek-V2/V3; `model.attention = "mla"`, sizes in `model.mla`).

Every head's keys and values come from one latent per token, c = RMSNorm(x W_kv_a[:, :r]) (r = kv_lora_rank):
[k_nope | v] = c W_kv_b per head. RoPE acts on a key part of its own, x W_kv_a[:, r:] (d_r wide, one for all
heads), and on the queries' last d_r dimensions; the queries are x W_q, or RMSNorm(x W_q_a) W_q_b with
`q_lora_rank`. The heads split over tp (W_q / W_q_b and W_kv_b column-parallel, W_o row-parallel, as MHA's);
the latent projections and norms are replicated over tp.

`attention_layer` expands the latent into per-head keys and values and calls the run's attention
(`attention.attend`: context parallelism and the implementations as for MHA). `cached_attention_layer`
(generation) caches only [c | RoPE key], r + d_r values per token per layer, and attends in the latent: W_kv_b's
key half absorbed into the queries (q_nope·k_nope = (W_kb q_nope)·c), its value half applied to the heads'
latent outputs, so the cache is one key "head" that every query head reads and no per-head key or value is
ever made.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxllm.models.attention import (CacheView, apply_rope, attend, cache_implementation, cache_read, cache_write,
                                     in_window, masking, project_out, stored_names)
from jaxllm.models import lora
from jaxllm.models.layers import column_parallel, norm, project
from jaxllm.ops import fp8
from jaxllm.ops.attention import attention
from jaxllm.sharding import constrain, weight

LATENT_NORM_EPS = 1e-6  # the latent norms' epsilon: transformers' DeepseekV3RMSNorm default, not rms_norm_eps
LATENT_CACHE = ("layers", "batch", "seq", "kv_lora")  # the latent cache's logical dimensions


def _queries(p: dict, x, positions, m, dtype, layer=None):
    """(q_nope [b, s, h, d_nope], q_rope [b, s, h, d_r] at `positions`), the heads split over tp."""
    if "wq" in p:
        (q,) = column_parallel(x, [(p["wq"], ("embed", "heads", "head_dim"))], dtype, "attention")
    else:
        (cq,) = column_parallel(x, [(p["wq_a"], ("embed", "q_lora"))], dtype, "attention")
        cq = norm("rmsnorm", p["q_a_norm"], cq, LATENT_NORM_EPS, m.norm_offset)
        q = project(cq, p["wq_b"], ("q_lora", "heads", "head_dim"), 1, dtype, "attention")
    dn = m.mla.qk_nope_head_dim
    return q[..., :dn], apply_rope(q[..., dn:], positions, m, layer)


def _latent(p: dict, x, positions, m, dtype, layer=None):
    """[c | k_rope] [b, s, r + d_r]: the normed latent and the RoPE key at `positions` (what a cache holds)."""
    (ckv,) = column_parallel(x, [(p["wkv_a"], ("embed", "kv_lora"))], dtype, "attention")
    r = m.mla.kv_lora_rank
    c = norm("rmsnorm", p["kv_a_norm"], ckv[..., :r], LATENT_NORM_EPS, m.norm_offset)
    return jnp.concatenate([c, apply_rope(ckv[..., None, r:], positions, m, layer)[:, :, 0]], axis=-1)


def _up(p: dict, m, dtype):
    """W_kv_b's key half [r, h, d_nope] and value half [r, h, d_v], as used (heads split over tp); with adapters
    (generation: no dropout), merged into it."""
    w = lora.merged(p["wkv_b"], ("kv_lora", "heads", "head_dim"), dtype, weight)
    return w[..., :m.mla.qk_nope_head_dim], w[..., m.mla.qk_nope_head_dim:]


def attention_layer(p: dict, x, positions, segment_ids, m, dtype, layer=None):
    """MLA over the whole sequence: the latent expanded to every head's key and value, then `attend`."""
    q_nope, q_rope = _queries(p, x, positions, m, dtype, layer)
    latent = _latent(p, x, positions, m, dtype, layer)
    r, dn = m.mla.kv_lora_rank, m.mla.qk_nope_head_dim
    kv = project(latent[..., :r], p["wkv_b"], ("kv_lora", "heads", "head_dim"), 1, dtype, "attention")
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k_rope = jnp.broadcast_to(latent[:, :, None, r:], (*k_nope.shape[:-1], latent.shape[-1] - r))
    names = ("batch", "seq", "heads", "head_dim")
    q = checkpoint_name(constrain(jnp.concatenate([q_nope, q_rope], -1), names), "query")
    k = checkpoint_name(constrain(jnp.concatenate([k_nope, k_rope], -1), names), "key")
    v = checkpoint_name(constrain(v, names), "value")
    out = checkpoint_name(attend(q, k, v, positions, segment_ids, m, layer), "attention")
    return project_out(p, out, dtype)


def cached_attention_layer(p: dict, x, positions, segment_ids, cache: CacheView, m, dtype, layer=None):
    """`attention_layer` for generation over a latent cache (`cache.k`: [repeats, batch, slots, r + d_r], or paged;
    no `cache.v`): this call's latents are written (`attention.cache_write`), then its queries, with W_kv_b's key half
    absorbed, attend to every slot as one shared key head; the heads' latent outputs go through W_kv_b's
    value half and W_o. Returns (output, the cache with this layer's slots written)."""
    q_nope, q_rope = _queries(p, x, positions, m, dtype, layer)
    latent = _latent(p, x, positions, m, dtype, layer)
    names = stored_names(LATENT_CACHE, cache.pages is not None)
    written = constrain(cache_write(cache.k, latent, cache, positions, segment_ids), names)
    seen = in_window(cache._replace(k=written), positions)
    keys = cache_read(written, seen)[:, :, None, :]  # [b, slots, 1, r + d_r]
    r = m.mla.kv_lora_rank
    w_k, w_v = _up(p, m, dtype)
    q = jnp.concatenate([fp8.einsum("attention", "bthd,rhd->bthr", q_nope, w_k), q_rope], -1)
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    out = attention(q, keys, keys[..., :r], positions, seen.positions, segment_ids, seen.segment_ids,
                    masking(m, layer), cache_implementation(m, q.shape[1]))
    out = fp8.einsum("attention", "bthr,rhd->bthd", out, w_v)
    return project_out(p, out, dtype), cache._replace(k=written)
