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
- `sequence_loss` (None for a token objective): the sequence stage. Its token terms return, in
  place of the sum, per-sequence sums (a tree of `[rows, pairs, 2]` arrays keyed by the batch fields
  `pair_id` and `side`: `trainer/preference.py`); once they are complete over the loss chunks and over
  sp and tp (the partitioner adds a row's pieces), `sequence_loss(sums) -> (sum over sequences,
  metric sums)` turns them into the loss. Its count is of sequences (pairs), and a pair lies within
  one row, so it never spans microbatches, pipeline microbatches or the devices of a manual batch
  island: every gradient path adds the stage's per-microbatch sums as it adds token sums.

Per-sequence quantities a token objective needs (rewards, advantages) are spread over their tokens on
the host as per-token weights, so every term is a sum over tokens and microbatches add up exactly.
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
    spiky: bool = True  # its loss is a likelihood, so the step guard may skip its spikes (trainer/guard.py)
    sequence_loss: Callable | None = None  # (per-sequence sums) -> (sum, {name: sum}); None: token-additive


def finish(objective: Objective, total, sums: dict):
    """The objective's (sum, metric sums) from its token terms summed over a batch: as they are for a token
    objective; through the sequence stage for a sequence objective."""
    if objective.sequence_loss is None:
        return total, sums
    loss, more = objective.sequence_loss(total)
    return loss, {**sums, **more}


def zero_metrics(objective: Objective, batch: dict) -> dict:
    """Zeros shaped as the objective's metric sums (the start of a sum over microbatches)."""
    one = lambda dtype: jax.ShapeDtypeStruct((1, 1), dtype)
    shapes = jax.eval_shape(lambda *a: finish(objective, *objective.token_terms(*a)), one(jnp.float32),
                            one(jnp.float32), {k: one(v.dtype) for k, v in batch.items()})[1]
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

# GRPO's batch fields, all [batch, seq] float32 and spread over each completion's tokens on the host
# (`rl/advantages.py`): the group-normalised advantage, the log-probability of the token under the
# parameters that sampled it and under the frozen reference (both at the sampling temperature, from
# the trainer's own forward pass before the update), each token's loss weight (0 outside completions)
# and `norm`, whose sum is the loss's denominator (token, sequence or constant normalisation).
GRPO_FIELDS = {k: "float32" for k in ("advantages", "old_logp", "ref_logp", "weights", "norm")}


ASYNC_FIELDS = {"behav_logp": "float32"}  # asynchronous RL: the generator's own log-probabilities, μ


def grpo(epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
         temperature: float = 1.0, behaviour_cap: float = 0.0) -> Objective:
    """GRPO's clipped surrogate (DeepSeekMath): per token −min(ρ·Â, clip(ρ, 1−ε, 1+ε_high)·Â) with
    ρ = π/π_old, plus β times the k3 estimate of KL(π‖π_ref), e^(r−l) − (r−l) − 1 with r, l the
    reference's and the policy's log-probabilities; summed with the weights, over Σ norm. Metrics:
    `clip_frac` (tokens where the clipped branch is the minimum) and `kl` (the k3 estimate), each weighted
    like the loss.

    `behaviour_cap` C > 0: decoupled PPO for rollouts sampled by older parameters (Hilton et al. 2022, as AReaL
    uses it): π_old is the proximal policy (the trainer's parameters when the batch is used), and the surrogate
    is weighted by min(π_old/μ, C), μ the generator's log-probabilities (`behav_logp`); metrics
    `behaviour_weight` (the weight's mean) and `behaviour_capped_frac`."""
    high = epsilon if epsilon_high is None else epsilon_high

    def terms(logp, lse, batch):
        w, adv = batch["weights"], batch["advantages"]
        ratio = jnp.exp(logp - batch["old_logp"])
        unclipped, clipped = ratio * adv, jnp.clip(ratio, 1 - epsilon, 1 + high) * adv
        per_token = -jnp.minimum(unclipped, clipped)
        metrics = {"clip_frac": jnp.sum(w * (clipped < unclipped))}
        if behaviour_cap:
            behaviour = jnp.exp(batch["old_logp"] - batch["behav_logp"])
            per_token = per_token * jnp.minimum(behaviour, behaviour_cap)
            metrics.update(behaviour_weight=jnp.sum(w * behaviour), behaviour_capped_frac=jnp.sum(
                w * (behaviour > behaviour_cap)))
        if beta:
            gap = batch["ref_logp"] - logp
            k3 = jnp.exp(gap) - gap - 1
            per_token = per_token + beta * k3
            metrics["kl"] = jnp.sum(w * k3)
        return jnp.sum(w * per_token), metrics

    name = f"grpo(epsilon={epsilon}, epsilon_high={high}, beta={beta}, temperature={temperature}" + (
        f", behaviour_cap={behaviour_cap})" if behaviour_cap else ")")
    fields = {**GRPO_FIELDS, **(ASYNC_FIELDS if behaviour_cap else {})}
    return Objective(name, count=lambda batch: jnp.sum(batch["norm"]), token_terms=terms, fields=fields,
                     temperature=temperature, spiky=False)  # near 0 and of either sign: no spikes to judge


def gspo(epsilon: float = 3e-4, epsilon_high: float | None = None, beta: float = 0.0,
         temperature: float = 1.0) -> Objective:
    """GSPO's sequence-level surrogate (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7): per
    completion y_i (one a row) the ratio s_i = exp(mean over its tokens of log π − log π_old), the loss
    −min(s_i·Â_i, clip(s_i, 1−ε, 1+ε_high)·Â_i), plus β times the mean over its tokens of GRPO's k3 KL; the mean
    over completions. It reads GRPO's fields with `rl.loss_norm = "sequence"`: each completion's tokens weigh
    1/|y_i| (so a weighted sum is a mean over them) and `norm` sums to 1 a completion. Metrics: `clip_frac`
    (completions whose clipped branch is the minimum), `kl` (with β)."""
    high = epsilon if epsilon_high is None else epsilon_high

    def terms(logp, lse, batch):
        w = batch["weights"]
        sums = {"log_ratio": jnp.sum(w * (logp - batch["old_logp"]), axis=1),
                "advantage": jnp.sum(w * batch["advantages"], axis=1), "weight": jnp.sum(w, axis=1)}
        if beta:
            gap = batch["ref_logp"] - logp
            sums["kl"] = jnp.sum(w * (jnp.exp(gap) - gap - 1), axis=1)
        return sums, {}

    def sequence_loss(sums):
        present, adv = sums["weight"] > 0, sums["advantage"]
        s = jnp.exp(sums["log_ratio"])
        unclipped, clipped = s * adv, jnp.clip(s, 1 - epsilon, 1 + high) * adv
        per_sequence = -jnp.minimum(unclipped, clipped) + (beta * sums["kl"] if beta else 0.0)
        total = lambda a: jnp.sum(jnp.where(present, a, 0.0))
        metrics = {"clip_frac": total((clipped < unclipped).astype(jnp.float32))}
        if beta:
            metrics["kl"] = total(jax.lax.stop_gradient(sums["kl"]))
        return total(per_sequence), metrics

    name = f"gspo(epsilon={epsilon}, epsilon_high={high}, beta={beta}, temperature={temperature})"
    return Objective(name, count=lambda batch: jnp.sum(batch["norm"]), token_terms=terms, fields=GRPO_FIELDS,
                     temperature=temperature, spiky=False, sequence_loss=sequence_loss)
