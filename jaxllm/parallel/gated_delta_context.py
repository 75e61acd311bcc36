"""Context parallelism for the gated delta rule (Gated DeltaNet's linear attention) over `sp` (a shard_map island).

Axes: `sp` carries the sequence, split contiguously: rank r holds tokens [r·t/sp, (r+1)·t/sp). The island is
manual over sp and every other axis of size > 1 not already manual (`manual_axes`, as `kernel_island`): batch
over the batch axes (dp, fsdp, ep), value heads over tp where the key heads split alike (hk divisible by tp),
else heads whole. The recurrence never mixes rows or heads, so those axes need no collective; left to the
partitioner they did (it re-gathered the rows and heads of the gathered [M | B] below). Layouts as
`ops/gated_delta.chunked`, per device: q, k [b, t, hk, dk], v [b, t, hv, dv], g, beta [b, t, hv], segment_ids
[b, t], states [b, hv, dk, dv].

The recurrence is affine in the state: over a rank's tokens, S_end = M · S_in + B, with
M = Π_t exp(g_t)(I − β_t k_t k_tᵀ) [dk, dk] (k as the chunked form uses it: normalised with use_qk_l2norm) and
B the end state from a zero start; a document starting inside the rank forgets S_in, so there M = 0. The maps
compose associatively, (M2, B2) ∘ (M1, B1) = (M2 M1, M2 B1 + B2), so:

1. One local pass (`local_pass`): `gated_delta.chunked` on the rank's tokens, with the state widened from
   [dk, dv] to [dk, dk + dv], entering as [I | 0], and the values widened to [0 | v]. The state's columns evolve
   independently, so the first dk columns end as M (the identity carried through the tokens' transitions, resets
   included: the chunked form zeroes them like any state) and the last dv as B; the outputs' last dv columns are
   o0 (the outputs from a zero start) and the first dk are `reads` [b, t, hv, dk], with reads_t = M_{≤t}ᵀ q_t
   (M_{≤t} the transition up to token t, q normalised and scaled as the chunked form does). No new math: the WY
   form, the l2norm, resets and padding are the chunked form's, so M is consistent with B by construction.
2. The composition (`incoming_state`): an all-gather over sp of every rank's [M | B], then a local fold of
   ranks 0..r−1 applied to the initial state (zero if none): S_in(r). A gather + fold, not a log-step
   (Hillis–Steele) ppermute scan: sp is small, one collective round instead of log2(sp) dependent ones, and
   the fold (sp steps of a dk×dk by dk×dv matmul per head) is negligible beside the local pass. The scan
   would move dk·(dk + dv) floats per head per step, log2(sp)·dk·(dk + dv) in all, against the gather's
   (sp − 1)·dk·(dk + dv) received: the same at sp = 2, more for the gather beyond, all of it small.
3. The correction (`local_gated_delta_rule`): the outputs are linear in the entering state too, and the part
   read from S_in is exactly Σ_k reads_t[k] · S_in[k, :], so o = o0 + reads · S_in — one small einsum, no
   rerun of the chunked form. The fold's last step gives the sequence's final state, on every rank.

Documents (`segment_ids`): a document starting exactly at a rank boundary must reset the state at the rank's
first token, which `gated_delta.resets_of` cannot see (position 0 is never a reset there): each rank receives
the previous rank's last segment id with a ppermute (`halo`) and marks its own resets (`sequence_resets`).

The short causal convolution before the recurrence (`causal_conv`) needs the previous rank's last K−1 inputs and
their segment ids (`halo`, a ppermute; rank 0 gets zeros and the id −1, which matches no document), then
equals `gated_delta.causal_conv` on the whole sequence (the same function, the halo as its window).

Zig-zag (load-balanced) order is not supported (`layout.sequence_order` is refused): the state passes from
rank to rank in sequence order, and zig-zag gives each rank two non-adjacent pieces of the sequence, whose
states would need two passes of the composition (the early pieces in order, then the late ones). The
recurrence's work is the same on every rank anyway (linear in the tokens, no causal imbalance to fix).

Collectives per call (per device, b, hv the rows and value heads the device holds, fp32): one all-gather of
[M | B], a result of sp·b·hv·dk·(dk + dv)·4 bytes ((sp−1)/sp of it received); with segment ids, one
collective-permute of b int32 (the previous rank's last id). No collective moves q, k, v, g or beta.
Backward: the gather's transpose, a reduce-scatter of the cotangent of that result (sp·b·hv·dk·(dk + dv)·4
bytes in, 1/sp of it out; the hand-written transpose shows as reduce-scatter on CPU too), nothing for the
permute (integers). The final state needs none: every rank folds all the maps. The convolution: one
collective-permute of b·(K−1)·c elements of x (and, with documents, of b·(K−1) int32 segment ids; K−1 must not
exceed t/sp), its transpose in the backward.

Cost beside one device's chunked form: the widened state makes the scan's matmuls and the UT solve's right-hand
side (dk + dv)/dv times wider (2× at dk = dv); the fold and the correction are small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.ops import gated_delta
from jaxllm.ops.gated_delta import HIGHEST
from jaxllm.parallel import kernel_island
from jaxllm.sharding import Layout, island_mesh, manual_spec

NO_DOCUMENT = -1  # the segment id rank 0 receives for the tokens before the sequence: equal to none


# ---------------------------------------------------------------- neighbours


def _from_previous(x, axis_name: str):
    """x of the previous rank along `axis_name` (rank 0 receives zeros): one ppermute, no wrap-around."""
    n = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, [(j, j + 1) for j in range(n - 1)])


def halo(x, segment_ids, width: int, axis_name: str = "sp"):
    """The previous rank's last `width` tokens of x [b, t, ...] and of `segment_ids` [b, t] (None: none), as
    (x_prev [b, width, ...], ids_prev [b, width] or None). Rank 0 gets zeros and the id NO_DOCUMENT."""
    if width > x.shape[1]:
        raise ValueError(f"a halo of {width} tokens needs at least as many on every rank, not {x.shape[1]}")
    x_prev = _from_previous(x[:, x.shape[1] - width:], axis_name)
    if segment_ids is None:
        return x_prev, None
    ids_prev = _from_previous(segment_ids[:, segment_ids.shape[1] - width:], axis_name)
    first = jax.lax.axis_index(axis_name) == 0
    return x_prev, jnp.where(first, NO_DOCUMENT, ids_prev)


def sequence_resets(segment_ids, axis_name: str = "sp"):
    """[b, t] bool for this rank's tokens: true at each document start of the whole sequence, including one at
    the rank's first token when the previous rank's last token belongs to another document. Rank 0's first
    token is never a reset (the sequence continues the initial state, as in `gated_delta.resets_of`)."""
    prev = _from_previous(segment_ids[:, -1], axis_name)  # [b]: the previous rank's last token's document
    starts = (prev != segment_ids[:, 0]) & (jax.lax.axis_index(axis_name) > 0)
    return gated_delta.resets_of(segment_ids).at[:, 0].set(starts)


# ---------------------------------------------------------------- the recurrence


def local_pass(q, k, v, g, beta, resets, chunk: int, use_qk_l2norm: bool):
    """One chunked pass over this rank's tokens with the state widened to [I | 0] and the values to [0 | v].
    Returns (o0 [b, t, hv, dv], reads [b, t, hv, dk], ends [b, hv, dk, dk + dv] = [M | B]), all fp32."""
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    f32 = jnp.float32
    v_wide = jnp.concatenate([jnp.zeros((b, t, hv, dk), f32), v.astype(f32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=f32), (b, hv, dk, dk))
    start = jnp.concatenate([eye, jnp.zeros((b, hv, dk, dv), f32)], axis=-1)
    # q in fp32: chunked returns o in q's dtype, and the reads must stay fp32 until the correction
    o, ends = gated_delta.chunked(q.astype(f32), k, v_wide, g, beta, chunk, start, use_qk_l2norm=use_qk_l2norm,
                                  resets=resets)
    return o[..., dk:], o[..., :dk], ends


def apply(ends, state):
    """(M, B) applied to a state: M · state + B (ends = [M | B] [b, hv, dk, dk + dv], state [b, hv, dk, dv])."""
    dk = ends.shape[-2]
    return jnp.einsum("bhij,bhjv->bhiv", ends[..., :dk], state, precision=HIGHEST) + ends[..., dk:]


def incoming_state(ends, initial_state, axis_name: str = "sp"):
    """(the state entering this rank, the sequence's final state): every rank's map, gathered over `axis_name`,
    applied in order to the initial state [b, hv, dk, dv] fp32; the first r of them give rank r's entering
    state, all of them the final state (the same on every rank)."""
    every = jax.lax.all_gather(ends, axis_name)  # [sp, b, hv, dk, dk + dv]

    def step(state, rank_ends):
        return apply(rank_ends, state), state  # emit the state entering that rank

    final, entering = jax.lax.scan(step, initial_state, every)
    return entering[jax.lax.axis_index(axis_name)], final


def local_gated_delta_rule(q, k, v, g, beta, segment_ids=None, initial_state=None, *, axis_name: str = "sp",
                           chunk: int = 64, use_qk_l2norm: bool = False):
    """The gated delta rule on this rank's tokens of a sequence split contiguously over `axis_name` (call inside
    a shard_map manual over it). Arguments as `gated_delta.chunked` on the local shards; `initial_state`
    [b, hv, dk, dv] enters the whole sequence (the same on every rank; None: zeros). Returns (o [b, t, hv, dv]
    in q's dtype, the sequence's final state [b, hv, dk, dv] fp32, the same on every rank)."""
    b, _, hv, dv = v.shape
    dk = k.shape[-1]
    resets = None if segment_ids is None else sequence_resets(segment_ids, axis_name)
    o0, reads, ends = local_pass(q, k, v, g, beta, resets, chunk, use_qk_l2norm)
    state = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    entering, final = incoming_state(ends, state, axis_name)
    # the outputs are linear in the entering state: what they read of it is reads · S_in, added to o0
    o = o0 + jnp.einsum("bthk,bhkv->bthv", reads, entering, precision=HIGHEST)
    return o.astype(q.dtype), final


# ---------------------------------------------------------------- the causal convolution


def local_causal_conv(x, w, segment_ids=None, axis_name: str = "sp"):
    """`gated_delta.causal_conv` (x [b, t, c], w [c, K]) of this rank's tokens of a sequence split over
    `axis_name`: the window reaches into the previous rank's last K−1 inputs, not across a document start. fp32."""
    x_prev, ids_prev = halo(x, segment_ids, w.shape[1] - 1, axis_name)
    return gated_delta.causal_conv(x, w, segment_ids, window=x_prev, window_ids=ids_prev)


# ---------------------------------------------------------------- the islands


def manual_axes(layout: Layout) -> set[str]:
    """sp, and every other axis of size > 1 the enclosing program has not made manual (`kernel_island`'s rule
    without its size-1 axes, which would only add trivial all-reduces of the cotangents): batch and heads are
    then split by hand too, so the partitioner never sees the gathered [M | B] and cannot re-gather its rows."""
    size = layout.mesh.shape
    return {a for a in kernel_island.manual_axes(layout) if a == "sp" or size[a] > 1}


def _specs(layout: Layout, k, v, axes: set[str]):
    """The island's specs of (q and k, v, g and beta, segment ids, states): batch over the batch axes, the
    sequence over sp, value heads over tp only where the key heads split alike (hk divisible by tp, so each
    rank's value heads are exactly those of its key heads); otherwise both stay whole."""
    rules, mesh = layout.activations, layout.mesh
    spec = lambda names, shape: list(manual_spec(names, rules, mesh, shape, axes))
    qk = spec(("batch", "seq", "kv_heads", "head_dim"), k.shape)
    vv = spec(("batch", "seq", "heads", "head_dim"), v.shape)
    heads = qk[2] if qk[2] == vv[2] else None
    batch, seq = qk[0], qk[1]
    return (P(batch, seq, heads, None), P(batch, seq, heads, None), P(batch, seq, heads), P(batch, seq),
            P(batch, heads, None, None))


def _check(layout: Layout, t: int):
    n = layout.mesh.shape["sp"]
    if layout.sequence_order is not None:
        raise ValueError("the gated delta rule over sp needs the sequence in order (its state passes rank to rank), "
                         "not the zig-zag load-balanced order")
    if t % n:
        raise ValueError(f"the sequence ({t} tokens) must divide over sp={n}")


def gated_delta_rule(q, k, v, g, beta, layout: Layout, segment_ids=None, initial_state=None, *, chunk: int = 64,
                     use_qk_l2norm: bool = False):
    """`gated_delta.chunked` of whole arrays laid out as `layout`'s activations, the sequence split over sp
    (`local_gated_delta_rule` in a shard_map, `manual_axes`). Returns (o [b, t, hv, dv] in q's dtype, the final
    state [b, hv, dk, dv] fp32)."""
    _check(layout, q.shape[1])
    axes = manual_axes(layout)
    qk_spec, v_spec, gb_spec, ids_spec, state_spec = _specs(layout, k, v, axes)

    def local(q, k, v, g, beta, segment_ids, initial_state):
        return local_gated_delta_rule(q, k, v, g, beta, segment_ids, initial_state, axis_name="sp", chunk=chunk,
                                      use_qk_l2norm=use_qk_l2norm)

    # the final state is the same on every sp rank; with check_vma=False shard_map's transpose divides its
    # cotangent by sp and sums the ranks' contributions, so its gradient is counted once
    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(qk_spec, qk_spec, v_spec, gb_spec, gb_spec,
                                   P() if segment_ids is None else ids_spec,
                                   P() if initial_state is None else state_spec),
                         out_specs=(v_spec, state_spec))(q, k, v, g, beta, segment_ids, initial_state)


def causal_conv(x, w, layout: Layout, segment_ids=None):
    """`gated_delta.causal_conv` of the whole x [b, t, c] (w [c, K], whole on every device) laid out as
    `layout`'s activations, the sequence split over sp (`local_causal_conv` in a shard_map, `manual_axes`; the
    channels whole: they mix q, k and v heads). fp32."""
    _check(layout, x.shape[1])
    axes = manual_axes(layout)
    rows = manual_spec(("batch", "seq"), layout.activations, layout.mesh, x.shape[:2], axes)
    x_spec = P(*(tuple(rows) + (None,) * (3 - len(rows))))
    local = lambda x, w, ids: local_causal_conv(x, w, ids, "sp")
    return jax.shard_map(local, mesh=island_mesh(layout), axis_names=axes, check_vma=False,
                         in_specs=(x_spec, P(), P() if segment_ids is None else rows),
                         out_specs=x_spec)(x, w, segment_ids)
