"""Ring attention over `sp`: K/V blocks travel round the ring while each rank's queries stay put
(a shard_map island).

Axes: manual over `sp` and `tp` (heads are split over tp and never mix); batch axes stay
with the compiler. q [b, s/sp, h/tp, d], k and v [b, s/sp, kv/tp, d] (KV heads repeated up
to tp where fewer), positions and segment ids [b, s/sp].

Each of sp steps folds the K/V block a rank holds into an online softmax
(`parallel/blockwise.py`), skipping query/key piece pairs whose keys all come after their
queries, then passes the block on with one `ppermute` (K, V, their positions and segment
ids together; the last step sends nothing). The mask is by position, so any order of the
sequence over ranks works (zig-zag load balancing included). Each step is
rematerialised: backward keeps the running (out, max, sum) per step, not the scores.

Collectives per call (per device, t = s/sp, E = bytes per element): sp-1
collective-permutes of K and V, 2·b·t·(kv/tp)·d·E bytes each, plus b·t int32 positions
and segment ids; no all-gather. The backward pass sends the K/V gradients round the
ring the other way (the transpose of each ppermute) and the blocks again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel import blockwise
from jaxllm.sharding import Layout, island_mesh, manual_spec


def manual_axes(layout: Layout) -> set[str]:
    """sp, and tp where it is larger than 1. (A size-1 manual axis would only add trivial
    all-reduces of the cotangents, which XLA:CPU's bf16 all-reduce promotion rejects.)"""
    return {a for a in ("sp", "tp") if a == "sp" or layout.mesh.shape[a] > 1}


def specs(layout: Layout, q, k):
    """(q spec, k/v spec, positions spec) of the islands over sp and tp."""
    rules, mesh, axes = layout.activations, layout.mesh, manual_axes(layout)
    return (manual_spec(("batch", "seq", "heads", "head_dim"), rules, mesh, q.shape, axes),
            manual_spec(("batch", "seq", "kv_heads", "head_dim"), rules, mesh, k.shape, axes),
            manual_spec(("batch", "seq"), rules, mesh, q.shape[:2], axes))


def attend(q, k, v, positions, segment_ids, layout: Layout, count_blocks: bool = False):
    """Ring attention of the sequence-split q, k, v. With `count_blocks` (tests only) also returns, per
    sp rank, how many (query piece, key piece) score blocks it computed: counted inside the island, in
    the branch that runs when a pair is not skipped."""
    n = layout.mesh.shape["sp"]
    q_spec, kv_spec, pos_spec = specs(layout, q, k)

    def local(q, k, v, pos, seg):
        pieces = blockwise.pieces_of(q.shape[1])
        qs, ps, ss = blockwise.split(q, pieces), blockwise.split(pos, pieces), blockwise.split(seg, pieces)
        ring = [(j, (j + 1) % n) for j in range(n)]

        def fold(state, count, kv):  # the block step, counting its computed piece pairs only in tests
            if count_blocks:
                return blockwise.step(state, qs, ps, ss, kv, count)
            return blockwise.step(state, qs, ps, ss, kv), count

        def body(carry, _):
            state, count, kv = carry
            nxt = jax.lax.ppermute(kv, "sp", ring)  # independent of this step's work: it can overlap
            return (*fold(state, count, kv), nxt), None

        start = ([blockwise.empty(x) for x in qs], jnp.int32(0), (k, v, pos, seg))
        (state, count, kv), _ = jax.lax.scan(body, start, length=n - 1)
        state, count = fold(state, count, kv)
        out = blockwise.finish(state, q.dtype)
        return (out, count[None]) if count_blocks else out

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=manual_axes(layout), check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
                         out_specs=(q_spec, P("sp")) if count_blocks else q_spec)(q, k, v, positions, segment_ids)
