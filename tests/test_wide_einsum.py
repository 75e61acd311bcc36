"""`ops/wide_einsum`: a matmul of bf16 operands with fp32 output (the head's logits) is differentiated in bf16.

- Its gradients equal a plain reference in float64: the cotangent rounded to the operands' dtype, multiplied by
  the other operand, rounded to that dtype (within one of its ulps: the accumulation orders differ); with fp32
  operands nothing is rounded.
- The train step exported for CUDA (the LLaMA-1B preset's widths on two layers, seq 4,096, bf16; plain text and
  DPO's pairs): every matmul with the vocabulary in it takes bf16 operands. JAX's own transpose of the fp32-output
  einsum multiplied the fp32 cotangent by widened operands, which XLA ran on the H200 as fp32 GEMM fusions at a
  quarter of cuBLAS's bf16 speed (BENCHMARKS.md, issue 62's profile).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.ops import wide_einsum
from test_auto_attention import CONFIGS, exported_step, llama_1b_layers

SPECS = ("bsd,dv->bsv", "bsd,vd->bsv")  # the head's, untied and tied


def _reference(spec: str, x, w, g) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(value, bound)] of dx and dw in float64 from the cotangent rounded to the operands' dtype, each value
    rounded to that dtype; the bound is one of its ulps plus fp32 accumulation's error over the summed terms."""
    low = x.dtype
    g64, x64, w64 = (np.asarray(a, np.float64) for a in (g.astype(low), x, w))
    dx_spec, dw_spec = wide_einsum.transposed(spec)
    pairs = ((dx_spec, g64, w64), (dw_spec, x64, g64))
    out = []
    for s, a, b in pairs:
        exact, magnitude = np.einsum(s, a, b), np.einsum(s, np.abs(a), np.abs(b))
        value = np.asarray(jnp.asarray(exact).astype(low), np.float64)
        terms = round((a.size * b.size / exact.size) ** 0.5)  # each output sums this many products
        out.append((value, np.abs(value) * float(jnp.finfo(low).eps) + terms * 2.0**-24 * magnitude))
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("spec", SPECS)
def test_the_gradients_are_the_rounded_cotangents_products(spec, dtype):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, 64), dtype)
    w = jax.random.normal(kw, (64, 96) if spec.endswith("dv->bsv") else (96, 64), dtype) / 8
    g = jax.random.normal(kc, (2, 8, 96), jnp.float32)  # the fp32 cotangent of the output
    y, backward = jax.vjp(lambda x, w: wide_einsum.einsum(spec, x, w, jnp.float32), x, w)
    assert y.dtype == jnp.float32
    dx, dw = backward(g)
    for got, (want, bound) in zip((dx, dw), _reference(spec, x, w, g)):
        assert got.dtype == dtype
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound)


DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["text", "dpo"])
def test_the_steps_vocabulary_matmuls_take_bf16_operands_on_cuda(name):
    cfg, shape, _ = llama_1b_layers(CONFIGS[name])
    text = exported_step(cfg, shape, "cuda")
    vocab = str(cfg.model.vocab_size)
    operands = [m.groups() for m in map(DOT.search, text.splitlines()) if m and vocab in m.group(0)]
    assert len(operands) >= 4, operands  # the forward's (recomputed in the backward) and the two gradients'
    wide = [pair for pair in operands if any(t.endswith("xf32>") for t in pair)]
    assert not wide, f"{name}: matmuls over the vocabulary with fp32 operands: {wide}"
