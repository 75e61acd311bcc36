"""ZeRO++ (`train.zeropp`): ZeRO-3's step as a shard_map island whose gathers and reduce-scatters are
written out, so they can move int8 (qwZ, qgZ), stay inside one fsdp group (hpZ), or reduce the gradients
in fp32 whatever the compute dtype (`precision.grad_reduce = float32`).

Axis: manual over the batch axes dp, fsdp, ep (tp, sp, ep and pp > 1 are refused for now). Each device
runs the forward and backward on its own rows; a weight sharded over fsdp is gathered where `weight()`
uses it (`sharding.weight` calls `gather` through the layout), and that gather's custom VJP is the
gradient's reduce-scatter, so the cotangent it reduces is each device's own partial sum.
(A use-site island over fsdp alone would receive a cotangent the partitioner had already all-reduced.)

Collectives, for a weight leaf of P elements (its shard P/F on each of F fsdp devices), block b, compute
dtype of d bytes; per device and per use (forward; again in the backward under remat):
- the gather: all-gather over fsdp of int8 blocks + fp32 scales with qwZ, P·(1 + 4/b) bytes received
  in all, else of the compute dtype, P·d;
- the gradient, in the backward: with qgZ an all-to-all over fsdp of int8 blocks + scales (each device
  sends (F-1)/F · P·(1 + 4/b)), dequantised and summed in fp32; else a reduce-scatter in the compute dtype
  (in fp32 with `precision.grad_reduce = float32`).
Once per step: one-dimensional leaves (norm scales, output biases: tiny) are all-gathered over fsdp in
fp32 before the microbatch loop and their gradients reduce-scattered after it; with hpZ every weight's
secondary copy is all-gathered over dp in the compute dtype (P·d over the step) and its gradient
reduce-scattered over dp in fp32; gradients are psum'ed over the batch axes they are replicated over,
the loss and metrics over all of them.

hpZ keeps the fp32 master and the optimizer state sharded over fsdp × dp (`embed` over ("fsdp", "dp"),
fsdp major), so the secondary copy gathered over dp is exactly the fsdp shard plain ZeRO-3 would hold.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ConfigError
from jaxllm.ops.quantize import dequantize, quantize
from jaxllm.stack import has_moe
from jaxllm.sharding import BATCH_AXES, Layout, is_names, manual_spec, use_layout


@dataclass(frozen=True)
class Plan:
    """What the island does: `train.zeropp`'s switches and `precision.grad_reduce`."""

    weights: bool  # qwZ: weight gathers move int8 blocks
    grads: bool  # qgZ: gradient reduce-scatters move int8 blocks (an all-to-all)
    hpz: bool  # hpZ: master sharded over fsdp × dp, a compute-dtype secondary copy over fsdp
    block: int  # elements per quantization block
    reduce_fp32: bool = False  # the unquantized gradient reduce-scatter in fp32 (precision.grad_reduce)

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes the stored `embed` dimension is split over."""
        return ("fsdp", "dp") if self.hpz else ("fsdp",)


def plan_of(cfg) -> Plan | None:
    """What `train.zeropp` and `precision.grad_reduce` ask of the island, or None when it is not needed."""
    z = cfg.train.zeropp
    p = Plan(z.weights, z.grads, z.hpz, z.block, cfg.precision.grad_reduce == "float32")
    return p if (p.weights or p.grads or p.hpz or p.reduce_fp32) else None


# ---------------------------------------------------------------- the use-site gather and its transpose


def _split(x: jax.Array, axis: int, parts: int) -> jax.Array:
    """[..., n, ...] -> [parts, ..., n/parts, ...]: the shards of x along `axis`, in order."""
    shape = x.shape[:axis] + (parts, x.shape[axis] // parts) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _join(parts: jax.Array, axis: int) -> jax.Array:
    """The inverse of `_split`: [parts, ..., m, ...] -> [..., parts·m, ...]."""
    x = jnp.moveaxis(parts, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def quantized_all_gather(w: jax.Array, axis: int, block: int, axis_name="fsdp") -> jax.Array:
    """The shards of w along `axis` from every device of `axis_name`, moved as int8 blocks, fp32 out."""
    q, s = quantize(w, block)
    parts = dequantize(jax.lax.all_gather(q, axis_name), jax.lax.all_gather(s, axis_name), w.shape)
    return _join(parts, axis)


def quantized_reduce_scatter(g: jax.Array, axis: int, block: int, axis_name="fsdp") -> jax.Array:
    """The sum over `axis_name` of g, this device's shard along `axis`: each shard-sized chunk quantized
    in blocks, sent to its owner by one all-to-all, dequantised and summed there in fp32."""
    n = jax.lax.axis_size(axis_name)
    chunks = _split(g, axis, n)
    q, s = jax.vmap(lambda c: quantize(c, block))(chunks)
    q = jax.lax.all_to_all(q, axis_name, 0, 0, tiled=True)
    s = jax.lax.all_to_all(s, axis_name, 0, 0, tiled=True)
    return dequantize(q, s, chunks.shape[1:]).sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gather(plan: Plan, axis: int, dtype, w: jax.Array) -> jax.Array:
    """This device's fsdp shard of a weight -> the whole weight in `dtype` (qwZ: through int8 blocks)."""
    if plan.weights:
        return quantized_all_gather(w, axis, plan.block).astype(dtype)
    return jax.lax.all_gather(w.astype(dtype), "fsdp", axis=axis, tiled=True)


def _gather_fwd(plan, axis, dtype, w):
    return gather(plan, axis, dtype, w), jnp.zeros((0,), w.dtype)  # the residual only carries w's dtype


def _gather_bwd(plan, axis, dtype, residual, ct):
    if plan.grads:
        shard = quantized_reduce_scatter(ct, axis, plan.block)
    else:
        ct = ct.astype(jnp.float32) if plan.reduce_fp32 else ct
        shard = jax.lax.psum_scatter(ct, "fsdp", scatter_dimension=axis, tiled=True)
    return (shard.astype(residual.dtype),)


gather.defvjp(_gather_fwd, _gather_bwd)


def use_site_gather(plan: Plan) -> Callable:
    """The function `sharding.weight` calls for a weight with an `embed` dimension: (w, names, dtype) -> w."""
    return lambda w, names, dtype: gather(plan, names.index("embed"), jnp.dtype(dtype), w)


# ---------------------------------------------------------------- once per step: before and after the loop


def _kind(names: tuple[str, ...]) -> str:
    """'use' (an fsdp-sharded weight gathered where `weight()` uses it), 'small' (a one-dimensional leaf
    sharded over fsdp, used directly: gathered once per step) or 'replicated' (no `embed` dimension)."""
    if "embed" not in names:
        return "replicated"
    return "small" if len([n for n in names if n != "layers"]) == 1 else "use"


def enter(w: jax.Array, names: tuple[str, ...], plan: Plan, dtype) -> jax.Array:
    """A stored shard as the microbatch loop uses it: small leaves whole (fp32); with hpZ, weights as
    their secondary copy (all-gathered over dp in the compute dtype); the rest as stored."""
    kind, axis = _kind(names), names.index("embed") if "embed" in names else None
    if kind == "small":
        return jax.lax.all_gather(w, plan.shard_axes, axis=axis, tiled=True)
    if kind == "use" and plan.hpz:
        return jax.lax.all_gather(w.astype(dtype), "dp", axis=axis, tiled=True)
    return w


def leave(g: jax.Array, names: tuple[str, ...], plan: Plan) -> jax.Array:
    """The transpose of `enter` on a leaf's summed gradient, then a psum over the batch axes the stored
    leaf is replicated over: the gradient of the stored shard, reduced over the whole batch."""
    kind, axis = _kind(names), names.index("embed") if "embed" in names else None
    if kind == "small":
        g = jax.lax.psum_scatter(g, plan.shard_axes, scatter_dimension=axis, tiled=True)
    if kind == "use" and plan.hpz:
        g = jax.lax.psum_scatter(g.astype(jnp.float32), "dp", scatter_dimension=axis, tiled=True)
    rest = tuple(a for a in BATCH_AXES if (kind == "replicated" or a not in plan.shard_axes)
                 and jax.lax.axis_size(a) > 1)  # XLA keeps an all-reduce over a one-device group
    return jax.lax.psum(g, rest) if rest else g


def island(accumulate: Callable, params, batch: dict, norm, names, layout: Layout, plan: Plan, dtype, grad_names):
    """(loss, metric shares, auxiliary terms, gradients as stored) of the global batch.

    `accumulate(params, batch, norm)` sums over the microbatches of the rows it is given, under
    `layout` (the batch axes manual) with the use-site gather on; params enter as their stored shards. The
    gradients are those `grad_names` names (the trainable part: under LoRA the adapters', None elsewhere)."""
    mesh = layout.mesh
    specs_of = lambda names: jax.tree.map(  # None (a frozen leaf, no gradient) stays None
        lambda n, w: None if n is None else manual_spec(n, layout.params, mesh, w.shape, set(BATCH_AXES)),
        names, params, is_leaf=lambda x: x is None or is_names(x))
    specs = specs_of(names)
    inner = dataclasses.replace(layout, use_site_gather=use_site_gather(plan))

    def local(params, batch, norm):
        used = jax.tree.map(lambda w, n: enter(w, n, plan, dtype), params, names)
        with use_layout(inner):
            loss, metrics, aux, grads = accumulate(used, batch, norm)
        # under LoRA the frozen base has no gradient (None): nothing to reduce
        grads = jax.tree.map(lambda g, n: None if g is None else leave(g, n, plan), grads, grad_names,
                             is_leaf=lambda x: x is None)
        return jax.lax.psum((loss, metrics, aux), BATCH_AXES), grads

    grad_specs = specs_of(grad_names)
    (loss, metrics, aux), grads = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(BATCH_AXES), P()),
                                                out_specs=(P(), grad_specs), axis_names=set(BATCH_AXES),
                                                check_vma=False)(params, batch, norm)
    return loss, metrics, aux, grads


# ---------------------------------------------------------------- config


GRAD_REDUCE = ("compute", "float32")  # precision.grad_reduce


def check_config(cfg, shape: dict) -> list[str]:
    """`train.zeropp` and `precision.grad_reduce` against the rest of the config: ConfigError (one line) for
    what the island does not support."""
    z, t, m = cfg.train.zeropp, cfg.train, cfg.model
    if z.block < 1:
        raise ConfigError(f"train.zeropp.block: must be at least 1, got {z.block}")
    if cfg.precision.grad_reduce not in GRAD_REDUCE:
        raise ConfigError(f"precision.grad_reduce: '{cfg.precision.grad_reduce}' is not one of {', '.join(GRAD_REDUCE)}")
    plan = plan_of(cfg)
    if plan is None:
        return []
    what = "train.zeropp" if (plan.weights or plan.grads or plan.hpz) else "precision.grad_reduce=float32"
    unsupported = ("train.zero_stage != 3 (the island is ZeRO-3's)" if t.zero_stage != 3 else
                   "mesh.pp > 1" if shape["pp"] > 1 else
                   "mesh.tp, mesh.sp or mesh.ep > 1" if max(shape["tp"], shape["sp"], shape["ep"]) > 1 else
                   "mixture-of-experts blocks" if has_moe(m) else
                   "model.collective_matmul" if m.collective_matmul else
                   "precision.matmul=fp8" if cfg.precision.matmul != "default" else
                   "memory offload" if cfg.memory.offload_params or cfg.memory.offload_optimizer else None)
    if unsupported:
        raise ConfigError(f"{what} with {unsupported} is not supported yet; turn it off")
    if plan.hpz and shape["dp"] < 2:
        raise ConfigError("train.zeropp.hpz needs mesh.dp > 1 (it shards the master over dp × fsdp and gathers "
                          "within fsdp); set mesh.dp or turn hpz off")
    shards = shape["fsdp"] * (shape["dp"] if plan.hpz else 1)
    if m.d_model % shards:
        raise ConfigError(f"{what}: model.d_model={m.d_model} is not divisible by the {shards} shards of "
                          "its embed dimension; pick a d_model or mesh that divides")
    return []
