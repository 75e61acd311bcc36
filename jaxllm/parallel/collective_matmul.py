"""Collective matmuls over `tp`: all-gather→matmul and matmul→reduce-scatter as rings of
`ppermute`s interleaved with partial matmuls, so the transfer of one block hides behind
the matmul of another (a shard_map island).

Axes: manual over `tp`, and over `sp` when the sequence is split over it too; batch axes
(and everything else) stay with the compiler. Used by the tensor-parallel projections
(`models.layers.column_parallel` / `row_parallel`) when `model.collective_matmul=true`,
which needs Megatron sequence parallelism: the residual stream is then split along the
sequence over (sp, tp), sp-major. The rings run over tp within each sp rank's block of the
sequence: what enters and leaves the attention is that block, split over sp as context
parallelism wants it, so nothing is gathered over sp.

- `all_gather_matmul(x, ws)`: x [b, s/tp, d] (this rank's sequence block) times
  column-parallel weights [d, ...] (output dims split over tp) -> [b, s, ...] each.
  Every block of x visits every rank; each rank multiplies the block it holds while
  passing it on.
- `matmul_reduce_scatter(h, w)`: h [b, s, *c] times a row-parallel weight [*c, d]
  (contracted dims split over tp) -> [b, s/tp, d], summed over tp. A partial sum per
  sequence block travels the ring; each rank adds its own term for that block.

Both are bidirectional: each sequence block is split in two halves that travel
opposite ways round the ring, so both directions of every link carry data (when
the block has an odd length, one ring carries it all).

Collectives and bytes per call (per device, n = tp, E = bytes per element of the
compute dtype): all-gather→matmul does 2(n-1) collective-permutes of
b·s/(2n)·d elements, (n-1)/n · b·s·d·E bytes in all, the same as the all-gather
it replaces; matmul→reduce-scatter does 2(n-1) collective-permutes of
b·s/(2n)·d elements, (n-1)/n · b·s·d·E bytes, the same as a reduce-scatter.
No all-gather, all-reduce or reduce-scatter is left. Autodiff turns each ring into
its dual for the backward pass (the transpose of a ppermute is the reverse ppermute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.sharding import Layout, island_mesh, manual_spec

AXIS = "tp"


def _tp_spec(names: tuple[str, ...], layout: Layout, shape) -> list:
    """Per dimension: 'tp' where the weight rule splits it over tp, else None."""
    return list(manual_spec(names, layout.weights, layout.mesh, shape, {AXIS}))


def _halves(t: int) -> list[tuple[int, int, int]]:
    """(offset, length, direction) of the pieces of a length-t block and the ring each travels."""
    if t % 2:
        return [(0, t, 1)]
    return [(0, t // 2, 1), (t // 2, t // 2, -1)]


def _axes(layout: Layout) -> tuple[set[str], str | tuple[str, str], str | None]:
    """(the island's manual axes, the residual stream's sequence spec, the sp rank's block's spec)."""
    if layout.mesh.shape["sp"] > 1:
        return {"sp", AXIS}, ("sp", AXIS), "sp"
    return {AXIS}, AXIS, None


def _shift(x, n: int, direction: int):
    return jax.lax.ppermute(x, AXIS, perm=[(j, (j + direction) % n) for j in range(n)])


def all_gather_matmul(x: jax.Array, ws: list[jax.Array], names: list[tuple[str, ...]],
                      layout: Layout) -> list[jax.Array]:
    """[x gathered along the sequence over tp] @ w for each w, without an all-gather (x's sp block, under sp)."""
    n = layout.mesh.shape[AXIS]
    w_specs = [_tp_spec(nm, layout, w.shape) for nm, w in zip(names, ws)]

    def local(x, *ws):
        i = jax.lax.axis_index(AXIS)
        b, t = x.shape[:2]
        outs = [jnp.zeros((b, n * t, *w.shape[1:]), jnp.result_type(x, w)) for w in ws]
        for offset, length, direction in _halves(t):
            block = jax.lax.slice_in_dim(x, offset, offset + length, axis=1)
            for step in range(n):
                # send first: the transfer does not depend on this step's matmuls
                nxt = _shift(block, n, direction) if step < n - 1 else None
                start = ((i - direction * step) % n) * t + offset  # whose block this is
                outs = [jax.lax.dynamic_update_slice_in_dim(o, jnp.tensordot(block, w, axes=1), start, axis=1)
                        for o, w in zip(outs, ws)]
                block = nxt
        return outs

    axes, residual, block = _axes(layout)
    return jax.shard_map(
        local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
        in_specs=(P(None, residual), *[P(*s) for s in w_specs]),
        out_specs=[P(None, block, *s[1:]) for s in w_specs])(x, *ws)


def matmul_reduce_scatter(h: jax.Array, w: jax.Array, names: tuple[str, ...], layout: Layout) -> jax.Array:
    """(h @ w) summed over tp and split along the sequence over tp (within h's sp block), without an all-reduce."""
    n = layout.mesh.shape[AXIS]
    w_spec = _tp_spec(names, layout, w.shape)
    c = w.ndim - 1  # contracted dimensions

    def local(h, w):
        i = jax.lax.axis_index(AXIS)
        t = h.shape[1] // n
        pieces = []
        for offset, length, direction in _halves(t):
            acc = None
            for step in range(n):
                # this partial sum ends, after the remaining sends, on the rank owning block `dest`
                dest = (i + direction * (n - 1 - step)) % n
                rows = jax.lax.dynamic_slice_in_dim(h, dest * t + offset, length, axis=1)
                part = jnp.tensordot(rows, w, axes=c)
                acc = part if acc is None else _shift(acc, n, direction) + part
            pieces.append(acc)
        return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]

    axes, residual, block = _axes(layout)
    return jax.shard_map(
        local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
        in_specs=(P(None, block, *w_spec[:c]), P(*w_spec)),
        out_specs=P(None, residual))(h, w)
