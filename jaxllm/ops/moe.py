"""Mixture-of-experts math on one group of tokens: top-k routing, capacity, dispatch to fixed-size expert
buffers, the experts, combine. Below both `models/moe.py` and `parallel/expert_dispatch.py`; imports neither.

The pieces, each a small pure function over flattened tokens x [T, D]:

- `route`: router logits in fp32, scores (`Routing.score`: softmax as Mixtral and Qwen, or sigmoid as
  DeepSeek-V3), `select` the top k — within the `topk_group` best of `n_group` expert groups when
  grouped, a group scored by the sum of its two highest scores, and by the scores plus a per-expert
  `bias` that decides the choice only (DeepSeek-V3's auxiliary-loss-free balancing) — then the gates
  are the chosen experts' unbiased scores: for k > 1 renormalised to sum to 1 (`norm_topk`; for k = 1
  the gate stays the score: a single gate renormalised to 1 would leave the router no gradient), times
  `routed_scale`;
- `queue_positions`: each (token, choice) pair's place in its expert's queue. All first
  choices come before all second choices, then token order (the Switch/GShard
  priority), so when an expert is full it is the later and lower-ranked pairs that drop;
  token order is the sequence's own, also when it is laid out in another (`seq_order`: the zig-zag over sp);
- `capacity`: buffer slots per expert and group: ceil(capacity_factor · T·k / E), or T
  in dropless mode (capacity_factor = 0: an expert gets each token at most once);
- `dispatch` / `combine`: scatter tokens into [E, C, D] buffers and gather the experts'
  outputs back, weighted by their gates. A dropped pair adds nothing: the token passes
  on through the residual connection;
- `expert_ffn`: every expert's feed-forward as batched matmuls over [E, C, D];
- `aux_losses`: Switch's load-balancing loss E·Σ_e f_e·P_e (f_e the share of
  assignments expert e got, P_e its mean router probability) and the router z-loss
  mean(logsumexp(logits)²), from statistics over all tokens given.

A group is the set of tokens that share one set of buffers: on one device all tokens
of the call (or `groups` equal slices of them); under expert parallelism each
device's own tokens (`parallel/expert_dispatch.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.ops import fp8
from jaxllm.ops.activations import gelu_tanh, glu


@dataclass(frozen=True)
class Routing:
    """How a router turns logits into (gates, experts), beyond top-k (`model.moe`'s routing keys; the default
    is Mixtral's)."""

    score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True  # for k > 1, the k gates renormalised to sum to 1
    routed_scale: float = 1.0  # the gates times this
    n_group: int = 1  # experts in n_group equal groups; the top k chosen within the topk_group best groups
    topk_group: int = 1


@dataclass(frozen=True)
class Experts:
    """What the experts compute beyond their weights: `mlp` (`model.mlp`), `limit` (the clamped SwiGLU's) and
    `gate_input` (Llama 4: each chosen expert's input, not its output, scaled by the gate)."""

    mlp: str = "swiglu"
    limit: float = 0.0
    gate_input: bool = False


def experts_of(spec) -> Experts:
    """`spec` as `Experts` (a bare `model.mlp` name: that feed-forward, gates on the outputs)."""
    return spec if isinstance(spec, Experts) else Experts(spec)


SCORES = {"softmax": lambda logits: jax.nn.softmax(logits, axis=-1), "sigmoid": jax.nn.sigmoid}


def select(scores: jax.Array, top_k: int, routing: Routing = Routing(), bias: jax.Array | None = None):
    """(gates [..., k], experts [..., k] int32) from scores [..., E]: the experts by scores + `bias` (the bias only
    decides the choice), within the best `topk_group` of `n_group` groups (a group's score: the sum of its two
    highest biased scores, as DeepSeek-V3); the gates the chosen experts' unbiased scores, renormalised and
    scaled as `routing` says."""
    choice = scores if bias is None else scores + bias
    if routing.n_group > 1:
        grouped = choice.reshape(*choice.shape[:-1], routing.n_group, -1)
        best_groups = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), routing.topk_group)[1]
        keep = jnp.any(jax.nn.one_hot(best_groups, routing.n_group, dtype=bool), axis=-2)  # [..., n_group]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, top_k)[1]
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if routing.norm_topk and top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return gates * routing.routed_scale, experts.astype(jnp.int32)


def route(router_w: jax.Array, x: jax.Array, top_k: int, routing: Routing = Routing(), bias: jax.Array | None = None,
          logit_bias: jax.Array | None = None):
    """(logits [..., E], scores [..., E], gates [..., k], experts [..., k]) in fp32 for tokens x [..., D]; `bias`
    only chooses (`select`), `logit_bias` joins the logits (gpt-oss's router bias)."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router_w.astype(jnp.float32))
    if logit_bias is not None:
        logits = logits + logit_bias
    scores = SCORES[routing.score](logits)
    return logits, scores, *select(scores, top_k, routing, bias)


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Buffer slots per expert for a group of `tokens` tokens (capacity_factor 0: dropless)."""
    if capacity_factor <= 0:
        return tokens
    return min(tokens, max(1, math.ceil(capacity_factor * tokens * top_k / n_experts)))


def queue_positions(experts: jax.Array, n_experts: int, seq_order: np.ndarray | None = None) -> jax.Array:
    """[T, k] place of each (token, choice) in its expert's queue: choice rank first, then token order. With
    `seq_order` (position j of each of the T / len(seq_order) rows holds the sequence's position seq_order[j]), token
    order is the sequence's: the queue is built on the rows put back in order, then laid out as given."""
    if seq_order is not None:
        seq_order = np.asarray(seq_order)
        rows = experts.reshape(-1, len(seq_order), experts.shape[-1])
        in_order = queue_positions(rows[:, np.argsort(seq_order)].reshape(experts.shape), n_experts)
        return in_order.reshape(rows.shape)[:, seq_order].reshape(experts.shape)
    t, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(k * t), n_experts, dtype=jnp.int32)  # [k·T, E], choice-major
    place = jnp.cumsum(onehot, axis=0) - 1
    return jnp.sum(place * onehot, axis=-1).reshape(k, t).T


def dispatch(x: jax.Array, experts: jax.Array, positions: jax.Array, n_experts: int, slots: int,
             scale: jax.Array | None = None) -> jax.Array:
    """Tokens x [T, D] into expert buffers [E, C, D], each (token, choice) times `scale` [T, k] where given; pairs
    past the capacity are dropped."""
    t, k = experts.shape
    index = jnp.where(positions < slots, experts * slots + positions, n_experts * slots)  # out of range: dropped
    rows = jnp.broadcast_to(x[:, None, :], (t, k, x.shape[-1]))
    rows = (rows if scale is None else rows * scale[..., None].astype(x.dtype)).reshape(t * k, -1)
    buffer = jnp.zeros((n_experts * slots, x.shape[-1]), x.dtype).at[index.reshape(-1)].add(rows, mode="drop")
    return buffer.reshape(n_experts, slots, -1)


def combine(out: jax.Array, experts: jax.Array, positions: jax.Array, gates: jax.Array) -> jax.Array:
    """Expert outputs [E, C, D] back to tokens [T, D], each weighted by its gate (dropped pairs add 0)."""
    n_experts, slots, d = out.shape
    kept = positions < slots
    index = jnp.where(kept, experts * slots + positions, 0)
    picked = jnp.take(out.reshape(n_experts * slots, d), index.reshape(-1), axis=0).reshape(*experts.shape, d)
    weights = jnp.where(kept, gates, 0.0).astype(picked.dtype)
    return jnp.einsum("tkd,tk->td", picked, weights)


def expert_ffn(p: dict, buffer: jax.Array, spec, dtype) -> jax.Array:
    """Every expert's feed-forward on its buffer [E, C, D] (`spec`, an `Experts` or a `model.mlp` name: gelu_tanh, or
    a gated one; biases b_* [E, out] where `p` has them). A weight given as a tuple (W, scale·A, B) carries
    low-rank adapters, added to W's product unmerged."""
    spec = experts_of(spec)
    h = buffer.astype(dtype)

    def expert_matmul(spec, x, name):  # the "experts" group of precision.matmul
        if not isinstance(p[name], tuple):
            return fp8.einsum("experts", spec, x, p[name].astype(dtype))
        w, a, b = (t.astype(dtype) for t in p[name])  # LoRA (models/lora.py): W, scale·A, B, applied unmerged
        ins, out = spec.split("->")
        xs, ws = ins.split(",")
        low = jnp.einsum(f"{xs},{ws[:2]}r->{xs[:2]}r", x, a)
        return fp8.einsum("experts", spec, x, w) + jnp.einsum(f"{xs[:2]}r,{ws[0]}r{ws[2]}->{out}", low, b)

    def project(spec, x, name):  # the matmul, plus the expert's bias where there is one
        y = expert_matmul(spec, x, name)
        bias = "b" + name[1:]
        return y + p[bias].astype(dtype)[:, None, :] if bias in p else y

    if spec.mlp == "gelu_tanh":
        hidden = gelu_tanh(project("ecd,edf->ecf", h, "w_in"))
        return project("ecf,efd->ecd", hidden, "w_out")
    gate, up = project("ecd,edf->ecf", h, "w_gate"), project("ecd,edf->ecf", h, "w_up")
    return project("ecf,efd->ecd", glu(spec.mlp, gate, up, spec.limit), "w_down")


def aux_losses(logits: jax.Array, probs: jax.Array, experts: jax.Array) -> dict:
    """Switch load-balancing loss, router z-loss, and the per-expert load (share of assignments)."""
    n_experts = probs.shape[-1]
    probs, logits = probs.reshape(-1, n_experts), logits.reshape(-1, n_experts)
    load = jnp.mean(jax.nn.one_hot(experts.reshape(-1), n_experts, dtype=jnp.float32), axis=0)  # f_e, sums to 1
    importance = jnp.mean(probs, axis=0)  # P_e
    return {"balance": n_experts * jnp.sum(load * importance),
            "z": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            "load": load}


def gated_pairs(x, gates, experts, positions, n_experts: int, slots: int, spec: Experts):
    """(expert buffers [E, C, D], the weights `combine` takes): the gates on the outputs, or (`gate_input`) on the
    inputs and the outputs summed as they are."""
    if spec.gate_input:
        return dispatch(x, experts, positions, n_experts, slots, gates), jnp.ones_like(gates)
    return dispatch(x, experts, positions, n_experts, slots), gates


def local_moe(p: dict, x: jax.Array, gates, experts, n_experts: int, capacity_factor: float, spec, dtype,
              groups: int = 1, seq_order: np.ndarray | None = None):
    """The routed experts (`spec`: `Experts`, or a `model.mlp` name) on tokens x [T, D] in `groups` equal groups,
    all experts local, queued in the sequence's order (`queue_positions`). Returns (y [T, D], dropped pairs
    count)."""
    t, k = experts.shape
    slots, spec = capacity(t // groups, n_experts, k, capacity_factor), experts_of(spec)

    def one(x, gates, experts):
        pos = queue_positions(experts, n_experts, seq_order)
        buffer, weights = gated_pairs(x, gates, experts, pos, n_experts, slots, spec)
        return combine(expert_ffn(p, buffer, spec, dtype), experts, pos, weights), jnp.sum(pos >= slots)

    split = lambda a: a.reshape(groups, t // groups, *a.shape[1:])
    y, dropped = jax.vmap(one)(split(x), split(gates), split(experts))
    return y.reshape(t, -1), jnp.sum(dropped)
