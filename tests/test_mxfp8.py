"""MXFP8 (`precision.matmul = "mxfp8"`, `jaxllm/ops/mxfp8.py`): the OCP microscaling format.

- The emulated product and both gradients equal a NumPy reference written here (E4M3 in blocks of 32 along each
  contraction, scale 2^⌈log2(amax / 448)⌉ in float64, ml_dtypes' rounding) within 1e-5 · max|reference|, for a
  contraction not a multiple of 32, fp32 and bf16 inputs.
- Its blocks and scales are JAX's own MX quantization's (`jax.nn.scaled_dot_general`'s mxfp8 configuration).
- The train step built for CUDA calls cuDNN's block-scaled dot (`__op$block_scaled_dot`) and the CPU one does not;
  a tiny LLaMA's loss is within 2% of the compute dtype's; a tensor-parallel width that does not split into 32s is
  refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import harness as H
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.mesh import make_mesh
from jaxllm.models import transformer
from jaxllm.ops import fp8, mxfp8
from jaxllm.trainer.step import make_step_fns

BLOCK = 32


def blocked(a: np.ndarray, axis: int) -> np.ndarray:
    """a rounded through E4M3 in blocks of 32 along `axis` (zero-padded), each block scaled by the power of two
    2^⌈log2(amax / 448)⌉ (float64 values)."""
    a = np.moveaxis(a.astype(np.float64), axis, -1)
    n = a.shape[-1]
    t = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -n % BLOCK)]).reshape(*a.shape[:-1], -1, BLOCK)
    amax = np.abs(t).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448.0)), 1.0)
    q = np.clip(t / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.moveaxis((q * scale).reshape(*a.shape[:-1], -1)[..., :n], -1, axis)


def reference(x, w, g):
    """y = x·w for x [rows, tokens, K], w [K, N], and its gradients for g: each operand blocked along the
    contraction of its product (for w's gradient the tokens of all rows in a row)."""
    rows, tokens = x.shape[:2]
    flat_x, flat_g = x.reshape(rows * tokens, -1), g.reshape(rows * tokens, -1)
    y = blocked(x, -1) @ blocked(w, 0)
    dx = blocked(g, -1) @ blocked(w, 1).T
    dw = blocked(flat_x, 0).T @ blocked(flat_g, 0)
    return y, dx, dw


def mx_product(x, w, g):
    with fp8.use(fp8.Coverage({"mlp"}, "mxfp8")):
        y, vjp = jax.vjp(lambda a, b: fp8.einsum("mlp", "btk,kn->btn", a, b, jnp.float32), x, w)
        return (y, *vjp(g.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", H.tiers(["float32", "bfloat16"], fast=("bfloat16",)))
def test_the_emulated_product_and_its_gradients_equal_a_numpy_reference(dtype):
    rng = np.random.default_rng(0)
    # each element also scaled by 10^u, u in [-5, 0]: a block's small values fall among E4M3's subnormals, where
    # the power of two chosen for the block shows (in the normal range any power of two rounds alike)
    x = rng.standard_normal((2, 50, 70)) * np.exp(rng.uniform(-3, 3, (2, 50, 1))) * 10 ** rng.uniform(-5, 0, (2, 50, 70))
    w = rng.standard_normal((70, 45)) * 0.05
    g = rng.standard_normal((2, 50, 45)) * 1e-3
    x, w, g = (jnp.asarray(a, dtype) for a in (x, w, g))
    got = mx_product(x, w, g)
    want = reference(*(np.asarray(a.astype(jnp.float32)) for a in (x, w, g)))
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        rounding = 0 if name == "y" or dtype == "float32" else 2.0 ** -8  # gradients in the inputs' dtype
        err = np.abs(np.asarray(a, np.float64) - b) - rounding * np.abs(b)
        assert err.max() <= 1e-5 * np.abs(b).max(), (name, err.max() / np.abs(b).max())


@pytest.mark.slow
def test_the_blocks_and_scales_are_jaxs_own_mx_quantization():
    stablehlo = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8, 128)) * np.exp(rng.uniform(-8, 8, (3, 8, 1))) * 10 ** rng.uniform(-5, 0, (3, 8, 128))
    x = jnp.asarray(x, jnp.float32)
    q, scales = stablehlo.quantize(x, jax.nn.get_scaled_dot_general_config("mxfp8"))
    theirs = q.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), BLOCK, axis=-1)
    np.testing.assert_array_equal(np.asarray(mxfp8._rounded(x)), np.asarray(theirs))


def _exported_calls(platform: str, cfg) -> str:
    fns = make_step_fns(cfg, make_mesh(validate(cfg, 1)[0], cfg, devices=jax.devices()[:1]), platform=platform)
    calls = ("__op$block_scaled_dot", "__gpu$xla.gpu.triton")  # the GPU's attention is Triton's (`auto`)
    exported = jax.export.export(fns.train_step, platforms=[platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in calls])
    return exported(fns.abstract_state, fns.abstract_batch(H.BATCH, H.SEQ)).mlir_module()


@pytest.mark.slow
def test_the_step_for_cuda_calls_the_block_scaled_dot_and_a_tiny_llama_trains_alike():
    cfg = H.equivalence_config("tiny-llama", **{"precision.matmul": "mxfp8"})
    assert "__op$block_scaled_dot" in _exported_calls("cuda", cfg)
    assert "__op$block_scaled_dot" not in _exported_calls("cpu", cfg)
    params = transformer.init_params(cfg.model, jax.random.key(0))
    loss, grads = H.loss_and_grads(H.step_fns(cfg), params)
    plain, _ = H.loss_and_grads(H.step_fns(H.equivalence_config("tiny-llama")), params)
    assert abs(float(loss) - float(plain)) <= 0.02 * float(plain)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_a_tensor_parallel_width_that_would_split_a_block_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"mxfp8: the KV heads \(as used\) × head_dim = 32 does not split into "
                                          r"multiples of 32 over mesh.tp=2"):
        validate(H.equivalence_config("tiny-llama", **{"precision.matmul": "mxfp8", "mesh.tp": 2, "mesh.dp": -1}), 8)
