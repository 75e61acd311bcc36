"""The mixture-of-experts feed-forward of an "moe" block: routing on the whole batch, the experts
where they live (here, or in the expert-parallel island), and the router statistics the block
reports. The math on one group of tokens (route, capacity, queue, dispatch, experts, combine,
auxiliary losses) is `ops/moe.py`.

A group is the set of tokens that share one set of buffers: on one device all tokens
of the call (or `groups` equal slices of them); under expert parallelism each
device's own tokens (`parallel/expert_dispatch.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.models import lora
from jaxllm.ops.moe import SCORES, Experts, Routing, aux_losses, local_moe, route
from jaxllm.parallel.expert_dispatch import expert_parallel_moe
from jaxllm.errors import ConfigError
from jaxllm.sharding import BATCH_AXES, current_layout, island_mesh, weight


# each expert leaf's logical names: weights [E, in, out], biases [E, out]
EXPERT_NAMES = {"w_in": ("experts", "embed", "mlp"), "w_gate": ("experts", "embed", "mlp"),
                "w_up": ("experts", "embed", "mlp"), "w_out": ("experts", "mlp", "embed"),
                "w_down": ("experts", "mlp", "embed"), "b_in": ("experts", "mlp"), "b_gate": ("experts", "mlp"),
                "b_up": ("experts", "mlp"), "b_out": ("experts", "embed"), "b_down": ("experts", "embed")}


def zero_stats(m) -> dict:
    """Router statistics of no MoE layer (the start of a sum over layers)."""
    return {"balance": jnp.float32(0), "z": jnp.float32(0), "dropped": jnp.float32(0), "seq_balance": jnp.float32(0),
            "load_probe": jnp.float32(0), "load": jnp.zeros(m.moe.n_experts, jnp.float32), "layers": jnp.float32(0)}


def seq_balance(scores: jax.Array, experts: jax.Array) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17–20) for scores [b, s, E] and chosen experts [b, s, k]: per
    sequence Σ_e f_e·P_e, f_e = E/(k·s) × the tokens choosing e, P_e the mean of e's score normalised over the
    experts; the mean over sequences."""
    b, s, n = scores.shape
    f = jnp.sum(jax.nn.one_hot(experts, n, dtype=jnp.float32), axis=(1, 2)) * n / (experts.shape[-1] * s)
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)
    return jnp.mean(jnp.sum(f * p, axis=-1))


def load_probe(bias: jax.Array, load: jax.Array) -> jax.Array:
    """0, whose gradient with respect to the router bias is the layer's load: Σ_e (b_e − sg(b_e))·sg(load_e). Every
    gradient path sums it over microbatches (and devices) as it sums gradients, so `trainer/bias_balance.py` reads the
    step's load per layer off the bias's gradient."""
    return jnp.sum((bias - jax.lax.stop_gradient(bias)) * jax.lax.stop_gradient(load))


def moe_ffn(p: dict, h: jax.Array, m, dtype):
    """The MoE feed-forward on normed h [b, s, D]: (y [b, s, D], this layer's router statistics).

    Routing runs on the whole batch (its statistics are global, whatever the mesh). The
    experts run where they live: with `mesh.ep > 1` in the expert-parallel island
    (`parallel/expert_dispatch.py`), otherwise here, in one group per batch shard (the
    rows one device holds), so tokens drop alike on every mesh with as many batch shards,
    queued in the sequence's order whatever its layout over sp.
    """
    e = m.moe
    bias = weight(p["router_bias"], ("router",), jnp.float32) if "router_bias" in p else None
    logit_bias = weight(p["router_logit_bias"], ("router",), jnp.float32) if "router_logit_bias" in p else None
    logits, probs, gates, experts = route(weight(p["router"], ("embed", "router"), jnp.float32), h, e.top_k,
                                          routing(m), None if bias is None else jax.lax.stop_gradient(bias),
                                          logit_bias)
    layout = current_layout()
    # The expert-parallel island is manual over the batch axes: it runs wherever those are not manual yet (also
    # inside a pipeline stage); MoE keeps out of ZeRO-0/1's accumulation island (`trainer.gradients.uses_island`).
    island = layout is not None and layout.mesh.shape["ep"] > 1 and batch_groups(layout) > 1
    # Into the island the weights go in fp32 on CPU: their gradients are summed over the batch axes
    # at its edge, and XLA:CPU aborts on bf16 all-reduces (AllReducePromotion). expert_ffn casts.
    w_dtype = jnp.float32 if island and jax.default_backend() == "cpu" else dtype
    w = {n: lora.expert_parts(a, EXPERT_NAMES[n], w_dtype, weight) for n, a in p["experts"].items()}
    # a capacity queues tokens in the sequence's order, however it is laid out (dropless queues drop nothing)
    order = layout.sequence_order if layout is not None and e.capacity_factor > 0 else None
    spec = Experts(m.mlp, m.mlp_limit, e.gate_input)
    if island:
        y, dropped = expert_parallel_moe(w, h, gates, experts, e.n_experts, e.capacity_factor, spec, dtype,
                                         island_mesh(layout), order)
    else:
        b, s, d = h.shape
        groups = batch_groups(layout)
        y, dropped = local_moe(w, h.reshape(b * s, d), gates.reshape(b * s, -1), experts.reshape(b * s, -1),
                               e.n_experts, e.capacity_factor, spec, dtype, groups if b % groups == 0 else 1, order)
        y = y.reshape(b, s, d)
    aux = aux_losses(logits, probs, experts)
    stats = {**aux, "dropped": dropped.astype(jnp.float32) / experts.size, "layers": jnp.float32(1),
             "seq_balance": seq_balance(probs, experts) if e.seq_balance_weight else jnp.float32(0),
             "load_probe": jnp.float32(0) if bias is None else load_probe(bias, aux["load"])}
    return y.astype(h.dtype), stats


def batch_groups(layout) -> int:
    """Token groups (sets of expert buffers) in h: one per batch shard whose rows h holds. Inside an island manual
    over the batch axes h is one device's rows: one group; inside one manual over others (a pipeline stage) every
    batch shard's. A batch smaller than the batch shards (sampling one sequence) is one group (the caller's test)."""
    if layout is None:
        return 1
    manual = jax.sharding.get_abstract_mesh().manual_axes if layout.manual else ()
    return math.prod(layout.mesh.shape[a] for a in BATCH_AXES if a not in manual)


def has_router_bias(m) -> bool:
    """Whether the MoE layers hold a routing bias (`moe.router_bias`: fixed, or moved by `bias_update_rate`)."""
    return bool(m.moe.router_bias or m.moe.bias_update_rate)


def routing(m) -> Routing:
    """`model.moe`'s routing keys."""
    e = m.moe
    return Routing(score=e.score, norm_topk=e.norm_topk, routed_scale=e.routed_scale, n_group=e.n_group,
                   topk_group=e.topk_group)


def objective(stats: dict, m, layers=None) -> jax.Array:
    """The auxiliary losses added to the language-model loss: weighted means over the MoE layers (`layers` of
    them, default those the statistics count; linear in the statistics, so a pipeline adds its stages' shares)."""
    if not stats:
        return jnp.float32(0)
    layers, e = jnp.maximum(stats["layers"], 1) if layers is None else layers, m.moe
    weighted = (e.balance_weight * stats["balance"] + e.z_weight * stats["z"]
                + e.seq_balance_weight * stats["seq_balance"])
    return weighted / layers + stats["load_probe"]


def metrics(stats: dict) -> dict:
    """Router statistics for the log, as means over MoE layers (and microbatches): the two auxiliary
    losses, the share of (token, choice) pairs dropped, each expert's share of the pairs
    (`moe_load`, [n_experts]) and the busiest expert's load over the mean."""
    if not stats:
        return {}
    n = jnp.maximum(stats["layers"], 1)
    load = stats["load"] / n
    return {"moe_balance": stats["balance"] / n, "moe_z": stats["z"] / n, "moe_dropped": stats["dropped"] / n,
            "moe_seq_balance": stats["seq_balance"] / n, "moe_load": load,
            "moe_load_max_over_mean": jnp.max(load) / jnp.mean(load)}


def _check_routing(e) -> None:
    if e.score not in SCORES:
        raise ConfigError(f"model.moe.score: '{e.score}' is not one of {', '.join(SCORES)}")
    if e.routed_scale <= 0:
        raise ConfigError(f"model.moe.routed_scale={e.routed_scale}: must be positive")
    if e.n_group < 1 or e.n_experts % e.n_group or (e.n_group > 1 and e.n_experts // e.n_group < 2):
        raise ConfigError(f"model.moe.n_group={e.n_group}: must divide n_experts={e.n_experts} into groups of at least "
                          "2 experts (a group is scored by its two best), or be 1")
    per_group = e.n_experts // e.n_group
    if not 1 <= e.topk_group <= e.n_group or (e.n_group > 1 and e.top_k > e.topk_group * per_group):
        raise ConfigError(f"model.moe.topk_group={e.topk_group}: need 1 ≤ topk_group ≤ n_group={e.n_group} and "
                          f"top_k={e.top_k} ≤ topk_group × {per_group} experts per group")


def check_config(m, t, shape: dict[str, int]) -> list[str]:
    """The MoE keys against the mesh and the training set-up: ConfigError (one line) for what cannot run."""
    e = m.moe
    if e.n_experts < 1 or not 1 <= e.top_k <= e.n_experts:
        raise ConfigError(f"model.moe: need n_experts ≥ 1 and 1 ≤ top_k ≤ n_experts, got n_experts={e.n_experts}, "
                          f"top_k={e.top_k}")
    negative = [f"model.moe.{k}={getattr(e, k)}" for k in ("capacity_factor", "d_ff", "balance_weight", "z_weight",
                                                          "seq_balance_weight", "bias_update_rate", "n_shared_experts",
                                                          "shared_d_ff") if getattr(e, k) < 0]
    if negative:
        raise ConfigError(f"{', '.join(negative)}: must be 0 or more")
    _check_routing(e)
    if e.shared_gate and not (e.n_shared_experts or e.shared_d_ff):
        raise ConfigError("model.moe.shared_gate=true gates the shared experts, and there are none; set "
                          "model.moe.n_shared_experts or turn the gate off")
    ep = shape["ep"]
    if e.n_experts % ep:
        raise ConfigError(f"model.moe.n_experts={e.n_experts} is not divisible by mesh.ep={ep}; each ep rank owns "
                          "an equal share of the experts")
    if (e.d_ff or m.d_ff) % shape["tp"]:
        raise ConfigError(f"model.moe.d_ff={e.d_ff or m.d_ff} is not divisible by mesh.tp={shape['tp']}")
    return []
