"""The train step: one function for every ZeRO stage and mesh; only shardings differ.

State is `{"step", "params", "opt_state"}` with fp32 parameters (the master copy) and
fp32 optimizer state. Per `train.zero_stage`, over the `fsdp` axis:

| stage | params | grads (and accumulation buffer) | optimizer state |
|---|---|---|---|
| 0 | replicated | replicated (all-reduce, once per step) | replicated |
| 1 | replicated | replicated (all-reduce, once per step) | sharded |
| 2 | replicated | sharded (reduce-scatter) | sharded |
| 3 | sharded, gathered at use | sharded (reduce-scatter) | sharded |

Tensor-parallel dimensions stay sharded over `tp` in every stage. The loss is the
language-model loss summed over all tokens of the global batch and divided by their
count, so microbatching and data sharding do not change it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.config import Config, batch_shards
from jaxllm.models import moe as moe_lib
from jaxllm.models import transformer
from jaxllm.parallel import pipeline
from jaxllm.parallel.accumulation import reduce_once
from jaxllm.parallel.pipeline_schedules import make_schedule
from jaxllm.parallel.load_balance import zigzag_order
from jaxllm.sharding import BATCH_AXES, Layout, activation_rules, logical_spec, param_rules, use_layout, with_rule
from jaxllm.train.optimizer import learning_rate, make_optimizer


def lm_batch(tokens: jax.Array) -> dict:
    """Model inputs from a [batch, seq+1] window of tokens (pretraining: every token counts)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    return {
        "inputs": inputs,
        "targets": targets,
        "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        "segment_ids": jnp.zeros((b, t), jnp.int32),
        "loss_mask": jnp.ones((b, t), jnp.float32),
    }


def split_microbatches(x: jax.Array, microbatches: int, shards: int) -> jax.Array:
    """[B, ...] -> [microbatches, B/microbatches, ...], each device's own rows split in order.

    Rows of shard d are d*B/shards ... (d+1)*B/shards; microbatch k takes the k-th slice of
    every shard's rows, so no row moves between devices.
    """
    b = x.shape[0]
    rows = b // (shards * microbatches)
    x = x.reshape(shards, microbatches, rows, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(microbatches, shards * rows, *x.shape[3:])


def optimizer_state_shardings(abstract_opt, table, layout: Layout, rules):
    """Each optimizer-state leaf laid out as its parameter under `rules`, matched by tree path: a state
    leaf belongs to the parameter whose path ends its own (`...mu['blocks'][0]['attn']['wq']`) and
    whose shape it has. The rest (step counts, Adafactor's factored statistics) are replicated.
    (Matching by shape alone would confuse parameters of equal shape and different layouts, such as
    [embed, mlp] and [mlp, embed] with d_ff = d_model.)"""
    params = {jax.tree_util.keystr(path): leaf for path, leaf in
              jax.tree_util.tree_leaves_with_path(table, is_leaf=lambda x: isinstance(x, transformer.Leaf))}

    def one(path, leaf):
        key = jax.tree_util.keystr(path)
        owners = [p for p, spec in params.items() if key.endswith(p) and spec.shape == leaf.shape]
        if not owners:
            return NamedSharding(layout.mesh, P())
        return layout.sharding(params[max(owners, key=len)].names, rules, leaf.shape)

    return jax.tree_util.tree_map_with_path(one, abstract_opt)


@dataclass
class StepFns:
    """Everything compiled for one config on one mesh."""

    layout: Layout
    tx: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    grad_shardings: Any
    init: Callable  # (seed) -> state
    train_step: Callable  # (state, tokens) -> (state, metrics)
    loss_and_grads: Callable  # (params, tokens) -> (loss, grads), the step's own gradient path
    eval_loss: Callable  # (params, tokens) -> (sum, count)
    abstract_state: Any
    schedule: Any = None  # the pipeline's Schedule table when mesh.pp > 1


def make_step_fns(cfg: Config, mesh) -> StepFns:
    m, t = cfg.model, cfg.train
    dtype = jnp.dtype(cfg.precision.compute)
    if dtype == jnp.float32:
        # fp32 must mean fp32 on GPU too (no TF32 matmuls).
        jax.config.update("jax_default_matmul_precision", "highest")
    stage = t.zero_stage
    layout = Layout(mesh=mesh, params=param_rules(shard_over_fsdp=stage == 3),
                    activations=activation_rules(t.sequence_parallel), collective_matmul=m.collective_matmul,
                    context_attention=m.cp_strategy)
    sharded = param_rules(shard_over_fsdp=True)
    table = transformer.param_table(m)
    names = transformer.param_names(m)
    shapes = transformer.param_shapes(m)
    replicated = NamedSharding(mesh, P())

    def shardings(rules):
        return jax.tree.map(lambda n, s: layout.sharding(n, rules, s.shape), names, shapes,
                            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x))

    param_sh = shardings(layout.params)
    opt_param_sh = shardings(sharded if stage >= 1 else layout.params)
    grad_sh = shardings(sharded if stage >= 2 else layout.params)

    tx = make_optimizer(t, table)
    lr_fn = learning_rate(t)
    abstract_opt = jax.eval_shape(tx.init, shapes)

    opt_sh = optimizer_state_shardings(abstract_opt, table, layout, sharded if stage >= 1 else layout.params)
    state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
    batch_sh = NamedSharding(mesh, P(BATCH_AXES))
    shards = batch_shards(dict(mesh.shape))
    microbatch_sh = NamedSharding(mesh, P(None, BATCH_AXES))
    # inside the accumulation island the batch axes are manual: activations carry no batch sharding
    local_layout = dataclasses.replace(layout, activations=with_rule(layout.activations, "batch", ()), manual=True)

    schedule = (make_schedule(t.pp_schedule, mesh.shape["pp"], t.microbatches, t.pp_virtual)
                if mesh.shape["pp"] > 1 else None)
    sp = mesh.shape["sp"]
    order = zigzag_order(m.seq_len, sp) if sp > 1 and m.cp_load_balance else None

    def model_batch(tokens):
        """The batch as the model sees it: with load-balanced context parallelism, in zig-zag order."""
        batch = lm_batch(tokens)
        return batch if order is None else {k: v[:, order] for k, v in batch.items()}

    def constrain_tree(tree, sh):
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, sh)

    moe = "moe" in m.pattern
    no_stats = moe_lib.zero_stats(m) if moe else {}

    def loss_share(params, batch, count):
        """This batch's token losses summed and divided by the global batch's token count (dividing
        inside the loss scales the scalar cotangent, not every gradient afterwards), plus this
        microbatch's share of the MoE auxiliary losses. Aux: (that token-loss share, router statistics)."""
        total, _, stats = transformer.forward_loss(params, batch, m, dtype, t.loss_chunk)
        share = total / count
        return share + moe_lib.objective(stats, m) / t.microbatches, (share, stats)

    def accumulate(params, batch, count, shards, pin_grads, pin_microbatches):
        """Sums of (loss, router statistics, gradients) over `train.microbatches` microbatches (a scan)."""
        mbs = jax.tree.map(lambda x: pin_microbatches(split_microbatches(x, t.microbatches, shards)), batch)

        def body(carry, mb):
            total, stats, acc = carry
            (_, (s, st)), g = jax.value_and_grad(loss_share, has_aux=True)(params, mb, count)
            return (total + s, jax.tree.map(jnp.add, stats, st), pin_grads(jax.tree.map(jnp.add, acc, g))), None

        zeros = pin_grads(jax.tree.map(jnp.zeros_like, params))
        (total, stats, grads), _ = jax.lax.scan(body, (jnp.float32(0), no_stats, zeros), mbs)
        return total, stats, grads

    def loss_grads_stats(params, tokens):
        """(language-model loss, gradients of the whole objective, router statistics summed over layers
        and microbatches; empty for a dense model)."""
        with use_layout(layout):
            batch = model_batch(tokens)
            count = jnp.sum(batch["loss_mask"])
            if mesh.shape["pp"] > 1:
                loss, grads = pipelined(params, batch, count)
                return loss, constrain_tree(grads, grad_sh), no_stats
            if t.microbatches == 1:
                (_, (loss, stats)), grads = jax.value_and_grad(loss_share, has_aux=True)(params, batch, count)
                grads = constrain_tree(grads, grad_sh)
            elif stage <= 1:  # reduce each device's partial sums once per step
                loss, stats, grads = reduce_once(
                    lambda p, b, c: accumulate(p, b, c, 1, lambda g: g, lambda x: x), params, batch, count,
                    local_layout)
            else:  # ZeRO-2/3: the accumulator is sharded, so each microbatch is reduce-scattered into it
                loss, stats, grads = accumulate(params, batch, count, shards, lambda g: constrain_tree(g, grad_sh),
                                                lambda x: jax.lax.with_sharding_constraint(x, microbatch_sh))
            return loss, grads, stats

    def loss_and_grads(params, tokens):
        return loss_grads_stats(params, tokens)[:2]

    def pipelined(params, batch, count):
        """(loss, grads) through the pipeline executor over pp (parallel/pipeline.py)."""
        batch_manual = stage <= 1  # as in the accumulation island: reduce over the batch axes once
        inner = local_layout if batch_manual else dataclasses.replace(layout, manual=True)
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            split_microbatches(x, t.microbatches, shards), microbatch_sh), batch)

        def island_specs(key, rules):
            """Specs of the params under `key` ("blocks" or the rest) inside the island: pp is manual there,
            so a stack leaf [v, R/v, ...] gets two leading Nones in place of its layer dimension."""
            pick = (lambda tree: tree["blocks"]) if key == "blocks" else (
                lambda tree: {k: v for k, v in tree.items() if k != "blocks"})
            lead = 1 if key == "blocks" else 0
            return jax.tree.map(
                lambda n, a: P(*(None,) * (2 * lead), *logical_spec(tuple(n[lead:]), rules, mesh, a.shape[lead:])),
                pick(names), pick(shapes), is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x))

        grad_rules = sharded if stage >= 2 else layout.params
        stack_grad_specs, shared_grad_specs = island_specs("blocks", grad_rules), island_specs("shared", grad_rules)

        def pin_grads(g_stack, g_shared):
            return constrain_tree(g_stack, stack_grad_specs), constrain_tree(g_shared, shared_grad_specs)

        def gather_once(stack, shared):
            """ZeRO-3: the stage's weights cast and gathered over fsdp once, before the loop."""
            use = lambda tree, specs: jax.tree.map(lambda a, sp: jax.lax.with_sharding_constraint(a.astype(dtype), sp),
                                                   tree, specs)
            return (use(stack, island_specs("blocks", layout.weights)),
                    use(shared, island_specs("shared", layout.weights)))

        return pipeline.loss_and_grads(
            params, mbs, count, schedule, inner,
            embed_fn=lambda sh, mb: transformer.embed(sh, mb["inputs"], mb["positions"], m, dtype),
            blocks_fn=lambda ch, x, mb: transformer.blocks(ch, x, mb["positions"], mb["segment_ids"], m, dtype)[0],
            loss_fn=lambda sh, x, mb: transformer.head_loss(sh, x, mb["targets"], mb["loss_mask"], m, dtype,
                                                            t.loss_chunk)[0],
            pin_grads=pin_grads, batch_manual=batch_manual,
            gather_once=gather_once if t.pp_gather_once and stage == 3 else None)

    def train_step(state, tokens):
        params, opt_state = state["params"], state["opt_state"]
        loss, grads, stats = loss_grads_stats(params, tokens)
        grad_norm = optax.tree.norm(grads)
        if stage in (1, 2):  # ZeRO-1/2: each fsdp rank updates its own shard, then params are gathered
            grads = constrain_tree(grads, opt_param_sh)
        updates, opt_state = tx.update(grads, opt_state, params)
        if stage in (1, 2):
            updates = constrain_tree(updates, opt_param_sh)
        params = constrain_tree(optax.apply_updates(params, updates), param_sh)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_fn(state["step"]), **moe_lib.metrics(stats)}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    def eval_loss(params, tokens):
        with use_layout(layout):
            return transformer.forward_loss(params, model_batch(tokens), m, dtype, t.loss_chunk)[:2]

    def init(seed):
        params = transformer.init_params(m, jax.random.key(seed))
        return {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}

    abstract_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                  jax.eval_shape(init, 0), state_sh)
    return StepFns(
        layout=layout,
        tx=tx,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        grad_shardings=grad_sh,
        init=jax.jit(init, static_argnums=0, out_shardings=state_sh),
        train_step=jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                           donate_argnums=0),
        loss_and_grads=jax.jit(loss_and_grads, in_shardings=(param_sh, batch_sh), out_shardings=(replicated, grad_sh)),
        eval_loss=jax.jit(eval_loss, in_shardings=(param_sh, batch_sh), out_shardings=replicated),
        abstract_state=abstract_state,
        schedule=schedule,
    )
