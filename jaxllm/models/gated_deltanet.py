"""The Gated DeltaNet layer (Qwen3-Next's linear attention) as one pure function on plain arrays: transformers'
`Qwen3NextGatedDeltaNet` (models/qwen3_next/modeling_qwen3_next.py, its pure-torch path: `causal_conv1d_fn` /
`torch_chunk_gated_delta_rule` and `Qwen3NextRMSNormGated`) without a cache, around the recurrence of
`jaxllm/ops/gated_delta.py`.

    qkvz = x W_qkvz, ba = x W_ba             interleaved per key-head group (below)
    q, k, v = silu(causal depthwise conv1d over time (kernel K, no bias) of [q | k | v])      z is not convolved
    β = sigmoid(b);  g = −exp(A_log) · softplus(a + dt_bias)                                 (g in fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β)                  (`gated_delta.chunked`, use_qk_l2norm)
    y = (RMSNorm(o) · w · silu(z)) W_out                 per value head over dv; not zero-centred; fp32 inside

Parameters `p` (names as transformers', matrices in jaxllm's [in, out] orientation, i.e. transformers' transposed):

    in_proj_qkvz [D, 2·hk·dk + 2·hv·dv]   in_proj_ba [D, 2·hv]   conv1d [2·hk·dk + hv·dv, K] (transformers'
    conv1d.weight [C, 1, K] squeezed; no bias)   dt_bias [hv]   A_log [hv]   norm [dv]   out_proj [hv·dv, D]

Interleaving (transformers' `fix_query_key_value_ordering`): the qkvz output is hk groups, one per key head, each
[q (dk) | k (dk) | v (r·dv) | z (r·dv)] with r = hv / hk, the r value heads of a group consecutive; the ba output
is hk groups of [b (r) | a (r)]. The convolution's channels are [q heads | k heads | v heads] (hk·dk, hk·dk,
hv·dv), in head order, as transformers concatenates them.

Layouts: x [b, t, D] → y [b, t, D]; inside, q, k [b, t, hk, dk], v, z [b, t, hv, dv], g, β [b, t, hv], the
layout of `gated_delta`. Sizes come in a `GatedDeltaNetSizes`.

Packed documents: `segment_ids` [b, t] (one id per document, padding 0). The convolution's window does not reach
across a document start (the taps that would read an earlier document read zero, as at the start of the
sequence) and the recurrence's state is zeroed at each document start (`gated_delta`'s `segment_ids`), so every
document gives what it gives alone.

Precision: the projections are plain matmuls under the caller's matmul precision (`layers.matmul_precision`);
the convolution, g, the recurrence and the gated norm are computed in fp32 and cast back to x's dtype where
transformers casts (the conv output, the norm's x̂ before the weight and its output).

Not built here: sharding / tensor parallelism (no `constrain`, no column/row-parallel split of the heads: the
arrays are one device's), the decode cache (conv state and recurrent state; `gated_delta.recurrent` is the
per-token form a cached path would call), context parallelism (a sequence split across devices would have to
pass the conv's last K−1 inputs and the recurrent state between shards), the integration into
`transformer.py` / the model config / HF weight conversion, and a custom VJP for the chunked recurrence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.ops import gated_delta


class GatedDeltaNetSizes(NamedTuple):
    """transformers' `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
    `linear_value_head_dim`, `linear_conv_kernel_dim` and `rms_norm_eps` (the gated norm's epsilon)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6


def split_projections(qkvz: jax.Array, ba: jax.Array, s: GatedDeltaNetSizes):
    """Un-interleave the projections as `fix_query_key_value_ordering`: qkvz [b, t, 2·hk·dk + 2·hv·dv] and
    ba [b, t, 2·hv] → q, k [b, t, hk, dk], v, z [b, t, hv, dv], b, a [b, t, hv]."""
    hk, hv, dk, dv = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of the key heads ({hk})")
    r = hv // hk
    lead = qkvz.shape[:-1]
    qkvz = qkvz.reshape(lead + (hk, 2 * dk + 2 * r * dv))
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    ba = ba.reshape(lead + (hk, 2 * r))
    b, a = ba[..., :r], ba[..., r:]
    return (q, k, v.reshape(lead + (hv, dv)), z.reshape(lead + (hv, dv)), b.reshape(lead + (hv,)),
            a.reshape(lead + (hv,)))


def causal_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """transformers' `causal_conv1d_fn` without bias and activation, channels last: x [b, t, c], w [c, K];
    y_t = Σ_j w[:, j] · x_{t−(K−1)+j}, inputs before position 0 (and, with `segment_ids` [b, t], inputs of an
    earlier document) read as zero. fp32."""
    t, kernel = x.shape[1], w.shape[1]
    x = x.astype(jnp.float32)
    w = w.astype(jnp.float32)
    xp = jnp.pad(x, [(0, 0), (kernel - 1, 0), (0, 0)])
    if segment_ids is not None:
        sp = jnp.pad(segment_ids, [(0, 0), (kernel - 1, 0)], constant_values=-1)
    y = jnp.zeros_like(x)
    for j in range(kernel):  # tap j reads lag kernel − 1 − j
        xs = xp[:, j:j + t]
        if segment_ids is not None and j < kernel - 1:
            xs = jnp.where((sp[:, j:j + t] == segment_ids)[..., None], xs, 0.0)
        y = y + xs * w[:, j]
    return y


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`Qwen3NextRMSNormGated` over the last axis: x̂ = x · rsqrt(mean(x²) + eps) in fp32, cast to x's dtype, times
    w, times silu(gate) in fp32; the result in x's dtype. Not zero-centred (w itself, not 1 + w)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w * xf.astype(dtype)
    y = y * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(dtype)


def gated_deltanet(p: dict, x: jax.Array, sizes: GatedDeltaNetSizes, chunk: int = 64,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """The Gated DeltaNet layer: x [b, t, D] → y [b, t, D] (see the module docstring; `p` its parameters,
    `segment_ids` [b, t] for packed documents, `chunk` the chunk size of the recurrence's chunked form)."""
    s = sizes
    bsz, t, _ = x.shape
    hk, hv, dk, dv = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
    qkvz = x @ p["in_proj_qkvz"]
    ba = x @ p["in_proj_ba"]
    q, k, v, z, b, a = split_projections(qkvz, ba, s)
    mixed = jnp.concatenate([q.reshape(bsz, t, hk * dk), k.reshape(bsz, t, hk * dk),
                             v.reshape(bsz, t, hv * dv)], axis=-1)
    mixed = jax.nn.silu(causal_conv(mixed, p["conv1d"], segment_ids)).astype(x.dtype)
    q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    q, k, v = q.reshape(bsz, t, hk, dk), k.reshape(bsz, t, hk, dk), v.reshape(bsz, t, hv, dv)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    o, _ = gated_delta.chunked(q, k, v, g, beta, chunk, use_qk_l2norm=True, segment_ids=segment_ids)
    o = gated_rms_norm(o, z, p["norm"], s.eps)  # [b, t, hv, dv]
    return o.reshape(bsz, t, hv * dv) @ p["out_proj"]
