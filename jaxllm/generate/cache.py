"""The KV cache generation writes and reads, laid out by the same logical rules as everything else.

Per block kind of `model.pattern`, keys and values [repeats, batch, slots, kv_heads, head_dim] in the
compute dtype, stacked over the repeats like that kind's weights (`attention.CACHE` names the
dimensions). Under `generation_layout` the batch is split over the data axes (dp, fsdp, ep) and the
KV heads over tp; layers and slots stay whole. Beside them, per slot, its position and segment id
([batch, slots] int32, shared by all layers): segment 0 marks left padding and slots not yet
written, so `ops/attention.py`'s causal-by-position, same-segment mask serves prefill and decode.

Bytes per device: 2 · n_layers · batch/(dp·fsdp·ep) · slots · kv_heads/tp · head_dim · B, B the
compute dtype's size (`cache_bytes`); kv_heads fewer than tp are repeated up to tp, as the weights are.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxllm.models.attention import CACHE, head_dim, kv_heads
from jaxllm.sharding import ACTIVATION_RULES, BATCH_AXES, WEIGHT_RULES, Layout, constrain, with_rule


def generation_layout(layout: Layout) -> Layout:
    """Where generation's arrays live on a training mesh: weights as used (never split over fsdp or pp: the
    transient gathered copy), activations and the cache with the batch over the data axes and heads over
    tp, the sequence whole (pp and sp ranks repeat the work of their data-parallel group)."""
    activations = with_rule(with_rule(ACTIVATION_RULES, "seq", ()), "residual_seq", ()) + (("layers", ()),)
    return Layout(mesh=layout.mesh, params=WEIGHT_RULES, activations=activations, weights=WEIGHT_RULES)


def cache_heads(m, mesh_shape: dict) -> int:
    """KV heads as the cache holds them: fewer than tp are repeated up to tp (`sharding.replicated_heads`)."""
    kv, tp = kv_heads(m), mesh_shape.get("tp", 1)
    return tp if kv < tp and tp % kv == 0 else kv


def init_cache(m, batch: int, slots: int, dtype, mesh_shape: dict) -> list[dict]:
    """An empty cache: one {"k", "v"} per block kind, zeros laid out as `CACHE` says."""
    repeats = m.n_layers // len(m.pattern)
    shape = (repeats, batch, slots, cache_heads(m, mesh_shape), head_dim(m))
    return [{n: constrain(jnp.zeros(shape, dtype), CACHE) for n in ("k", "v")} for _ in m.pattern]


def cache_bytes(m, batch: int, slots: int, dtype, mesh_shape: dict) -> int:
    """Bytes of the cache on one device (see the module docstring)."""
    shards = math.prod(mesh_shape.get(a, 1) for a in BATCH_AXES)
    heads = cache_heads(m, mesh_shape)
    per_device_heads = heads // mesh_shape.get("tp", 1) if heads % mesh_shape.get("tp", 1) == 0 else heads
    return 2 * m.n_layers * -(-batch // shards) * slots * per_device_heads * head_dim(m) * jnp.dtype(dtype).itemsize
