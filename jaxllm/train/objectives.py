"""Objectives: what a train step minimises, kept outside the model and the gradient paths.

An objective declares

- `fields`: the batch fields it needs beyond the contract's (`jaxllm/batch.py`), name -> dtype;
- `count(batch)`: the denominator, computable from the batch alone before the forward pass
  (the step divides each microbatch's sum by the global count inside the differentiated
  function, so accumulation, data sharding and the pipeline do not change the result);
- `token_terms(logp, lse, batch) -> (sum, metric sums)`, evaluated per loss chunk
  (`train.loss_chunk`): `logp` is each position's log-probability of its target and `lse`
  the log-sum-exp of its logits, both `[rows, chunk]` fp32 at `temperature`; `batch` holds
  the same positions of every field. Each metric sum is reported divided by the count,
  like the loss.

Per-sequence quantities (rewards, advantages) are spread over their tokens on the host as
per-token weights, so every term is a sum over tokens and microbatches add up exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Objective:
    name: str
    count: Callable  # (batch) -> scalar
    token_terms: Callable  # (logp, lse, batch) -> (sum, {name: sum})
    fields: dict = field(default_factory=dict)
    temperature: float = 1.0


def zero_metrics(objective: Objective, batch: dict) -> dict:
    """Zeros shaped as the objective's metric sums (the start of a sum over microbatches)."""
    one = lambda dtype: jax.ShapeDtypeStruct((1, 1), dtype)
    shapes = jax.eval_shape(objective.token_terms, one(jnp.float32), one(jnp.float32),
                            {k: one(v.dtype) for k, v in batch.items()})[1]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _lm_terms(logp, lse, batch):
    return jnp.sum(-logp * batch["loss_mask"]), {}


# Next-token cross-entropy over the tokens `loss_mask` marks, averaged over them: pre-training
# (every token) and supervised fine-tuning (the reply's tokens) alike.
LANGUAGE_MODEL = Objective("lm", count=lambda batch: jnp.sum(batch["loss_mask"]), token_terms=_lm_terms)


def _weighted_terms(logp, lse, batch):
    w = batch["weights"]
    return jnp.sum(-logp * w), {"target_prob": jnp.sum(jnp.exp(logp) * w)}


# Σ w·(−log p(target)) / Σ w with per-token weights from the host (zeros drop a token); its
# metric `target_prob` is the weighted mean probability of the targets.
WEIGHTED_TOKENS = Objective("weighted", count=lambda batch: jnp.sum(batch["weights"]), token_terms=_weighted_terms,
                            fields={"weights": "float32"})

OBJECTIVES = {o.name: o for o in (LANGUAGE_MODEL, WEIGHTED_TOKENS)}
