"""Choosing the next token from fp32 logits: greedy, temperature, top-k, top-p.

Each sampled token comes with its log-probability under the full-vocabulary
`log_softmax(logits / temperature)`, also when top-k or top-p truncate what is sampled from: the
number a trainer recomputes for that token at the same temperature (RL's old log-probabilities).
Temperature 0 is greedy, and its log-probabilities are taken at temperature 1.

All settings are traced values, so one compiled program serves every setting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops.masking import NEG_INF


def truncate(scaled: jax.Array, top_k, top_p) -> jax.Array:
    """Logits [rows, vocab] with everything outside the top-k (k > 0) and then outside the nucleus (the
    fewest best tokens whose probability, renormalised over the top-k, reaches top_p) pushed to -1e30.
    The best token always stays."""
    ranked = -jnp.sort(-scaled, axis=-1)  # best first
    rank = jnp.arange(scaled.shape[-1])
    ranked = jnp.where((top_k <= 0) | (rank < top_k), ranked, NEG_INF)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the better tokens
    kept = (rank == 0) | ((before < top_p) & (ranked > NEG_INF))
    lowest = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= lowest, scaled, NEG_INF)


def sample(logits: jax.Array, keys, temperature, top_k, top_p):
    """(next token [rows] int32, its log-probability [rows] fp32) from logits [rows, vocab] fp32, each row
    drawing with its own key (keys [rows])."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    pool = jax.lax.cond((top_k > 0) | (top_p < 1), truncate, lambda s, k, p: s, scaled, top_k, top_p)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.vmap(jax.random.categorical)(keys, pool))
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
