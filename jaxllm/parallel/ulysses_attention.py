"""Ulysses attention over `sp`: all-to-all from sequence-split to head-split and back
(a shard_map island).

Axes: manual over `sp` and `tp`, shapes as in `ring_attention`. An all-to-all gives each
rank the whole sequence for h/(tp·sp) of the query heads and the matching KV heads (KV
heads fewer than that are repeated first, so each rank holds the ones its query heads
use); attention then runs locally with the chunked kernel (`ops/chunked_attention.py`:
the model's window and soft cap, an O(t) backward), and a last all-to-all brings the
output back to sequence-split. Needs the query heads divisible by sp·tp (config
validation says so).

Collectives per call (per device, t = s/sp, E = bytes per element): 4 all-to-alls of
b·t·(h/tp)·d·E bytes (q, out) and b·t·(kv'/tp)·d·E (k, v; kv' the repeated KV count),
(sp-1)/sp of each sent; all-gathers of the int32 positions and segment ids (b·s·4 bytes
each). Backward: the same all-to-alls in reverse.

Attention sinks (`sinks` [h/tp] on each rank, whole over sp): after the all-to-all a rank holds the query heads
of its sp index's slice, so it passes that slice of the sinks to the chunked kernel (whole rows: each sink added
once); the slice's transpose and the island's sum over sp put each head's gradient in its place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.ops.chunked_attention import BLOCK, chunked_attention
from jaxllm.ops.masking import CAUSAL, Masking
from jaxllm.parallel.ring_attention import manual_axes, sinks_spec, specs
from jaxllm.sharding import Layout, island_mesh


def attend(q, k, v, positions, segment_ids, layout: Layout, masking: Masking = CAUSAL, block: int = BLOCK,
           sinks=None):
    """Attention of the sequence-split q, k, v with the model's `masking` and attention `sinks` ([h]; None: none),
    in blocks of `block` rows."""
    n = layout.mesh.shape["sp"]
    q_spec, kv_spec, pos_spec = specs(layout, q, k)

    def local(q, k, v, pos, seg, limits, sinks):
        if k.shape[2] % n:  # fewer local KV heads than sp: repeat so each rank gets its own
            k, v = (jnp.repeat(x, n // k.shape[2], axis=2) for x in (k, v))
        to_heads = lambda x: jax.lax.all_to_all(x, "sp", split_axis=2, concat_axis=1, tiled=True)
        gather = lambda x: jax.lax.all_gather(x, "sp", axis=1, tiled=True)
        pos, seg = gather(pos), gather(seg)
        if sinks is not None:  # the query heads this rank holds after the all-to-all: its sp index's slice
            heads = sinks.shape[0] // n
            sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index("sp") * heads, heads)
        out = chunked_attention(to_heads(q), to_heads(k), to_heads(v), pos, pos, seg, seg,
                                masking.with_limits(limits), block, sinks=sinks)
        return jax.lax.all_to_all(out, "sp", split_axis=1, concat_axis=2, tiled=True)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=manual_axes(layout), check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec, P(), sinks_spec(layout, sinks)),
                         out_specs=q_spec)(q, k, v, positions, segment_ids, masking.limits(),
                                           sinks)
