"""Ulysses attention over `sp`: all-to-all from sequence-split to head-split and back
(a shard_map island).

Axes: manual over `sp` and `tp`, shapes as in `ring_attention`. An all-to-all gives each
rank the whole sequence for h/(tp·sp) of the query heads and the matching KV heads (KV
heads fewer than that are repeated first, so each rank holds the ones its query heads
use); attention then runs locally with the chunked kernel (`ops/chunked_attention.py`:
the model's window and soft cap, an O(t) backward), and a last all-to-all brings the
output back to sequence-split. Needs the query heads divisible by sp·tp (config
validation says so).

On a fused kernel (`kernel=`: `pallas_gpu` or `pallas_tpu`, a custom call the partitioner cannot split) the island
is manual over every axis (`kernel_island.manual_axes`) and the rank's whole sequence goes to the kernel as one
device's would: packed rows too (the kernels take segment ids), the zig-zag order (`layout.sequence_order`) put
back in index order around the call, since the kernels mask causally by index.

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
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.ops import pallas_attention
from jaxllm.ops.attention import refuse_chunk, refuse_sinks
from jaxllm.ops.chunked_attention import BLOCK, chunked_attention
from jaxllm.ops.masking import CAUSAL, Masking, is_off
from jaxllm.parallel import kernel_island
from jaxllm.parallel.ring_attention import manual_axes, sinks_spec, specs
from jaxllm.sharding import Layout, island_mesh

KERNELS = ("pallas_gpu", "pallas_tpu")  # the fused kernels the island runs on a rank's whole sequence


def _fused(q, k, v, pos, seg, masking: Masking, kernel: str, order, interpret: bool):
    """`kernel` over the whole sequence of a rank's heads, laid out in `order` (None: index order): put in index
    order for the kernel, which masks causally by index, and back."""
    call = lambda q, k, v, pos, seg: getattr(pallas_attention, kernel)(q, k, v, pos, pos, seg, seg, masking,
                                                                       interpret=interpret)
    if order is None:
        return call(q, k, v, pos, seg)
    back = np.argsort(order)  # laid-out slot i holds index order[i]
    out = call(*(jnp.take(x, back, axis=1) for x in (q, k, v, pos, seg)))
    return jnp.take(out, np.asarray(order), axis=1)


def attend(q, k, v, positions, segment_ids, layout: Layout, masking: Masking = CAUSAL, block: int = BLOCK,
           sinks=None, kernel: str = "chunked", interpret: bool = False):
    """Attention of the sequence-split q, k, v with the model's `masking` and attention `sinks` ([h]; None: none;
    the chunked kernel only), in blocks of `block` rows, on `kernel` (chunked, or one of `KERNELS`; `interpret`
    runs it on CPU, for tests)."""
    n = layout.mesh.shape["sp"]
    if kernel != "chunked" and sinks is not None:
        raise refuse_sinks(f"{kernel} Ulysses")
    if kernel != "chunked" and not is_off(masking.chunk):
        raise refuse_chunk(f"{kernel} Ulysses")
    axes = manual_axes(layout) if kernel == "chunked" else kernel_island.manual_axes(layout)
    q_spec, kv_spec, pos_spec = specs(layout, q, k, axes)

    def local(q, k, v, pos, seg, limits, sinks):
        if k.shape[2] % n:  # fewer local KV heads than sp: repeat so each rank gets its own
            k, v = (jnp.repeat(x, n // k.shape[2], axis=2) for x in (k, v))
        to_heads = lambda x: jax.lax.all_to_all(x, "sp", split_axis=2, concat_axis=1, tiled=True)
        gather = lambda x: jax.lax.all_gather(x, "sp", axis=1, tiled=True)
        q, k, v, pos, seg = to_heads(q), to_heads(k), to_heads(v), gather(pos), gather(seg)
        if kernel != "chunked":
            out = _fused(q, k, v, pos, seg, masking, kernel, layout.sequence_order, interpret)
        else:
            if sinks is not None:  # the query heads this rank holds after the all-to-all: its sp index's slice
                heads = sinks.shape[0] // n
                sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index("sp") * heads, heads)
            out = chunked_attention(q, k, v, pos, pos, seg, seg, masking.with_limits(limits), block, sinks=sinks)
        return jax.lax.all_to_all(out, "sp", split_axis=1, concat_axis=2, tiled=True)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec, P(), sinks_spec(layout, sinks, axes)),
                         out_specs=q_spec)(q, k, v, positions, segment_ids, masking.limits(), sinks)
