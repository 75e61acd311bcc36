"""Mixture-of-experts feed-forward: top-k routing, capacity, dispatch to fixed-size expert buffers.

The pieces, each a small pure function over flattened tokens x [T, D]:

- `route`: router logits in fp32, softmax, top-k; for k > 1 the k gates are
  renormalised to sum to 1 (for k = 1 the gate stays the softmax probability: a single
  gate renormalised to 1 would leave the router no gradient);
- `queue_positions`: each (token, choice) pair's place in its expert's queue. All first
  choices come before all second choices, then token order (the Switch/GShard
  priority), so when an expert is full it is the later and lower-ranked pairs that drop;
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

import jax
import jax.numpy as jnp

from jaxllm.sharding import BATCH_AXES, current_layout, weight


def route(router_w: jax.Array, x: jax.Array, top_k: int):
    """(logits [..., E], probs [..., E], gates [..., k], experts [..., k]) in fp32 for tokens x [..., D]."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router_w.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)
    if top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return logits, probs, gates, experts.astype(jnp.int32)


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Buffer slots per expert for a group of `tokens` tokens (capacity_factor 0: dropless)."""
    if capacity_factor <= 0:
        return tokens
    return min(tokens, max(1, math.ceil(capacity_factor * tokens * top_k / n_experts)))


def queue_positions(experts: jax.Array, n_experts: int) -> jax.Array:
    """[T, k] place of each (token, choice) in its expert's queue: choice rank first, then token order."""
    t, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(k * t), n_experts, dtype=jnp.int32)  # [k·T, E], choice-major
    place = jnp.cumsum(onehot, axis=0) - 1
    return jnp.sum(place * onehot, axis=-1).reshape(k, t).T


def dispatch(x: jax.Array, experts: jax.Array, positions: jax.Array, n_experts: int, slots: int) -> jax.Array:
    """Tokens x [T, D] into expert buffers [E, C, D]; pairs past the capacity are dropped."""
    t, k = experts.shape
    index = jnp.where(positions < slots, experts * slots + positions, n_experts * slots)  # out of range: dropped
    rows = jnp.broadcast_to(x[:, None, :], (t, k, x.shape[-1])).reshape(t * k, -1)
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


def expert_ffn(p: dict, buffer: jax.Array, family: str, dtype) -> jax.Array:
    """Every expert's feed-forward on its buffer [E, C, D] (GELU for gpt2, SwiGLU for llama)."""
    h = buffer.astype(dtype)
    if family == "gpt2":
        hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", h, p["w_in"].astype(dtype)), approximate=True)
        return jnp.einsum("ecf,efd->ecd", hidden, p["w_out"].astype(dtype))
    gate = jnp.einsum("ecd,edf->ecf", h, p["w_gate"].astype(dtype))
    up = jnp.einsum("ecd,edf->ecf", h, p["w_up"].astype(dtype))
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, p["w_down"].astype(dtype))


def aux_losses(logits: jax.Array, probs: jax.Array, experts: jax.Array) -> dict:
    """Switch load-balancing loss, router z-loss, and the per-expert load (share of assignments)."""
    n_experts = probs.shape[-1]
    probs, logits = probs.reshape(-1, n_experts), logits.reshape(-1, n_experts)
    load = jnp.mean(jax.nn.one_hot(experts.reshape(-1), n_experts, dtype=jnp.float32), axis=0)  # f_e, sums to 1
    importance = jnp.mean(probs, axis=0)  # P_e
    return {"balance": n_experts * jnp.sum(load * importance),
            "z": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            "load": load}


def local_moe(p: dict, x: jax.Array, gates, experts, n_experts: int, capacity_factor: float, family: str, dtype,
              groups: int = 1):
    """The routed experts on tokens x [T, D] in `groups` equal groups, all experts local.
    Returns (y [T, D], dropped pairs count)."""
    t, k = experts.shape
    slots = capacity(t // groups, n_experts, k, capacity_factor)

    def one(x, gates, experts):
        pos = queue_positions(experts, n_experts)
        out = expert_ffn(p, dispatch(x, experts, pos, n_experts, slots), family, dtype)
        return combine(out, experts, pos, gates), jnp.sum(pos >= slots)

    split = lambda a: a.reshape(groups, t // groups, *a.shape[1:])
    y, dropped = jax.vmap(one)(split(x), split(gates), split(experts))
    return y.reshape(t, -1), jnp.sum(dropped)


def zero_stats(m) -> dict:
    """Router statistics of no MoE layer (the start of a sum over layers)."""
    return {"balance": jnp.float32(0), "z": jnp.float32(0), "dropped": jnp.float32(0),
            "load": jnp.zeros(m.moe.n_experts, jnp.float32), "layers": jnp.float32(0)}


def moe_ffn(p: dict, h: jax.Array, m, dtype):
    """The MoE feed-forward on normed h [b, s, D]: (y [b, s, D], this layer's router statistics).

    Routing runs on the whole batch (its statistics are global, whatever the mesh). The
    experts run where they live: with `mesh.ep > 1` in the expert-parallel island
    (`parallel/expert_dispatch.py`), otherwise here, in one group per batch shard (the
    rows one device holds), so tokens drop alike on every mesh with as many batch shards.
    """
    e = m.moe
    logits, probs, gates, experts = route(weight(p["router"], ("embed", "router"), jnp.float32), h, e.top_k)
    layout = current_layout()
    island = layout is not None and layout.mesh.shape["ep"] > 1
    if island and layout.manual:  # validation keeps MoE out of the pipeline and ZeRO-0/1 accumulation
        raise NotImplementedError("the expert-parallel island cannot nest inside another island yet")
    # Into the island the weights go in fp32 on CPU: their gradients are summed over the batch axes
    # at its edge, and XLA:CPU aborts on bf16 all-reduces (AllReducePromotion). expert_ffn casts.
    w_dtype = jnp.float32 if island and jax.default_backend() == "cpu" else dtype
    w = {n: weight(a, ("experts",) + (("mlp", "embed") if n in ("w_out", "w_down") else ("embed", "mlp")), w_dtype)
         for n, a in p["experts"].items()}
    if island:
        from jaxllm.parallel.expert_dispatch import expert_parallel_moe

        y, dropped = expert_parallel_moe(w, h, gates, experts, e.n_experts, e.capacity_factor, m.family, dtype,
                                         layout.mesh)
    else:
        b, s, d = h.shape
        # inside an island manual over the batch axes, h is already one device's rows; a batch smaller
        # than the batch shards (sampling one sequence) is one group
        groups = 1 if layout is None or layout.manual else math.prod(layout.mesh.shape[a] for a in BATCH_AXES)
        y, dropped = local_moe(w, h.reshape(b * s, d), gates.reshape(b * s, -1), experts.reshape(b * s, -1),
                               e.n_experts, e.capacity_factor, m.family, dtype, groups if b % groups == 0 else 1)
        y = y.reshape(b, s, d)
    aux = aux_losses(logits, probs, experts)
    stats = {**aux, "dropped": dropped.astype(jnp.float32) / experts.size, "layers": jnp.float32(1)}
    return y.astype(h.dtype), stats


def objective(stats: dict, m) -> jax.Array:
    """The auxiliary losses added to the language-model loss: weighted means over the MoE layers."""
    if not stats:
        return jnp.float32(0)
    layers = jnp.maximum(stats["layers"], 1)
    return (m.moe.balance_weight * stats["balance"] + m.moe.z_weight * stats["z"]) / layers


def metrics(stats: dict) -> dict:
    """Router statistics for the log, as means over MoE layers (and microbatches): the two auxiliary
    losses, the share of (token, choice) pairs dropped, each expert's share of the pairs
    (`moe_load`, [n_experts]) and the busiest expert's load over the mean."""
    if not stats:
        return {}
    n = jnp.maximum(stats["layers"], 1)
    load = stats["load"] / n
    return {"moe_balance": stats["balance"] / n, "moe_z": stats["z"] / n, "moe_dropped": stats["dropped"] / n,
            "moe_load": load, "moe_load_max_over_mean": jnp.max(load) / jnp.mean(load)}
