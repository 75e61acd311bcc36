"""All-gather attention over `sp`: K/V gathered along the sequence, queries stay local
(a shard_map island).

Axes: manual over `sp` and `tp`, shapes as in `ring_attention`. Each rank gathers the
whole sequence's K, V, positions and segment ids, then runs its own queries against them
block by block with an online softmax (`parallel/blockwise.py`: masked piece pairs are
skipped, and backward keeps no block's scores).

Collectives per call (per device, s = sequence, E = bytes per element): all-gathers of K
and V, each with a result of b·s·(kv/tp)·d·E bytes ((sp-1)/sp of it received), and of the
int32 positions and segment ids (b·s·4 bytes each). Backward: reduce-scatters of the K/V
gradients (on CPU, an all-reduce and a slice). Simpler than the ring and one collective
round, at the price of holding the whole K/V on every rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.parallel import blockwise
from jaxllm.parallel.ring_attention import manual_axes, specs
from jaxllm.sharding import Layout, island_mesh


def attend(q, k, v, positions, segment_ids, layout: Layout):
    n = layout.mesh.shape["sp"]
    q_spec, kv_spec, pos_spec = specs(layout, q, k)

    def local(q, k, v, pos, seg):
        gather = lambda x: jax.lax.all_gather(x, "sp", axis=1, tiled=True)
        if jax.default_backend() == "cpu" and k.dtype == jnp.bfloat16:
            # XLA:CPU aborts on the bf16 reduce-scatter that transposes this gather
            # (AllReducePromotion); gather in fp32 there. GPU/TPU gather bf16.
            k, v = (gather(x.astype(jnp.float32)).astype(x.dtype) for x in (k, v))
        else:
            k, v = gather(k), gather(v)
        blocks = tuple(blockwise.blocks_of(x, n) for x in (k, v, gather(pos), gather(seg)))
        return blockwise.over_blocks(q, pos, seg, blocks, blockwise.pieces_of(q.shape[1]))

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=manual_axes(layout), check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
                         out_specs=q_spec)(q, k, v, positions, segment_ids)
