"""FP8 matmuls with per-tensor current scaling (`precision.matmul = "fp8"`); DeepSeek-V3's tile- and
block-wise scaling (`fp8_block`) is `fp8_block.py`'s and MXFP8 (`mxfp8`) `mxfp8.py`'s, reached through the same
`einsum` and `weight_grad`.

A covered matmul quantizes both operands just before it: scale = amax / the format's largest
finite value (448 for E4M3), so the largest element maps to ±448 and nothing saturates; the
operands are multiplied as fp8 with fp32 accumulation and the product is scaled back by
scale_x · scale_w. The backward pass quantizes the incoming gradient to E5M2 (wider range,
fewer bits) and multiplies it with the saved E4M3 operands: E5M2 × E4M3 and E4M3 × E5M2, the
pairs cuBLASLt's fp8 GEMM takes (E5M2 × E5M2 it does not). The saved residuals are the fp8
operands and their scales, a quarter of fp32's bytes.

Scales are "current": computed from the tensor being multiplied, every time. Delayed scaling
(an amax history carried in the state) is not offered: inside the accumulation scan every
microbatch would add its own update to it.

The amax is the whole tensor's. Under the compiler's sharding, `max` over a sharded array is
already global. Inside a shard_map island each device holds a piece, so the amax is reduced
(`pmax`, one fp32 scalar per call) over the island's manual axes but `pp`, whose ranks hold
different layers, not pieces of one tensor. Per tensor means per microbatch and per loss chunk:
a run equals one device for microbatches 1 only (a device's microbatches are its own rows).

On CPU XLA multiplies fp8 by widening it (exact: the products fit fp32); on a GPU with fp8
tensor cores the dot lowers to cuBLASLt's fp8 GEMM.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError
from jaxllm.ops import fp8_block, mxfp8, wide_einsum

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GROUPS = ("attention", "mlp", "experts", "head")  # the weight matmuls precision.matmul = "fp8" covers
MATMULS = ("default", "fp8", "fp8_block", "mxfp8")  # precision.matmul
PIPELINE_AXIS = "pp"

class Coverage(frozenset):
    """The groups of weight matmuls run in fp8, how (`mode`: a `precision.matmul` other than default), and for which
    platform the program is built (MXFP8 calls the GPU's scaled dot there)."""

    def __new__(cls, groups=(), mode: str = "fp8", platform: str | None = None):
        covered = super().__new__(cls, groups)
        covered.mode, covered.platform = mode, platform
        return covered


_covered: contextvars.ContextVar[Coverage] = contextvars.ContextVar("jaxllm_fp8", default=Coverage())


def covered_groups(precision, platform: str | None = None) -> Coverage:
    """The groups of weight matmuls run in fp8 under a `precision` config section, and how, for `platform`;
    ConfigError (one line) for an unknown setting."""
    if precision.matmul not in MATMULS:
        raise ConfigError(f"precision.matmul: '{precision.matmul}' is not one of {', '.join(MATMULS)}")
    unknown = sorted(set(precision.fp8_exclude) - set(GROUPS))
    if unknown:
        raise ConfigError(f"precision.fp8_exclude: {unknown} are not matmul groups; choose from {', '.join(GROUPS)}")
    if precision.matmul == "default":
        return Coverage()
    return Coverage(frozenset(GROUPS) - set(precision.fp8_exclude), precision.matmul, platform)


@contextlib.contextmanager
def use(groups: frozenset):
    """Trace the matmuls of `groups` in fp8 (a context, so building a program changes no global setting): per
    tensor, or as a Coverage says."""
    token = _covered.set(groups if isinstance(groups, Coverage) else Coverage(groups))
    try:
        yield
    finally:
        _covered.reset(token)


def covers(group: str) -> bool:
    """Whether the program being traced runs `group`'s weight matmuls in fp8."""
    return group in _covered.get()


def _amax(x: jax.Array) -> jax.Array:
    """max |x| over the whole tensor, fp32, reduced over the manual axes of the island traced in."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a != PIPELINE_AXIS)
    return jax.lax.pmax(amax, axes) if axes else amax


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(q, scale) with x ≈ q · scale: q = x / scale in `dtype` (rounded to nearest), scale = amax / its
    largest value. An all-zero x gets scale 1 (q is zero, nothing divides by zero)."""
    top = float(jnp.finfo(dtype).max)
    amax = _amax(x)
    scale = jnp.where(amax > 0, jnp.maximum(amax / top, jnp.finfo(jnp.float32).tiny), 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype), scale


def _dot(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _fp8_einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    return _forward(spec, x, w, out_dtype)[0]


def _forward(spec, x, w, out_dtype):
    (qx, sx), (qw, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return _dot(spec, qx, qw, sx * sw, out_dtype), (qx, sx, qw, sw, jnp.zeros((0,), x.dtype))


def _backward(spec, out_dtype, saved, g):
    qx, sx, qw, sw, like = saved
    qg, sg = quantize(g, E5M2)
    dx_spec, dw_spec = wide_einsum.transposed(spec)
    return _dot(dx_spec, qg, qw, sg * sw, like.dtype), _dot(dw_spec, qx, qg, sx * sg, like.dtype)


_fp8_einsum.defvjp(_forward, _backward)


def weight_grad(group: str, x: jax.Array, dy: jax.Array) -> jax.Array:
    """Σ over the rows (the leading two dimensions, batch and sequence) of x ⊗ dy: the gradient of the weight
    of a matmul y = x·w from its input x and its output's cotangent dy, in x's dtype. Where the traced program
    covers the group, through fp8 as `_backward` computes it (x in E4M3, dy in E5M2, each scaled by its whole
    tensor's amax), so a weight gradient made apart from the backward (the zero-bubble pipelines' W) is the
    fused backward's."""
    dims = (((0, 1), (0, 1)), ((), ()))
    if not covers(group):
        return jax.lax.dot_general(x, dy, dims, preferred_element_type=jnp.float32).astype(x.dtype)
    if _covered.get().mode == "fp8_block":
        return fp8_block.weight_grad(x, dy)
    if _covered.get().mode == "mxfp8":
        return mxfp8.weight_grad(x, dy)
    (qx, sx), (qg, sg) = quantize(x, E4M3), quantize(dy, E5M2)
    return (jax.lax.dot_general(qx, qg, dims, preferred_element_type=jnp.float32) * (sx * sg)).astype(x.dtype)


def einsum(group: str, spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """jnp.einsum(spec, x, w) of a weight matmul in `group` (x and w of one dtype; out_dtype defaults to
    theirs), through the fp8 dot when the traced program covers the group, else `wide_einsum`'s (an out_dtype
    wider than x and w is differentiated in their dtype). Each index of the spec
    appears in two of its three terms (a matmul: no index summed within one operand)."""
    if not covers(group):
        return wide_einsum.einsum(spec, x, w, out_dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"fp8 einsum {spec}: operands of dtypes {x.dtype} and {w.dtype}; cast them to one")
    if _covered.get().mode == "fp8_block":
        return fp8_block.einsum(spec, x, w, jnp.dtype(out_dtype or x.dtype))
    if _covered.get().mode == "mxfp8":
        return mxfp8.einsum(spec, x, w, jnp.dtype(out_dtype or x.dtype), _covered.get().platform)
    return _fp8_einsum(spec, x, w, jnp.dtype(out_dtype or x.dtype))


def tensordot(group: str, x: jax.Array, w: jax.Array, axes: int) -> jax.Array:
    """jnp.tensordot(x, w, axes) (x's last `axes` dimensions against w's first) as `einsum` above."""
    if not covers(group):
        return jnp.tensordot(x, w, axes=axes)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lead, summed, rest = x.ndim - axes, letters[x.ndim - axes:x.ndim], letters[x.ndim:x.ndim + w.ndim - axes]
    return einsum(group, f"{letters[:lead]}{summed},{summed}{rest}->{letters[:lead]}{rest}", x, w)
