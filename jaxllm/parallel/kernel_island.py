"""A Pallas attention kernel on each device's own rows and heads (a shard_map island): training's fused kernels
(`attend`) and the rollout engine's paged decode kernel (`paged`).

A Pallas kernel is a custom call the SPMD partitioner cannot split: Splash's Mosaic call refuses to be
partitioned, and XLA would run a Triton call on operands gathered whole. So with the sequence whole on each
device (sp = 1) `pallas_tpu` and `pallas_gpu` run inside this island, manual over every mesh axis the enclosing
program has not already made manual (inside gradient accumulation the batch axes are; inside a pipeline stage pp
is). (cuDNN's call partitions itself and needs no island; the ring runs its own, `ring_attention.py`.)

Axes: all of them. q [b/B, t, h/tp, dk], k and v [b/B, t, kv/tp, d] with B the batch axes' product (dp, fsdp,
ep) where they split the batch, KV heads already repeated up to tp where fewer (`sharding.replicated_heads`);
positions and segment ids [b/B, t]. Every other axis holds the operands whole (size 1 here: pp outside a stage,
sp). Collectives per call: none, 0 bytes: a device attends over its own rows and heads.

`paged`: q [b/B, 1, h/tp, d], a layer's pools k and v [kv/tp, B/B, n_pages, page, d] (one pool per shard of the
rows, split over the batch axes as the rows are: a device's rows' pages are on it, their ids in its own pool), page
tables [b/B, width] and lengths [b/B]. Collectives per call: none, 0 bytes.
"""

from __future__ import annotations

import jax

from jaxllm.ops import paged_attention, pallas_attention
from jaxllm.ops.masking import Masking
from jaxllm.sharding import Layout, island_mesh, manual_spec


def manual_axes(layout: Layout) -> set[str]:
    """The mesh axes the enclosing program has not made manual."""
    done = set(jax.sharding.get_abstract_mesh().manual_axes) if layout.manual else set()
    return set(layout.mesh.axis_names) - done


def attend(q, k, v, positions, segment_ids, layout: Layout, masking: Masking, impl: str, interpret: bool = False):
    """`impl`'s attention (a Pallas kernel, `ops/attention.py`'s interface) of q, k, v laid out as `layout`'s
    activations, each device computing its own rows and heads (`interpret`: on CPU, for tests)."""
    axes, rules, mesh = manual_axes(layout), layout.activations, layout.mesh
    q_spec = manual_spec(("batch", "seq", "heads", "head_dim"), rules, mesh, q.shape, axes)
    kv_spec = manual_spec(("batch", "seq", "kv_heads", "head_dim"), rules, mesh, k.shape, axes)
    pos_spec = manual_spec(("batch", "seq"), rules, mesh, positions.shape, axes)

    def local(q, k, v, pos, seg):
        return getattr(pallas_attention, impl)(q, k, v, pos, pos, seg, seg, masking, interpret=interpret)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
                         out_specs=q_spec)(q, k, v, positions, segment_ids)


def paged(q, k_pool, v_pool, pages, lengths, layout: Layout, masking: Masking, interpret: bool = False):
    """`paged_attention.attend` of q laid out as `layout`'s activations over a layer's pools [kv_heads, shards,
    pages, page, d], each device reading its own rows' pages (its shard) of its own heads (`interpret`: on CPU,
    for tests)."""
    axes, rules, mesh = manual_axes(layout), layout.activations, layout.mesh
    q_spec = manual_spec(("batch", "seq", "heads", "head_dim"), rules, mesh, q.shape, axes)
    pool_spec = manual_spec(("kv_heads", "page_shards", "pages", "seq", "head_dim"), rules, mesh, k_pool.shape, axes)
    rows_spec = manual_spec(("batch", "pages"), rules, mesh, pages.shape, axes)
    lengths_spec = manual_spec(("batch",), rules, mesh, lengths.shape, axes)

    def local(q, k, v, pages, lengths):  # k, v: this device's one shard of the pools
        return paged_attention.attend(q, k[:, 0], v[:, 0], pages, lengths, masking, interpret)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(q_spec, pool_spec, pool_spec, rows_spec, lengths_spec),
                         out_specs=q_spec)(q, k_pool, v_pool, pages, lengths)
