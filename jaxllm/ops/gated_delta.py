"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) on one device's arrays: a recurrent
form (`recurrent`, a scan over tokens: decode, and the readable reference) and a chunked parallel form
(`chunked`, within-chunk matmuls in WY/UT form and a scan over chunks: training and prefill). Plain JAX.

The recurrence, per (value) head, with a state S [dk, dv] (zero unless `initial_state` gives one):

    S ← exp(g_t) · S                        g_t ≤ 0: the token's log decay
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)        β_t ∈ (0, 1): the delta rule's step, S moves k_t's read towards v_t
    o_t = Sᵀ q_t

i.e. S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ. Conventions are transformers' pure-torch path
(`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` in models/qwen3_next/modeling_qwen3_next.py):
with `use_qk_l2norm` q and k are first L2-normalised over dk (x · rsqrt(Σx² + 1e-6), FLA's `l2norm`), then q
is always scaled by dk^-1/2; everything is computed in fp32 and o is returned in q's dtype, the state in fp32.

Layout: q, k [b, t, hk, dk]; v [b, t, hv, dv]; g, beta [b, t, hv]; state [b, hv, dk, dv]; o [b, t, hv, dv] —
the layout of transformers' functions and of the projections that feed them, so no caller transposes. hv is a
multiple of hk (grouped value heads: each q/k head serves hv/hk consecutive value heads, repeated here like
transformers' `repeat_interleave`). Internally the time (or chunk) axis is moved to the front for the scan.

Chunked form (chunk size C; t padded at the end with k = v = q = 0, g = 0, β = 0 — a padded token neither
decays nor writes the state — and the padding sliced off). Inside a chunk let G_i = Σ_{j≤i} g_j (the chunk's
cumulative log decay) and D_ij = exp(G_i − G_j) for j ≤ i (0 above the diagonal; the exponent is masked
before the exp, so nothing overflows). With S0 the state entering the chunk, the UT transform
(I + A) with A_ij = β_i k_iᵀ k_j D_ij strictly below the diagonal gives (its inverse by forward substitution,
`unit_lower_inverse`)

    u = (I + A)⁻¹ (β v)            the chunk's "new values" if S0 were 0
    w = (I + A)⁻¹ (β k exp(G))     how much of each new value S0 already predicts
    v_new = u − w S0
    o     = (q exp(G)) S0 + ((q kᵀ) ∘ D) v_new                 (D including the diagonal)
    S1    = exp(G_C) S0 + Σ_j (k_j exp(G_C − G_j)) v_newⱼᵀ

u, w and the masked q kᵀ of all chunks are computed at once (batched matmuls and solves), and a `lax.scan`
over the chunks carries S: only the three matmuls with S are sequential.

Packed documents: `resets` [b, t] bool, true at each document's first token, zeroes the state before that
token (equivalently, that token's decay is exp(−∞)); `segment_ids` [b, t] (the batch contract's: one id per
document, padding 0) is turned into resets where the id changes (position 0 is never a reset: the sequence
continues `initial_state`; pass `resets` to drop it). In the recurrent form the carried state is zeroed at a
reset. In the chunked form a reset inside a chunk is exact: with seg_i = the number of resets in the chunk up to
and including i, D_ij is also zeroed where seg_i ≠ seg_j (so A, and hence (I + A)⁻¹, is block diagonal by
document and no within-chunk interaction crosses a document start), the S0 terms (q exp(G) and w) are kept only
for tokens with seg_i = 0 (before the chunk's first reset), and in S1 exp(G_C) S0 is dropped if the chunk has a
reset and only tokens of the chunk's last document (seg_j = seg_C) write. G still sums g across a reset, but
only differences within one document are ever used, so the decay of a document's first token (which acts on a
zero state) has no effect, as in the recurrence.

Memory (per layer, b·hv heads): `recurrent` keeps the state [dk, dv] and the outputs; under `jax.grad` its scan
saves a state per token, O(t·dk·dv) — fine for decode, too much for training. `chunked` holds O(t·C) for D, A
and q kᵀ, O(t·(dk + dv)) for u, w and the inputs, and the state. Under `jax.grad` the chunk scan saves the state
entering every chunk, O(t/C · dk·dv) (t·256 floats per head at dk = dv = 128, C = 64, i.e. more than the O(t·C)
of the within-chunk arrays when dk·dv > C²), besides the within-chunk arrays: still linear in t but not
O(t·C). A custom VJP that keeps only the inputs (and perhaps every k-th state) and recomputes the states in a
reverse pass, as FLA's kernels do, is a later step; not done here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # fp32 matmuls stay fp32 on accelerators (no TF32 / bf16 passes)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """FLA's / transformers' `l2norm` over the last axis: x · rsqrt(Σx² + eps)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def resets_of(segment_ids: jax.Array) -> jax.Array:
    """[b, t] bool: true where a token's segment id differs from the previous token's (never at position 0)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1)


def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm, segment_ids, resets):
    """fp32 inputs with q/k heads repeated to the value heads, q (and k) normalised and scaled; the resets [b, t]
    (none: all false); the entering state [b, hv, dk, dv] fp32 (none: zeros)."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of the key heads ({hk})")
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if hv != hk:
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    b, t, h, dk = k.shape
    if resets is None:
        resets = jnp.zeros((b, t), bool) if segment_ids is None else resets_of(segment_ids)
    state = jnp.zeros((b, h, dk, v.shape[-1]), f32) if initial_state is None else initial_state.astype(f32)
    return q, k, v, g, beta, resets, state


def recurrent(q, k, v, g, beta, initial_state=None, *, use_qk_l2norm: bool = False, segment_ids=None,
              resets=None):
    """The gated delta rule token by token: a `lax.scan` over t carrying the state [b, hv, dk, dv].
    Returns (o [b, t, hv, dv] in q's dtype, final state [b, hv, dk, dv] fp32). One token at a time (decode):
    call with t = 1 and pass the returned state back as `initial_state`."""
    out_dtype = q.dtype
    q, k, v, g, beta, resets, state = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm, segment_ids, resets)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t, r_t = xs  # [b, h, d] / [b, h] / [b]
        s = jnp.where(r_t[:, None, None, None], 0.0, s)
        s = s * jnp.exp(g_t)[..., None, None]
        read = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        s = s + k_t[..., :, None] * (beta_t[..., None] * (v_t - read))[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), state


def chunked(q, k, v, g, beta, chunk: int = 64, initial_state=None, *, use_qk_l2norm: bool = False,
            segment_ids=None, resets=None):
    """The gated delta rule in chunks of `chunk` tokens (WY/UT form within a chunk, a scan over chunks carrying
    the state; see the module docstring). Any t (padded inside to a multiple of `chunk`). Same arguments and
    results as `recurrent`."""
    out_dtype = q.dtype
    q, k, v, g, beta, resets, state = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm, segment_ids, resets)
    b, t, h, _ = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [b, t, h, ...] -> [b, h, n, c, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(x.shape[:2] + (n, chunk) + x.shape[3:])

    resets = jnp.pad(resets, [(0, 0), (0, pad)]).reshape(b, 1, n, chunk)
    parts = _within_chunks(*(chunks(x) for x in (q, k, v, g, beta)), resets)
    state, o = _across_chunks(state, parts)  # o [n, b, h, c, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2).astype(out_dtype), state


def _forward_substitution(a):
    """(I + a)⁻¹ row by row: row i is e_i − Σ_{j<i} a_ij · row j (a strictly lower [..., c, c])."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)

    def row(i, t):
        return t.at[..., i, :].set(eye[i] - jnp.einsum("...j,...jk->...k", a[..., i, :], t, precision=HIGHEST))

    return jax.lax.fori_loop(0, c, row, jnp.zeros_like(a))


@jax.custom_vjp
def unit_lower_inverse(a):
    """(I + a)⁻¹ for a strictly lower triangular [..., c, c] (the UT transform's), by forward substitution in a loop
    of c steps, with the inverse's own backward (d(M⁻¹) = −M⁻¹ dM M⁻¹: one product, nothing saved per step). Not
    LAPACK's batched triangular solve: its XLA:CPU custom call waits on the thread pool it queues its batches on,
    and deadlocks when both pool threads do (seen on two cores at t = 1,024 and 2,048)."""
    return _forward_substitution(a)


def _inverse_forward(a):
    t = _forward_substitution(a)
    return t, t


def _inverse_backward(t, dt):
    da = -jnp.einsum("...ji,...jk,...lk->...il", t, dt, t, precision=HIGHEST)  # −Tᵀ dT Tᵀ
    return (jnp.tril(da, -1),)  # only a's strictly lower entries are inputs


unit_lower_inverse.defvjp(_inverse_forward, _inverse_backward)


def _within_chunks(q, k, v, g, beta, resets):
    """Every chunk's own products, all chunks at once ([b, h, n, c, ...]; `resets` [b, 1, n, c]): u and w of the UT
    transform, the decayed q·kᵀ, the queries that read the entering state, the keys that write the leaving one
    and the factor the entering state survives by."""
    c, dv = q.shape[-2], v.shape[-1]
    seg = jnp.cumsum(resets.astype(jnp.int32), axis=-1)  # [b, 1, n, c]: resets in the chunk up to here
    first = seg == 0  # tokens that still see the state entering the chunk
    last = seg == seg[..., -1:]  # tokens of the chunk's last document: those that write the leaving state
    carries = ~resets.any(axis=-1)  # [b, 1, n]: the entering state survives the chunk
    cum = jnp.cumsum(g, axis=-1)  # [b, h, n, c]: G
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = causal & (seg[..., :, None] == seg[..., None, :])  # [b, 1, n, c, c]
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # D, 0 where masked
    kb = k * beta[..., None]
    a = jnp.einsum("...ik,...jk->...ij", kb, k, precision=HIGHEST) * decay
    a = jnp.where(causal & ~jnp.eye(c, dtype=bool), a, 0.0)  # A, strictly lower
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.where(first, jnp.exp(cum), 0.0)[..., None]], axis=-1)
    uw = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(a), rhs, precision=HIGHEST)
    attn = jnp.einsum("...ik,...jk->...ij", q, k, precision=HIGHEST) * decay
    q_in = q * jnp.where(first, jnp.exp(cum), 0.0)[..., None]  # reads S0
    k_out = k * jnp.where(last, jnp.exp(cum[..., -1:] - cum), 0.0)[..., None]  # writes S1
    keep = jnp.where(carries, jnp.exp(cum[..., -1]), 0.0)  # [b, h, n]
    return uw[..., :dv], uw[..., dv:], attn, q_in, k_out, keep


def _across_chunks(state, parts):
    """The scan over chunks carrying the state [b, h, dk, dv]: the only sequential work. Returns (the final state,
    o [n, b, h, c, dv])."""
    def step(s, xs):
        u_c, w_c, attn_c, q_c, k_c, keep_c = xs
        v_new = u_c - jnp.einsum("bhik,bhkv->bhiv", w_c, s, precision=HIGHEST)
        o = (jnp.einsum("bhik,bhkv->bhiv", q_c, s, precision=HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", attn_c, v_new, precision=HIGHEST))
        s = keep_c[..., None, None] * s + jnp.einsum("bhjk,bhjv->bhkv", k_c, v_new, precision=HIGHEST)
        return s, o

    return jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in parts))


def causal_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None, window=None,
                window_ids=None) -> jax.Array:
    """transformers' `causal_conv1d_fn` (the short convolution before Gated DeltaNet's recurrence) without bias and activation, channels last: x [b, t, c], w [c, K];
    y_t = Σ_j w[:, j] · x_{t−(K−1)+j}. The K − 1 inputs before position 0 are `window` [b, K − 1, c] (generation's
    carried inputs, or a context-parallel rank's halo; none: zeros); with `segment_ids` [b, t] an input of an
    earlier document reads as zero (`window_ids` [b, K − 1] the window's ids; none: never the same). fp32."""
    t, kernel = x.shape[1], w.shape[1]
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    if window is None:
        window = jnp.zeros((x.shape[0], kernel - 1, x.shape[2]), jnp.float32)
    xp = jnp.concatenate([window.astype(jnp.float32), x], axis=1)
    if segment_ids is not None:
        if window_ids is None:
            window_ids = jnp.full((x.shape[0], kernel - 1), -1, segment_ids.dtype)
        sp = jnp.concatenate([window_ids.astype(segment_ids.dtype), segment_ids], axis=1)
    y = jnp.zeros_like(x)
    for j in range(kernel):  # tap j reads lag kernel − 1 − j
        xs = xp[:, j:j + t]
        if segment_ids is not None and j < kernel - 1:
            xs = jnp.where((sp[:, j:j + t] == segment_ids)[..., None], xs, 0.0)
        y = y + xs * w[:, j]
    return y
