"""The gradient paths of a train step: one batch in, (loss, metric shares, auxiliary terms, gradients) out.

    batch ──zig-zag (sp, load balance)──► count = objective.count(batch)
      │
      ├─ pp > 1 ─────────────────────────► pipelined          (parallel/pipeline.py island)
      ├─ microbatches = 1 ───────────────► one_batch          (the partitioner places the reductions)
      ├─ ZeRO-0/1, microbatches > 1, ────► island_accumulation (parallel/accumulation.py: one all-reduce,
      │  or any train.allreduce but xla                         or train.allreduce's rounds)
      ├─ ZeRO-3 with train.zeropp or ────► zeropp_accumulation (parallel/zeropp.py island: its own gathers
      │  precision.grad_reduce=float32                          and reduce-scatters: int8, hierarchical, fp32)
      └─ ZeRO-2/3, microbatches > 1 ─────► sharded_accumulation (reduce-scatter into a sharded buffer)

Every path evaluates `loss_share` on its rows: the objective's sum divided by the *global*
count (so microbatches add up to the mean over the whole batch), plus the model's auxiliary
losses (MoE) divided by the number of microbatches, times the loss scale when there is one
(`trainer/guard.py`; the gradients come out scaled, the reported loss does not). Every path sums the objective's metric
shares and the blocks' auxiliary terms like the loss. The batch is a dict of fields
(`jaxllm/batch.py`), split and reordered field by field, none read here by name.

A sequence objective (DPO: `trainer/preference.py`) runs its sequence stage inside the loss head, once per call on
whole rows: once per batch on `one_batch`, per microbatch on the accumulations (on each device's own rows in the
islands), per pipeline microbatch on the last stage. A pair lies within a row, so each call's pairs are whole and
its results add up like token sums; the count (pairs) comes from the whole batch as every count does.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm import stack as stack_lib
from jaxllm.models import lora, mtp, taps, transformer
from jaxllm.parallel import allreduce, pipeline, zeropp
from jaxllm.parallel.accumulation import reduce_once
from jaxllm.sharding import Layout, constrain, is_names, logical_spec, use_layout, with_rule
from jaxllm.trainer.objectives import Objective, finish, zero_metrics


@dataclass(frozen=True)
class Paths:
    """What the gradient paths need, fixed when the step is built (`trainer/step.py`)."""

    model: Any  # ModelConfig
    dtype: Any  # the compute dtype
    objective: Objective
    microbatches: int
    loss_chunk: int
    zero_stage: int
    layout: Layout  # the step's layout
    grad_shardings: Any  # where gradients end: replicated (ZeRO-0/1) or sharded over fsdp (ZeRO-2/3)
    grad_rules: Any  # the rules behind grad_shardings, for the pipeline island's specs
    batch_shards: int  # dp × fsdp × ep
    microbatch_sharding: Any  # [microbatches, rows, seq] with the rows over the batch axes
    order: Any = None  # zig-zag order of the sequence (context parallelism with load balance), or None
    schedule: Any = None  # the pipeline's table when pp > 1
    pp_gather_once: bool = False
    fp8: frozenset = frozenset()  # the weight matmul groups run in fp8 (precision.matmul, ops/fp8.py)
    allreduce: str = "xla"  # the ZeRO-0/1 gradient all-reduce (train.allreduce, parallel/allreduce.py)
    bucket_bytes: int = 25 << 20  # train.bucket_mb
    zeropp: Any = None  # a parallel/zeropp.py Plan when train.zeropp or precision.grad_reduce=float32 asks for it
    mtp_weight: float = 0.0  # train.mtp_weight, with model.mtp_depth > 0 (models/mtp.py)
    trainable: Any = None  # a tree of bools like the parameters: what is differentiated (`models/lora.py`)
    seed: int = 0  # train.seed: salts LoRA's adapter dropout with the step

    @property
    def local_layout(self) -> Layout:
        """The layout inside an island manual over the batch axes: activations carry no batch sharding."""
        return dataclasses.replace(self.layout, activations=with_rule(self.layout.activations, "batch", ()),
                                   manual=True)


def constrain_tree(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def split_microbatches(x: jax.Array, microbatches: int, shards: int) -> jax.Array:
    """[B, ...] -> [microbatches, B/microbatches, ...], each device's own rows split in order.

    Rows of shard d are d*B/shards ... (d+1)*B/shards; microbatch k takes the k-th slice of
    every shard's rows, so no row moves between devices.
    """
    b = x.shape[0]
    rows = b // (shards * microbatches)
    x = x.reshape(shards, microbatches, rows, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(microbatches, shards * rows, *x.shape[3:])


def loss_share(params, batch: dict, norm, g: Paths):
    """This batch's objective sum divided by the global batch's count (dividing inside the loss scales the
    scalar cotangent, not every gradient afterwards), plus this microbatch's share of the model's
    auxiliary losses, times the loss scale. `norm` is (count, scale). Aux: (that objective share, metric
    shares, the blocks' auxiliary terms), unscaled."""
    (count, scale), o = norm, g.objective
    with lora.dropout_salt(batch):
        total, sums, aux = mtp.forward(params, batch, g.model, g.dtype, o.token_terms, g.loss_chunk, o.temperature,
                                       g.mtp_weight, functools.partial(finish, o))
    # The scale enters as count / S, and the step passes S (1 when not scaling) as data, so a scaled and an
    # unscaled run compile one program and, S a power of two, every gradient is exactly S times the other's.
    denom = count / scale
    share = total / denom
    shares = {k: v / denom / scale for k, v in sums.items()}
    aux_loss = transformer.aux_loss(aux, g.model) / g.microbatches
    return share + aux_loss * scale, (share / scale, shares, aux)


def _value_and_grad(params, batch, norm, g: Paths):
    """Gradients of the trainable part of the parameters alone (under LoRA, the adapters')."""
    train, frozen = lora.split(params, g.trainable)
    share = lambda t: loss_share(lora.combine(t, frozen), batch, norm, g)
    (_, (loss, metrics, aux)), grads = jax.value_and_grad(share, has_aux=True)(train)
    return loss, metrics, aux, grads


def one_batch(params, batch: dict, norm, g: Paths):
    loss, metrics, aux, grads = _value_and_grad(params, batch, norm, g)
    return loss, metrics, aux, constrain_tree(grads, g.grad_shardings)


def accumulate(params, batch: dict, norm, g: Paths, shards: int, pin_grads, pin_microbatches):
    """Sums of (loss, metric shares, auxiliary terms, gradients) over `g.microbatches` microbatches (a scan)."""
    mbs = jax.tree.map(lambda x: pin_microbatches(split_microbatches(x, g.microbatches, shards)), batch)

    def body(carry, mb):
        loss, metrics, aux, acc = carry
        s, ms, a, grads = _value_and_grad(params, mb, norm, g)
        add = lambda x, y: jax.tree.map(jnp.add, x, y)
        return (loss + s, add(metrics, ms), add(aux, a), pin_grads(add(acc, grads))), None

    zeros = pin_grads(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),  # fp32 even for hpZ's copy
                                   lora.split(params, g.trainable)[0]))
    (loss, metrics, aux, grads), _ = jax.lax.scan(
        body, (jnp.float32(0), {**zero_metrics(g.objective, batch), **mtp.zero_metrics(g.model, batch)},
               transformer.zero_aux(g.model), zeros), mbs)
    return loss, metrics, aux, grads


def accumulate_own_rows(g: Paths):
    """`accumulate` inside an island manual over the batch axes: this device's rows, nothing pinned."""
    return lambda p, b, n: accumulate(p, b, n, g, 1, lambda t: t, lambda x: x)


def island_accumulation(params, batch: dict, norm, g: Paths):
    """ZeRO-0/1: each device accumulates its own rows, then one all-reduce over the batch axes (`psum`, or
    the hand-built algorithm `train.allreduce` names)."""
    local = accumulate_own_rows(g)
    reduce = lambda tree, axes: allreduce.all_reduce_tree(tree, g.allreduce, axes, "dp", g.bucket_bytes)
    return reduce_once(local, params, batch, norm, g.local_layout, reduce)


def zeropp_accumulation(params, batch: dict, norm, g: Paths):
    """ZeRO++: each device accumulates its own rows inside the island of `parallel/zeropp.py`, which gathers
    each weight where it is used and reduce-scatters its gradient there (int8 with qwZ / qgZ)."""
    local = accumulate_own_rows(g)
    names = transformer.param_names(g.model)
    loss, metrics, aux, grads = zeropp.island(local, params, batch, norm, names, g.local_layout, g.zeropp, g.dtype,
                                              lora.split(names, g.trainable)[0])
    return loss, metrics, aux, constrain_tree(grads, g.grad_shardings)


def sharded_accumulation(params, batch: dict, norm, g: Paths):
    """ZeRO-2/3: the accumulator is sharded over fsdp, so each microbatch is reduce-scattered into it."""
    return accumulate(params, batch, norm, g, g.batch_shards, lambda t: constrain_tree(t, g.grad_shardings),
                      lambda x: jax.lax.with_sharding_constraint(x, g.microbatch_sharding))


def _island_specs(key: str, rules, g: Paths, names, shapes):
    """Specs of the params under `key` ("blocks" or the rest) inside the pipeline island: pp is manual
    there, so a stack leaf [v, R/v, ...] gets two leading Nones in place of its layer dimension, and the
    leading segments' layers (replicated over pp there, as the embedding is) none."""
    pick = (lambda tree: tree["blocks"]) if key == "blocks" else (
        lambda tree: {k: v for k, v in tree.items() if k != "blocks"})
    lead = 1 if key == "blocks" else 0
    rules = rules if key == "blocks" else with_rule(rules, "layers", ())
    mesh = g.layout.mesh
    return jax.tree.map(
        lambda n, a: jax.sharding.PartitionSpec(*(None,) * (2 * lead),
                                                *logical_spec(tuple(n[lead:]), rules, mesh, a.shape[lead:])),
        pick(names), pick(shapes), is_leaf=is_names)


def _pipelined_params(tree, m):
    """The parameters (or a tree like them) as the pipeline takes them: the last segment's blocks under "blocks",
    the blocks of the segments before it under "lead_blocks" (run on the first stage, after the embedding)."""
    last = stack_lib.segments(m)[-1]
    return {**{k: a for k, a in tree.items() if k != "blocks"}, "lead_blocks": tree["blocks"][:last.first_block],
            "blocks": tree["blocks"][last.blocks]}


def pipelined(params, batch: dict, norm, g: Paths):
    """(loss, metric shares, the blocks' auxiliary terms, gradients) through the pipeline executor over pp. The
    executor divides by the count; a loss scale S enters as count / S (exact: S is a power of two)."""
    (count, scale), m, dtype, o = norm, g.model, g.dtype, g.objective
    names = _pipelined_params(transformer.param_names(m), m)
    shapes = _pipelined_params(transformer.param_shapes(m), m)
    *lead, last = stack_lib.segments(m)
    moe_layers = sum(map(stack_lib.is_moe, stack_lib.layer_kinds(m))) + mtp.moe_layers(m)
    # as in the accumulation island, reduce over the batch axes once; not MoE's whole-batch routing statistics
    batch_manual = g.zero_stage <= 1 and not stack_lib.has_moe(m)
    inner = g.local_layout if batch_manual else dataclasses.replace(g.layout, manual=True)
    mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        split_microbatches(x, g.microbatches, g.batch_shards), g.microbatch_sharding), batch)
    train, frozen = (_pipelined_params(t, m) for t in lora.split(params, g.trainable))
    masks = _pipelined_params(g.trainable, m)
    mask = {"blocks": masks["blocks"], "shared": {k: v for k, v in masks.items() if k != "blocks"}}
    grad_specs = [lora.split(_island_specs(k, g.grad_rules, g, names, shapes), mask[k])[0]
                  for k in ("blocks", "shared")]

    def gather_once(stack, shared, stack_f, shared_f):
        """ZeRO-3: the stage's weights cast and gathered over fsdp once, before the loop."""
        def use(tree, tree_f, key):
            specs = _island_specs(key, g.layout.weights, g, names, shapes)
            used = jax.tree.map(lambda a, sp: jax.lax.with_sharding_constraint(a.astype(dtype), sp),
                                lora.combine(tree, tree_f), specs)
            return lora.split(used, mask[key])

        (stack, stack_f), (shared, shared_f) = use(stack, stack_f, "blocks"), use(shared, shared_f, "shared")
        return stack, shared, stack_f, shared_f

    def lead_fn(sh, x, mb):  # the segments before the pipelined one
        if not lead:
            return x, transformer.zero_aux(m)
        with lora.dropout_salt(mb):
            return transformer.blocks(sh["lead_blocks"], x, mb["positions"], mb["segment_ids"], m, dtype,
                                      segments=lead)

    loss, metrics, aux, grads = pipeline.loss_and_grads(
        train, mbs, (count / scale, scale / g.microbatches), g.schedule, inner,
        embed_fn=lambda sh, mb: transformer.embed(sh, mb["inputs"], mb["positions"], m, dtype),
        lead_fn=lead_fn, leading=bool(lead),
        blocks_fn=lambda ch, x, mb, first: _salted_blocks(ch, x, mb, first, m, dtype, last),
        loss_fn=lambda sh, x, mb, trail=None: mtp.output_terms(sh, x, mb, m, dtype, o.token_terms, g.loss_chunk,
                                                               o.temperature, g.mtp_weight,
                                                               functools.partial(finish, o), trail),
        trail_fn=(lambda sh, x, mb: mtp.trunk(sh, x, mb, m, dtype)) if m.mtp_depth else None,
        aux_fn=lambda stats, weight: transformer.aux_loss(stats, m, moe_layers) * weight,
        pin_grads=lambda gs, gsh: (constrain_tree(gs, grad_specs[0]), constrain_tree(gsh, grad_specs[1])),
        batch_manual=batch_manual,
        gather_once=gather_once if g.pp_gather_once and g.zero_stage == 3 else None, frozen=frozen, join=lora.combine,
        taps=taps.Taps(names["blocks"]) if g.schedule.split else None)
    loss, metrics = loss / scale, jax.tree.map(lambda v: v / scale, metrics)
    grads = {**{k: a for k, a in grads.items() if k not in ("blocks", "lead_blocks")},
             "blocks": [*grads["lead_blocks"], *grads["blocks"]]}
    return loss, metrics, aux, constrain_tree(grads, g.grad_shardings)


def _salted_blocks(chunk, x, mb: dict, first, m, dtype, last):
    """A pipeline chunk of the last segment on microbatch `mb` (its LoRA dropout salted by `mb`'s salt)."""
    with lora.dropout_salt(mb):
        return transformer.blocks(chunk, x, mb["positions"], mb["segment_ids"], m, dtype, first, segments=(last,))


def uses_island(zero_stage: int, microbatches: int, allreduce: str, moe: bool = False) -> bool:
    """Whether a step without a pipeline takes its gradients through the accumulation island: ZeRO-0/1 with
    several microbatches or a hand-built all-reduce, but not MoE, whose routing statistics are over each
    microbatch's rows on every device (it takes the compiler's accumulation, an all-reduce per microbatch)."""
    return zero_stage <= 1 and (microbatches > 1 or allreduce != "xla") and not moe


def path_of(g: Paths):
    """The gradient path this configuration takes."""
    if g.schedule is not None:
        return pipelined
    if g.zeropp is not None:
        return zeropp_accumulation
    if uses_island(g.zero_stage, g.microbatches, g.allreduce, stack_lib.has_moe(g.model)):
        return island_accumulation
    return one_batch if g.microbatches == 1 else sharded_accumulation


def loss_and_grads(params, batch: dict, g: Paths, scale, step=0):
    """(loss, metric shares, auxiliary terms summed over layers and microbatches, gradients of the whole
    objective times `scale`, a power of two, 1 when not scaling) over the global batch, on the step's layout;
    `step` salts LoRA's adapter dropout."""
    with use_layout(g.layout):
        batch = lora.salted(batch, g.model, g.seed, step, lambda a: constrain(a, ("batch", "seq")))
        batch = in_model_order(mtp.with_fields(batch, g.model.mtp_depth), g)
        return path_of(g)(params, batch, (g.objective.count(batch), scale), g)


def in_model_order(batch: dict, g: Paths) -> dict:
    """The batch as the model sees it: with load-balanced context parallelism, every field in zig-zag order."""
    return batch if g.order is None else {k: v[:, g.order] for k, v in batch.items()}
