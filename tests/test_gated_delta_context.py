"""Context parallelism for the gated delta rule (`jaxllm/parallel/gated_delta_context.py`, fp32, fake CPU devices).

The sequence split over sp ∈ {2, 4}, and dp2×sp2, sp2×tp2: the outputs, the final state and the gradients of
q, k, v, g, β (and the initial state) equal one device's `gated_delta.chunked`, with packed documents starting
exactly at a rank boundary and inside a rank (and rows that carry the state across every rank boundary). The
local pass's transition operator against the product of the tokens' transitions (zero after a reset); the
convolution's halo against the whole-sequence `causal_conv`; the compiled program's collectives (one gather
of [M | B], the permute of one segment id, nothing that moves q, k or v); zig-zag order refused.

Mutants tried by hand, each failing here: the correction o0 + reads·S_in dropped, the fold over the ranks'
maps run in reverse order, or M left out of the fold (equivalence fails at sp = 2 and 4); the reset at a rank's
first token not derived from the previous rank's last segment id (equivalence with documents and the
collectives test fail); the halo's segment ids ignored (the conv test fails).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jaxllm.mesh import MESH_AXES
from jaxllm.ops.gated_delta import causal_conv
from jaxllm.ops import gated_delta
from jaxllm.parallel import gated_delta_context as gdc
from jaxllm.plan.hlo import executed_collectives
from jaxllm.sharding import Layout, param_rules

B, HK, HV, DK, DV = 2, 2, 4, 8, 16
CHUNK = 16
TOL = 1e-5  # of each tensor's max abs


def layout(sp: int, dp: int = 1, tp: int = 1, order=None) -> Layout:
    devices = np.asarray(jax.devices()[:dp * sp * tp]).reshape(1, dp, 1, 1, sp, tp)
    mesh = Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Layout(mesh, param_rules(False), sequence_order=order)


def inputs(t: int, seed: int = 0):
    """q, k, v, g, β with realistic magnitudes: |k| about 1, g = −softplus(x − 3) (a weak decay, about exp(−0.05)
    a token, so the state entering a rank still matters at its end), β = sigmoid(x); an initial state; the
    cotangents of o and of the final state."""
    r = np.random.default_rng(seed)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q = f32(r.normal(size=(B, t, HK, DK)))
    k = f32(r.normal(size=(B, t, HK, DK)) / np.sqrt(DK))
    v = f32(r.normal(size=(B, t, HV, DV)))
    g = f32(-np.logaddexp(0.0, r.normal(size=(B, t, HV)) - 3.0))
    beta = f32(1 / (1 + np.exp(-r.normal(size=(B, t, HV)))))
    state = f32(r.normal(size=(B, HV, DK, DV)) * 0.5)
    return (q, k, v, g, beta), state, (f32(r.normal(size=(B, t, HV, DV))), f32(r.normal(size=(B, HV, DK, DV))))


def documents(t: int, sp: int):
    """[B, t] int32: row 0 starts documents exactly at the first rank boundary and 5 tokens into the next rank,
    and ends in padding (id 0); row 1 has one start inside rank 0, so its state crosses every rank boundary."""
    per = t // sp
    ids = np.ones((B, t), np.int32)
    ids[0, per:] = 2
    ids[0, per + 5:] = 3
    ids[0, t - 3:] = 0
    ids[1, per // 2:] = 2
    return jnp.asarray(ids)


def _loss(run, xs, segment_ids, state, cts):
    o, final = run(*xs, segment_ids, state)
    return jnp.sum(o * cts[0]) + jnp.sum(final * cts[1]), (o, final)


def results(run, xs, segment_ids, state, cts):
    """(o, final state, gradients of q, k, v, g, β and the initial state) of a scalar loss of o and the final
    state, in one compiled program."""
    grad = jax.value_and_grad(_loss, argnums=(1, 3), has_aux=True)
    f = jax.jit(lambda xs, ids, s, cts: grad(lambda *a: run(*a), xs, ids, s, cts))
    (_, (o, final)), (dxs, ds) = f(xs, segment_ids, state, cts)
    return o, final, dxs + ((ds,) if state is not None else ())


def assert_close(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        scale = float(jnp.max(jnp.abs(b)))
        err = float(jnp.max(jnp.abs(a - b)))
        assert scale > 0 and err <= TOL * scale, f"{what}[{i}]: max |a−b| {err:.3g} against max |b| {scale:.3g}"


CASES = {  # name: (sp, dp, tp, tokens per rank, documents, initial state, use_qk_l2norm)
    "sp2": (2, 1, 1, 32, True, False, True),
    "sp2-one-document": (2, 1, 1, 32, False, True, False),
    "sp4": (4, 1, 1, 48, True, True, False),
    "dp2xsp2": (2, 2, 1, 32, True, True, True),
    "sp2xtp2": (2, 1, 2, 32, True, True, False),
}


@pytest.mark.parametrize("case", [c if c == "sp2" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_matches_one_device(case):
    sp, dp, tp, per, docs, initial, l2 = CASES[case]
    t = sp * per
    xs, state, cts = inputs(t)
    state = state if initial else None
    ids = documents(t, sp) if docs else None
    lay = layout(sp, dp, tp)
    island = lambda *a: gdc.gated_delta_rule(*a[:5], lay, a[5], a[6], chunk=CHUNK, use_qk_l2norm=l2)
    one = lambda *a: gated_delta.chunked(*a[:5], CHUNK, a[6], use_qk_l2norm=l2, segment_ids=a[5])
    got, want = results(island, xs, ids, state, cts), results(one, xs, ids, state, cts)
    assert_close(got[:2], want[:2], "o, final state")
    assert_close(got[2], want[2], "gradients of q, k, v, g, beta, initial state")


@pytest.mark.slow
def test_transition_operator():
    """The local pass's [M | B]: M the product of exp(g_t)(I − β_t k_t k_tᵀ) over the tokens (float64 NumPy),
    zero when a document starts inside; B and o0 one device's chunked form from a zero state."""
    (q, k, v, g, beta), _, _ = inputs(40, seed=1)
    resets = np.zeros((B, 40), bool)
    resets[1, 17] = True
    o0, reads, ends = jax.jit(gdc.local_pass, static_argnums=(6, 7))(q, k, v, g, beta, jnp.asarray(resets), CHUNK,
                                                                     False)
    kk = np.repeat(np.asarray(k, np.float64), HV // HK, axis=2)
    want = np.broadcast_to(np.eye(DK), (B, HV, DK, DK)).copy()
    for i in range(40):
        step = np.exp(np.asarray(g[:, i], np.float64))[..., None, None] * (
            np.eye(DK) - np.asarray(beta[:, i], np.float64)[..., None, None]
            * kk[:, i, :, :, None] * kk[:, i, :, None, :])
        want = step @ want
    m = np.asarray(ends[..., :DK])
    assert np.abs(m[0] - want[0]).max() <= TOL * np.abs(want[0]).max()
    assert np.all(m[1] == 0.0)
    o_ref, b_ref = jax.jit(functools.partial(gated_delta.chunked, chunk=CHUNK))(q, k, v, g, beta,
                                                                                resets=jnp.asarray(resets))
    assert_close((o0, ends[..., DK:]), (o_ref, b_ref), "o0, B")
    assert reads.shape == (B, 40, HV, DK)


@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_conv_halo(sp):
    """The convolution over sp equals the whole sequence's (values and gradients of x and w), with a document
    starting at a rank boundary, one a token after the next (its window would reach back across it), and
    without documents."""
    t, c, kernel = 16 * sp, 6, 4
    r = np.random.default_rng(2)
    x, w, ct = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, t, c), (c, kernel), (B, t, c)))
    ids = np.ones((B, t), np.int32)
    ids[0, 16:] = 2
    ids[1, 17:] = 2
    lay = layout(sp)
    for seg in (jnp.asarray(ids), None):
        loss = lambda conv: jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(conv(x, w) * ct), argnums=(0, 1)))
        (y, gy) = loss(lambda x, w: gdc.causal_conv(x, w, lay, seg))(x, w)
        (y1, gy1) = loss(lambda x, w: causal_conv(x, w, seg))(x, w)
        assert_close((jnp.reshape(y, (1,)),) + gy, (jnp.reshape(y1, (1,)),) + gy1, f"conv, documents={seg is not None}")
    y = jax.jit(lambda x: gdc.causal_conv(x, w, lay, jnp.asarray(ids)))(x)
    assert_close((y,), (jax.jit(causal_conv)(x, w, jnp.asarray(ids)),), "conv outputs")


@pytest.mark.slow
@pytest.mark.parametrize("sp,dp,tp", [(2, 1, 1), (2, 1, 2)])
def test_collectives(sp, dp, tp):
    """The compiled forward holds what the module docstring says and nothing more: one all-gather of every
    rank's [M | B] (sp·b·hv·dk·(dk + dv)·4 bytes, per device) and one collective-permute of b int32 segment ids;
    none of q, k or v moves. The backward adds the gather's transpose (a reduce-scatter; on CPU it may show as
    an all-reduce) of the same [M | B]."""
    t = sp * 32
    xs, state, cts = inputs(t)
    lay = layout(sp, dp, tp)
    ids = documents(t, sp)
    run = lambda *a: gdc.gated_delta_rule(*a[:5], lay, a[5], chunk=CHUNK)
    hv = HV // tp
    gathered = sp * B * hv * DK * (DK + DV) * 4
    forward = executed_collectives(jax.jit(run).lower(*xs, ids).compile().as_text())[0]
    assert sorted((o["kind"], o["bytes"]) for o in forward) == sorted(
        [("all-gather", gathered), ("collective-permute", B * 4)]), forward
    grad = jax.jit(jax.grad(lambda xs, ids: _loss(lambda *a: run(*a[:6]), xs, ids, None, cts)[0]))
    backward = executed_collectives(grad.lower(xs, ids).compile().as_text())[0]
    kinds = sorted(o["kind"] for o in backward)
    assert kinds in (sorted(["all-gather", "collective-permute", "reduce-scatter"]),
                     sorted(["all-gather", "collective-permute", "all-reduce"])), backward
    assert max(o["bytes"] for o in backward) == gathered, backward  # nothing larger than [M | B] moves


def test_refuses_zigzag_and_uneven_splits():
    xs, _, _ = inputs(64)
    with pytest.raises(ValueError, match="zig-zag"):
        gdc.gated_delta_rule(*xs, layout(2, order=tuple(range(64))))
    odd = tuple(x[:, :63] for x in xs)
    with pytest.raises(ValueError, match="divide"):
        gdc.gated_delta_rule(*odd, layout(2))
