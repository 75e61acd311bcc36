"""The train step, wired and compiled: one function for every ZeRO stage and mesh; only shardings differ.

State is a `TrainState` (`trainer/state.py`) with fp32 parameters (the master copy) and
fp32 optimizer state. Per `train.zero_stage`, over the `fsdp` axis:

| stage | params | grads (and accumulation buffer) | optimizer state |
|---|---|---|---|
| 0 | replicated | replicated (all-reduce, once per step) | replicated |
| 1 | replicated | replicated (all-reduce, once per step) | sharded |
| 2 | replicated | sharded (reduce-scatter) | sharded |
| 3 | sharded, gathered at use | sharded (reduce-scatter) | sharded |

Tensor-parallel dimensions stay sharded over `tp` in every stage. A step takes a batch
(`jaxllm/batch.py`) and minimises an objective (`trainer/objectives.py`, next-token
cross-entropy unless told otherwise): its sum over the global batch divided by its count, so
microbatching and data sharding do not change it. The gradient paths are
`trainer/gradients.py`. Building a step changes no global JAX setting: fp32 steps trace under
`jax.default_matmul_precision("highest")` (no TF32 on GPU) inside their own functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm import batch as batch_lib
from jaxllm import stack as stack_lib
from jaxllm.errors import ConfigError
from jaxllm.mesh import batch_shards
from jaxllm.models import attention, base_quant, lora
from jaxllm.models import moe as moe_lib
from jaxllm.models import transformer
from jaxllm.models.layers import matmul_precision
from jaxllm.ops import fp8, fp8_block, mxfp8
from jaxllm.parallel import allreduce, zeropp
from jaxllm.parallel.load_balance import zigzag_order
from jaxllm.parallel.pipeline_schedules import Schedule, make_schedule, model_chunks
from jaxllm.schema import Config
from jaxllm.sharding import BATCH_AXES, Layout, activation_rules, heads_as_used, is_names, param_rules, use_layout
from jaxllm.trainer import bias_balance, gradients, guard, offload, preference
from jaxllm.trainer.gradients import Paths, constrain_tree
from jaxllm.trainer.objectives import LANGUAGE_MODEL, Objective, finish, grpo, gspo
from jaxllm.trainer.optimizer import learning_rate, make_optimizer
from jaxllm.trainer.state import TrainState


COMPUTE_DTYPES = ("bfloat16", "float32", "float16")  # precision.compute
OBJECTIVES = ("lm", "grpo", "dpo")  # train.objective


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


@dataclass(frozen=True)
class Shardings:
    """Where each piece of the state lives for one ZeRO stage (see the table above)."""

    params: Any  # the parameters as the step uses them (on the device)
    update: Any  # parameters as the optimizer update sees them (sharded from ZeRO-1 on)
    grads: Any  # gradients and their accumulator (sharded from ZeRO-2 on)
    grad_rules: Any
    opt_state: Any  # the optimizer state as the update uses it (on the device)
    state: Any  # the whole TrainState as stored between steps (offloaded parts in host memory)


def trained(m):
    """(the trainable part of the parameter table, the mask that splits parameters into it: `models/lora.py`)."""
    table = transformer.param_table(m)
    mask = lora.trainable_mask(table, m)
    return lora.split(table, mask)[0], mask


def _shardings(cfg: Config, layout: Layout, tx) -> Shardings:
    m, stage, mesh = cfg.model, cfg.train.zero_stage, layout.mesh
    sharded = param_rules(shard_over_fsdp=True, hpz=cfg.train.zeropp.hpz)
    names, shapes = transformer.param_names(m), transformer.param_shapes(m)
    table, mask = trained(m)

    def of(rules, part=True):
        tree = jax.tree.map(lambda n, s: layout.sharding(n, rules, s.shape), names, shapes,
                            is_leaf=is_names)
        return lora.split(tree, mask)[0] if part else tree

    update_rules = sharded if stage >= 1 else layout.params
    grad_rules = sharded if stage >= 2 else layout.params
    opt = optimizer_state_shardings(jax.eval_shape(tx.init, lora.split(shapes, mask)[0]), table, layout, update_rules)
    replicated = NamedSharding(mesh, P())
    params = of(layout.params, part=False)
    guard_sh = jax.tree.map(lambda _: replicated, guard.init(cfg))
    mem = cfg.memory
    return Shardings(params=params, update=of(update_rules), grads=of(grad_rules), grad_rules=grad_rules,
                     opt_state=opt,
                     state=TrainState(step=replicated, applied=replicated, guard=guard_sh,
                                      params=offload.stored(params, mem.offload_params),
                                      opt_state=offload.stored(opt, mem.offload_optimizer)))


@dataclass
class StepFns:
    """Everything compiled for one config and objective on one mesh."""

    layout: Layout
    tx: optax.GradientTransformation
    objective: Objective
    state_shardings: Any  # a TrainState of shardings
    batch_sharding: NamedSharding  # every batch field's: rows over the batch axes
    grad_shardings: Any
    init: Callable  # (seed) -> state
    start: Callable  # (params) -> state at step 0 with a fresh optimizer (params from elsewhere; donated)
    device_params: Callable  # (params as stored) -> params on the device, for programs besides the step
    fresh_guard: Callable  # () -> the guard a new run starts with (for checkpoints saved before it existed)
    with_adapters: Callable  # (base params) -> parameters with fresh adapters of the run's seed (LoRA; else as given)
    base_shardings: Any  # the base model's parameters (without adapters, unquantized) laid out as stored
    train_step: Callable  # (state, batch) -> (state, metrics)
    loss_and_grads: Callable  # (params, batch) -> (loss, metrics, grads), the step's own gradient path
    eval_loss: Callable  # (params, batch) -> (sum, count, metric sums) on validation (`eval_loss`)
    token_logp: Callable  # (params, batch) -> [batch, seq] log-probabilities of the targets (GRPO)
    logits: Callable  # (params, batch) -> [batch, seq, vocabulary] fp32 logits of the inputs
    abstract_state: Any
    schedule: Any = None  # the pipeline's Schedule table when mesh.pp > 1

    def abstract_batch(self, rows: int, seq: int) -> dict:
        """The shapes and dtypes of a batch for this step (for lowering it without data)."""
        return batch_lib.abstract(rows, seq, self.batch_sharding, self.objective.fields)


def pipeline_schedule(m, t, pp: int) -> Schedule:
    """The pipeline's table: the zero-bubble ones built for this model's per-layer costs
    (`transformer.layer_costs`), with W in one piece per layer (per repeat of the layer pattern) of a chunk."""
    chunk_layers = stack_lib.segments(m)[-1].repeats // (pp * model_chunks(t.pp_schedule, t.pp_virtual))
    return make_schedule(t.pp_schedule, pp, t.microbatches, t.pp_virtual, transformer.layer_costs(m), chunk_layers)


def sequence_order(m, sp: int) -> tuple[int, ...] | None:
    """The zig-zag order of the sequence over sp (`model.cp_load_balance`), None: in order."""
    return tuple(zigzag_order(m.seq_len, sp).tolist()) if sp > 1 and m.cp_load_balance else None


def loss_chunk(cfg: Config, shape: dict) -> int:
    """`train.loss_chunk` resolved: -1 (the default) by `transformer.default_loss_chunk`'s rule."""
    t = cfg.train
    if t.loss_chunk >= 0:
        return t.loss_chunk
    return transformer.default_loss_chunk(cfg.model, cfg.precision.compute, shape["sp"], shape["tp"])


def _paths(cfg: Config, layout: Layout, sh: Shardings, objective: Objective, platform: str) -> Paths:
    m, t, mesh = cfg.model, cfg.train, layout.mesh
    return Paths(
        model=m, dtype=jnp.dtype(cfg.precision.compute), objective=objective, microbatches=t.microbatches,
        loss_chunk=loss_chunk(cfg, dict(mesh.shape)), zero_stage=t.zero_stage, layout=layout, grad_shardings=sh.grads,
        grad_rules=sh.grad_rules, batch_shards=batch_shards(dict(mesh.shape)),
        microbatch_sharding=NamedSharding(mesh, P(None, BATCH_AXES)),
        order=None if layout.sequence_order is None else np.asarray(layout.sequence_order),
        schedule=pipeline_schedule(m, t, mesh.shape["pp"]) if mesh.shape["pp"] > 1 else None,
        pp_gather_once=t.pp_gather_once, fp8=fp8.covered_groups(cfg.precision, platform), allreduce=t.allreduce,
        bucket_bytes=int(t.bucket_mb * 2**20), zeropp=zeropp.plan_of(cfg), mtp_weight=t.mtp_weight,
        trainable=trained(m)[1], seed=t.seed)


def train_step(state: TrainState, batch: dict, *, g: Paths, sh: Shardings, tx, lr_fn, cfg) -> tuple[TrainState, dict]:
    """One optimizer step: gradients of the objective over the batch (scaled, then unscaled, when a loss
    scale is on), the update unless the guard skips it (`trainer/guard.py`), the logged metrics."""
    scale = state.guard.loss_scale  # 1 when not scaling, still data: see gradients.loss_share
    mem = cfg.memory
    old_params = offload.fetch(state.params, sh.params, mem.offload_params)
    old_opt = offload.fetch(state.opt_state, sh.opt_state, mem.offload_optimizer)
    with matmul_precision(g.dtype, g.fp8):
        loss, metrics, aux, grads = gradients.loss_and_grads(old_params, batch, g, scale, state.step)
        grads = jax.tree.map(lambda x: x / scale, grads)  # once per step, before clipping
        with_loads, grads = grads, bias_balance.without_loads(grads)  # the router biases' "gradients" are loads
        grad_norm = optax.tree.norm(grads)
        applied, finite = guard.decide(loss, grad_norm, state.guard, cfg, g.objective.spiky)
        if g.zero_stage in (1, 2):  # ZeRO-1/2: each fsdp rank updates its own shard, then params are gathered
            grads = constrain_tree(grads, sh.update)
        train, frozen = lora.split(old_params, g.trainable)
        with jax.named_scope("optimizer"):  # the scopes name the step's parts in profiler traces
            updates, opt_state = tx.update(grads, old_opt, train)
            if g.zero_stage in (1, 2):
                updates = constrain_tree(updates, sh.update)
            params = lora.combine(optax.apply_updates(train, updates), frozen)
        if moe_lib.has_router_bias(cfg.model) and not cfg.model.lora.rank:  # a fixed (or frozen) bias stays
            params = bias_balance.update(params, old_params, with_loads, cfg.model.moe.bias_update_rate)
        params = constrain_tree(params, sh.params)
    params, opt_state = guard.keep_if(applied, (params, opt_state), (old_params, old_opt))
    kept = guard.advance(state.guard, loss, applied, finite, cfg)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_fn(state.applied), **metrics,
               **transformer.aux_metrics(aux), "skipped": ~applied, "skipped_total": kept.skipped_total,
               "consecutive_skips": kept.consecutive_skips, "loss_scale": scale}
    return state.replace(step=state.step + 1, applied=state.applied + applied.astype(jnp.int32), params=params,
                         opt_state=opt_state, guard=kept), metrics


def loss_and_grads(params, batch: dict, g: Paths, cfg):
    """(loss, metrics, gradients): the step's gradient path alone, for tests and tools, with the initial
    loss scale a new run starts with (the gradients unscaled)."""
    scale = guard.init(cfg).loss_scale
    with matmul_precision(g.dtype, g.fp8):
        loss, metrics, aux, grads = gradients.loss_and_grads(params, batch, g, scale)
    return loss, {**metrics, **transformer.aux_metrics(aux)}, jax.tree.map(lambda x: x / scale, grads)


def eval_loss(params, batch: dict, g: Paths):
    """(sum, count, metric sums) on a validation batch: of next-token cross-entropy over loss_mask tokens (no
    metrics) for a token objective, whatever it is; of the objective itself for a sequence objective (DPO: its
    loss and reward metrics over the held-out pairs)."""
    o = g.objective if g.objective.sequence_loss is not None else LANGUAGE_MODEL
    with matmul_precision(g.dtype, g.fp8), use_layout(g.layout):
        batch = gradients.in_model_order(batch, g)
        total, sums, _ = transformer.forward(params, batch, g.model, g.dtype, o.token_terms, g.loss_chunk,
                                             o.temperature, functools.partial(finish, o))
        return total, o.count(batch), sums


def token_logp(params, batch: dict, g: Paths):
    """Each target's log-probability at the objective's temperature, in the batch's own order: the trainer's
    forward pass, as GRPO needs for the sampling and the reference parameters before an update."""
    with matmul_precision(g.dtype, g.fp8), use_layout(g.layout):
        logp = transformer.target_logp(params, gradients.in_model_order(batch, g), g.model, g.dtype,
                                       g.objective.temperature)
        return logp if g.order is None else logp[:, np.argsort(g.order)]


def logits(params, batch: dict, g: Paths):
    """fp32 logits [batch, seq, vocabulary] of the batch's inputs, in the batch's own order: the trainer's
    forward pass (`jaxllm.load(...).logits`)."""
    with matmul_precision(g.dtype, g.fp8), use_layout(g.layout):
        out = transformer.batch_logits(params, gradients.in_model_order(batch, g), g.model, g.dtype)
        return out if g.order is None else out[:, np.argsort(g.order)]


def init_state(seed: int, *, cfg: Config, tx) -> TrainState:
    return start_state(transformer.init_params(cfg.model, jax.random.key(seed)), cfg=cfg, tx=tx)


def start_state(params, *, cfg: Config, tx, sh: Shardings | None = None) -> TrainState:
    """The state at step 0 from `params` (as stored: brought to the device first when offloaded). What the step
    does not train (a LoRA base) is held in the compute dtype; the optimizer sees only what it trains."""
    if sh is not None:
        params = offload.fetch(params, sh.params, cfg.memory.offload_params)
    train, frozen = lora.split(params, trained(cfg.model)[1])
    keep = lambda a: base_quant.is_quantized(a) or not jnp.issubdtype(a.dtype, jnp.floating)
    frozen = jax.tree.map(lambda a: a if keep(a) else a.astype(cfg.precision.compute), frozen,
                          is_leaf=base_quant.is_quantized)  # a QLoRA base stays quantized, dropout sites integers
    return TrainState(step=jnp.int32(0), applied=jnp.int32(0), params=lora.combine(train, frozen),
                      opt_state=tx.init(train), guard=guard.init(cfg))


def objective_of(cfg: Config) -> Objective:
    """What `train.objective` (and for GRPO the `rl` section) asks a step to minimise."""
    if cfg.train.objective == "grpo":
        r = cfg.rl
        if r.loss == "gspo":
            return gspo(r.epsilon, r.epsilon_high or r.epsilon, r.beta, r.temperature)
        return grpo(r.epsilon, r.epsilon_high or r.epsilon, r.beta, r.temperature,
                    r.behaviour_cap if r.async_steps else 0.0)
    if cfg.train.objective == "dpo":
        return preference.objective_of(cfg)
    return LANGUAGE_MODEL


def make_step_fns(cfg: Config, mesh, objective: Objective | None = None, platform: str | None = None) -> StepFns:
    """The step's programs on `mesh` for `objective` (None: the config's, `objective_of`), compiled for `platform`
    (None: the mesh's devices'; `cuda` or `tpu` to export for one from here): `auto` attention resolves for it."""
    platform = platform or mesh.devices.flat[0].platform
    cfg = attention.for_platform(cfg, platform, mesh.shape["sp"])
    m, t = cfg.model, cfg.train
    objective = objective_of(cfg) if objective is None else objective
    layout = Layout(mesh=mesh, params=param_rules(shard_over_fsdp=t.zero_stage == 3, hpz=t.zeropp.hpz),
                    activations=activation_rules(t.sequence_parallel), collective_matmul=m.collective_matmul,
                    context_attention=m.cp_strategy, sequence_order=sequence_order(m, mesh.shape["sp"]))
    tx = make_optimizer(t, trained(m)[0])
    sh = _shardings(cfg, layout, tx)
    g = _paths(cfg, layout, sh, objective, platform)
    replicated, batch_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P(BATCH_AXES))
    init = functools.partial(init_state, cfg=cfg, tx=tx)
    abstract_state = jax.tree.map(lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd),
                                  jax.eval_shape(init, 0), sh.state)
    step = functools.partial(train_step, g=g, sh=sh, tx=tx, lr_fn=learning_rate(t), cfg=cfg)
    base = lora.base_model(m)
    base_sh = (jax.tree.map(lambda n, s: layout.sharding(n, layout.params, s.shape), transformer.param_names(base),
                            transformer.param_shapes(base), is_leaf=lambda x: isinstance(x, tuple))
               if m.lora.rank else sh.state.params)
    return StepFns(
        layout=layout, tx=tx, objective=objective, state_shardings=sh.state, batch_sharding=batch_sh,
        grad_shardings=sh.grads,
        init=jax.jit(init, static_argnums=0, out_shardings=sh.state),
        start=jax.jit(functools.partial(start_state, cfg=cfg, tx=tx, sh=sh), in_shardings=(sh.state.params,),
                      out_shardings=sh.state, donate_argnums=0),
        device_params=(jax.jit(lambda p: p, in_shardings=(sh.state.params,), out_shardings=sh.params)
                       if cfg.memory.offload_params else lambda p: p),
        fresh_guard=jax.jit(functools.partial(guard.init, cfg), out_shardings=sh.state.guard),
        with_adapters=(jax.jit(lambda base: transformer.with_adapters(base, m, jax.random.key(t.seed)),
                               in_shardings=(base_sh,), out_shardings=sh.state.params)
                       if m.lora.rank else lambda p: p),
        base_shardings=base_sh,
        train_step=jax.jit(step, in_shardings=(sh.state, batch_sh), out_shardings=(sh.state, replicated),
                           donate_argnums=0),
        loss_and_grads=jax.jit(functools.partial(loss_and_grads, g=g, cfg=cfg), in_shardings=(sh.params, batch_sh),
                               out_shardings=(replicated, replicated, sh.grads)),
        eval_loss=jax.jit(functools.partial(eval_loss, g=g), in_shardings=(sh.params, batch_sh),
                          out_shardings=replicated),
        token_logp=jax.jit(functools.partial(token_logp, g=g), in_shardings=(sh.params, batch_sh),
                           out_shardings=batch_sh),
        logits=jax.jit(functools.partial(logits, g=g), in_shardings=(sh.params, batch_sh), out_shardings=batch_sh),
        abstract_state=abstract_state, schedule=g.schedule)


def _check_allreduce(m, t, shape: dict) -> list[str]:
    """`train.allreduce`: a hand-built algorithm replaces ZeRO-0/1's all-reduce over the batch axes."""
    if t.allreduce not in allreduce.CHOICES:
        raise ConfigError(f"train.allreduce: '{t.allreduce}' is not one of {', '.join(allreduce.CHOICES)}")
    if t.allreduce == "xla":
        return []
    if t.bucket_mb <= 0:
        raise ConfigError(f"train.bucket_mb: must be positive, got {t.bucket_mb}")
    unchecked = ("train.zero_stage >= 2 (its reduction is a reduce-scatter)" if t.zero_stage >= 2 else
                 "mesh.pp > 1 (the pipeline keeps xla's)" if shape["pp"] > 1 else
                 "MoE blocks (their whole-batch routing keeps the compiler's accumulation)" if stack_lib.has_moe(m) else
                 "mesh.tp, mesh.sp or mesh.ep > 1" if max(shape["tp"], shape["sp"], shape["ep"]) > 1 else None)
    if unchecked:
        raise ConfigError(f"train.allreduce={t.allreduce} with {unchecked} is not supported; use train.allreduce=xla")
    shards = batch_shards(shape)
    if t.allreduce == "halving_doubling" and shards & (shards - 1):
        raise ConfigError(f"train.allreduce=halving_doubling needs a power-of-two dp×fsdp×ep, got {shards}; use ring")
    return []


def _fp8_block_widths(cfg, tp: int) -> dict[str, int]:
    """The tensor-parallel dimensions (whole) of the matmuls `fp8_block` covers: each splits over tp."""
    m, covered = cfg.model, fp8.covered_groups(cfg.precision)
    widths = {}
    if "attention" in covered:
        widths["model.n_heads × head_dim"] = m.n_heads * attention.head_dim(m)
        widths["the KV heads (as used) × head_dim"] = heads_as_used(attention.kv_heads(m), tp) * attention.head_dim(m)
    if "mlp" in covered:
        widths["model.d_ff"] = m.d_ff
    if "experts" in covered and stack_lib.has_moe(m):
        widths["model.moe.d_ff"] = m.moe.d_ff or m.d_ff
    if "head" in covered:
        widths["the padded vocabulary"] = transformer.padded_vocab(m)
    return widths


BLOCKS = {"fp8_block": fp8_block.TILE, "mxfp8": mxfp8.BLOCK}  # precision.matmul -> its tile along a contraction


def _check_fp8_block(cfg, shape: dict) -> None:
    """fp8_block's and mxfp8's tiles stay on one device: each tensor-parallel weight dimension splits into
    multiples of the tile (128; MXFP8's blocks 32) per tp rank, and a sequence split over sp into multiples of
    the tile's tokens (the weight gradient's tiles); ConfigError (one line) otherwise."""
    mode = cfg.precision.matmul
    tp, sp, tile = shape["tp"], shape["sp"], BLOCKS[mode]
    if tp > 1 and cfg.model.attention == "mla":
        raise ConfigError(f"precision.matmul={mode} with model.attention=mla and mesh.tp > 1 is not supported yet "
                          "(its per-head blocks are not checked against the tp split); set mesh.tp=1 or matmul=fp8")
    for name, width in (_fp8_block_widths(cfg, tp).items() if tp > 1 else ()):
        if width % (tile * tp):
            raise ConfigError(f"precision.matmul={mode}: {name} = {width} does not split into multiples of {tile} "
                              f"over mesh.tp={tp} (its {tile}-wide tiles would straddle devices); change the model or tp")
    if sp > 1 and cfg.model.seq_len % (tile * sp):
        raise ConfigError(f"precision.matmul={mode}: model.seq_len={cfg.model.seq_len} does not split into "
                          f"multiples of {tile} tokens over mesh.sp={sp}; change seq_len or sp")


def check_config(cfg: Config, shape: dict) -> list[str]:
    """The step's keys (precision, ZeRO stage, batch and microbatches, sequence parallelism, loss chunks)
    against the mesh: ConfigError (one line) for what cannot run; notes to log."""
    m, t, notes = cfg.model, cfg.train, []
    if t.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective: '{t.objective}' is not one of {', '.join(OBJECTIVES)}")
    if cfg.precision.compute not in COMPUTE_DTYPES:
        raise ConfigError(f"precision.compute: '{cfg.precision.compute}' is not one of {', '.join(COMPUTE_DTYPES)}")
    notes += (guard.check_config(cfg) + offload.check_config(cfg, shape) + _check_allreduce(m, t, shape)
              + zeropp.check_config(cfg, shape) + lora.check_config(m, cfg, zeropp.plan_of(cfg))
              + preference.check_config(cfg))
    if fp8.covered_groups(cfg.precision) and m.collective_matmul:
        raise ConfigError(f"precision.matmul={cfg.precision.matmul} with model.collective_matmul=true is not supported "
                          "yet (its island multiplies chunks of one tensor); set one of them off")
    if cfg.precision.matmul in BLOCKS:
        _check_fp8_block(cfg, shape)
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage: must be 0, 1, 2 or 3, got {t.zero_stage}")
    for key in ("global_batch", "microbatches"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}: must be at least 1, got {getattr(t, key)}")
    rows = t.microbatches * batch_shards(shape)
    if t.global_batch % rows:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by microbatches×dp×fsdp×ep = "
            f"{t.microbatches}×{shape['dp']}×{shape['fsdp']}×{shape['ep']} = {rows}; make it a multiple of {rows}")
    sp, tp = shape["sp"], shape["tp"]
    if t.sequence_parallel and m.seq_len % (sp * tp):
        raise ConfigError(f"train.sequence_parallel: model.seq_len={m.seq_len} is not divisible by mesh.sp×mesh.tp="
                          f"{sp * tp}; change seq_len or tp")
    if t.sequence_parallel and tp == 1:
        notes.append("train.sequence_parallel=true with mesh.tp=1: nothing to shard the sequence over; it has no effect")
    if t.loss_chunk < -1 or (t.loss_chunk > 0 and m.seq_len % t.loss_chunk):
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} must be -1 (by the rule), 0 or divide model.seq_len="
                          f"{m.seq_len}; pick a divisor of seq_len")
    if t.loss_chunk > 0 and t.loss_chunk % sp:
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} is not divisible by mesh.sp={sp}; make it a multiple of sp")
    chunk = loss_chunk(cfg, shape)
    notes.append(f"loss: the logits {f'{chunk} positions at a time' if chunk else 'whole'} (train.loss_chunk="
                 f"{t.loss_chunk}{'' if t.loss_chunk >= 0 else ': the rule on the logits bytes'})")
    return notes
