"""The pipeline executor over `pp`: one program runs any schedule table (a shard_map island).

Axes: manual over `pp`, and over the batch axes `dp`, `fsdp`, `ep` under ZeRO-0/1 (each
device then sums its own rows' gradients and one `psum` reduces them at the end, as
`parallel/accumulation.py` does); `tp`, `sp` and, under ZeRO-2/3, the batch axes stay with
the compiler, so the stage's weights are gathered and its gradients reduce-scattered there.

Every stage runs the same scan over the ticks of a `pipeline_schedules.Schedule`. At each
tick a stage reads its own row of the table (by `axis_index('pp')`) and:

1. forward slot: runs its chunk on the input the table names (the embedding of the
   microbatch's tokens, and any layers run before the pipelined ones, on the first global
   stage, a buffer slot elsewhere; the last global stage skips its forward, since its
   backward recomputes it);
2. backward slot: re-runs its chunk under `jax.vjp` from the saved input (stage-level
   recompute) and pulls back the output gradient from its slot (on the last global stage:
   the loss, the head's cotangent is 1) and the chunk's auxiliary objective (MoE losses,
   linear in its layers' router statistics, cotangent 1), adding the weight gradients
   into an accumulator and the statistics into a sum;
3. exchange: one `ppermute` sends every stage's forward output downstream and one sends
   its input gradient upstream; what arrives is stored in the slot the table names.

Each slot's work is a `lax.switch` on the kind of stage (idle, first, middle, last), so a
branch may hold collectives over tp or fsdp: every member of such a group sits on the
same stage and takes the same branch. Embedding and head weights are replicated over
`pp`; their gradients (and the loss) are summed over `pp` at the end, which also adds the
two uses of tied embeddings.

Collectives per call (per device; b·t·d activations of one microbatch, E bytes each):
2 collective-permutes per tick, b·t·d·E bytes each, over the schedule's ticks
(2(m+p−1)−1 for GPipe, m+2(p−1) for 1F1B); then one all-reduce over pp of the loss and
the embedding/head gradients, and under ZeRO-0/1 one all-reduce over the batch axes of
all gradients. Under ZeRO-2/3 the gradients are reduce-scattered over fsdp into the
sharded accumulators every tick, and under ZeRO-3 each forward and backward slot
all-gathers the chunk's weights over fsdp, unless `gather_once`: then the stage's
weights are gathered once (in the compute dtype) before the loop. With v > 1 the
[v, p, L/(p·v)] view of the layer stack is not the contiguous split the weights are
stored in, so at the island's edge the partitioner moves most of each stage's weights
in (all-to-all over pp) and their gradients back, once per step.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.pipeline_schedules import FIELDS, Schedule
from jaxllm.sharding import BATCH_AXES, Layout, constrain, use_layout

AXIS = "pp"
ACT = ("batch", "residual_seq", "embed")  # a stage's input and output: the residual stream
IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3


def to_chunks(stack, stages: int, chunks: int):
    """[R, ...] layer-stack leaves -> [v, p, R/(p·v), ...]: chunk c of stage s holds global stage c·p + s."""
    return jax.tree.map(lambda a: a.reshape(chunks, stages, a.shape[0] // (stages * chunks), *a.shape[1:]), stack)


def from_chunks(stack):
    """The inverse of `to_chunks`: back to the canonical layer order [R, ...]."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:]), stack)


def loss_and_grads(params: dict, microbatches: dict, norm, schedule: Schedule, inner: Layout,
                   embed_fn: Callable, blocks_fn: Callable, loss_fn: Callable, aux_fn: Callable, pin_grads: Callable,
                   batch_manual: bool, gather_once: Callable | None = None, frozen: dict | None = None,
                   join: Callable = lambda train, frozen: train):
    """(loss, metric shares, the blocks' auxiliary terms, gradients) of the whole batch through the pipeline.

    `params` holds the pipelined layer stack under "blocks" (leaves [R, ...], R split over pp) and the
    embedding/head weights (and any layers run before the pipelined ones) elsewhere; `microbatches` holds the
    batch's fields as [m, rows, ...] arrays. The model enters as its seams: `embed_fn(shared, mb) -> (x, aux)`,
    `blocks_fn(chunk, x, mb, first) -> (x, aux)` (`first`: the chunk's first layer repeat in the stack,
    from which per-layer data such as attention windows is read), `loss_fn(shared, x, mb) -> (objective sum, metric
    sums, auxiliary terms of any layers it runs)`, the sums divided by the global count, and `aux_fn(aux, weight)`,
    what a chunk's auxiliary terms (MoE router statistics) add to the objective. `norm` is (count, weight) (dividing the scalar, not every gradient). Inside
    the island the model traces under the `inner` layout (manual, without batch sharding when
    `batch_manual`: the batch axes are manual here, ZeRO-0/1). `pin_grads(stack_grads,
    shared_grads)` lays the gradient accumulators out; `gather_once(stack, shared, stack_f, shared_f)`, if
    given, returns the weights (trained and frozen) as used, cast and gathered once for the whole loop.
    `frozen`, laid out as `params`, holds what is not differentiated (a LoRA base, `models/lora.py`; None where
    `params` has a leaf), `join(params, frozen)` puts the two together for the model; gradients are `params`'
    alone.
    """
    p, v = schedule.stages, schedule.chunks
    last = p * v - 1
    table = jnp.asarray(schedule.table)
    col = {f: i for i, f in enumerate(FIELDS)}
    frozen = jax.tree.map(lambda _: None, params) if frozen is None else frozen
    stack, stack_f = (to_chunks(tree["blocks"], p, v) for tree in (params, frozen))
    shared, shared_f = ({k: a for k, a in tree.items() if k != "blocks"} for tree in (params, frozen))
    axes = {AXIS} | (set(BATCH_AXES) if batch_manual else set())
    batch_spec = P(None, BATCH_AXES) if batch_manual else P()

    def local(stack, shared, stack_f, shared_f, mbs, norm):
        with use_layout(inner):
            return run(stack, shared, stack_f, shared_f, mbs, *norm)

    def run(stack, shared, stack_f, shared_f, mbs, count, aux_weight):
        stack, stack_f = (jax.tree.map(lambda a: a[:, 0], t) for t in (stack, stack_f))  # [v, Lc, ...]: this stage's
        s = jax.lax.axis_index(AXIS)
        used_stack, used_shared, used_stack_f, used_shared_f = (
            gather_once(stack, shared, stack_f, shared_f) if gather_once else (stack, shared, stack_f, shared_f))

        def microbatch(i):  # rows stay split over the batch axes (with ZeRO-2/3 the compiler owns them)
            return jax.tree.map(lambda a: constrain(a[jnp.maximum(i, 0)], ("batch", "seq")), mbs)

        def chunk_of(tree, c):
            return jax.tree.map(lambda a: a[jnp.maximum(c, 0)], tree)

        repeats = jax.tree.leaves(stack)[0].shape[1]  # per chunk

        def run_chunk(chunk, c, x, mb):  # chunk c of this stage is global stage c·p + s: (y, aux)
            return blocks_fn(join(chunk, chunk_of(used_stack_f, c)), x, mb, (jnp.maximum(c, 0) * p + s) * repeats)

        def embedded_chunk(chunk, c, sh, mb):  # the first global stage: embedding (and leading layers), chunk
            x, aux = embed_fn(join(sh, used_shared_f), mb)
            y, more = run_chunk(chunk, c, x, mb)
            return y, jax.tree.map(jnp.add, aux, more)

        x_shape, aux_shape = jax.eval_shape(lambda: embed_fn(join(used_shared, used_shared_f), microbatch(0)))
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
        no_metrics = f32(jax.eval_shape(lambda: loss_fn(join(used_shared, used_shared_f), zeros_x, microbatch(0))[1]))
        no_aux = f32(aux_shape)

        # ---- forward slot: the output to send downstream
        def forward(kind, c, i, x_in):
            def first():
                return embedded_chunk(chunk_of(used_stack, c), c, used_shared, microbatch(i))[0]

            def middle():
                return run_chunk(chunk_of(used_stack, c), c, x_in, microbatch(i))[0]

            return jax.lax.switch(kind, [lambda: zeros_x, first, middle, lambda: zeros_x])

        # ---- backward slot: (input gradient, chunk gradients, shared gradients, loss share, metric shares, aux)
        def backward(kind, c, i, x_in, dy):
            chunk, mb = chunk_of(used_stack, c), microbatch(i)
            cast = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
            with_aux = lambda y, aux: ((y, aux_fn(aux, aux_weight)), aux)  # the chunk's auxiliary objective beside y

            def idle():
                return zeros_x, f32(chunk), f32(used_shared), jnp.float32(0), no_metrics, no_aux

            def first():
                _, pull, aux = jax.vjp(lambda ch, sh: with_aux(*embedded_chunk(ch, c, sh, mb)), chunk, used_shared,
                                       has_aux=True)
                g_chunk, g_shared = pull((dy, jnp.float32(1)))
                return zeros_x, cast(g_chunk), cast(g_shared), jnp.float32(0), no_metrics, cast(aux)

            def middle():
                _, pull, aux = jax.vjp(lambda ch, x: with_aux(*run_chunk(ch, c, x, mb)), chunk, x_in, has_aux=True)
                g_chunk, dx = pull((dy, jnp.float32(1)))
                return dx, cast(g_chunk), f32(used_shared), jnp.float32(0), no_metrics, cast(aux)

            def final():
                def stage(ch, sh, x):
                    y, aux = run_chunk(ch, c, x, mb)
                    total, sums, more = loss_fn(join(sh, used_shared_f), y, mb)  # `more`: aux. terms of its layers
                    aux = jax.tree.map(jnp.add, aux, more)
                    loss, shares = total / count, jax.tree.map(lambda a: (a / count).astype(jnp.float32), sums)
                    return loss + aux_fn(aux, aux_weight), (loss, shares, aux)

                objective, pull, (loss, metrics, aux) = jax.vjp(stage, chunk, used_shared, x_in, has_aux=True)
                g_chunk, g_shared, dx = pull(jnp.ones_like(objective))
                return dx, cast(g_chunk), cast(g_shared), loss.astype(jnp.float32), metrics, cast(aux)

            return jax.lax.switch(kind, [idle, first, middle, final])

        def kind_of(mb, c, skip_last):
            g = c * p + s
            kind = jnp.where(g == 0, FIRST, jnp.where(g == last, LAST, MIDDLE))
            if skip_last:
                kind = jnp.where(kind == LAST, IDLE, kind)
            return jnp.where(mb < 0, IDLE, kind)

        def pin_buffer(buf):
            spec = inner.constraint(ACT, inner.activations, buf.shape[1:])
            return jax.lax.with_sharding_constraint(buf, P(None, *spec))

        def store(buf, slot, value):
            k = jnp.maximum(slot, 0)
            return pin_buffer(buf.at[k].set(jnp.where(slot >= 0, value, buf[k])))

        fwd_perm = [(j, (j + 1) % p) for j in range(p if v > 1 else p - 1)]
        bwd_perm = [(j, (j - 1) % p) for j in range(1 if v == 1 else 0, p)]

        def tick(carry, rows):
            acts, grads_in, g_stack, g_shared, loss, metrics, aux = carry
            r = {f: rows[s, k] for f, k in col.items()}
            y = forward(kind_of(r["fwd_mb"], r["fwd_chunk"], True), r["fwd_chunk"], r["fwd_mb"],
                        acts[jnp.maximum(r["fwd_slot"], 0)])
            dx, g_chunk, g_sh, l, ms, a = backward(kind_of(r["bwd_mb"], r["bwd_chunk"], False), r["bwd_chunk"],
                                                   r["bwd_mb"], acts[jnp.maximum(r["bwd_slot"], 0)],
                                                   grads_in[jnp.maximum(r["bwd_grad_slot"], 0)])
            c = jnp.maximum(r["bwd_chunk"], 0)
            g_stack = jax.tree.map(lambda acc, g: acc.at[c].add(g), g_stack, g_chunk)
            g_stack, g_shared = pin_grads(g_stack, jax.tree.map(jnp.add, g_shared, g_sh))
            acts = store(acts, r["recv_slot"], jax.lax.ppermute(y, AXIS, fwd_perm))
            grads_in = store(grads_in, r["grad_recv_slot"], jax.lax.ppermute(dx, AXIS, bwd_perm))
            add = functools.partial(jax.tree.map, jnp.add)
            return (acts, grads_in, g_stack, g_shared, loss + l, add(metrics, ms), add(aux, a)), None

        acts = pin_buffer(jnp.zeros((schedule.act_depth,) + x_shape.shape, x_shape.dtype))
        grads_in = pin_buffer(jnp.zeros((schedule.grad_depth,) + x_shape.shape, x_shape.dtype))
        g_stack, g_shared = pin_grads(f32(stack), f32(shared))
        start = (acts, grads_in, g_stack, g_shared, jnp.float32(0), no_metrics, no_aux)
        (_, _, g_stack, g_shared, loss, metrics, aux), _ = jax.lax.scan(tick, start, table)
        loss, metrics, aux, g_shared = jax.lax.psum((loss, metrics, aux, g_shared), AXIS)
        if batch_manual:  # (MoE is refused here on more than one batch shard: its statistics are not sums)
            loss, metrics, aux, g_shared, g_stack = jax.lax.psum((loss, metrics, aux, g_shared, g_stack), BATCH_AXES)
        return loss, metrics, aux, jax.tree.map(lambda a: a[:, None], g_stack), g_shared

    loss, metrics, aux, g_stack, g_shared = jax.shard_map(
        local, mesh=inner.mesh, axis_names=axes, check_vma=False,
        in_specs=(P(None, AXIS), P(), P(None, AXIS), P(), batch_spec, P()),
        out_specs=(P(), P(), P(), P(None, AXIS), P()))(stack, shared, stack_f, shared_f, microbatches, norm)
    return loss, metrics, aux, {**g_shared, "blocks": from_chunks(g_stack)}

