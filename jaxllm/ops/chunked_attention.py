"""Attention in O(t) memory, in XLA: query blocks × key blocks with an online softmax, and a custom VJP
that recomputes each block's scores in the backward (FlashAttention's algorithm, written with lax loops).

Forward: for each query block, a scan over the key blocks keeps the running (out, max, sum) and ends
with the output and the rows' softmax (max, sum); the residuals are q, k, v, the output and those,
so no pass keeps a [t, s] array, only [block_q, block_k] scores at a time. Backward: for each key block,
a scan over the query blocks recomputes the probabilities from the saved (max, sum), adds the block's
dK and dV, and adds its share of dQ into one [t]-long accumulator.

A (query block, key block) pair whose positions rule out every pair (all keys after all queries, or
all before the window, or all in chunks before the queries' first) is skipped with `lax.cond`: by position, not by index, so the test is the
positions' min and max and holds for any order (zig-zag included). Causal masks skip about half the
blocks; a window leaves O(t·window) work. Sequences that are not a multiple of the block are padded
with keys no query sees (segment −1) and queries that see nothing (their rows give 0 and are cut).

The steps are public for the ring island (`parallel/ring_attention.py`), which folds each K/V block
that reaches it into the same running state (`fold`) and sums each block's gradients the same way
(`gradients`): `queries` and `keys` put the arrays in blocks, `empty` starts the state, `finish` ends it.

`count` (tests) returns, beside the output, how many key blocks the forward visited, counted in the
branch that runs.

Attention sinks (`sinks` [h], gpt-oss's): each query's running state starts from its head's sink instead of
empty, (max, sum, out) = (sink, 1, 0), so the sink joins the softmax's denominator once, whatever the order and
number of key blocks folded in after (the ring's too). The backward's dQ, dK, dV keep their form (they use the
final denominator, sink included, and the sink's value is 0, so rowsum(dO · O) is still the correction term);
the sink's own gradient is −Σ P_sink · rowsum(dO · O) over the rows of its head (`sink_gradient`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.ops.masking import NEG_INF, Masking, is_off, grouped, grouped_sinks, scores_of, ungrouped, visible

BLOCK = 512  # rows of q and of k per block: [512, 512] fp32 scores per (kv head, group) at a time


class Queries(NamedTuple):
    """Grouped queries in blocks: q [nq, b, B, kv, g, dk]; positions and segment ids [nq, b, B]."""
    q: jax.Array
    pos: jax.Array
    seg: jax.Array


class Keys(NamedTuple):
    """Keys and values in blocks: k [nk, b, B, kv, dk], v [nk, b, B, kv, dv]; positions, segment ids [nk, b, B]."""
    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array


def blocked(x, block: int, pad=0):
    """[b, t, ...] -> [n, b, block, ...], padded with `pad` to a multiple of the block."""
    n = -(-x.shape[1] // block)
    x = jnp.pad(x, [(0, 0), (0, n * block - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=pad)
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def unblocked(x, length: int):
    """[n, b, block, ...] -> [b, length, ...]: the rows put back in order, the padding cut."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :length]


def queries(q, q_pos, q_seg, kv_heads: int, block: int) -> Queries:
    """q [b, t, h, dk] grouped by K/V head and blocked; padded rows get segment −2 (they see no key)."""
    return Queries(blocked(grouped(q, kv_heads), block), blocked(q_pos, block), blocked(q_seg, block, -2))


def keys(k, v, k_pos, k_seg, block: int) -> Keys:
    """k, v [b, s, kv, d] blocked; padded keys get segment −1 (no query sees them)."""
    return Keys(blocked(k, block), blocked(v, block), blocked(k_pos, block), blocked(k_seg, block, -1))


def empty(qs: Queries, dv: int, sinks=None):
    """The online softmax's state before any key: (out [nq, b, kv, g, B, dv], max and sum [nq, b, kv, g, B]); with
    `sinks` [h], each row's head's sink already in it (max = sink, sum = exp(0) = 1, out 0: the sink's value)."""
    nq, b, B, kv, g, _ = qs.q.shape
    rows = (nq, b, kv, g, B)
    if sinks is not None:
        m = jnp.broadcast_to(grouped_sinks(sinks, kv)[None, None, :, :, None], rows)
        return jnp.zeros((*rows, dv), jnp.float32), m, jnp.ones(rows, jnp.float32)
    return jnp.zeros((*rows, dv), jnp.float32), jnp.full(rows, NEG_INF, jnp.float32), jnp.zeros(rows, jnp.float32)


def _reachable(qp, kp, masking: Masking):
    """Whether any query of a block may see any key of another, by their positions alone: some key not after
    some query, within the window, and (with chunks) some key's chunk not before the first query's."""
    window, chunk = masking.window, masking.chunk
    reach = (qp.max() >= kp.min()) & ((window <= 0) | (qp.min() - kp.max() < window))
    if is_off(chunk):
        return reach
    c = jnp.maximum(chunk, 1)
    return reach & ((chunk <= 0) | (qp.min() // c <= kp.max() // c))


def _scores(qg, kj, qp, kp, qs, ks, masking):
    """A block's fp32 scores, capped and masked, and its mask [b, 1, 1, Bq, Bk]."""
    mask = visible(qp, kp, qs, ks, masking.window, masking.chunk)[:, None, None]
    return jnp.where(mask, scores_of(qg, kj, masking), NEG_INF), mask


def _fold_block(acc, qg, qp, qs, ks: Keys, masking, count):
    """One query block's running (out, max, sum) with every key block of `ks` folded in, and the count."""

    def step(carry, blk):
        kj, vj, kp, ksg = blk

        def fold_in(carry):
            o, m, l, c = carry
            s, mask = _scores(qg, kj, qp, kp, qs, ksg, masking)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            fade = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
            return o * fade[..., None] + pv, m_new, l * fade + p.sum(-1), c + 1

        return jax.lax.cond(_reachable(qp, kp, masking), fold_in, lambda c: c, carry), None

    (o, m, l, count), _ = jax.lax.scan(step, (*acc, count), ks)
    return (o, m, l), count


def fold(state, qs: Queries, ks: Keys, masking: Masking, count=None):
    """The state with the key blocks `ks` folded into every query block's softmax; and the key blocks visited
    (added to `count`)."""

    def per_query_block(count, blk):
        (qg, qp, qsg), acc = blk
        acc, count = _fold_block(acc, qg, qp, qsg, ks, masking, count)
        return count, acc

    count, state = jax.lax.scan(per_query_block, jnp.int32(0) if count is None else count, (qs, state))
    return state, count


def finish(state):
    """(out [nq, b, B, kv, g, dv] fp32, the rows' (max, sum)). The backward takes exp(score − max) / sum from
    them, as the softmax does: a log-sum-exp would round the large scores a soft cap allows (an ulp at 40
    is 4e-6)."""
    o, m, l = state
    l = jnp.where(l > 0, l, 1.0)  # a row that sees nothing (padding) gives 0, not NaN
    return jnp.moveaxis(o / l[..., None], 4, 2), (m, l)


def output_gradient(d_out, out, kv_heads: int, block: int):
    """The output's cotangent blocked as the output (fp32), and rowsum(dO · O) [nq, b, kv, g, B]."""
    do = blocked(grouped(d_out, kv_heads), block).astype(jnp.float32)
    return do, jnp.einsum("nbtkgd,nbtkgd->nbkgt", do, out)


def sink_gradient(sinks, stats, delta):
    """The sinks' gradient [h] fp32 from the rows' saved softmax statistics (max, sum [nq, b, kv, g, B]) and
    rowsum(dO · O) (`output_gradient`): −Σ over the rows of each head of P_sink · rowsum(dO · O), the sink's value
    being 0. Rows that see nothing (padding) have dO = 0 there and add nothing."""
    m, l = stats
    kv = m.shape[2]
    p_sink = jnp.exp(grouped_sinks(sinks, kv)[None, None, :, :, None] - m) / l
    return -jnp.einsum("nbkgt,nbkgt->kg", p_sink, delta).reshape(-1)


def gradients(qs: Queries, ks: Keys, stats, do, delta, masking: Masking, dq):
    """dq (blocked as qs.q, fp32) plus the share of the key blocks `ks`, and their dk, dv (blocked, fp32), from
    the rows' saved softmax statistics and output gradient (`output_gradient`): one key block at a time."""
    scale = masking.score_scale(qs.q.shape[-1])
    per_query = (qs, do, *stats, delta, jnp.arange(qs.q.shape[0]))

    def per_key_block(dq, blk):
        kj, vj, kp, ksg = blk

        def step(carry, qblk):
            (qi, qp, qsg), doi, mi, li, di, i = qblk

            def add(carry):
                dk, dv, dq = carry
                s, mask = _scores(qi, kj, qp, kp, qsg, ksg, masking)
                p = jnp.where(mask, jnp.exp(s - mi[..., None]) / li[..., None], 0.0)
                dv = dv + jnp.einsum("bkgts,btkgd->bskd", p, doi)
                ds = p * (jnp.einsum("btkgd,bskd->bkgts", doi, vj.astype(jnp.float32)) - di[..., None])
                if masking.softcap:  # d(cap·tanh(x/cap))/dx = 1 − (capped/cap)², where the mask lets it through
                    ds = ds * jnp.where(mask, 1 - (s / masking.softcap) ** 2, 0.0)
                dq = dq.at[i].add(jnp.einsum("bkgts,bskd->btkgd", ds, kj.astype(jnp.float32)) * scale)
                dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds, qi.astype(jnp.float32)) * scale
                return dk, dv, dq

            return jax.lax.cond(_reachable(qp, kp, masking), add, lambda c: c, carry), None

        start = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32), dq)
        (dk, dv, dq), _ = jax.lax.scan(step, start, per_query)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(per_key_block, dq, ks)
    return dq, dk, dv


def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k, sinks=None):
    """(out [b, t, h, dv] in q's dtype, residuals, key blocks visited)."""
    qs, ks = queries(q, q_pos, q_seg, k.shape[2], block_q), keys(k, v, k_pos, k_seg, block_k)
    state, count = fold(empty(qs, v.shape[-1], sinks), qs, ks, masking)
    out, stats = finish(state)
    return ungrouped(unblocked(out, q.shape[1])).astype(q.dtype), (qs, ks, out, stats), count


def tied(q, *ints):
    """The integer inputs made to depend on q (by adding 0 computed from it). Positions and segment ids are
    the same in every layer, and when a differentiated scan over the layers closes over them, JAX's scan
    partial evaluation hoists what depends on them alone out of the loop: here every block pair's mask,
    stacked, a [t, s] array. Tied to q they are computed per layer, in the loop, one block at a time."""
    zero = q[(0,) * q.ndim].astype(jnp.int32) * 0  # 0 whatever q holds (an int times 0; XLA folds it later)
    return tuple(x + zero for x in ints)


def no_cotangents(*ints):
    """The cotangents of integer inputs (positions, segment ids, a traced window, `Masking.limits`): float0 zeros,
    each input's structure kept."""
    return tuple(jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), x) for x in ints)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12))
def _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, limits, sinks, softcap, scale, block_q, block_k):
    masking = Masking(softcap=softcap, scale=scale).with_limits(limits)
    return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k, sinks)[0]


def _attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, limits, sinks, softcap, scale, block_q, block_k):
    masking = Masking(softcap=softcap, scale=scale).with_limits(limits)
    out, residuals, _ = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k, sinks)
    return out, (residuals, (q_pos, k_pos, q_seg, k_seg, limits), sinks)


def _attention_bwd(softcap, scale, block_q, block_k, saved, d_out):
    (qs, ks, out, stats), ints, sinks = saved
    masking = Masking(softcap=softcap, scale=scale).with_limits(ints[-1])
    do, delta = output_gradient(d_out, out, ks.k.shape[3], block_q)
    dq, dk, dv = gradients(qs, ks, stats, do, delta, masking, jnp.zeros(qs.q.shape, jnp.float32))
    t, s = ints[0].shape[1], ints[1].shape[1]
    d_sinks = None if sinks is None else sink_gradient(sinks, stats, delta).astype(sinks.dtype)
    return (ungrouped(unblocked(dq, t)).astype(d_out.dtype), unblocked(dk, s).astype(ks.k.dtype),
            unblocked(dv, s).astype(ks.v.dtype), *no_cotangents(*ints), d_sinks)


_attention.defvjp(_attention_fwd, _attention_bwd)


def chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = Masking(), block: int = BLOCK,
                      count: bool = False, sinks=None):
    """Attention of q [b, t, h, dk] against k [b, s, kv, dk], v [b, s, kv, dv] in blocks of `block` rows (fewer
    when the sequence is shorter), with attention sinks `sinks` [h] (None: none). With `count`, also the number of
    key blocks the forward visited."""
    block_q, block_k = min(block, q.shape[1]), min(block, k.shape[1])
    q_pos, k_pos, q_seg, k_seg = tied(q, q_pos, k_pos, q_seg, k_seg)
    if count:
        out, _, visited = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k, sinks)
        return out, visited
    return _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking.limits(), sinks, masking.softcap, masking.scale,
                      block_q, block_k)
