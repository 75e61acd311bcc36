"""JAX's Pallas attention kernels (`jaxllm/ops/pallas_attention.py`: Splash on TPU, Triton on GPU) in
interpret mode on CPU against test_attention_kernels.py's float64 reference: the output and dq, dk, dv
within 1e-5 of each tensor's largest value, for every case the kernel `supports`; every other case
refused by `supports` with the one-line reason expected. Sequences are 128 or 256 long (Splash's blocks
are multiples of 128; the 256-long cases run in blocks of 128, so several blocks, and segments and
windows across block edges); the packed rows restart positions per document, which is exactly when the
kernels' index-causal mask equals the position rule. And each kernel exported for its platform
(`jax.export`, no accelerator needed), forward and gradient, with its custom call in the program.

Interpret mode is slow (1 to 4 s a case): one case per kernel is in the fast tier.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.ops.masking import Masking
from jaxllm.ops.pallas_attention import IMPLEMENTATIONS, pallas_gpu, pallas_tpu, supports
from test_attention_kernels import assert_near_reference, random_rows, reference

KERNELS = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}

CASES = {  # name: (t, q heads, kv heads, dk, dv, window, softcap, q scale, layout, block)
    "causal": (128, 4, 4, 8, 8, 0, 0.0, 1.0, "plain", None),
    "causal256": (256, 2, 2, 8, 8, 0, 0.0, 1.0, "plain", 128),
    "packed": (128, 4, 4, 8, 8, 0, 0.0, 1.0, "packed", None),
    "packed_gqa": (256, 4, 2, 8, 8, 0, 0.0, 1.0, "packed", 128),
    "zigzag": (128, 4, 4, 8, 8, 0, 0.0, 1.0, "zigzag", None),
    "short": (48, 4, 4, 8, 8, 0, 0.0, 1.0, "plain", None),
    "window1": (128, 4, 2, 8, 8, 1, 0.0, 1.0, "plain", None),
    "window17": (256, 4, 2, 8, 8, 17, 0.0, 1.0, "packed", 128),
    "window_ge_t": (128, 4, 2, 8, 8, 200, 0.0, 1.0, "plain", None),
    "softcap30": (128, 4, 2, 8, 8, 0, 30.0, 12.0, "plain", None),
    "softcap50_window": (128, 4, 2, 8, 8, 17, 50.0, 16.0, "packed", None),
    "gqa8to2": (128, 8, 2, 8, 8, 0, 0.0, 1.0, "packed", None),
    "mqa": (128, 8, 1, 8, 8, 0, 0.0, 1.0, "plain", None),
    "v_dim": (128, 4, 2, 16, 8, 0, 0.0, 1.0, "plain", None),  # latent attention's: values narrower than keys
    "v_wider": (128, 4, 2, 8, 16, 0, 0.0, 1.0, "plain", None),
}
FAST = {"pallas_tpu": "softcap50_window", "pallas_gpu": "v_dim"}
REFUSED = {  # (case, kernel): what the reason must say; every other pair must be supported
    ("zigzag", "pallas_tpu"): "custom positions", ("zigzag", "pallas_gpu"): "custom positions",
    ("short", "pallas_tpu"): "multiples of 128",
    **{(c, "pallas_gpu"): "no sliding window" for c in ("window1", "window17", "window_ge_t", "softcap50_window")},
    ("softcap30", "pallas_gpu"): "no soft cap",
    ("v_wider", "pallas_gpu"): "no wider than keys",
}


def inputs(case: str):
    """(q, k, v, d_out), (q_pos, k_pos, q_seg, k_seg), masking, positions_are_index, from
    test_attention_kernels' rows (zig-zag positions are not the index)."""
    t, h, kv, dk, dv, window, softcap, q_scale, layout, _ = CASES[case]
    arrays, ints = random_rows(case, t, h, kv, dk, dv, q_scale, layout)
    return arrays, ints, Masking(window, softcap), layout != "zigzag"


def _param(case, impl):
    marks = () if FAST[impl] == case or (case, impl) in REFUSED else (pytest.mark.slow,)
    return pytest.param(case, impl, marks=marks, id=f"{impl}-{case}")


@pytest.mark.parametrize("case,impl", [_param(c, i) for i in IMPLEMENTATIONS for c in CASES])
def test_fp32_matches_float64_reference_or_is_refused(case, impl):
    (q, k, v, d_out), ints, masking, positions_are_index = inputs(case)
    reason = supports(impl, masking, q.shape, k.shape, v.shape, positions_are_index)
    if (case, impl) in REFUSED:
        assert reason and "\n" not in reason and REFUSED[case, impl] in reason, reason
        return
    assert reason is None, reason
    block = CASES[case][-1]
    f = lambda q, k, v: KERNELS[impl](q, k, v, *ints, masking, interpret=True, block=block)
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    got = (out, *vjp(d_out))
    want = reference(q, k, v, *map(np.asarray, ints), d_out, masking.window, masking.softcap)
    assert out.dtype == q.dtype
    assert_near_reference(got, want, f"{impl} {case}")


def test_supports_refuses_what_no_shape_case_shows():
    q, k = (2, 128, 4, 8), (2, 128, 2, 8)
    assert supports("pallas_tpu", Masking(), q, k, k, None) is not None  # positions not known: a no
    assert "not one of" in supports("flash", Masking(), q, k, k, True)
    assert "self-attention" in supports("pallas_gpu", Masking(), q, (2, 256, 2, 8), (2, 256, 2, 8), True)
    assert supports("pallas_tpu", Masking(), q, (2, 256, 2, 8), (2, 256, 2, 8), True) is None
    assert "fixed at trace time" in supports("pallas_tpu", Masking(window=jnp.int32(3)), q, k, k, True)


EXPORTS = {"pallas_tpu": ("tpu", "tpu_custom_call", []),
           "pallas_gpu": ("cuda", "__gpu$xla.gpu.triton",
                          [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_exports_for_its_platform_with_its_kernel(impl):
    """Forward and gradient lowered for the real platform (interpret=False) from this CPU machine."""
    platform, target, disabled = EXPORTS[impl]
    (q, k, v, _), ints, _, _ = inputs("packed_gqa")
    masking = Masking(window=0 if impl == "pallas_gpu" else 64, softcap=0.0 if impl == "pallas_gpu" else 30.0)
    f = lambda q, k, v: KERNELS[impl](q, k, v, *ints, masking)
    grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for fn in (f, grad):
        exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(q, k, v)
        assert target in exported.mlir_module(), f"{impl}: no {target} in the exported {platform} program"
