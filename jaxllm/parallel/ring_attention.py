"""Ring attention over `sp`: K/V blocks travel round the ring while each rank's queries stay put
(a shard_map island).

Axes: manual over `sp` and `tp` (heads are split over tp and never mix); batch axes stay
with the compiler. q [b, s/sp, h/tp, d], k and v [b, s/sp, kv/tp, d] (KV heads repeated up
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

On a fused kernel (`model.attention_impl = "pallas_gpu"`, `kernel=` here): with the sequence in
order and rows of one segment, a (query block, K/V block) pair is diagonal (the rank's own
block: causal by index), full (a block from a rank before: every key before every query) or
empty (from a rank after: skipped with `lax.cond`). The Triton kernel runs the first two and
returns each pair's output and log-sum-exp, which the ring combines in fp32; the backward runs
the Triton backward kernel per pair from the whole row's output and log-sum-exp, the blocks
and their dK, dV travelling as above. Zig-zag order, packed segments, windows, soft caps and
values narrower than keys make pairs that are neither, and stay on the chunked kernel
(validation refuses the fused choice there, naming why).

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
from jaxllm.ops.masking import CAUSAL, Masking, ungrouped
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


def _send(x, n: int):
    """Everything in x to the next rank of the ring."""
    return jax.lax.ppermute(x, "sp", [(j, (j + 1) % n) for j in range(n)])


def _forward(q, k, v, pos, seg, masking: Masking, n: int, block: int):
    """(out [b, t, h, dv] in q's dtype, residuals, key blocks visited on this rank)."""
    qs = chunked.queries(q, pos, seg, k.shape[2], block)
    ks = chunked.keys(k, v, pos, seg, block)

    def body(carry, _):
        state, count, ks = carry
        nxt = _send(ks, n)  # independent of this step's work: it can overlap
        return (*chunked.fold(state, qs, ks, masking, count), nxt), None

    (state, count, ks), _ = jax.lax.scan(body, (chunked.empty(qs, v.shape[-1]), jnp.int32(0), ks), length=n - 1)
    state, count = chunked.fold(state, qs, ks, masking, count)
    out, stats = chunked.finish(state)
    return ungrouped(chunked.unblocked(out, q.shape[1])).astype(q.dtype), (qs, out, stats), count


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ring(q, k, v, pos, seg, window, softcap, scale, n, block):
    return _forward(q, k, v, pos, seg, Masking(window, softcap, scale), n, block)[0]


def _ring_fwd(q, k, v, pos, seg, window, softcap, scale, n, block):
    out, residuals, _ = _forward(q, k, v, pos, seg, Masking(window, softcap, scale), n, block)
    return out, (residuals, k, v, pos, seg, window)


def _ring_bwd(softcap, scale, n, block, saved, d_out):
    (qs, out, stats), k, v, pos, seg, window = saved
    masking = Masking(window, softcap, scale)
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
    return (ungrouped(chunked.unblocked(dq, t)).astype(d_out.dtype), chunked.unblocked(dk, t).astype(k.dtype),
            chunked.unblocked(dv, t).astype(v.dtype), *chunked.no_cotangents(pos, seg, window))


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------- the ring on a fused kernel


def _before(s):
    """Whether the block a rank holds at ring step s came from a rank before it (a full pair; after: empty)."""
    return s <= jax.lax.axis_index("sp")


def _fused_forward(q, k, v, pair, n: int):
    """(out [b, t, h, dv] in q's dtype, lse [b, h, t] fp32): the diagonal pair, then each full pair as it arrives."""
    out, lse = pair(q, k, v, True)

    def body(carry, s):
        acc, lse, kv = carry
        kv = _send(kv, n)
        o, l = jax.lax.cond(_before(s), lambda: pair(q, *kv, False),
                            lambda: (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)))
        total = jnp.logaddexp(lse, l)
        weight = lambda a, b: jnp.moveaxis(jnp.exp(a - b), 1, 2)[..., None]  # [b, h, t] -> [b, t, h, 1]
        return (acc * weight(lse, total) + o.astype(jnp.float32) * weight(l, total), total, kv), None

    (acc, lse, _), _ = jax.lax.scan(body, (out.astype(jnp.float32), lse, (k, v)), jnp.arange(1, n))
    return acc.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_ring(q, k, v, n, pairs):
    return _fused_forward(q, k, v, pairs[0], n)[0]


def _fused_ring_fwd(q, k, v, n, pairs):
    out, lse = _fused_forward(q, k, v, pairs[0], n)
    return out, (q, k, v, out, lse)


def _fused_ring_bwd(n, pairs, saved, d_out):
    q, k, v, out, lse = saved
    grads = lambda kv, causal: pairs[1](q, *kv, out, lse, d_out, causal)
    dq, dk, dv = grads((k, v), True)
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
    dq, dk, dv = f32(dq, dk, dv)

    def body(carry, s):
        dq, kv, dk, dv = carry
        kv, dk, dv = _send((kv, dk, dv), n)
        g = jax.lax.cond(_before(s), lambda: f32(*grads(kv, False)),
                         lambda: (jnp.zeros_like(dq), jnp.zeros_like(dk), jnp.zeros_like(dv)))
        return (dq + g[0], kv, dk + g[1], dv + g[2]), None

    (dq, _, dk, dv), _ = jax.lax.scan(body, (dq, (k, v), dk, dv), jnp.arange(1, n))
    dk, dv = _send((dk, dv), n)  # the last step's gradients go home with the block's
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_fused_ring.defvjp(_fused_ring_fwd, _fused_ring_bwd)


def _fused_pairs(kernel: str, masking: Masking, d: int, interpret: bool):
    """(pair, pair_grads) of `kernel` at the model's score scale (`ops/pallas_attention.py`)."""
    from jaxllm.ops import pallas_attention

    if kernel != "pallas_gpu":
        raise ValueError(f"the ring runs the chunked kernel or pallas_gpu, not {kernel}")
    scale = masking.score_scale(d)
    return (lambda q, k, v, causal: pallas_attention.pallas_gpu_pair(q, k, v, causal, scale, interpret),
            lambda q, k, v, out, lse, do, causal: pallas_attention.pallas_gpu_pair_grads(q, k, v, out, lse, do,
                                                                                       causal, scale, interpret))


def attend(q, k, v, positions, segment_ids, layout: Layout, masking: Masking = CAUSAL, count_blocks: bool = False,
           block: int = chunked.BLOCK, kernel: str = "chunked", interpret: bool = False):
    """Ring attention of the sequence-split q, k, v with the model's `masking`, in blocks of `block` rows (fewer
    when a rank holds fewer), on `kernel` (chunked, or pallas_gpu for rows of one segment in sequence order, the
    positions their index: validation's word; `interpret` runs it on CPU, for tests). With `count_blocks` (tests
    only, forward only) also returns, per sp rank, how many (query block, key block) pairs it computed: counted
    inside the island, in the branch that runs when a pair is not skipped."""
    n = layout.mesh.shape["sp"]
    q_spec, kv_spec, pos_spec = specs(layout, q, k)
    block = min(block, q.shape[1] // n)
    pairs = None if kernel == "chunked" else _fused_pairs(kernel, masking, q.shape[-1], interpret)

    def local(q, k, v, pos, seg, window):
        if pairs is not None:
            return _fused_ring(q, k, v, n, pairs)
        pos, seg = chunked.tied(q, pos, seg)
        if count_blocks:
            out, _, count = _forward(q, k, v, pos, seg, Masking(window, masking.softcap, masking.scale), n, block)
            return out, count[None]
        return _ring(q, k, v, pos, seg, window, masking.softcap, masking.scale, n, block)

    window = jnp.asarray(masking.window, jnp.int32)
    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=manual_axes(layout), check_vma=False,
                         in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec, P()),
                         out_specs=(q_spec, P("sp")) if count_blocks else q_spec)(q, k, v, positions, segment_ids, window)
