"""The Gated DeltaNet layer (Qwen3-Next's linear attention) as one pure function: transformers'
`Qwen3NextGatedDeltaNet` (models/qwen3_next/modeling_qwen3_next.py, its pure-torch path: `causal_conv1d_fn` /
`torch_chunk_gated_delta_rule` and `Qwen3NextRMSNormGated`) around the recurrence of `jaxllm/ops/gated_delta.py`;
the token mixer of the `linear` and `linear_moe` block kinds (`model.linear_attn`).

    qkvz = x W_qkvz, ba = x W_ba             per key-head group (below)
    q, k, v = silu(causal depthwise conv1d over time (kernel K, no bias) of [q | k | v])      z is not convolved
    β = sigmoid(b);  g = −exp(A_log) · softplus(a + dt_bias)                                 (g in fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β)                  (`gated_delta.chunked`, use_qk_l2norm)
    y = (RMSNorm(o) · w · silu(z)) W_out                 per value head over dv; not zero-centred; fp32 inside

Parameters (`param_shapes`), every one laid out by key-head group — hk groups, each one key head's q and k and
its r = hv / hk value heads — so tensor parallelism splits the groups (`linear_heads`) like attention's heads:

    in_proj_qkvz [D, hk, 2·dk + 2·r·dv]   each group's [q (dk) | k (dk) | v (r·dv) | z (r·dv)], transformers'
                                          interleaving (`fix_query_key_value_ordering`) as it is
    in_proj_ba   [D, hk, 2·r]              each group's [b (r) | a (r)]
    dt_bias, A_log [hk, r]    norm [dv]    out_proj [hk, r·dv, D]
    conv1d       [2·hk·dk + hv·dv, K]      the taps of transformers' channels, [all q | all k | all v]: whole on
                                          every device (K numbers a channel), regrouped by key head at use

`from_hf` / `to_hf` convert to and from transformers' tensors (matrices [out, in]); the convolution is
depthwise, so regrouping its channels changes nothing computed.

Layouts: x [b, t, D] → y [b, t, D]; inside, q, k [b, t, hk, dk], v, z [b, t, hv, dv], g, β [b, t, hv], the
layout of `gated_delta`.

Packed documents: `segment_ids` [b, t] (one id per document, padding 0). The convolution's window does not reach
across a document start (the taps that would read an earlier document read zero, as at the start of the
sequence) and the recurrence's state is zeroed at each document start (`gated_delta`'s `segment_ids`), so every
document gives what it gives alone. Left padding (generation's) is a document of its own, so the prompt after it
starts from a zero state and an empty window: what transformers' zeroed padding gives.

With the sequence split over `mesh.sp` the convolution and the recurrence run in the island of
`jaxllm/parallel/gated_delta_context.py` (the halo and the state passed from rank to rank), in sequence order.

Generation (`cached_gated_deltanet`) carries per layer a `LinearState`: the convolution's last K − 1 inputs and
the recurrence's state [b, hv, dk, dv] fp32, fixed in size whatever the length (`state_bytes`).

Precision: the projections are matmuls under the caller's matmul precision; the convolution, g, the recurrence
and the gated norm are computed in fp32 and cast back to x's dtype where transformers casts (the conv output,
the norm's x̂ before the weight and its output).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError
from jaxllm.ops import gated_delta
from jaxllm.parallel import gated_delta_context
from jaxllm.sharding import current_layout, weight


class GatedDeltaNetSizes(NamedTuple):
    """transformers' `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
    `linear_value_head_dim`, `linear_conv_kernel_dim` and `rms_norm_eps` (the gated norm's epsilon)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6

    @property
    def group(self) -> int:
        """Value heads per key head (r)."""
        return self.num_v_heads // self.num_k_heads

    @property
    def conv_width(self) -> int:
        """A group's convolved channels: its q, k and v."""
        return 2 * self.head_k_dim + self.group * self.head_v_dim


def sizes_of(m) -> GatedDeltaNetSizes:
    """The layer's sizes from the model section (`model.linear_attn`, the norm's epsilon `model.norm_eps`)."""
    a = m.linear_attn
    return GatedDeltaNetSizes(a.num_k_heads, a.num_v_heads, a.head_k_dim, a.head_v_dim, a.conv_kernel, m.norm_eps)


def check_config(m, shape: dict) -> None:
    """`model.linear_attn` against the model and mesh: ConfigError (one line: the key and the fix)."""
    a = m.linear_attn
    for key in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel", "chunk"):
        if getattr(a, key) < 1:
            raise ConfigError(f"model.linear_attn.{key}={getattr(a, key)}: must be at least 1")
    if a.num_v_heads % a.num_k_heads:
        raise ConfigError(f"model.linear_attn.num_v_heads={a.num_v_heads} is not a multiple of num_k_heads="
                          f"{a.num_k_heads}: each key head serves a whole group of value heads; change one of them")
    if a.num_k_heads % shape["tp"]:
        raise ConfigError(f"model.linear_attn.num_k_heads={a.num_k_heads} is not divisible by mesh.tp={shape['tp']}: "
                          "tensor parallelism splits the key-head groups; use a tp that divides them")
    if shape["sp"] > 1 and m.cp_load_balance:
        raise ConfigError(f"mesh.sp={shape['sp']} with linear attention layers and model.cp_load_balance=true: their "
                          "state passes from rank to rank in sequence order, which the zig-zag order breaks (and "
                          "their work is even across ranks without it); set model.cp_load_balance=false")


def recurrence_flops_per_token(s: GatedDeltaNetSizes, chunk: int) -> float:
    """The chunked form's matmul FLOPs per token and layer for training (3× the forward: the backward's two
    products per forward one), over its value heads: per head q kᵀ and β k kᵀ within the chunk (2·C·dk each), the
    UT transform's inverse by forward substitution (C steps of a row by the C × C inverse: 2·C² a token) and its
    product with [β v | β k e^G] (2·C·(dk + dv)), the outputs' within-chunk product (2·C·dv) and the three products
    with the state (2·dk·dv each). The projections around it are in 6N."""
    dk, dv, c = s.head_k_dim, s.head_v_dim, chunk
    return 3.0 * s.num_v_heads * (4 * c * dk + 2 * c * c + 2 * c * (dk + dv) + 2 * c * dv + 6 * dk * dv)


_HEADS = ("linear_heads", "linear_group")
PARAM_NAMES = {"in_proj_qkvz": ("embed",) + _HEADS, "in_proj_ba": ("embed",) + _HEADS,
               "conv1d": ("linear_conv", "conv_kernel"), "dt_bias": _HEADS, "A_log": _HEADS, "norm": ("head_dim",),
               "out_proj": _HEADS + ("embed",)}  # each parameter's logical names


def param_shapes(s: GatedDeltaNetSizes, d_model: int) -> dict:
    """Each parameter's (shape, logical names), in the grouped layout of the module docstring."""
    hk, r, dk, dv, K = s.num_k_heads, s.group, s.head_k_dim, s.head_v_dim, s.conv_kernel
    shapes = {"in_proj_qkvz": (d_model, hk, 2 * dk + 2 * r * dv), "in_proj_ba": (d_model, hk, 2 * r),
              "conv1d": (hk * s.conv_width, K), "dt_bias": (hk, r), "A_log": (hk, r), "norm": (dv,),
              "out_proj": (hk, r * dv, d_model)}
    return {name: (shape, PARAM_NAMES[name]) for name, shape in shapes.items()}


FP32_PARAMS = ("A_log", "dt_bias")  # read in fp32 (g is computed in fp32); the rest in the compute dtype


def used_weights(p: dict, dtype) -> dict:
    """The layer's parameters as used: in the compute dtype (but `FP32_PARAMS`), laid out by their names."""
    return {name: weight(w, PARAM_NAMES[name], jnp.float32 if name in FP32_PARAMS else dtype) for name, w in p.items()}


def from_hf(w: dict, s: GatedDeltaNetSizes) -> dict:
    """transformers' tensors (`in_proj_qkvz.weight` [out, in], `conv1d.weight` [C, 1, K], ...; NumPy or JAX) in
    the grouped layout."""
    hk, r, dk, dv = s.num_k_heads, s.group, s.head_k_dim, s.head_v_dim
    return {"in_proj_qkvz": w["in_proj_qkvz.weight"].T.reshape(-1, hk, 2 * dk + 2 * r * dv),
            "in_proj_ba": w["in_proj_ba.weight"].T.reshape(-1, hk, 2 * r), "conv1d": w["conv1d.weight"][:, 0, :],
            "dt_bias": w["dt_bias"].reshape(hk, r), "A_log": w["A_log"].reshape(hk, r), "norm": w["norm.weight"],
            "out_proj": w["out_proj.weight"].T.reshape(hk, r * dv, -1)}


def to_hf(p: dict, s: GatedDeltaNetSizes) -> dict:
    """The grouped layout back in transformers' tensors (`from_hf`'s inverse, bit for bit)."""
    return {"in_proj_qkvz.weight": p["in_proj_qkvz"].reshape(p["in_proj_qkvz"].shape[0], -1).T,
            "in_proj_ba.weight": p["in_proj_ba"].reshape(p["in_proj_ba"].shape[0], -1).T,
            "conv1d.weight": p["conv1d"][:, None, :], "dt_bias": p["dt_bias"].reshape(-1),
            "A_log": p["A_log"].reshape(-1), "norm.weight": p["norm"],
            "out_proj.weight": p["out_proj"].reshape(-1, p["out_proj"].shape[-1]).T}


def grouped_conv(w: jax.Array, s: GatedDeltaNetSizes) -> jax.Array:
    """The convolution's taps [2·hk·dk + hv·dv, K] (transformers' channel order) regrouped as the projections
    give the channels: [hk · conv_width, K], each group's q, k, v."""
    hk, dk = s.num_k_heads, s.head_k_dim
    q, k, v = w[:hk * dk], w[hk * dk:2 * hk * dk], w[2 * hk * dk:]
    parts = [q.reshape(hk, dk, -1), k.reshape(hk, dk, -1), v.reshape(hk, s.group * s.head_v_dim, -1)]
    return jnp.concatenate(parts, axis=1).reshape(hk * s.conv_width, -1)


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`Qwen3NextRMSNormGated` over the last axis: x̂ = x · rsqrt(mean(x²) + eps) in fp32, cast to x's dtype, times
    w, times silu(gate) in fp32; the result in x's dtype. Not zero-centred (w itself, not 1 + w)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w * xf.astype(dtype)
    y = y * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(dtype)


class Mixed(NamedTuple):
    """The layer's inputs to the convolution and what goes around it, from the projections."""
    qkv: jax.Array  # [b, t, hk · conv_width]: each group's [q | k | v], the convolution's channels
    z: jax.Array  # [b, t, hv, dv]
    beta: jax.Array  # [b, t, hv]
    g: jax.Array  # [b, t, hv] fp32


def _project(p: dict, x: jax.Array, s: GatedDeltaNetSizes) -> Mixed:
    hk, hv, dv = s.num_k_heads, s.num_v_heads, s.head_v_dim
    bsz, t, _ = x.shape
    qkvz = jnp.einsum("btd,dhc->bthc", x, p["in_proj_qkvz"])
    ba = jnp.einsum("btd,dhc->bthc", x, p["in_proj_ba"])
    qkv, z = qkvz[..., :s.conv_width], qkvz[..., s.conv_width:]
    b, a = ba[..., :s.group].reshape(bsz, t, hv), ba[..., s.group:].reshape(bsz, t, hv)
    g = -jnp.exp(p["A_log"].reshape(hv).astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].reshape(hv).astype(jnp.float32))
    return Mixed(qkv.reshape(bsz, t, hk * s.conv_width), z.reshape(bsz, t, hv, dv), jax.nn.sigmoid(b), g)


def _split_heads(qkv: jax.Array, s: GatedDeltaNetSizes):
    """The convolved channels [b, t, hk · conv_width] as q, k [b, t, hk, dk] and v [b, t, hv, dv]."""
    bsz, t, _ = qkv.shape
    qkv = qkv.reshape(bsz, t, s.num_k_heads, s.conv_width)
    q, k, v = qkv[..., :s.head_k_dim], qkv[..., s.head_k_dim:2 * s.head_k_dim], qkv[..., 2 * s.head_k_dim:]
    return q, k, v.reshape(bsz, t, s.num_v_heads, s.head_v_dim)


def _output(p: dict, o: jax.Array, z: jax.Array, s: GatedDeltaNetSizes) -> jax.Array:
    bsz, t = o.shape[:2]
    o = gated_rms_norm(o, z, p["norm"], s.eps)  # [b, t, hv, dv]
    return jnp.einsum("bthc,hcd->btd", o.reshape(bsz, t, s.num_k_heads, s.group * s.head_v_dim), p["out_proj"])


def gated_deltanet(p: dict, x: jax.Array, sizes: GatedDeltaNetSizes, chunk: int = 64,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """The Gated DeltaNet layer: x [b, t, D] → y [b, t, D] (see the module docstring; `p` its parameters in the
    grouped layout, as the compute dtype's, `segment_ids` [b, t] for packed documents, `chunk` the chunk size
    of the recurrence's chunked form)."""
    s = sizes
    mixed = _project(p, x, s)
    conv_w = grouped_conv(p["conv1d"], s)
    layout = current_layout()
    if layout is not None and layout.mesh.shape["sp"] > 1:  # the sequence split: `parallel/gated_delta_context.py`
        conv = functools.partial(gated_delta_context.causal_conv, layout=layout)
        rule = functools.partial(gated_delta_context.gated_delta_rule, layout=layout)
    else:
        conv, rule = gated_delta.causal_conv, gated_delta.chunked
    qkv = jax.nn.silu(conv(mixed.qkv, conv_w, segment_ids=segment_ids)).astype(x.dtype)
    q, k, v = _split_heads(qkv, s)
    o, _ = rule(q, k, v, mixed.g, mixed.beta, chunk=chunk, use_qk_l2norm=True, segment_ids=segment_ids)
    return _output(p, o, mixed.z, s)


class LinearView(NamedTuple):
    """What a linear layer's cached step reads: its carried state and where the new tokens start documents."""
    state: "LinearState"
    resets: jax.Array  # [b, t] bool


class LinearState(NamedTuple):
    """A linear layer's generation state: the convolution's last K − 1 inputs [b, K − 1, hk · conv_width] (in the
    compute dtype, as projected) and the recurrence's state [b, hv, dk, dv] fp32."""
    conv: jax.Array
    state: jax.Array


def empty_state(s: GatedDeltaNetSizes, rows: int, dtype) -> LinearState:
    return LinearState(jnp.zeros((rows, s.conv_kernel - 1, s.num_k_heads * s.conv_width), dtype),
                       jnp.zeros((rows, s.num_v_heads, s.head_k_dim, s.head_v_dim), jnp.float32))


def state_bytes(s: GatedDeltaNetSizes, rows: int, dtype) -> int:
    """One layer's generation state in bytes: (K − 1) · hk · conv_width inputs in the compute dtype and
    hv · dk · dv fp32 per row, whatever the length."""
    conv = (s.conv_kernel - 1) * s.num_k_heads * s.conv_width * jnp.dtype(dtype).itemsize
    return rows * (conv + 4 * s.num_v_heads * s.head_k_dim * s.head_v_dim)


def _next_window(window, qkv, ids, window_ids):
    """The last K − 1 inputs of [window | qkv] for the next call, those of an earlier document than the last
    token's zeroed (a prompt shorter than the window keeps none of the left padding before it)."""
    inputs = jnp.concatenate([window, qkv.astype(window.dtype)], axis=1)[:, qkv.shape[1]:]
    documents = jnp.concatenate([window_ids, ids], axis=1)[:, ids.shape[1]:]
    return jnp.where((documents == ids[:, -1:])[..., None], inputs, 0)


def cached_gated_deltanet(p: dict, x: jax.Array, sizes: GatedDeltaNetSizes, carried: LinearState, resets,
                          chunk: int = 64):
    """The layer continuing from `carried` (generation): x [b, t, D] the next t tokens of every row (a prompt, or
    one token), `resets` [b, t] true where a row's new document starts (its state and window zeroed there:
    the first prompt token after left padding, or a slot's first token). Returns (y, the state after x).
    One token is the recurrent form's one step; longer inputs the chunked form from the carried state."""
    s, t = sizes, x.shape[1]
    mixed = _project(p, x, s)
    ids = jnp.cumsum(resets, axis=1).astype(jnp.int32)  # a reset starts a new id: the window before it reads zero
    window_ids = jnp.zeros(carried.conv.shape[:2], jnp.int32)
    conv_w = grouped_conv(p["conv1d"], s)
    qkv = jax.nn.silu(gated_delta.causal_conv(mixed.qkv, conv_w, ids, carried.conv, window_ids)).astype(x.dtype)
    window = _next_window(carried.conv, mixed.qkv, ids, window_ids)
    q, k, v = _split_heads(qkv, s)
    form = gated_delta.recurrent if t == 1 else functools.partial(gated_delta.chunked, chunk=chunk)
    o, state = form(q, k, v, mixed.g, mixed.beta, initial_state=carried.state, use_qk_l2norm=True,
                    resets=resets)
    return _output(p, o, mixed.z, s), LinearState(window, state)
