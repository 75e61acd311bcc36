"""Small building blocks: norms, projections, feed-forward layers.

Pure functions over parameter dicts. Statistics are computed in fp32; outputs come
back in the compute dtype of their input.

`column_parallel` and `row_parallel` are the projections into and out of a
tensor-parallel region (Megatron's column- and row-parallel linears). Without
`model.collective_matmul` they are plain contractions and the partitioner places
the collectives the shardings imply; with it they dispatch to the collective-matmul
island, the one place where that choice is made.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxllm.models import lora, taps
from jaxllm.ops import fp8
from jaxllm.ops.activations import GLUS, gelu_tanh, glu
from jaxllm.parallel import collective_matmul
from jaxllm.sharding import constrain, current_layout, weight


@contextlib.contextmanager
def matmul_precision(dtype, fp8_groups: frozenset = frozenset()):
    """The matmul precision a forward pass of this compute dtype traces under: fp32 means fp32 on GPU too
    (no TF32); the weight matmuls of `fp8_groups` run in fp8 (`ops/fp8.py`). A context manager, so
    building a program changes no global JAX setting."""
    highest = jnp.dtype(dtype) == jnp.float32
    with jax.default_matmul_precision("highest") if highest else contextlib.nullcontext(), fp8.use(fp8_groups):
        yield


def _scale(p: dict, offset: float):
    """The norm's multiplier: its scale, plus `model.norm_offset` where there is one (Gemma's 1 + w)."""
    return p["scale"] + offset if offset else p["scale"]


def layer_norm(p: dict, x: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * _scale(p, offset) + p["bias"]
    return y.astype(x.dtype)


def rms_norm(p: dict, x: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * _scale(p, offset)
    return y.astype(x.dtype)


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm}


def norm(kind: str, p: dict, x: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """`model.norm`: layernorm (scale and bias) or rmsnorm (scale only), computing x̂·(offset + scale)."""
    return NORMS[kind](p, x, eps, offset)


def column_parallel(x: jax.Array, weights: list[tuple[jax.Array, tuple[str, ...]]], dtype,
                    group: str) -> list[jax.Array]:
    """x [batch, seq, embed] times each weight [embed, ...] (given with its logical names) -> [batch, seq, ...];
    `group` names the matmuls for `precision.matmul` (`ops/fp8.py`).

    The weights' output dimensions are split over tp; x enters from the residual stream
    (sequence-split over tp under sequence parallelism, so it is gathered along the sequence).
    """
    ws = [lora.base(taps.weight_of(w), names, dtype, weight) for w, names in weights]
    layout = current_layout()
    if layout is not None and layout.collective_matmul:  # the adapters beside the ring, left to the compiler
        ys = collective_matmul.all_gather_matmul(x, ws, [names for _, names in weights], layout)
        return [_with_adapter(y, x, node, names, 1, dtype) for y, (node, names) in zip(ys, weights)]
    # the whole sequence enters the region (under sequence parallelism: the all-gather is here)
    x = constrain(x, ("batch", "seq", "embed"))
    return [_with_adapter(_project(group, x, w, node, 1), x, node, names, 1, dtype)
            for w, (node, names) in zip(ws, weights)]


def project(x: jax.Array, w, names: tuple[str, ...], n_in: int, dtype, group: str) -> jax.Array:
    """x's last n_in dimensions times w (logical `names`, its first n_in the input), with its adapter if it has one:
    a projection inside the heads (latent attention's up-projections), laid out by the weight's names alone."""
    node, w = w, lora.base(taps.weight_of(w), names, dtype, weight)
    return _with_adapter(_project(group, x, w, node, n_in), x, node, names, n_in, dtype)


def _project(group: str, x: jax.Array, w: jax.Array, node, contracted: int) -> jax.Array:
    """x·w over x's last `contracted` dimensions; a tapped weight (`models/taps.py`) sees its input and its
    output's cotangent."""
    return taps.pass_back(fp8.tensordot(group, taps.keep(x, node), w, axes=contracted), node)


def _with_adapter(y: jax.Array, x: jax.Array, node, names: tuple[str, ...], n_in: int, dtype) -> jax.Array:
    """y plus a LoRA node's scale·(x·A)·B (`models/lora.py`), the adapters in the compute dtype; y when the weight
    has none."""
    if not lora.is_node(node):
        return y
    return y + lora.low_rank(x, node, names, n_in, dtype, weight)


def row_parallel(h: jax.Array, w: jax.Array, names: tuple[str, ...], dtype, group: str) -> jax.Array:
    """h [batch, seq, *c] times w [*c, embed] -> [batch, seq, embed]: the contracted dimensions are
    split over tp, so the result is a sum over tp (all-reduced, or reduce-scattered along the
    sequence into the residual stream under sequence parallelism)."""
    node, w = w, lora.base(taps.weight_of(w), names, dtype, weight)
    layout = current_layout()
    if layout is not None and layout.collective_matmul:
        y = collective_matmul.matmul_reduce_scatter(h, w, names, layout)
        return _with_adapter(y, h, node, names, w.ndim - 1, dtype)
    return _with_adapter(_project(group, h, w, node, w.ndim - 1), h, node, names, w.ndim - 1, dtype)


def add_bias(y: jax.Array, p: dict, name: str, names: tuple[str, ...] | None, dtype) -> jax.Array:
    """y plus a projection's bias where the parameters have one (`model.mlp_bias`, `model.attn_bias`).
    A bias added after a row-parallel sum (names None) is used replicated, as it is stored."""
    if name not in p:
        return y
    return y + (p[name].astype(dtype) if names is None else weight(p[name], names, dtype))


def gelu_mlp(p: dict, x: jax.Array, dtype) -> jax.Array:
    """GPT-2 feed-forward (`model.mlp = "gelu_tanh"`): column-parallel in, GELU (tanh form), row-parallel out."""
    (h,) = column_parallel(x, [(p["w_in"], ("embed", "mlp"))], dtype, "mlp")
    h = add_bias(h, p, "b_in", ("mlp",), dtype)
    h = checkpoint_name(constrain(gelu_tanh(h), ("batch", "seq", "mlp")), "mlp_hidden")
    return add_bias(row_parallel(h, p["w_out"], ("mlp", "embed"), dtype, "mlp"), p, "b_out", None, dtype)


def gated_mlp(p: dict, x: jax.Array, dtype, mlp: str, limit: float = 0.0) -> jax.Array:
    """A gated feed-forward: activation(x W_gate + b) * (x W_up + b), then W_down. LLaMA's SwiGLU (silu),
    Gemma's GeGLU (tanh GELU) and gpt-oss's clamped SwiGLU (`ops/activations.glu`)."""
    gate, up = column_parallel(x, [(p["w_gate"], ("embed", "mlp")), (p["w_up"], ("embed", "mlp"))], dtype,
                               "mlp")
    gate, up = add_bias(gate, p, "b_gate", ("mlp",), dtype), add_bias(up, p, "b_up", ("mlp",), dtype)
    h = checkpoint_name(constrain(glu(mlp, gate, up, limit), ("batch", "seq", "mlp")), "mlp_hidden")
    return add_bias(row_parallel(h, p["w_down"], ("mlp", "embed"), dtype, "mlp"), p, "b_down", None, dtype)


MLPS = ("gelu_tanh", *GLUS)  # `model.mlp`


def feed_forward(m):
    """The dense feed-forward of `model.mlp`: p, x [b, s, D], dtype -> [b, s, D]."""
    if m.mlp == "gelu_tanh":
        return gelu_mlp
    return functools.partial(gated_mlp, mlp=m.mlp, limit=m.mlp_limit)
