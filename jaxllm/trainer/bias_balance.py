"""Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): after each step, every MoE layer's router bias moves by
`model.moe.bias_update_rate`, down for each expert that took more than the mean share of the step's (token,
choice) pairs, up for each that took less (unchanged on a tie). The bias only decides which experts a token
goes to (`ops/moe.select`); the gates stay the unbiased scores.

The bias is a parameter leaf (`moe.router_bias`, [layers, experts], fp32), so it is checkpointed, resumed and
resharded with the parameters; the optimizer's update of it is replaced by this one, and it never moves by a
gradient. The load reaches the step as the bias's "gradient": the MoE layer adds a zero-valued term whose
gradient with respect to the bias is the layer's load (`models/moe.load_probe`), so whatever sums gradients
over microbatches and devices sums the load over the whole step. That gradient is taken out of the gradients
before their norm, clipping and the optimizer see them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LEAF = "router_bias"


def _is_bias(path) -> bool:
    return getattr(path[-1], "key", None) == LEAF


def without_loads(grads):
    """The gradients with every router bias's (its layer's load) zeroed."""
    return jax.tree_util.tree_map_with_path(lambda p, g: jnp.zeros_like(g) if _is_bias(p) else g, grads)


def update(new_params, old_params, grads, rate: float):
    """`new_params` with each router bias set to its old value moved by `rate` against the sign of its expert's
    load over the layer's mean, the load read off the bias's gradient in `grads` (a positive multiple of the
    step's share of pairs per expert); the optimizer's own update of the bias is dropped."""

    def move(path, new, old, load):
        if not _is_bias(path):
            return new
        return old - rate * jnp.sign(load - jnp.mean(load, axis=-1, keepdims=True))

    return jax.tree_util.tree_map_with_path(move, new_params, old_params, grads)
