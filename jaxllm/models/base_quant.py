"""QLoRA's frozen base (`model.lora.base_quant = "int8" | "nf4"`): each adapted weight stored blockwise quantized,
dequantized where it is used.

Blocks are `BLOCK` = 64 consecutive elements along the weight's `embed` dimension (every adapted weight has one:
the input of a column-parallel weight, the output of a row-parallel one), one fp32 absmax scale each, as QLoRA's
4-bit NormalFloat: codes are the nearest of the 16 NF4 values (QLoRA's Appendix E) to x / absmax, stored two to
a byte; int8 codes are round(x / scale) with scale = absmax / 127.5. With `double_quant` the scales
themselves are stored as int8 after their mean is taken off, in blocks of up to 256 along the same dimension,
as QLoRA does (its second level is 8-bit too).

The codes keep the weight's logical names (nf4's `embed` half as long), the scales the same names over a shorter
`embed`, so
every mesh lays them out as the weight: ZeRO-3 gathers the quantized bytes at use, then dequantizes.
The arithmetic is qwix's (`qwix.quantize` / `qwix.dequantize`, Google's JAX quantization library, pure
functions over a pytree `QArray`); this module only chooses the blocks and stores the parts.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError

BLOCK = 64  # elements per scale (QLoRA's)
SCALE_BLOCK = 256  # scales per second-level scale with double quantization (QLoRA's)
KINDS = {"int8": jnp.int8, "nf4": "nf4"}


@flax.struct.dataclass
class Quantized:
    """A frozen weight as stored: codes like the weight, one scale per block along axis `axis` (from the end,
    so a stacked leaf sliced by the layer scan keeps it). `scale` is an fp32 array or, double-quantized, a
    Quantized of its own with `mean` beside it."""

    codes: Any
    scale: Any
    mean: Any = None
    kind: str = flax.struct.field(pytree_node=False, default="nf4")
    axis: int = flax.struct.field(pytree_node=False, default=-1)


def is_quantized(x) -> bool:
    return isinstance(x, Quantized)


def _qarray(codes, scale, kind: str):
    import qwix

    return qwix.QArray(codes, scale, None, KINDS[kind])


def quantize(w: jax.Array, kind: str, axis: int, double_quant: bool = True) -> Quantized:
    """w quantized in blocks of BLOCK along `axis` (negative), every other dimension its own scales."""
    import qwix

    axis = axis % w.ndim - w.ndim
    others = tuple(d for d in range(w.ndim) if d != w.ndim + axis)
    q = qwix.quantize(w.astype(jnp.float32), KINDS[kind], channelwise_axes=others, tiled_axes={w.ndim + axis: BLOCK})
    codes = _pack(q.qvalue, axis) if kind == "nf4" else q.qvalue
    if not double_quant:
        return Quantized(codes, q.scale, None, kind, axis)
    mean = jnp.mean(q.scale, axis=axis, keepdims=True)
    size = q.scale.shape[axis]
    s = qwix.quantize(q.scale - mean, jnp.int8, channelwise_axes=others,
                      tiled_axes={w.ndim + axis: SCALE_BLOCK if size % SCALE_BLOCK == 0 else size})
    return Quantized(codes, Quantized(s.qvalue, s.scale, None, "int8", axis), mean, kind, axis)


def _pack(codes: jax.Array, axis: int) -> jax.Array:
    """4-bit codes as bytes, two neighbours along `axis` in one (low nibble first): a uint4 array's layout is not
    kept the same from one compiled program to the next on every backend, a byte's is."""
    c = jnp.moveaxis(codes.astype(jnp.uint8), axis, -1)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return jnp.moveaxis(packed, -1, axis)


def unpack(packed: jax.Array, axis: int) -> jax.Array:
    p = jnp.moveaxis(packed, axis, -1)
    codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return jnp.moveaxis(codes, -1, axis).astype(jnp.uint4)


def scales(q: Quantized) -> jax.Array:
    """The fp32 block scales of q (dequantized first when they are quantized)."""
    if not is_quantized(q.scale):
        return q.scale
    import qwix

    return qwix.dequantize(_qarray(q.scale.codes, q.scale.scale, "int8")) + q.mean


def dequantize(q: Quantized, dtype) -> jax.Array:
    import qwix

    codes = unpack(q.codes, q.axis) if q.kind == "nf4" else q.codes
    return qwix.dequantize(_qarray(codes, scales(q), q.kind)).astype(dtype)


def shapes(shape: tuple, axis: int, kind: str, double_quant: bool = True) -> dict:
    """The shapes of a stored weight's parts: codes (nf4: two to a byte along `axis`), scale (and the second
    level's, and the mean)."""
    scale, codes = list(shape), list(shape)
    scale[axis] = shape[axis] // BLOCK
    codes[axis] = shape[axis] // 2 if kind == "nf4" else shape[axis]
    out = {"codes": tuple(codes), "scale": tuple(scale)}
    if double_quant:
        second, mean = list(scale), list(scale)
        second[axis] = 1 if scale[axis] % SCALE_BLOCK else scale[axis] // SCALE_BLOCK
        mean[axis] = 1
        out.update(second=tuple(second), mean=tuple(mean))
    return out


def table_node(leaf, make_leaf, kind: str, double_quant: bool) -> Quantized:
    """The parameter table's description of a base weight stored quantized (its parts named as the weight)."""
    axis = leaf.names.index("embed") - len(leaf.names)
    part = {k: make_leaf(v, leaf.names, "frozen") for k, v in shapes(leaf.shape, axis, kind, double_quant).items()}
    scale = Quantized(part["scale"], part["second"], None, "int8", axis) if double_quant else part["scale"]
    return Quantized(part["codes"], scale, part.get("mean"), kind, axis)


def used(q: Quantized, names: tuple[str, ...], dtype, weight) -> jax.Array:
    """The weight as used: its quantized parts laid out for use as `weight(w, names, dtype)` lays a weight out
    (ZeRO-3 gathers the codes, not the dequantized values), then dequantized."""
    return dequantize(jax.tree.map(lambda a: weight(a, names, a.dtype), q), dtype)


def check_config(m) -> None:
    lc = m.lora
    if lc.base_quant not in ("none", *KINDS):
        raise ConfigError(f"model.lora.base_quant: '{lc.base_quant}' is not one of none, {', '.join(KINDS)}")
    if lc.base_quant != "none" and m.d_model % BLOCK:
        raise ConfigError(f"model.lora.base_quant={lc.base_quant} quantizes in blocks of {BLOCK} along d_model; "
                          f"d_model={m.d_model} is not a multiple of {BLOCK}")
