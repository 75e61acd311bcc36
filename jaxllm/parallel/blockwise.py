"""Blockwise causal attention with an online softmax: what the context-parallel islands share.

Not an island itself: plain functions on one device's arrays, called inside the
ring / all-gather / Ulysses islands. Queries are split into pieces and every K/V block
into pieces; a (query piece, key piece) pair whose keys all lie after its queries (by
position) is skipped with `lax.cond`, so with causal masks about half the score blocks
are never computed. Each step over a K/V block is rematerialised: the backward pass
keeps the running (out, max, sum) per step, never the scores of the K/V blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.ops.attention import attention_block, merge_blocks
from jaxllm.ops.masking import NEG_INF


def pieces_of(t: int, want: int = 2) -> int:
    """How many pieces a length-t block splits into (`want` when it divides t, else 1)."""
    return want if t % want == 0 else 1


def split(x: jax.Array, n: int) -> list[jax.Array]:
    return jnp.split(x, n, axis=1)


def empty(q: jax.Array):
    """The online softmax's start: nothing seen yet."""
    b, t, h, d = q.shape
    return jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, t, h), NEG_INF, jnp.float32), jnp.zeros((b, t, h),
                                                                                                        jnp.float32)


def visible(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Whether any query may see any key (causal by position); segments only mask further."""
    return jnp.any(q_pos.max(axis=1) >= k_pos.min(axis=1))


@functools.partial(jax.checkpoint, prevent_cse=False)
def step(state, q, q_pos, q_seg, kv, count=None):
    """Fold one K/V block into the running softmax of each query piece.

    state: [(out, max, sum)] per query piece; q, q_pos, q_seg: lists of query pieces;
    kv: (k, v, k_pos, k_seg) of the block, itself split in pieces for the skipping.
    With `count` (an int32 scalar, for tests) also returns it plus the number of piece
    pairs computed rather than skipped: the counter is incremented in the taken branch.
    """
    k, v, k_pos, k_seg = kv
    n = pieces_of(k.shape[1])
    keys = list(zip(split(k, n), split(v, n), split(k_pos, n), split(k_seg, n)))
    counting = count is not None
    count = jnp.int32(0) if count is None else count
    out = []
    for acc, qa, pa, sa in zip(state, q, q_pos, q_seg):
        for kc, vc, pc, sc in keys:
            acc, count = jax.lax.cond(visible(pa, pc),
                                      lambda acc, c, qa=qa, pa=pa, sa=sa, kc=kc, vc=vc, pc=pc, sc=sc:
                                      (merge_blocks(acc, attention_block(qa, kc, vc, pa, pc, sa, sc)), c + 1),
                                      lambda acc, c: (acc, c), acc, count)
        out.append(acc)
    return (out, count) if counting else out


def finish(state, dtype) -> jax.Array:
    """Normalise and put the query pieces back together."""
    return jnp.concatenate([(o / l[..., None]).astype(dtype) for o, _, l in state], axis=1)


def over_blocks(q, q_pos, q_seg, blocks, n_pieces: int) -> jax.Array:
    """Attention of q against K/V blocks stacked on a leading axis ([n, b, t, ...] each), one at a time."""
    qs, ps, ss = split(q, n_pieces), split(q_pos, n_pieces), split(q_seg, n_pieces)

    def body(state, kv):
        return step(state, qs, ps, ss, kv), None

    state, _ = jax.lax.scan(body, [empty(x) for x in qs], blocks)
    return finish(state, q.dtype)


def blocks_of(x: jax.Array, n: int) -> jax.Array:
    """[b, n·t, ...] -> [n, b, t, ...]: the K/V sequence as n blocks."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 1, 0)
