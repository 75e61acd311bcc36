"""The gated delta rule (`jaxllm/ops/gated_delta.py`): its chunked and recurrent forms against a float64 NumPy
loop written here (outputs, final states, and gradients from a hand-derived backward-through-time that is itself
checked by finite differences), packed documents, one-token decode, and transformers' pure-torch functions."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from harness import tiers
from jaxllm.ops import gated_delta

B, H, DK, DV = 2, 2, 8, 12
EPS = 1e-6  # l2norm's


def inputs(t, seed=0, hk=H, hv=H, b=B, shift=-3.0):
    """Random fp32 q, k [b, t, hk, dk], v [b, t, hv, dv], g = -softplus(x - 3), beta = sigmoid(x) [b, t, hv].
    k has norm about 1, so that the recurrence without l2norm stays contracting (β|k|² < 2 mostly). The decay is
    weak (about exp(-0.06) a token) so that the state entering a chunk still matters at its end (with
    -softplus(x) it fades by about e^-13 over 16 tokens, and a wrong carry between chunks or across a document
    start would hide below the tolerance). `shift` = 2: a strong decay, exp(G) underflowing to 0 within a chunk."""
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, hk, DK))
    k = r.normal(size=(b, t, hk, DK)) / np.sqrt(DK)
    v = r.normal(size=(b, t, hv, DV))
    g = -np.logaddexp(0.0, r.normal(size=(b, t, hv)) + shift)
    beta = 1 / (1 + np.exp(-r.normal(size=(b, t, hv))))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


# ---------------------------------------------------------------- the float64 NumPy reference


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + EPS)


def _l2_backward(x, dy):
    r = 1 / np.sqrt((x * x).sum(-1, keepdims=True) + EPS)
    return r * dy - r ** 3 * x * (x * dy).sum(-1, keepdims=True)


def reference(q, k, v, g, beta, state=None, resets=None, l2norm=False, keep=False):
    """The plain recurrence in float64, a Python loop over t; q, k already with the value heads' count.
    Returns (o [b, t, h, dv], final state [b, h, dk, dv]) and, with keep, the per-token tensors the backward needs."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    if l2norm:
        q, k = _l2(q), _l2(k)
    q = q * q.shape[-1] ** -0.5
    b, t, h, dk = k.shape
    s = np.zeros((b, h, dk, v.shape[-1])) if state is None else np.asarray(state, np.float64)
    o, saved = np.zeros(v.shape), []
    for i in range(t):
        if resets is not None:
            s = np.where(resets[:, i, None, None, None], 0.0, s)
        s_a = np.exp(g[:, i])[..., None, None] * s
        read = np.einsum("bhkv,bhk->bhv", s_a, k[:, i])
        delta = beta[:, i, :, None] * (v[:, i] - read)
        s = s_a + k[:, i, :, :, None] * delta[:, :, None, :]
        o[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i])
        saved.append((s_a, read, delta, s))
    return (o, s, saved) if keep else (o, s)


def reference_grads(q, k, v, g, beta, d_o, d_state, state=None, resets=None, l2norm=False):
    """Hand-derived backward through time of `reference` for the loss Σ o·d_o + Σ S_T·d_state: the gradients of
    q, k, v, g, beta and the initial state, float64."""
    q0, k0 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    _, _, saved = reference(q, k, v, g, beta, state, resets, l2norm, keep=True)
    qs, kn = (_l2(q0), _l2(k0)) if l2norm else (q0, k0)
    scale = q0.shape[-1] ** -0.5
    qs = qs * scale
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    dq, dk, dv = np.zeros(qs.shape), np.zeros(kn.shape), np.zeros(v.shape)
    dg, dbeta = np.zeros(g.shape), np.zeros(beta.shape)
    ds = np.asarray(d_state, np.float64).copy()
    for i in reversed(range(q0.shape[1])):
        s_a, read, delta, s = saved[i]
        ds = ds + qs[:, i, :, :, None] * d_o[:, i, :, None, :]  # o = Sᵀ q
        dq[:, i] = np.einsum("bhkv,bhv->bhk", s, d_o[:, i])
        ds_a = ds.copy()  # S = S_a + k δᵀ
        dk[:, i] = np.einsum("bhkv,bhv->bhk", ds, delta)
        d_delta = np.einsum("bhkv,bhk->bhv", ds, kn[:, i])
        dbeta[:, i] = (d_delta * (v[:, i] - read)).sum(-1)  # δ = β (v − read)
        dv[:, i] = beta[:, i, :, None] * d_delta
        d_read = -beta[:, i, :, None] * d_delta
        ds_a += kn[:, i, :, :, None] * d_read[:, :, None, :]  # read = S_aᵀ k
        dk[:, i] += np.einsum("bhkv,bhv->bhk", s_a, d_read)
        dg[:, i] = (s_a * ds_a).sum((-1, -2))  # S_a = exp(g) S
        ds = np.exp(g[:, i])[..., None, None] * ds_a
        if resets is not None:
            ds = np.where(resets[:, i, None, None, None], 0.0, ds)
    dq = dq * scale
    if l2norm:
        dq, dk = _l2_backward(q0, dq), _l2_backward(k0, dk)
    return dq, dk, dv, dg, dbeta, ds


def close(got, want, tol=1e-5, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, size = np.abs(got - want).max(), np.abs(want).max()
    assert err <= tol * size, f"{what}: max abs error {err:.3g} > {tol} × {size:.3g}"


@functools.cache
def jitted(form, chunk=64, l2norm=False):
    if form == "chunked":
        return jax.jit(lambda *a, state=None, **kw: gated_delta.chunked(*a, chunk=chunk, initial_state=state,
                                                                         use_qk_l2norm=l2norm, **kw))
    return jax.jit(lambda *a, state=None, **kw: gated_delta.recurrent(*a, initial_state=state, use_qk_l2norm=l2norm,
                                                                       **kw))


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("l2norm", [False, True])
def test_reference_backward_matches_finite_differences(l2norm):
    """The hand-derived backward (the gradient tests' reference) against central differences, float64."""
    r = np.random.default_rng(1)
    args = [x.astype(np.float64) for x in inputs(10, seed=1, b=1)]
    state = r.normal(size=(1, H, DK, DV))
    resets = np.zeros((1, 10), bool)
    resets[0, 6] = True
    d_o, d_state = r.normal(size=(1, 10, H, DV)), r.normal(size=(1, H, DK, DV))

    def loss(*xs):
        o, s = reference(*xs[:5], xs[5], resets, l2norm)
        return (o * d_o).sum() + (s * d_state).sum()

    grads = reference_grads(*args, d_o, d_state, state, resets, l2norm)
    point = [*args, state]
    for i, grad in enumerate(grads):
        direction = r.normal(size=point[i].shape)
        plus, minus = list(point), list(point)
        plus[i], minus[i] = point[i] + 1e-6 * direction, point[i] - 1e-6 * direction
        numeric = (loss(*plus) - loss(*minus)) / 2e-6
        assert abs(numeric - (grad * direction).sum()) <= 1e-6 * max(1.0, abs(numeric)), i


@pytest.mark.parametrize("t,chunk,shift", tiers([(50, 16, -3), (100, 16, -3), (50, 64, -3), (100, 64, -3), (100, 64, 2)],
                                                {(50, 16, -3), (100, 64, 2)}))
def test_forms_match_reference(t, chunk, shift):
    """chunked == recurrent == the float64 loop (outputs and final state), from a zero and a given state; shift 2:
    a decay of about e^-2.2 a token, whose within-chunk products underflow fp32 (no inf or nan may come of it)."""
    q, k, v, g, beta = inputs(t, seed=t + chunk, shift=shift)
    state = np.random.default_rng(2).normal(size=(B, H, DK, DV)).astype(np.float32)
    for initial in (None, state):
        want_o, want_s = reference(q, k, v, g, beta, initial)
        for form in ("chunked", "recurrent"):
            o, s = jitted(form, chunk)(q, k, v, g, beta, state=initial)
            close(o, want_o, what=f"{form} o")
            close(s, want_s, what=f"{form} state")


@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_gradients_match_reference(l2norm):
    """jax.grad through `chunked` (fp32, t = 50, chunk 16, a given initial state, one document start inside a
    chunk) against the float64 backward-through-time of the plain recurrence, for q, k, v, g, beta and the state."""
    t = 50
    q, k, v, g, beta = inputs(t, seed=3)
    r = np.random.default_rng(4)
    state = r.normal(size=(B, H, DK, DV)).astype(np.float32)
    resets = np.zeros((B, t), bool)
    resets[1, 21] = True
    d_o, d_state = r.normal(size=(B, t, H, DV)), r.normal(size=(B, H, DK, DV))
    want = reference_grads(q, k, v, g, beta, d_o, d_state, state, resets, l2norm)

    def loss(q, k, v, g, beta, state):
        o, s = gated_delta.chunked(q, k, v, g, beta, chunk=16, initial_state=state, use_qk_l2norm=l2norm,
                                   resets=resets)
        return (o * d_o.astype(np.float32)).sum() + (s * d_state.astype(np.float32)).sum()

    got = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, state)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        close(a, b, what=f"d{name}")


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_documents_equal_each_alone(form):
    """Documents packed in a row (resets, or segment ids) give each document's outputs as if run alone, starts
    inside a chunk included (chunk 16: starts at 23 and 29, two in one chunk; at 32, a chunk's first token; at 42,
    in the chunk before the padded last one); the final state is the last document's alone."""
    lengths = (23, 6, 3, 10, 8)  # starts at 0, 23, 29, 32, 42
    t = sum(lengths)
    q, k, v, g, beta = inputs(t, seed=5)
    starts = np.cumsum((0,) + lengths[:-1])
    resets = np.zeros((B, t), bool)
    resets[:, starts] = True
    segment_ids = np.broadcast_to(np.cumsum(resets[0]), (B, t)).astype(np.int32)
    fn = jitted(form, 16)
    o_res, s_res = fn(q, k, v, g, beta, resets=resets)
    o_seg, s_seg = fn(q, k, v, g, beta, segment_ids=segment_ids)
    want_o, want_s = reference(q, k, v, g, beta, resets=resets)
    close(o_res, want_o, what="o vs reference")
    close(s_res, want_s, what="state vs reference")
    np.testing.assert_array_equal(np.asarray(o_seg), np.asarray(o_res))
    for start, length in zip(starts, lengths):
        part = [x[:, start:start + length] for x in (q, k, v, g, beta)]
        o_alone, s_alone = reference(*part)
        close(o_res[:, start:start + length], o_alone, what=f"document at {start}")
    close(s_res, s_alone, what="final state")


@pytest.mark.parametrize("l2norm,hk,hv", tiers([(False, 2, 2), (True, 2, 2), (True, 2, 4)], {(True, 2, 4)}))
def test_matches_transformers(l2norm, hk, hv):
    """Against transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` (fp32, t = 50,
    chunk 64, a given initial state; hv = 4: each of 2 q/k heads serves 2 consecutive value heads)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = inputs(50, seed=6, hk=hk, hv=hv)
    state = np.random.default_rng(7).normal(size=(B, hv, DK, DV)).astype(np.float32)
    tq, tk, tv, tg, tbeta, tstate = (torch.from_numpy(x) for x in (q, k, v, g, beta, state))
    for form, theirs in (("chunked", hf.torch_chunk_gated_delta_rule),
                         ("recurrent", hf.torch_recurrent_gated_delta_rule)):
        assert theirs.__module__ == hf.__name__, f"{theirs} is not transformers' torch path"
        want_o, want_s = theirs(tq, tk, tv, tg, tbeta, initial_state=tstate, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2norm)
        o, s = jitted(form, 64, l2norm)(q, k, v, g, beta, state=state)
        close(o, want_o.numpy(), what=f"{form} o")
        close(s, want_s.numpy(), what=f"{form} state")


def test_decode_one_token_at_a_time():
    """`recurrent` one token at a time, the state carried between calls, after a `chunked` prefill, equals the
    whole sequence at once."""
    t, prefill = 40, 29
    q, k, v, g, beta = inputs(t, seed=8)
    want_o, want_s = jitted("chunked", 16)(q, k, v, g, beta)
    o, state = jitted("chunked", 16)(*(x[:, :prefill] for x in (q, k, v, g, beta)))
    outs = [np.asarray(o)]
    step = jitted("recurrent")
    for i in range(prefill, t):
        o, state = step(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), state=state)
        outs.append(np.asarray(o))
    close(np.concatenate(outs, axis=1), want_o, what="o")
    close(state, want_s, what="state")


def test_the_chunked_form_calls_no_lapack_solve():
    """The UT transform's inverse is forward substitution in XLA, forward and backward: no LAPACK triangular solve
    (jaxlib's batched trsm custom call deadlocked the step on two cores, waiting on its own thread pool)."""
    q, k, v, g, beta = inputs(40, seed=5)
    loss = lambda *x: gated_delta.chunked(*x, chunk=16, use_qk_l2norm=True)[0].sum()  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, k, v, g, beta).compile().as_text()
    assert "custom-call" not in hlo or "trsm" not in hlo.lower(), "a LAPACK solve in the chunked form"
    assert "while" in hlo  # the substitution's loop (and the chunks' scan) is there
