"""The gate activations of the gated feed-forwards (`model.mlp`): silu for SwiGLU, tanh-GELU for Gemma's GeGLU,
gpt-oss's clamped SwiGLU.
Shared by the dense feed-forward (`models/layers.py`) and the experts (`ops/moe.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU in its tanh form (transformers' `gelu_new` / `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


GATES = {"swiglu": jax.nn.silu, "geglu_tanh": gelu_tanh}  # `model.mlp` -> the activation of its gate
GLUS = (*GATES, "swiglu_clamped")  # the gated feed-forwards
CLAMPED_ALPHA = 1.702  # gpt-oss's sigmoid gain (transformers' `swiglu_alpha`)


def glu(mlp: str, gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
    """A gated feed-forward's hidden from its gate and up projections: activation(gate)·up, or gpt-oss's clamped
    SwiGLU (`swiglu_clamped`: the gate clamped above at `limit`, up to ±`limit`, (up + 1)·gate·σ(1.702·gate))."""
    if mlp != "swiglu_clamped":
        return GATES[mlp](gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(CLAMPED_ALPHA * gate)
