"""Ring attention over `sp`: K/V blocks travel round the ring while each rank's queries stay put
(a shard_map island).

Axes: manual over `sp` and `tp` (heads are split over tp and never mix); batch axes stay
with the compiler, except on a fused kernel (a custom call the partitioner cannot split), where the island is
manual over every axis (`kernel_island.manual_axes`). q [b, s/sp, h/tp, d], k and v [b, s/sp, kv/tp, d] (KV heads repeated up
to tp where fewer), positions and segment ids [b, s/sp].

Forward: each of sp steps folds the K/V block a rank holds into the chunked kernel's online
softmax (`ops/chunked_attention.fold`: query blocks × key blocks, pairs the mask leaves empty
skipped by position, so zig-zag order and windows skip too), then passes the block on with one
`ppermute` (K, V, their positions and segment ids together; the last step sends nothing). Only
the output and the rows' softmax (max, sum) are kept. Backward (a custom VJP): the blocks go
round again, each carrying its dK and dV; every rank adds the gradients of its queries against
the block it holds (`chunked_attention.gradients`, the scores recomputed block by block) and
passes block and gradients on, so after sp steps each block's gradients are home. Memory: O(t)
per rank whatever sp is; no step's state is kept.

On a fused kernel (`model.attention_impl = "pallas_gpu"`, `kernel=` here), for rows of one
segment: a rank's block is one chunk of the sequence in order, two in the zig-zag order, and a
(query chunk, key chunk) pair is causal (the same chunk, by index), full (the key chunk earlier:
every key before every query) or empty (later: skipped with `lax.switch`). The Triton kernel
runs the first two and returns each pair's output and log-sum-exp, which the ring combines in
fp32; the backward runs the Triton backward kernel per pair from the whole row's output and
log-sum-exp, the blocks and their dK, dV travelling as above. Packed segments, windows, soft
caps and values narrower than keys make pairs that are neither, and stay on the chunked
kernel (validation refuses the fused choice there, naming why).

Attention sinks (`sinks` [h/tp] on each rank, the heads' own): each rank's queries start their running softmax
from their head's sink (`chunked_attention.empty`), so the sink joins each query's denominator once, not once per
ring step; each rank computes the sinks' gradient from its own queries' statistics (`chunked_attention.
sink_gradient`), and the island's transpose sums it over sp (the sinks enter replicated over sp). The fused
ring cannot add a sink, and validation refuses it (`model.attn_sinks`).

Collectives per call (per device, t = s/sp, E = bytes per element): forward, sp−1
collective-permutes of K and V, 2·b·t·(kv/tp)·d·E bytes each, plus b·t int32 positions and
segment ids; backward, sp−1 of the same and sp of the fp32 dK and dV (2·b·t·(kv/tp)·d·4 bytes).
No all-gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.ops import chunked_attention as chunked
from jaxllm.ops import pallas_attention
from jaxllm.ops.attention import refuse_chunk, refuse_sinks
from jaxllm.ops.masking import CAUSAL, Masking, is_off, ungrouped
from jaxllm.parallel import kernel_island
from jaxllm.sharding import Layout, island_mesh, manual_spec


def manual_axes(layout: Layout) -> set[str]:
    """sp, and tp where it is larger than 1. (A size-1 manual axis would only add trivial
    all-reduces of the cotangents, which XLA:CPU's bf16 all-reduce promotion rejects.)"""
    return {a for a in ("sp", "tp") if a == "sp" or layout.mesh.shape[a] > 1}


def specs(layout: Layout, q, k, axes: set[str] | None = None):
    """(q spec, k/v spec, positions spec) of the islands over `axes` (None: sp and tp, `manual_axes`)."""
    rules, mesh, axes = layout.activations, layout.mesh, manual_axes(layout) if axes is None else axes
    return (manual_spec(("batch", "seq", "heads", "head_dim"), rules, mesh, q.shape, axes),
            manual_spec(("batch", "seq", "kv_heads", "head_dim"), rules, mesh, k.shape, axes),
            manual_spec(("batch", "seq"), rules, mesh, q.shape[:2], axes))


def sinks_spec(layout: Layout, sinks, axes: set[str] | None = None):
    """The spec of attention sinks [h] in the islands over `axes` (None: `manual_axes`): split over tp as the query
    heads, whole on every sp rank (P() when there are none)."""
    if sinks is None:
        return P()
    axes = manual_axes(layout) if axes is None else axes
    return manual_spec(("heads",), layout.activations, layout.mesh, sinks.shape, axes)


def _send(x, n: int):
    """Everything in x to the next rank of the ring."""
    return jax.lax.ppermute(x, "sp", [(j, (j + 1) % n) for j in range(n)])


def _forward(q, k, v, pos, seg, masking: Masking, n: int, block: int, sinks=None):
    """(out [b, t, h, dv] in q's dtype, residuals, key blocks visited on this rank); `sinks` join each query's
    softmax once, in its starting state."""
    qs = chunked.queries(q, pos, seg, k.shape[2], block)
    ks = chunked.keys(k, v, pos, seg, block)

    def body(carry, _):
        state, count, ks = carry
        nxt = _send(ks, n)  # independent of this step's work: it can overlap
        return (*chunked.fold(state, qs, ks, masking, count), nxt), None

    (state, count, ks), _ = jax.lax.scan(body, (chunked.empty(qs, v.shape[-1], sinks), jnp.int32(0), ks),
                                         length=n - 1)
    state, count = chunked.fold(state, qs, ks, masking, count)
    out, stats = chunked.finish(state)
    return ungrouped(chunked.unblocked(out, q.shape[1])).astype(q.dtype), (qs, out, stats), count


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _ring(q, k, v, pos, seg, limits, sinks, softcap, scale, n, block):
    return _forward(q, k, v, pos, seg, Masking(softcap=softcap, scale=scale).with_limits(limits), n, block, sinks)[0]


def _ring_fwd(q, k, v, pos, seg, limits, sinks, softcap, scale, n, block):
    out, residuals, _ = _forward(q, k, v, pos, seg, Masking(softcap=softcap, scale=scale).with_limits(limits), n,
                                 block, sinks)
    return out, (residuals, k, v, pos, seg, limits, sinks)


def _ring_bwd(softcap, scale, n, block, saved, d_out):
    (qs, out, stats), k, v, pos, seg, limits, sinks = saved
    masking = Masking(softcap=softcap, scale=scale).with_limits(limits)
    do, delta = chunked.output_gradient(d_out, out, k.shape[2], block)
    ks = chunked.keys(k, v, pos, seg, block)
    grads = lambda dq, ks: chunked.gradients(qs, ks, stats, do, delta, masking, dq)

    def body(carry, _):
        dq, ks, dk, dv = carry
        dq, dk_here, dv_here = grads(dq, ks)
        return (dq, *_send((ks, dk + dk_here, dv + dv_here), n)), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    (dq, ks, dk, dv), _ = jax.lax.scan(body, (zeros(qs.q), ks, zeros(ks.k), zeros(ks.v)), length=n - 1)
    dq, dk_here, dv_here = grads(dq, ks)
    dk, dv = _send((dk + dk_here, dv + dv_here), n)  # the last step's gradients go home with the block's
    t = pos.shape[1]
    d_sinks = None if sinks is None else chunked.sink_gradient(sinks, stats, delta).astype(sinks.dtype)
    return (ungrouped(chunked.unblocked(dq, t)).astype(d_out.dtype), chunked.unblocked(dk, t).astype(k.dtype),
            chunked.unblocked(dv, t).astype(v.dtype), *chunked.no_cotangents(pos, seg, limits), d_sinks)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------- the ring on a fused kernel
#
# A rank's block is `c` chunks of the sequence: one in order (chunk r of sp), two in the zig-zag order (chunks r
# and 2·sp−1−r of 2·sp). A (query chunk, key chunk) pair is causal (the same chunk), full (the key chunk earlier)
# or empty (later): the kernel runs the first two, each returning its output and log-sum-exp.

SKIPPED, FULL_PAIR, CAUSAL_PAIR = 0, 1, 2  # lax.switch's branches


def _chunk_ids(rank, n: int, c: int) -> list:
    """The sequence chunks rank `rank` holds, in its block's order."""
    return [rank] if c == 1 else [rank, 2 * n - 1 - rank]


def _kinds(rank, src, n: int, c: int) -> list[list]:
    """[query chunk][key chunk] pair kinds for this rank's queries against the block rank `src` held."""
    kind = lambda qi, ki: jnp.where(qi == ki, CAUSAL_PAIR, jnp.where(ki < qi, FULL_PAIR, SKIPPED))
    return [[kind(qi, ki) for ki in _chunk_ids(src, n, c)] for qi in _chunk_ids(rank, n, c)]


def _chunks(x, c: int, axis: int = 1) -> list:
    return jnp.split(x, c, axis=axis)


def _combine(acc, lse, out, l):
    """Two partial softmax results of the same queries (out [b, t, h, d] fp32, lse [b, h, t]) as one."""
    total = jnp.logaddexp(lse, l)
    safe = jnp.where(jnp.isneginf(total), 0.0, total)  # nothing seen yet: weights 0, not NaN
    weight = lambda a: jnp.moveaxis(jnp.exp(a - safe), 1, 2)[..., None]  # [b, h, t] -> [b, t, h, 1]
    return acc * weight(lse) + out.astype(jnp.float32) * weight(l), total


def _fold(state, q_chunks, kv, kinds, pair):
    """Every query chunk's (out, lse) with the key chunks of one block folded in, by their pair kinds."""
    ks, vs = _chunks(kv[0], len(kinds)), _chunks(kv[1], len(kinds))
    new = []
    for qc, (acc, lse), row in zip(q_chunks, state, kinds):
        for kc, vc, kind in zip(ks, vs, row):
            empty = lambda: (jnp.zeros(qc.shape[:3] + vc.shape[-1:], qc.dtype), jnp.full_like(lse, -jnp.inf))
            o, l = jax.lax.switch(kind, [empty, lambda: pair(qc, kc, vc, False), lambda: pair(qc, kc, vc, True)])
            acc, lse = _combine(acc, lse, o, l)
        new.append((acc, lse))
    return new


def _fused_forward(q, k, v, pair, n: int, c: int):
    """(out [b, t, h, dv] in q's dtype, lse [b, h, t] fp32): the rank's own block, then each block as it arrives."""
    r = jax.lax.axis_index("sp")
    q_chunks = _chunks(q, c)
    b, t, h = q_chunks[0].shape[:3]
    start = [(jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32))] * c
    state = _fold(start, q_chunks, (k, v), _kinds(r, r, n, c), pair)

    def body(carry, s):
        state, kv = carry
        kv = _send(kv, n)
        return (_fold(state, q_chunks, kv, _kinds(r, (r - s) % n, n, c), pair), kv), None

    (state, _), _ = jax.lax.scan(body, (state, (k, v)), jnp.arange(1, n))
    return (jnp.concatenate([a for a, _ in state], axis=1).astype(q.dtype),
            jnp.concatenate([l for _, l in state], axis=-1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_ring(q, k, v, n, c, pairs):
    return _fused_forward(q, k, v, pairs[0], n, c)[0]


def _fused_ring_fwd(q, k, v, n, c, pairs):
    out, lse = _fused_forward(q, k, v, pairs[0], n, c)
    return out, (q, k, v, out, lse)


def _block_grads(saved, d_out, kv, kinds, pair_grads):
    """(dq, dk, dv) in fp32 of this rank's queries against one block, pair by pair (empty pairs: zeros)."""
    q, _, _, out, lse = saved
    c = len(kinds)
    qs, outs, dos, lses = _chunks(q, c), _chunks(out, c), _chunks(d_out, c), _chunks(lse, c, axis=-1)
    ks, vs = _chunks(kv[0], c), _chunks(kv[1], c)
    f32 = lambda xs: tuple(x.astype(jnp.float32) for x in xs)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dk, dv = [jnp.zeros(x.shape, jnp.float32) for x in ks], [jnp.zeros(x.shape, jnp.float32) for x in vs]
    for i in range(c):
        for j in range(c):
            run = lambda causal: f32(pair_grads(qs[i], ks[j], vs[j], outs[i], lses[i], dos[i], causal))
            empty = lambda: (dq[i] * 0, dk[j] * 0, dv[j] * 0)
            g = jax.lax.switch(kinds[i][j], [empty, lambda: run(False), lambda: run(True)])
            dq[i], dk[j], dv[j] = dq[i] + g[0], dk[j] + g[1], dv[j] + g[2]
    return tuple(jnp.concatenate(x, axis=1) for x in (dq, dk, dv))


def _fused_ring_bwd(n, c, pairs, saved, d_out):
    q, k, v = saved[:3]
    r = jax.lax.axis_index("sp")
    dq, dk, dv = _block_grads(saved, d_out, (k, v), _kinds(r, r, n, c), pairs[1])

    def body(carry, s):
        dq, kv, dk, dv = carry
        kv, dk, dv = _send((kv, dk, dv), n)
        g = _block_grads(saved, d_out, kv, _kinds(r, (r - s) % n, n, c), pairs[1])
        return (dq + g[0], kv, dk + g[1], dv + g[2]), None

    (dq, _, dk, dv), _ = jax.lax.scan(body, (dq, (k, v), dk, dv), jnp.arange(1, n))
    dk, dv = _send((dk, dv), n)  # the last step's gradients go home with the block's
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_fused_ring.defvjp(_fused_ring_fwd, _fused_ring_bwd)


def _fused_pairs(kernel: str, masking: Masking, d: int, interpret: bool):
    """(pair, pair_grads) of `kernel` at the model's score scale (`ops/pallas_attention.py`)."""
    if kernel != "pallas_gpu":
        raise ValueError(f"the ring runs the chunked kernel or pallas_gpu, not {kernel}")
    scale = masking.score_scale(d)
    return (lambda q, k, v, causal: pallas_attention.pallas_gpu_pair(q, k, v, causal, scale, interpret),
            lambda q, k, v, out, lse, do, causal: pallas_attention.pallas_gpu_pair_grads(q, k, v, out, lse, do,
                                                                                       causal, scale, interpret))


def attend(q, k, v, positions, segment_ids, layout: Layout, masking: Masking = CAUSAL, count_blocks: bool = False,
           block: int = chunked.BLOCK, kernel: str = "chunked", interpret: bool = False, sinks=None):
    """Ring attention of the sequence-split q, k, v with the model's `masking` and attention `sinks` ([h] fp32;
    None: none; the chunked kernel only), in blocks of `block` rows (fewer
    when a rank holds fewer), on `kernel` (chunked, or pallas_gpu for rows of one segment, in sequence order or
    the zig-zag one `layout.sequence_order` says, the positions their index: validation's word; `interpret` runs
    it on CPU, for tests). With `count_blocks` (tests only, forward only) also returns, per sp rank, how many
    (query block, key block) pairs it computed: counted inside the island, in the branch that runs when a pair
    is not skipped."""
    n = layout.mesh.shape["sp"]
    # a fused kernel is a custom call the partitioner cannot split: then the island is manual over every axis
    axes = manual_axes(layout) if kernel == "chunked" else kernel_island.manual_axes(layout)
    q_spec, kv_spec, pos_spec = specs(layout, q, k, axes)
    block = min(block, q.shape[1] // n)
    pairs = None if kernel == "chunked" else _fused_pairs(kernel, masking, q.shape[-1], interpret)
    if pairs is not None and sinks is not None:
        raise refuse_sinks(f"{kernel} ring")
    if pairs is not None and not is_off(masking.chunk):
        raise refuse_chunk(f"{kernel} ring")

    def local(q, k, v, pos, seg, limits, sinks):
        if pairs is not None:
            return _fused_ring(q, k, v, n, 1 if layout.sequence_order is None else 2, pairs)
        pos, seg = chunked.tied(q, pos, seg)
        if count_blocks:
            out, _, count = _forward(q, k, v, pos, seg, masking.with_limits(limits), n, block, sinks)
            return out, count[None]
        return _ring(q, k, v, pos, seg, limits, sinks, masking.softcap, masking.scale, n, block)

    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec, P(), sinks_spec(layout, sinks, axes)),
                         out_specs=(q_spec, P("sp")) if count_blocks else q_spec)(q, k, v, positions, segment_ids,
                                                                                   masking.limits(), sinks)
