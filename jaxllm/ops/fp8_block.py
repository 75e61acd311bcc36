"""FP8 with DeepSeek-V3's fine-grained scaling (`precision.matmul = "fp8_block"`; DeepSeek-V3 §3.3).

Every operand is E4M3 with an fp32 scale per tile, scale = the tile's amax × fp32(1 / 448) (a product, which
every compiler computes alike, where XLA:CPU may turn a division by a constant into one; an all-zero tile: 1):
activations, and the output's gradient, in 1 × 128 tiles along the contraction (a token's 128 consecutive
contracted values share a scale); weights in 128 × 128 blocks (contraction × output). The weight's gradient
contracts over tokens, so there x and dy are quantized again, in 128 × 1 tiles (128 tokens of one channel
share a scale), the tokens along the last of x's own dimensions (the sequence), so a tile never crosses a
sequence row. One outlier then costs only its own tile's precision, not the tensor's.

How the tiled product is computed: as its quantize–dequantize form, each operand rounded to E4M3 in its tiles
and multiplied back by its tile's scale (fp32), then one fp32-accumulating dot over fp32 operands. A tile's
scale multiplies every product of its elements, so this is the blocked product (per tile, an exact E4M3 × E4M3
product in fp32 times the two scales) up to fp32 rounding; the tests hold it to a NumPy reference of that
arithmetic. Cost: no fp8 speed (the dot is fp32, on an H200's SIMT cores: 0.15–0.18 of bf16's step,
BENCHMARKS.md), where per-tensor `fp8` runs an fp8 dot; what it keeps for the backward is fp8 (the weight's
blocks and x's 128 × 1 tiles) with a scale per 128 values, about a quarter of fp32's bytes. A GPU kernel taking
block scales (cuBLASLt's, DeepGEMM's) would multiply the same fp8 values at fp8 speed; none is called here.

Dimensions not a multiple of 128 are padded with zeros to whole tiles (nothing added to an amax or a sum), and
the results sliced back. Any einsum of a weight matmul reduces to one form (`einsum`): x as [B, R, T, K] and w
as [B, K, N], B the indices in x, w and the output (latent attention's heads, the experts), R and T x's own (T
its last: the tokens), K the contracted, N w's own; each group flattened in the order the operands list them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
TILE = 128
_TOP = float(jnp.finfo(E4M3).max)  # 448
_INVERSE_TOP = float(np.float32(1 / _TOP))
_DOT = {"preferred_element_type": jnp.float32, "precision": "highest"}


def pad(x, axis: int, tile: int = TILE):
    """x padded with zeros along `axis` to a multiple of `tile`."""
    extra = -x.shape[axis] % tile
    return x if not extra else jnp.pad(x, [(0, extra if a == axis % x.ndim else 0) for a in range(x.ndim)])


def _scale(amax):
    return jnp.where(amax > 0, jnp.maximum(amax * jnp.float32(_INVERSE_TOP), jnp.finfo(jnp.float32).tiny), 1.0)


def quantize_tiles(x, tile: int = TILE, scale_of=_scale):
    """x in 1 × `tile` tiles along its last axis (padded): (q [..., tiles, tile] E4M3, scale [..., tiles, 1] fp32),
    each tile's scale `scale_of` its amax."""
    t = pad(x.astype(jnp.float32), -1, tile)
    t = t.reshape(*t.shape[:-1], -1, tile)
    scale = scale_of(jnp.max(jnp.abs(t), axis=-1, keepdims=True))
    return jnp.clip(t / scale, -_TOP, _TOP).astype(E4M3), scale


def tiles_value(q, scale):
    """The fp32 values [..., tiles · TILE] of `quantize_tiles`' tiles."""
    v = q.astype(jnp.float32) * scale
    return v.reshape(*v.shape[:-2], -1)


def quantize_blocks(w):
    """w [B, K, N] in TILE × TILE blocks (padded): (q [B, K/T, T, N/T, T] E4M3, scale [B, K/T, 1, N/T, 1] fp32)."""
    b = pad(pad(w.astype(jnp.float32), 1), 2)
    b = b.reshape(b.shape[0], b.shape[1] // TILE, TILE, b.shape[2] // TILE, TILE)
    scale = _scale(jnp.max(jnp.abs(b), axis=(2, 4), keepdims=True))
    return jnp.clip(b / scale, -_TOP, _TOP).astype(E4M3), scale


def blocks_value(q, scale):
    """The fp32 values [B, K', N'] (padded) of `quantize_blocks`' blocks."""
    v = q.astype(jnp.float32) * scale
    return v.reshape(v.shape[0], v.shape[1] * TILE, v.shape[3] * TILE)


@jax.custom_vjp
def product(x, w):
    """x [B, R, T, K] · w [B, K, N] -> fp32 [B, R, T, N], the operands tiled as the module docstring says."""
    return _forward(x, w)[0]


def _forward(x, w):
    w_q, w_s = quantize_blocks(w)
    y = jnp.einsum("brtk,bkn->brtn", tiles_value(*quantize_tiles(x)), blocks_value(w_q, w_s), **_DOT)
    x_q, x_s = quantize_tiles(jnp.swapaxes(x, 2, 3))  # x's 128 × 1 tiles over the tokens, for the weight's gradient
    like = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return y[..., :w.shape[2]], (x_q, x_s, w_q, w_s, like)


def _backward(saved, dy):
    x_q, x_s, w_q, w_s, (x_like, w_like) = saved
    k = x_q.shape[2]
    dx = jnp.einsum("brtn,bkn->brtk", tiles_value(*quantize_tiles(dy)), blocks_value(w_q, w_s), **_DOT)
    dy_t = tiles_value(*quantize_tiles(jnp.swapaxes(dy, 2, 3)))  # [B, R, N, T'], 128 × 1 tiles over the tokens
    dw = jnp.einsum("brkt,brnt->bkn", tiles_value(x_q, x_s), dy_t, **_DOT)
    return dx[..., :k].astype(x_like.dtype), dw.astype(w_like.dtype)


product.defvjp(_forward, _backward)


def weight_grad(x, dy):
    """Σ over the rows (batch and sequence, x's and dy's leading two dimensions) of x ⊗ dy in x's dtype, as
    `product`'s backward computes a weight's gradient (x and dy in 128 × 1 tiles over each row's tokens)."""
    b, t = x.shape[:2]
    x_t = tiles_value(*quantize_tiles(jnp.swapaxes(x.reshape(b, t, -1), 1, 2)))  # [b, K, T']
    dy_t = tiles_value(*quantize_tiles(jnp.swapaxes(dy.reshape(b, t, -1), 1, 2)))  # [b, N, T']
    dw = jnp.einsum("bkt,bnt->kn", x_t, dy_t, **_DOT)
    return dw.reshape(*x.shape[2:], *dy.shape[2:]).astype(x.dtype)


def einsum(spec: str, x, w, out_dtype, product=product):
    """jnp.einsum(spec, x, w) of a weight matmul through `product` (x [B, R, T, K], w [B, K, N] -> fp32
    [B, R, T, N]): x's own last index is the tokens' (see the module docstring), every index of x is in w or the
    output."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    size = dict(zip(xs, x.shape)) | dict(zip(ws, w.shape))
    batch = [c for c in xs if c in ws and c in out]
    own_x = [c for c in xs if c not in ws]
    contracted = [c for c in xs if c in ws and c not in out]
    own_w = [c for c in ws if c not in xs]
    n = lambda group: math.prod(size[c] for c in group)
    x_c = jnp.einsum(f"{xs}->{''.join(batch + own_x + contracted)}", x)
    x_c = x_c.reshape(n(batch), n(own_x[:-1]), size[own_x[-1]], n(contracted))
    w_c = jnp.einsum(f"{ws}->{''.join(batch + contracted + own_w)}", w).reshape(n(batch), n(contracted), n(own_w))
    y = product(x_c, w_c).reshape([size[c] for c in batch + own_x + own_w])
    return jnp.einsum(f"{''.join(batch + own_x + own_w)}->{out}", y).astype(out_dtype)
