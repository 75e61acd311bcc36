"""All-gather attention over `sp`: K/V gathered along the sequence, queries stay local
(a shard_map island).

Axes: manual over `sp` and `tp`, shapes as in `ring_attention`. Each rank gathers the
whole sequence's K, V, positions and segment ids, then runs its own queries against them
with the chunked kernel (`ops/chunked_attention.py`: query blocks × key blocks, pairs the
mask leaves empty skipped by position, the model's window and soft cap, an O(t) backward).

Collectives per call (per device, s = sequence, E = bytes per element): all-gathers of K
and V, each with a result of b·s·(kv/tp)·d·E bytes ((sp-1)/sp of it received), and of the
int32 positions and segment ids (b·s·4 bytes each). Backward: reduce-scatters of the K/V
gradients (on CPU, an all-reduce and a slice). Simpler than the ring and one collective
round, at the price of holding the whole K/V on every rank.

Attention sinks (`sinks` [h], split over tp as the heads, whole over sp): a rank's rows are whole, so the chunked
kernel adds each sink once; the island's transpose sums the sinks' gradient over sp.
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
    q_spec, kv_spec, pos_spec = specs(layout, q, k)

    def local(q, k, v, pos, seg, limits, sinks):
        gather = lambda x: jax.lax.all_gather(x, "sp", axis=1, tiled=True)
        if jax.default_backend() == "cpu" and k.dtype == jnp.bfloat16:
            # XLA:CPU aborts on the bf16 reduce-scatter that transposes this gather
            # (AllReducePromotion); gather in fp32 there. GPU/TPU gather bf16.
            k, v = (gather(x.astype(jnp.float32)).astype(x.dtype) for x in (k, v))
        else:
            k, v = gather(k), gather(v)
        here = masking.with_limits(limits)
        return chunked_attention(q, k, v, pos, gather(pos), seg, gather(seg), here, block, sinks=sinks)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=manual_axes(layout), check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec, P(), sinks_spec(layout, sinks)),
                         out_specs=q_spec)(q, k, v, positions, segment_ids, masking.limits(),
                                           sinks)
