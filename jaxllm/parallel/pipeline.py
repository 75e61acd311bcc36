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
2. backward slot (the fused schedules): re-runs its chunk under `jax.vjp` from the saved
   input (stage-level recompute) and pulls back the output gradient from its slot (on the
   last global stage: the loss, the head's cotangent is 1) and the chunk's auxiliary
   objective (MoE losses, linear in its layers' router statistics, cotangent 1), adding
   the weight gradients into an accumulator and the statistics into a sum;
   or, with the backward split (zb_h1, zb_v), four slots: R re-runs the chunk from its
   saved input under `jax.vjp` with its projection weights tapped (`models/taps.py`) and
   keeps the pullback (one set per stage: the schedule runs each B before the next R),
   less what the weights alone give (`_given_by`), which B makes again; B pulls the output
   gradient back through it, making the input gradient, the other weights' gradients and
   the W stash (each projection's input and output cotangent), kept in a stash slot; two W
   slots each turn a range of a stash's layers (the table's pieces) into those layers'
   projection weight gradients, added into the accumulator layer by layer;
3. exchange: one `ppermute` sends to stage s+1 and one to s−1 what the table says (a forward
   output or an input gradient: downstream and upstream for the loop placement, both ways
   in the V); what arrives from each side, and what a stage keeps of its own at the V's
   turn, is stored in the slot the table names.

Each slot's work is a `lax.switch` on the kind of stage (idle, first, middle, last), so a
branch may hold collectives over tp or fsdp: every member of such a group sits on the
same stage and takes the same branch. Not so the islands a chunk may hold (ring attention over
sp, collective matmuls over tp): their collective-permutes wait for every device of the mesh on
XLA:CPU. With those (`islands_inside`) every stage runs its chunk at every tick, idle ones on
zeros and pulled back from zeros, and only the embedding before it and the head after it are
switched on the kind (the slots' `_uniform` forms; layers before the pipelined ones and
multi-token prediction's modules after them run on every stage too, only their lookups and
heads switched). Embedding and head weights are replicated over
`pp`; their gradients (and the loss) are summed over `pp` at the end, which also adds the
two uses of tied embeddings.

Collectives per call (per device; b·t·d activations of one microbatch, E bytes each):
2 collective-permutes per tick, b·t·d·E bytes each, over the schedule's ticks
(2(m+p−1)−1 for GPipe, m+2(p−1) for 1F1B, 4m+p−1 for ZB-H1 and 8m+p−1 for ZB-V at unit
costs: one operation per tick, so most permutes carry nothing the receiver keeps); then one
all-reduce over pp of the loss and the embedding/head gradients, and under ZeRO-0/1 one all-reduce over the batch axes of
all gradients. Under ZeRO-2/3 the gradients are reduce-scattered over fsdp into the
sharded accumulators every tick, and under ZeRO-3 each forward, backward, R and B slot
all-gathers the chunk's weights over fsdp (B for the weights as used that R did not keep;
W needs no weights gathered: its gradient is a contraction of the stash), unless
`gather_once`: then the stage's weights are gathered once (in the compute dtype) before
the loop. With v > 1 the [v, p, L/(p·v)] view of the
layer stack (chunk 1 reversed for the V) is not the contiguous split the weights are
stored in, so at the island's edge the partitioner moves most of each stage's weights in
(all-to-all over pp) and their gradients back, once per step.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.pipeline_schedules import FIELDS, GRADIENT, OUTPUT, SIDES, Schedule, global_stage
from jaxllm.sharding import BATCH_AXES, Layout, constrain, is_names, use_layout

try:  # no public API splits a program by dependence (`_given_by`)
    from jax._src.interpreters import partial_eval as pe
except ImportError:
    pe = None

AXIS = "pp"
ACT = ("batch", "residual_seq", "embed")  # a stage's input and output: the residual stream
IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3


def islands_inside(inner: Layout) -> bool:
    """Whether a chunk holds shard_map islands of its own (ring attention over sp, collective matmuls over tp).
    Their collective-permutes wait for every device of the mesh on XLA:CPU, so no stage may skip them in a branch
    the others do not take: the chunk then runs on every stage at every tick (`_Stage.backward_uniform`)."""
    return inner.mesh.shape["sp"] > 1 or inner.collective_matmul


def to_chunks(stack, stages: int, chunks: int, placement: str = "loop"):
    """[R, ...] layer-stack leaves -> [v, p, R/(p·v), ...]: [c, s] holds the global stage `global_stage(c, s)`
    (c·p + s; for the V, chunk 1 reversed: 2p−1−s)."""
    def one(a):
        a = a.reshape(chunks, stages, a.shape[0] // (stages * chunks), *a.shape[1:])
        return jnp.concatenate([a[:1], a[1:, ::-1]]) if placement == "v" else a
    return jax.tree.map(one, stack)


def from_chunks(stack, placement: str = "loop"):
    """The inverse of `to_chunks`: back to the canonical layer order [R, ...]."""
    def one(a):
        a = jnp.concatenate([a[:1], a[1:, ::-1]]) if placement == "v" else a
        return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])
    return jax.tree.map(one, stack)


def _add_at(acc, c, grads):
    """acc (a tree of [v, ...] accumulators) plus `grads` (like one chunk of it, None where it has nothing) at c."""
    structure = jax.tree.structure(acc)
    out = [a if g is None else a.at[c].add(g) for a, g in zip(jax.tree.leaves(acc), structure.flatten_up_to(grads))]
    return structure.unflatten(out)


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def _zeros_like(tree, dtype=None):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _given_by(fn, known, *unknown):
    """Which of the leaves of `fn(known, *unknown)` (a pytree of arrays) depend on `known` alone, and how to make
    just those from `known`: (mask over the leaves, rebuild(known) -> those leaves, the output's shapes as a
    pytree like it). JAX's own partial
    evaluation (the split `jax.linearize` makes) and dead-code elimination, on the traced program: R's
    pullback holds the chunk's weights as used (cast, gathered), which B can make again instead of the loop
    carrying a copy of them from R to B."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(known, *unknown)
    n_known = len(jax.tree.leaves(known))
    unknowns = [False] * n_known + [True] * (len(closed.jaxpr.invars) - n_known)
    try:  # internal API (checked on JAX 0.10): where it has moved, keep every residual (more memory, same numbers)
        known_part, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=False)
        n_out = out_unknown.count(False)  # the known part's outputs: these, then what the unknown part needs
        used = [True] * n_out + [False] * (len(known_part.jaxpr.outvars) - n_out)
        pruned, _ = pe.dce_jaxpr(known_part.jaxpr, used, instantiate=True)
        run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(pruned, known_part.consts))
    except (AttributeError, TypeError, ValueError) as e:
        warnings.warn(f"pipeline: R keeps the weights it used (this JAX cannot split a program by dependence: {e})")
        return [False] * len(closed.jaxpr.outvars), lambda k: [], shapes
    return [not u for u in out_unknown], lambda k: run(*jax.tree.leaves(k)), shapes


class _Stage:
    """One stage's program inside the island: the tick loop and its slots (forward and backward, or forward, R, B
    and W)."""

    def __init__(self, schedule: Schedule, inner: Layout, batch_manual: bool, **seams):
        self.schedule, self.inner, self.batch_manual = schedule, inner, batch_manual
        self.__dict__.update(seams)
        self.p, self.v = schedule.stages, schedule.chunks
        self.last = self.p * self.v - 1
        self.uniform = islands_inside(inner)

    # ---- the model's pieces on this stage

    def global_stage(self, c):
        return global_stage(self.schedule.placement, self.p, self.s, jnp.maximum(c, 0))

    def microbatch(self, i):  # rows stay split over the batch axes (with ZeRO-2/3 the compiler owns them)
        return jax.tree.map(lambda a: constrain(a[jnp.maximum(i, 0)], ("batch", "seq")), self.mbs)

    @staticmethod
    def chunk_of(tree, c):
        return jax.tree.map(lambda a: a[jnp.maximum(c, 0)], tree)

    def run_chunk(self, chunk, c, x, mb):
        """Chunk c of this stage (its trained weights `chunk`) on x: (y, aux)."""
        return self.run_joined(self.join(chunk, self.chunk_of(self.stack_f, c)), c, x, mb)

    def run_joined(self, full, c, x, mb):
        return self.blocks_fn(full, x, mb, self.global_stage(c) * self.repeats)

    def embed(self, sh, mb):
        """(x, aux): the first global stage's input, the embedding and the layers before the pipelined ones."""
        full = self.join(sh, self.shared_f)
        return self.lead_fn(full, self.embed_fn(full, mb), mb)

    def embedded(self, sh, mb, chunk_fn):
        """The first global stage: the embedding (and leading layers), then `chunk_fn(x) -> (y, aux)`."""
        x, aux = self.embed(sh, mb)
        y, more = chunk_fn(x)
        return y, jax.tree.map(jnp.add, aux, more)

    def with_loss(self, sh, y, aux, mb, trail=None):
        """The last global stage's objective after its chunk: (objective, (loss, metric shares, aux)); `trail`: what
        `trail_fn` made of y, where it ran outside."""
        more_args = () if trail is None else (trail,)
        total, sums, more = self.loss_fn(self.join(sh, self.shared_f), y, mb, *more_args)  # `more`: its layers' aux
        aux = jax.tree.map(jnp.add, aux, more)
        loss, shares = total / self.count, jax.tree.map(lambda a: (a / self.count).astype(jnp.float32), sums)
        return loss + self.aux_fn(aux, self.aux_weight), (loss, shares, aux)

    def kind_of(self, mb, c, skip_last):
        g = self.global_stage(c)
        kind = jnp.where(g == 0, FIRST, jnp.where(g == self.last, LAST, MIDDLE))
        if skip_last:
            kind = jnp.where(kind == LAST, IDLE, kind)
        return jnp.where(mb < 0, IDLE, kind)

    # ---- the slots

    def forward(self, kind, c, i, x_in):
        """The forward slot: the output to send on (the last global stage skips its forward)."""
        chunk, mb = self.chunk_of(self.used_stack, c), self.microbatch(i)
        if self.uniform:  # every stage runs the chunk, on what its kind gives it
            x, _ = self.chunk_input(kind, x_in, mb)
            return jnp.where((kind == FIRST) | (kind == MIDDLE), self.run_chunk(chunk, c, x, mb)[0], self.zeros_x)
        first = lambda: self.embedded(self.used_shared, mb, lambda x: self.run_chunk(chunk, c, x, mb))[0]
        middle = lambda: self.run_chunk(chunk, c, x_in, mb)[0]
        return jax.lax.switch(kind, [lambda: self.zeros_x, first, middle, lambda: self.zeros_x])

    # ---- the slots when the chunk holds islands (`islands_inside`): the chunk outside the switch on the kind

    def chunk_input(self, kind, x_in, mb):
        """(the chunk's input, the leading layers' aux): on the first global stage the embedding and the layers
        before the pipelined ones, x_in elsewhere (zeros when idle). The lookup is switched on the kind; the
        leading layers, which may hold islands too, run on every stage, their aux zero off the first."""
        sh = self.join(self.used_shared, self.shared_f)
        looked_up = jax.lax.switch(kind, [lambda: self.zeros_x, lambda: self.embed_fn(sh, mb), lambda: x_in,
                                          lambda: x_in])
        if not self.leading:
            return looked_up, self.no_aux_as_made
        led, aux = self.lead_fn(sh, looked_up, mb)
        first = kind == FIRST
        return jnp.where(first, led, looked_up), jax.tree.map(lambda a: jnp.where(first, a, jnp.zeros_like(a)), aux)

    def head_cotangent(self, kind, y, dy, mb):
        """On the last global stage the head and the loss after the chunk's output y: (the output's cotangent,
        shared gradients, loss share, metric shares, the head's aux); elsewhere dy and nothing (zeros when
        idle). The head's layers that may hold islands (`trail_fn`: multi-token prediction's modules) run on every
        stage, pulled back from the head's cotangent on the last and from zeros elsewhere."""
        none = jnp.float32(0)
        if self.trail_fn is None:
            trail, pull_trail = None, None
        else:
            trail, pull_trail = jax.vjp(lambda sh, y: self.trail_fn(self.join(sh, self.shared_f), y, mb),
                                        self.used_shared, y)
        no_trail = jax.tree.map(jnp.zeros_like, trail)

        def head():
            head = lambda sh, y, trail: self.with_loss(sh, y, self.no_aux_as_made, mb, trail)
            objective, pull, (loss, metrics, more) = jax.vjp(head, self.used_shared, y, trail, has_aux=True)
            g_shared, dy_head, d_trail = pull(jnp.ones_like(objective))
            return dy_head.astype(y.dtype), _f32(g_shared), loss.astype(jnp.float32), metrics, _f32(more), d_trail

        given = lambda: (dy, self.no_shared, none, self.no_metrics, self.no_aux, no_trail)
        idle = lambda: (jnp.zeros_like(dy), self.no_shared, none, self.no_metrics, self.no_aux, no_trail)
        dy, g_shared, loss, metrics, more, d_trail = jax.lax.switch(kind, [idle, given, given, head])
        if pull_trail is None:
            return dy, g_shared, loss, metrics, more
        g_trail, dy_trail = pull_trail(d_trail)
        return dy + dy_trail.astype(dy.dtype), jax.tree.map(jnp.add, g_shared, _f32(g_trail)), loss, metrics, more

    def embedding_grads(self, kind, dx, mb):
        """On the first global stage the shared weights' gradients through the leading layers (pulled back on every
        stage, from zeros off the first: they may hold islands) and the embedding (switched), from the chunk's
        input gradient dx; the leading layers' aux objective with cotangent 1. Zeros elsewhere."""
        first = kind == FIRST
        g_lead, dx_embed = self.no_shared, dx
        if self.leading:
            led = lambda sh, x: (lambda y, aux: (y, self.aux_fn(aux, self.aux_weight)))(
                *self.lead_fn(self.join(sh, self.shared_f), x, mb))
            x_embed = jax.lax.switch(jnp.where(first, 1, 0), [lambda: self.zeros_x, lambda: self.embed_fn(
                self.join(self.used_shared, self.shared_f), mb)])
            g_lead, dx_embed = jax.vjp(led, self.used_shared, x_embed)[1]((jnp.where(first, dx, 0),
                                                                            first.astype(jnp.float32)))
            g_lead = _f32(g_lead)

        def lookup():
            (g,) = jax.vjp(lambda sh: self.embed_fn(self.join(sh, self.shared_f), mb), self.used_shared)[1](dx_embed)
            return _f32(g)

        g_embed = jax.lax.switch(jnp.where(first, 1, 0), [lambda: self.no_shared, lookup])
        return jax.tree.map(jnp.add, g_lead, g_embed)

    def backward_uniform(self, kind, c, i, x_in, dy):
        """The fused backward slot with the chunk outside the switch: the chunk re-run under `jax.vjp` on every
        stage (idle ones on zeros, pulled back from zeros); the embedding before it and the head after it switched
        on the kind. The chunk's aux objective is pulled back with cotangent 1 apart from the head's and the
        embedding's (the objective is linear in the blocks' aux terms)."""
        chunk, mb = self.chunk_of(self.used_stack, c), self.microbatch(i)
        live = kind != IDLE
        x, aux_embed = self.chunk_input(kind, x_in, mb)
        aux_obj = lambda y, aux: ((y, self.aux_fn(aux, self.aux_weight)), aux)
        (y, _), pull, aux = jax.vjp(lambda ch, x: aux_obj(*self.run_chunk(ch, c, x, mb)), chunk, x, has_aux=True)
        dy, g_shared, loss, metrics, more = self.head_cotangent(kind, y, dy, mb)
        g_chunk, dx = pull((dy, live.astype(jnp.float32)))
        g_shared = jax.tree.map(jnp.add, g_shared, self.embedding_grads(kind, dx, mb))
        aux = jax.tree.map(lambda a, e, m: jnp.where(live, a.astype(jnp.float32) + e + m, 0), aux,
                           _f32(aux_embed), more)
        dx = jnp.where((kind == MIDDLE) | (kind == LAST), dx, self.zeros_x)
        return dx, _f32(g_chunk), g_shared, loss, metrics, aux

    def backward(self, kind, c, i, x_in, dy):
        """The fused backward slot: the chunk re-run under `jax.vjp` from its saved input, pulled back from the
        output gradient (on the last global stage: the loss, and the chunk's auxiliary objective, cotangent 1).
        (input gradient, chunk gradients, shared gradients, loss share, metric shares, aux)."""
        chunk, mb = self.chunk_of(self.used_stack, c), self.microbatch(i)
        aux_obj = lambda y, aux: ((y, self.aux_fn(aux, self.aux_weight)), aux)  # the chunk's aux. objective beside y
        none = jnp.float32(0)

        def idle():
            return self.zeros_x, _zeros_like(chunk, jnp.float32), self.no_shared, none, self.no_metrics, self.no_aux

        def first():
            stage = lambda ch, sh: aux_obj(*self.embedded(sh, mb, lambda x: self.run_chunk(ch, c, x, mb)))
            _, pull, aux = jax.vjp(stage, chunk, self.used_shared, has_aux=True)
            g_chunk, g_shared = pull((dy, jnp.float32(1)))
            return self.zeros_x, _f32(g_chunk), _f32(g_shared), none, self.no_metrics, _f32(aux)

        def middle():
            _, pull, aux = jax.vjp(lambda ch, x: aux_obj(*self.run_chunk(ch, c, x, mb)), chunk, x_in, has_aux=True)
            g_chunk, dx = pull((dy, jnp.float32(1)))
            return dx, _f32(g_chunk), self.no_shared, none, self.no_metrics, _f32(aux)

        def final():
            stage = lambda ch, sh, x: self.with_loss(sh, *self.run_chunk(ch, c, x, mb), mb)
            objective, pull, (loss, metrics, aux) = jax.vjp(stage, chunk, self.used_shared, x_in, has_aux=True)
            g_chunk, g_shared, dx = pull(jnp.ones_like(objective))
            return dx, _f32(g_chunk), _f32(g_shared), loss.astype(jnp.float32), metrics, _f32(aux)

        return jax.lax.switch(kind, [idle, first, middle, final])

    def chunk_vjp(self, weights, c, x, mb):
        """The VJP of chunk c (its trained `weights`) on x with respect to its tapped weights' probes, its other
        weights and x (the tapped weights closed over, so none of their gradients is made): (pullback, y, aux).
        The chunk's auxiliary objective (MoE losses) is its second output, pulled back with cotangent 1."""
        tapped, rest = self.taps.split(weights)
        probes = self.taps.probes(tapped, self.rows, self.zeros_x.dtype)

        def chunk(pr, re, x):
            y, aux = self.run_joined(self.taps.join(tapped, pr, self.join(re, self.chunk_of(self.stack_f, c))),
                                     c, x, mb)
            return (y, self.aux_fn(aux, self.aux_weight)), aux

        (y, _), pull, aux = jax.vjp(chunk, probes, rest, x, has_aux=True)
        return pull, y, aux

    def recompute(self, kind, c, i, x_in, kept):
        """R of a split backward: chunk c re-run from its saved input (on the first global stage: from the
        embedding), keeping what its backward needs but what the weights alone give (`_given_by`).
        (residuals, output (on the last global stage only, for the head), aux: the chunk's and the embedding's);
        when idle, `kept` (residuals, output) as they are: the schedule runs each B before the next R, so one
        set is ever kept, updated in place rather than through a slot buffer's copies."""
        mb, weights = self.microbatch(i), self.chunk_of(self.used_stack, c)
        kept_of = lambda pull: [a for a, again in zip(jax.tree.leaves(pull), self.rebuilt) if not again]

        def idle():
            return (*kept, self.no_aux)

        def first():
            x, aux = self.embed(self.used_shared, mb)
            pull, _, more = self.chunk_vjp(weights, c, x, mb)
            return kept_of(pull), self.zeros_x, _f32(jax.tree.map(jnp.add, aux, more))

        def middle():  # the output is not kept (only the head needs it), so its last matmul is not run
            pull, _, aux = self.chunk_vjp(weights, c, x_in, mb)
            return kept_of(pull), self.zeros_x, _f32(aux)

        def final():
            pull, y, aux = self.chunk_vjp(weights, c, x_in, mb)
            return kept_of(pull), y, _f32(aux)

        if self.uniform:
            return self.recompute_uniform(kind, c, x_in, mb, weights, kept, kept_of)
        return jax.lax.switch(kind, [idle, first, middle, final])

    def recompute_uniform(self, kind, c, x_in, mb, weights, kept, kept_of):
        """R with the chunk outside the switch: every stage re-runs its chunk (idle ones on zeros, keeping what
        they kept), the embedding before it switched on the kind."""
        live = kind != IDLE
        x, aux_embed = self.chunk_input(kind, x_in, mb)
        pull, y, aux = self.chunk_vjp(weights, c, x, mb)
        residuals = [jnp.where(live, new, old) for new, old in zip(kept_of(pull), kept[0])]
        y = jnp.where(kind == LAST, y, jnp.where(live, self.zeros_x, kept[1]))
        aux = jax.tree.map(lambda a, e: jnp.where(live, a + e, 0), _f32(aux), _f32(aux_embed))
        return residuals, y, aux

    def pullback(self, c, kept):
        """R's pullback of chunk c from the residuals it kept and those its weights give again."""
        again = iter(self.rebuild(self.chunk_of(self.used_stack, c)))
        kept = iter(kept)
        return jax.tree.unflatten(self.residual_structure, [next(again if a else kept) for a in self.rebuilt])

    def backward_input(self, kind, c, i, residuals, y, dy):
        """B of a split backward: the pullback R kept, from the output gradient (on the last global stage: from
        the loss, the head re-run on R's output y; on the first, on through the embedding). (input gradient,
        the untapped weights' chunk gradients, shared gradients, loss share, metric shares, the head's aux,
        W stash)."""
        mb = self.microbatch(i)
        none = jnp.float32(0)

        def idle():
            return (self.zeros_x, self.no_rest, self.no_shared, none, self.no_metrics, self.no_aux,
                    self.no_stash)

        def first():
            stash, g_rest, dx = self.pullback(c, residuals)((dy, jnp.float32(1)))
            embedded = lambda sh: (lambda x, aux: (x, self.aux_fn(aux, self.aux_weight)))(*self.embed(sh, mb))
            (g_shared,) = jax.vjp(embedded, self.used_shared)[1]((dx, jnp.float32(1)))
            return self.zeros_x, _f32(g_rest), _f32(g_shared), none, self.no_metrics, self.no_aux, stash

        def middle():
            stash, g_rest, dx = self.pullback(c, residuals)((dy, jnp.float32(1)))
            return dx, _f32(g_rest), self.no_shared, none, self.no_metrics, self.no_aux, stash

        def final():
            head = lambda sh, y: self.with_loss(sh, y, self.no_aux, mb)
            objective, pull_head, (loss, metrics, more) = jax.vjp(head, self.used_shared, y, has_aux=True)
            g_shared, dy_chunk = pull_head(jnp.ones_like(objective))
            stash, g_rest, dx = self.pullback(c, residuals)((dy_chunk.astype(y.dtype), jnp.float32(1)))
            return dx, _f32(g_rest), _f32(g_shared), loss.astype(jnp.float32), metrics, _f32(more), stash

        if self.uniform:
            return self.backward_input_uniform(kind, c, mb, residuals, y, dy)
        return jax.lax.switch(kind, [idle, first, middle, final])

    def backward_input_uniform(self, kind, c, mb, residuals, y, dy):
        """B with the pullback outside the switch: every stage pulls back (idle ones from zeros), the head before
        it and the embedding after it switched on the kind."""
        live = kind != IDLE
        dy, g_shared, loss, metrics, more = self.head_cotangent(kind, y, dy, mb)
        stash, g_rest, dx = self.pullback(c, residuals)((dy, live.astype(jnp.float32)))
        # an idle stage pulls back through residuals no R has made yet (zeros): a saved 1/Σ (MoE's gate
        # normalisation) is then 1/0, and 0·∞ a NaN, so what it returns is dropped, not added as zero
        g_rest = jax.tree.map(lambda a: jnp.where(live, a, 0), g_rest)
        dx = jnp.where(live, dx, 0)
        g_shared = jax.tree.map(jnp.add, g_shared, self.embedding_grads(kind, dx, mb))
        stash = jax.tree.map(lambda a, none: jnp.where(live, a, none), stash, self.no_stash)
        dx = jnp.where((kind == MIDDLE) | (kind == LAST), dx, self.zeros_x)
        return dx, _f32(g_rest), g_shared, loss, metrics, more, stash

    def backward_weights(self, g_stack, c, first, count, stash):
        """W of a split backward: the tapped weights' gradients of chunk c from a stash, for its layers
        [first, first + count) (in the table's pieces), added layer by layer into the accumulators `g_stack`
        ([v, Lc, ...]; none when count is 0)."""
        tapped, _ = self.taps.split(self.chunk_of(self.used_stack, c))
        per_piece = self.repeats // self.schedule.pieces

        def layer(k, acc):
            one = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, k, 1), tree)
            grads = self.taps.weight_grads(one(tapped), one(stash))
            return _add_at(acc, (c, k), jax.tree.map(lambda g: g[0], grads))

        return jax.lax.fori_loop(first * per_piece, (first + count) * per_piece, layer, g_stack)

    # ---- buffers and the exchange

    def pin(self, buf, names):
        """A buffer [slots, ...] of values with these logical names (after `lead` unnamed dimensions)."""
        lead = buf.ndim - len(names)
        spec = self.inner.constraint(names, self.inner.activations, buf.shape[lead:])
        return jax.lax.with_sharding_constraint(buf, P(*(None,) * lead, *spec))

    def store(self, buf, slot, value, names):
        k = jnp.maximum(slot, 0)
        return self.pin(buf.at[k].set(jnp.where(slot >= 0, value, buf[k])), names)

    def exchange(self, r, y, dx, acts, grads_in):
        """The buffers after the exchange that ends the tick: what this stage sends up (to s+1) and down (to s−1)
        as the table's send_up and send_down say, and what arrives from s−1, from s+1 and from itself stored as
        the table's below_*, above_* and self_* say (OUTPUT into the activations, GRADIENT into the gradients).
        Only the (side, kind) pairs the table ever names are stored: two for the fused schedules."""
        p, ring = self.p, self.schedule.ring
        nothing = jnp.zeros_like(y)
        up = jax.lax.select_n(r["send_up"], nothing, y, dx)
        down = jax.lax.select_n(r["send_down"], nothing, y, dx)
        to_above = [(j, j + 1) for j in range(p - 1)] + ([(p - 1, 0)] if ring else [])
        to_below = [(j, j - 1) for j in range(1, p)] + ([(0, p - 1)] if ring else [])
        arrived = {"below": lambda: jax.lax.ppermute(up, AXIS, to_above),
                   "above": lambda: jax.lax.ppermute(down, AXIS, to_below),
                   "self": lambda: jax.lax.select_n(r["self_kind"], nothing, y, dx)}
        for side in SIDES:
            kinds = self.schedule.arrivals(side)
            value, slot = (arrived[side]() if kinds else None), r[side + "_slot"]
            if OUTPUT in kinds:
                acts = self.store(acts, jnp.where(r[side + "_kind"] == OUTPUT, slot, -1), value, ACT)
            if GRADIENT in kinds:
                grads_in = self.store(grads_in, jnp.where(r[side + "_kind"] == GRADIENT, slot, -1), value, ACT)
        return acts, grads_in

    # ---- the loop

    def tick(self, carry, rows):
        acts, grads_in, split, g_stack, g_shared, loss, metrics, aux = carry
        r = {f: rows[self.s, k] for k, f in enumerate(FIELDS)}
        y = self.forward(self.kind_of(r["fwd_mb"], r["fwd_chunk"], True), r["fwd_chunk"], r["fwd_mb"],
                         acts[jnp.maximum(r["fwd_slot"], 0)])
        kind, dy = self.kind_of(r["bwd_mb"], r["bwd_chunk"], False), grads_in[jnp.maximum(r["bwd_grad_slot"], 0)]
        if self.schedule.split:
            split, (dx, g_chunk, g_sh, l, ms, a), g_stack = self.split_slots(r, acts, split, kind, dy, g_stack)
        else:
            backward = self.backward_uniform if self.uniform else self.backward
            dx, g_chunk, g_sh, l, ms, a = backward(kind, r["bwd_chunk"], r["bwd_mb"],
                                                   acts[jnp.maximum(r["bwd_slot"], 0)], dy)
        g_stack = _add_at(g_stack, jnp.maximum(r["bwd_chunk"], 0), g_chunk)
        g_stack, g_shared = self.pin_grads(g_stack, jax.tree.map(jnp.add, g_shared, g_sh))
        acts, grads_in = self.exchange(r, y, dx, acts, grads_in)
        add = functools.partial(jax.tree.map, jnp.add)
        return (acts, grads_in, split, g_stack, g_shared, loss + l, add(metrics, ms), add(aux, a)), None

    def split_slots(self, r, acts, buffers, kind, dy, g_stack):
        """R, B and W of a split backward on their buffers (R's residuals and output, the W stash): (buffers,
        B's results with R's aux added, the accumulators with the two W slots' gradients added)."""
        residuals, y, stash_buf = buffers
        at = lambda slot: jnp.maximum(slot, 0)
        residuals, y, aux = self.recompute(self.kind_of(r["r_mb"], r["r_chunk"], False), r["r_chunk"], r["r_mb"],
                                           acts[at(r["r_slot"])], (residuals, y))
        *out, stash = self.backward_input(kind, r["bwd_chunk"], r["bwd_mb"], residuals, y, dy)
        out[-1] = jax.tree.map(jnp.add, out[-1], aux)
        stash_buf = jax.tree.map(lambda b, x, n: self.store(b, r["stash_slot"], x, n), stash_buf, stash,
                                 self.stash_names, is_leaf=is_names)
        for w in ("w", "w2"):
            stash_w = jax.tree.map(lambda b: b[at(r[w + "_slot"])], stash_buf)
            g_stack = self.backward_weights(g_stack, at(r[w + "_chunk"]), at(r[w + "_first"]), r[w + "_count"], stash_w)
        return (residuals, y, stash_buf), out, g_stack

    def run(self, stack, shared, stack_f, shared_f, mbs, count, aux_weight):
        stack, stack_f = (jax.tree.map(lambda a: a[:, 0], t) for t in (stack, stack_f))  # [v, Lc, ...]: this stage's
        self.s, self.mbs, self.count, self.aux_weight = jax.lax.axis_index(AXIS), mbs, count, aux_weight
        self.used_stack, self.used_shared, self.stack_f, self.shared_f = (
            self.gather_once(stack, shared, stack_f, shared_f) if self.gather_once else
            (stack, shared, stack_f, shared_f))
        self.repeats = jax.tree.leaves(stack)[0].shape[1]  # per chunk
        x_shape, aux_shape = jax.eval_shape(lambda: self.embed(self.used_shared, self.microbatch(0)))
        self.zeros_x, self.rows = jnp.zeros(x_shape.shape, x_shape.dtype), x_shape.shape[:2]
        zeros32 = lambda tree: _zeros_like(tree, jnp.float32)
        self.no_metrics = zeros32(jax.eval_shape(lambda: self.loss_fn(self.join(self.used_shared, self.shared_f),
                                                                   self.zeros_x, self.microbatch(0))[1]))
        self.no_aux, self.no_shared = zeros32(aux_shape), zeros32(self.used_shared)
        self.no_aux_as_made = _zeros_like(aux_shape)
        depth = lambda n: (n,) + x_shape.shape
        acts = self.pin(jnp.zeros(depth(self.schedule.act_depth), x_shape.dtype), ACT)
        grads_in = self.pin(jnp.zeros(depth(self.schedule.grad_depth), x_shape.dtype), ACT)
        split = self.split_buffers(stack)
        g_stack, g_shared = self.pin_grads(zeros32(stack), zeros32(shared))
        start = (acts, grads_in, split, g_stack, g_shared, jnp.float32(0), self.no_metrics, self.no_aux)
        (_, _, _, g_stack, g_shared, loss, metrics, aux), _ = jax.lax.scan(self.tick, start,
                                                                           jnp.asarray(self.schedule.table))
        loss, metrics, aux, g_shared = jax.lax.psum((loss, metrics, aux, g_shared), AXIS)
        if self.batch_manual:  # (MoE is refused here on more than one batch shard: its statistics are not sums)
            loss, metrics, aux, g_shared, g_stack = jax.lax.psum((loss, metrics, aux, g_shared, g_stack), BATCH_AXES)
        return loss, metrics, aux, jax.tree.map(lambda a: a[:, None], g_stack), g_shared

    def split_buffers(self, stack):
        """A split backward's buffers (None without one): the residuals and output of the one R kept, the W stash
        [stash_depth, ...] of each probe's cotangent. Sets the zeros the idle slots return."""
        if not self.schedule.split:
            return None
        assert self.schedule.residual_depth == 1, "a split schedule keeps one R's residuals at a time"
        assert self.repeats % self.schedule.pieces == 0, (self.repeats, self.schedule.pieces)  # W's pieces: layers
        tapped, rest = self.taps.split(self.chunk_of(stack, 0))
        probes = self.taps.probes(tapped, self.rows, self.zeros_x.dtype)
        self.stash_names = self.taps.stash_names(probes)
        self.no_stash, self.no_rest = probes, _zeros_like(rest, jnp.float32)
        pullback = lambda weights, c, x, i: self.chunk_vjp(weights, c, x, self.microbatch(i))[0]
        self.rebuilt, self.rebuild, shapes = _given_by(pullback, self.chunk_of(self.used_stack, 0), jnp.int32(0),
                                                       self.zeros_x, jnp.int32(0))
        self.residual_structure = jax.tree.structure(shapes)
        residuals = [jnp.zeros(a.shape, a.dtype) for a, again in zip(jax.tree.leaves(shapes), self.rebuilt)
                     if not again]
        stash_buf = jax.tree.map(lambda a, n: self.pin(jnp.zeros((self.schedule.stash_depth,) + a.shape, a.dtype), n),
                                 probes, self.stash_names, is_leaf=is_names)
        return residuals, self.zeros_x, stash_buf


def loss_and_grads(params: dict, microbatches: dict, norm, schedule: Schedule, inner: Layout,
                   embed_fn: Callable, lead_fn: Callable, leading: bool, blocks_fn: Callable, loss_fn: Callable,
                   aux_fn: Callable, pin_grads: Callable, batch_manual: bool, gather_once: Callable | None = None,
                   frozen: dict | None = None, join: Callable = lambda train, frozen: train, taps=None,
                   trail_fn: Callable | None = None):
    """(loss, metric shares, the blocks' auxiliary terms, gradients) of the whole batch through the pipeline.

    `params` holds the pipelined layer stack under "blocks" (leaves [R, ...], R split over pp) and the
    embedding/head weights (and any layers run before the pipelined ones) elsewhere; `microbatches` holds the
    batch's fields as [m, rows, ...] arrays. The model enters as its seams: `embed_fn(shared, mb) -> x` (the
    embedding), `lead_fn(shared, x, mb) -> (x, aux)` (the layers before the pipelined ones, which `leading` says
    there are; else x and no aux),
    `blocks_fn(chunk, x, mb, first) -> (x, aux)` (`first`: the chunk's first layer repeat in the stack,
    from which per-layer data such as attention windows is read), `loss_fn(shared, x, mb[, trail]) -> (objective
    sum, metric sums, auxiliary terms of any layers it runs)`, the sums divided by the global count; with islands
    inside, `trail_fn(shared, x, mb) -> trail` (if given: the layers of the head that may hold islands, run on every
    stage) makes what `loss_fn` takes as `trail` instead of running them itself; and `aux_fn(aux, weight)`,
    what a chunk's auxiliary terms (MoE router statistics) add to the objective. `norm` is (count, weight) (dividing
    the scalar, not every gradient). Inside the island the model traces under the `inner` layout (manual, without
    batch sharding when `batch_manual`: the batch axes are manual here, ZeRO-0/1). `pin_grads(stack_grads,
    shared_grads)` lays the gradient accumulators out; `gather_once(stack, shared, stack_f, shared_f)`, if
    given, returns the weights (trained and frozen) as used, cast and gathered once for the whole loop.
    `frozen`, laid out as `params`, holds what is not differentiated (a LoRA base, `models/lora.py`; None where
    `params` has a leaf), `join(params, frozen)` puts the two together for the model; gradients are `params`'
    alone. A schedule that splits the backward needs `taps` (`models/taps.Taps` of one chunk of the stack).
    """
    p, v = schedule.stages, schedule.chunks
    frozen = jax.tree.map(lambda _: None, params) if frozen is None else frozen
    stack, stack_f = (to_chunks(tree["blocks"], p, v, schedule.placement) for tree in (params, frozen))
    shared, shared_f = ({k: a for k, a in tree.items() if k != "blocks"} for tree in (params, frozen))
    axes = {AXIS} | (set(BATCH_AXES) if batch_manual else set())
    batch_spec = P(None, BATCH_AXES) if batch_manual else P()
    seams = dict(embed_fn=embed_fn, lead_fn=lead_fn, leading=leading, blocks_fn=blocks_fn, loss_fn=loss_fn,
                 aux_fn=aux_fn, pin_grads=pin_grads, gather_once=gather_once, join=join, taps=taps,
                 trail_fn=trail_fn if islands_inside(inner) else None)

    def local(stack, shared, stack_f, shared_f, mbs, norm):
        with use_layout(inner):
            return _Stage(schedule, inner, batch_manual, **seams).run(stack, shared, stack_f, shared_f, mbs, *norm)

    loss, metrics, aux, g_stack, g_shared = jax.shard_map(
        local, mesh=inner.mesh, axis_names=axes, check_vma=False,
        in_specs=(P(None, AXIS), P(), P(None, AXIS), P(), batch_spec, P()),
        out_specs=(P(), P(), P(), P(None, AXIS), P()))(stack, shared, stack_f, shared_f, microbatches, norm)
    return loss, metrics, aux, {**g_shared, "blocks": from_chunks(g_stack, schedule.placement)}
