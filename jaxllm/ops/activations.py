"""The gate activations of the gated feed-forwards (`model.mlp`): silu for SwiGLU, tanh-GELU for Gemma's GeGLU.
Shared by the dense feed-forward (`models/layers.py`) and the experts (`ops/moe.py`)."""

from __future__ import annotations

import jax


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU in its tanh form (transformers' `gelu_new` / `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


GATES = {"swiglu": jax.nn.silu, "geglu_tanh": gelu_tanh}  # `model.mlp` -> the activation of its gate
