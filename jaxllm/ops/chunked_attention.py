"""Attention in O(t) memory, in XLA: query blocks × key blocks with an online softmax, and a custom VJP
that recomputes each block's scores in the backward (FlashAttention's algorithm, written with lax loops).

Forward: for each query block, a scan over the key blocks keeps the running (out, max, sum) and ends
with the output and the rows' softmax (max, sum); the residuals are q, k, v, the output and those,
so no pass keeps a [t, s] array, only [block_q, block_k] scores at a time. Backward: for each key block,
a scan over the query blocks recomputes the probabilities from the saved (max, sum), adds the block's
dK and dV, and adds its share of dQ into one [t]-long accumulator.

A (query block, key block) pair whose positions rule out every pair (all keys after all queries, or
all before the window) is skipped with `lax.cond`: by position, not by index, so the test is the
positions' min and max and holds for any order (zig-zag included). Causal masks skip about half the
blocks; a window leaves O(t·window) work. Sequences that are not a multiple of the block are padded
with keys no query sees (segment −1) and queries that see nothing (their rows give 0 and are cut).

`count` (tests) returns, beside the output, how many key blocks the forward visited, counted in the
branch that runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.ops.masking import NEG_INF, Masking, grouped, scores_of, ungrouped, visible

BLOCK = 512  # rows of q and of k per block: [512, 512] fp32 scores per (kv head, group) at a time


def _blocks(x, n: int):
    """[b, n·B, ...] -> [n, b, B, ...]."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """[n, b, B, ...] -> [b, n·B, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _pad(x, to: int, value):
    return jnp.pad(x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _reachable(qp, kp, window):
    """Whether any query of a block may see any key of another, by their positions alone."""
    return (qp.max() >= kp.min()) & ((window <= 0) | (qp.min() - kp.max() < window))


def _scores(qg, kj, qp, kp, qs, ks, masking):
    """A block's fp32 scores, capped and masked, and its mask [b, 1, 1, Bq, Bk]."""
    mask = visible(qp, kp, qs, ks, masking.window)[:, None, None]
    return jnp.where(mask, scores_of(qg, kj, masking), NEG_INF), mask


def _forward_block(qg, qp, qs, kb, vb, kpb, ksb, masking, count):
    """One query block against every key block: (out [b, B, kv, g, dv], the rows' (max, sum) [b, kv, g, B],
    count). The backward takes exp(score − max) / sum from them, as the softmax does: a log-sum-exp would
    round the large scores a soft cap allows (an ulp at 40 is 4e-6)."""
    b, B, kv, g, _ = qg.shape
    start = (jnp.zeros((b, kv, g, B, vb.shape[-1]), jnp.float32), jnp.full((b, kv, g, B), NEG_INF, jnp.float32),
             jnp.zeros((b, kv, g, B), jnp.float32), count)

    def step(carry, blk):
        kj, vj, kp, ks = blk

        def fold(carry):
            o, m, l, c = carry
            s, mask = _scores(qg, kj, qp, kp, qs, ks, masking)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            fade = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
            return o * fade[..., None] + pv, m_new, l * fade + p.sum(-1), c + 1

        return jax.lax.cond(_reachable(qp, kp, masking.window), fold, lambda c: c, carry), None

    (o, m, l, count), _ = jax.lax.scan(step, start, (kb, vb, kpb, ksb))
    l = jnp.where(l > 0, l, 1.0)  # a row that sees nothing (padding) gives 0, not NaN
    return jnp.moveaxis(o / l[..., None], 3, 1), (m, l), count


def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k):
    """(out [b, t, h, dv] in q's dtype, residuals, key blocks visited)."""
    t, s = q.shape[1], k.shape[1]
    nq, nk = -(-t // block_q), -(-s // block_k)
    qg = grouped(_pad(q, nq * block_q, 0), k.shape[2])
    q_pos, q_seg = _pad(q_pos, nq * block_q, 0), _pad(q_seg, nq * block_q, -2)
    k, v = _pad(k, nk * block_k, 0), _pad(v, nk * block_k, 0)
    k_pos, k_seg = _pad(k_pos, nk * block_k, 0), _pad(k_seg, nk * block_k, -1)
    keys = (_blocks(k, nk), _blocks(v, nk), _blocks(k_pos, nk), _blocks(k_seg, nk))

    def per_query_block(count, blk):
        out, stats, count = _forward_block(*blk, *keys, masking, count)
        return count, (out, stats)

    count, (out, stats) = jax.lax.scan(per_query_block, jnp.int32(0),
                                     (_blocks(qg, nq), _blocks(q_pos, nq), _blocks(q_seg, nq)))
    out = _unblocks(out)  # [b, T, kv, g, dv]
    residuals = (qg, k, v, q_pos, k_pos, q_seg, k_seg, out, stats)
    return ungrouped(out[:, :t]).astype(q.dtype), residuals, count


def _backward(masking, block_q, block_k, t, s, residuals, d_out):
    """dq, dk, dv (fp32) from the rows' saved softmax statistics: one key block at a time."""
    qg, k, v, q_pos, k_pos, q_seg, k_seg, out, (peak, total) = residuals
    nq, nk = qg.shape[1] // block_q, k.shape[1] // block_k
    d_out = grouped(_pad(d_out, nq * block_q, 0), k.shape[2]).astype(jnp.float32)
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out, out)  # rowsum(dO · O)
    scale = masking.score_scale(qg.shape[-1])
    queries = (_blocks(qg, nq), _blocks(q_pos, nq), _blocks(q_seg, nq), _blocks(d_out, nq), peak, total,
               jnp.moveaxis(delta.reshape(*delta.shape[:3], nq, block_q), 3, 0), jnp.arange(nq))

    def per_key_block(dq, blk):
        kj, vj, kp, ks = blk

        def step(carry, qblk):
            qi, qp, qs, do, mi, li, di, i = qblk

            def add(carry):
                dk, dv, dq = carry
                s, mask = _scores(qi, kj, qp, kp, qs, ks, masking)
                p = jnp.where(mask, jnp.exp(s - mi[..., None]) / li[..., None], 0.0)
                dv = dv + jnp.einsum("bkgts,btkgd->bskd", p, do)
                ds = p * (jnp.einsum("btkgd,bskd->bkgts", do, vj.astype(jnp.float32)) - di[..., None])
                if masking.softcap:  # d(cap·tanh(x/cap))/dx = 1 − (capped/cap)², where the mask lets it through
                    ds = ds * jnp.where(mask, 1 - (s / masking.softcap) ** 2, 0.0)
                dqi = jnp.einsum("bkgts,bskd->btkgd", ds, kj.astype(jnp.float32)) * scale
                dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds, qi.astype(jnp.float32)) * scale
                dq = jax.lax.dynamic_update_slice_in_dim(dq, jax.lax.dynamic_slice_in_dim(dq, i * block_q, block_q, 1)
                                                         + dqi, i * block_q, 1)
                return dk, dv, dq

            return jax.lax.cond(_reachable(qp, kp, masking.window), add, lambda c: c, carry), None

        start = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32), dq)
        (dk, dv, dq), _ = jax.lax.scan(step, start, queries)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(per_key_block, jnp.zeros(qg.shape, jnp.float32),
                                (_blocks(k, nk), _blocks(v, nk), _blocks(k_pos, nk), _blocks(k_seg, nk)))
    return ungrouped(dq[:, :t]), _unblocks(dk)[:, :s], _unblocks(dv)[:, :s]


def _tied(q, *ints):
    """The integer inputs made to depend on q (by adding 0 computed from it). Positions and segment ids are
    the same in every layer, and when a differentiated scan over the layers closes over them, JAX's scan
    partial evaluation hoists what depends on them alone out of the loop: here every block pair's mask,
    stacked, a [t, s] array. Tied to q they are computed per layer, in the loop, one block at a time."""
    zero = q[(0,) * q.ndim].astype(jnp.int32) * 0  # 0 whatever q holds (an int times 0; XLA folds it later)
    return tuple(x + zero for x in ints)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, window, softcap, scale, block_q, block_k):
    masking = Masking(window, softcap, scale)
    return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k)[0]


def _attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, window, softcap, scale, block_q, block_k):
    masking = Masking(window, softcap, scale)
    out, residuals, _ = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k)
    return out, (residuals, (q_pos, k_pos, q_seg, k_seg, window))


def _attention_bwd(softcap, scale, block_q, block_k, saved, d_out):
    residuals, ints = saved
    qg, k, v = residuals[:3]
    t, s, window = ints[0].shape[1], ints[1].shape[1], ints[-1]
    dq, dk, dv = _backward(Masking(window, softcap, scale), block_q, block_k, t, s, residuals, d_out)
    no_cotangent = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in ints)  # the integer inputs
    return (dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_cotangent)


_attention.defvjp(_attention_fwd, _attention_bwd)


def chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking = Masking(), block: int = BLOCK,
                      count: bool = False):
    """Attention of q [b, t, h, dk] against k [b, s, kv, dk], v [b, s, kv, dv] in blocks of `block` rows (fewer
    when the sequence is shorter). With `count`, also the number of key blocks the forward visited."""
    block_q, block_k = min(block, q.shape[1]), min(block, k.shape[1])
    q_pos, k_pos, q_seg, k_seg = _tied(q, q_pos, k_pos, q_seg, k_seg)
    if count:
        out, _, visited = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block_q, block_k)
        return out, visited
    window = jnp.asarray(masking.window, jnp.int32)
    return _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, window, masking.softcap, masking.scale, block_q, block_k)
