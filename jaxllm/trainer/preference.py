"""Preference optimisation (`train.objective = "dpo"`, the `dpo` section): DPO, IPO and SimPO on pairs of completions.

A batch holds pairs (`data.format = "preference"`, `data/preference.py`): each pair's chosen and rejected sequence
share one row, so a pair never spans microbatches or devices. Besides the contract's fields a token carries

- `pair_id`: its pair's index within the row (0, 1, ...), `side`: 0 in the chosen sequence, 1 in the rejected;
- `ref_logp`: its target's log-probability under the reference (not for `simpo`), from the trainer's own forward
  pass on the reference parameters once per batch, before the update (`Scored`).

The token terms sum, per (row, pair, side), the policy's and the reference's log-probabilities over the completion's
tokens (`loss_mask`) and count those tokens; the sequence stage (`objectives.finish`) then computes each pair's loss
from the complete sums and adds them; the count is the pairs. Metrics, under TRL's names, are means over pairs:
`rewards/chosen`, `rewards/rejected` (β × the completion's log-ratio to the reference; SimPO: β × its averaged
log-probability), `rewards/margins` (chosen − rejected), `rewards/accuracies` (the share of pairs whose chosen reward
is strictly above the rejected one), `logps/chosen`, `logps/rejected` (the policy's summed log-probabilities; SimPO:
averaged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError
from jaxllm.trainer.objectives import Objective

LOSSES = ("sigmoid", "ipo", "simpo")
PAIR_FIELDS = {"pair_id": "int32", "side": "int32"}


def pairs_per_row(seq_len: int) -> int:
    """The most pairs a row can hold: each of a pair's two sequences fills at least one position."""
    return max(seq_len // 2, 1)


def pair_sums(values: dict, batch: dict, pairs: int) -> dict:
    """Each [rows, positions] array of `values` summed per (row, pair, side): [rows, pairs, 2]. A masked sum over
    the positions, which the partitioner splits over sp like any reduction (no scatter)."""
    slot = batch["pair_id"] * 2 + batch["side"]
    hit = slot[..., None] == jnp.arange(2 * pairs, dtype=slot.dtype)
    return {k: jnp.sum(jnp.where(hit, v[..., None], 0.0), axis=1).reshape(v.shape[0], pairs, 2)
            for k, v in values.items()}


def _smoothed(z, epsilon: float):
    """−(1−ε)·log σ(z) − ε·log σ(−z)."""
    return -(1 - epsilon) * jax.nn.log_sigmoid(z) - epsilon * jax.nn.log_sigmoid(-z)


def pair_losses(sums: dict, loss: str, beta: float, epsilon: float, gamma: float):
    """(each pair's loss, its chosen and rejected rewards, the log-probabilities the metrics report), all
    [rows, pairs] (the last two [rows, pairs, 2]), from the per-pair sums: `logp`, `ref` (not SimPO), `n`."""
    n = jnp.maximum(sums["n"], 1.0)
    if loss == "simpo":
        mean = sums["logp"] / n
        return _smoothed(beta * (mean[..., 0] - mean[..., 1]) - gamma, epsilon), beta * mean, mean
    ratio = sums["logp"] - sums["ref"]
    if loss == "sigmoid":
        per_pair = _smoothed(beta * (ratio[..., 0] - ratio[..., 1]), epsilon)
    else:  # ipo, on length-averaged log-ratios (TRL)
        mean = ratio / n
        per_pair = (mean[..., 0] - mean[..., 1] - 1 / (2 * beta)) ** 2
    return per_pair, beta * ratio, sums["logp"]


def dpo(loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0, gamma: float = 0.5,
        seq_len: int = 2048) -> Objective:
    """The objective `loss` names over pairs of rows of `seq_len` positions (see the module's docstring)."""
    pairs = pairs_per_row(seq_len)
    uses_reference = loss != "simpo"

    def terms(logp, lse, batch):
        mask = batch["loss_mask"]
        values = {"logp": logp * mask, "n": mask}
        if uses_reference:
            values["ref"] = batch["ref_logp"] * mask
        return pair_sums(values, batch, pairs), {}

    def sequence_loss(sums):
        present = (sums["n"][..., 0] > 0) & (sums["n"][..., 1] > 0)
        per_pair, rewards, logps = pair_losses(sums, loss, beta, label_smoothing, gamma)
        total = lambda a: jnp.sum(jnp.where(present, a, 0.0))
        chosen, rejected = jax.lax.stop_gradient(rewards[..., 0]), jax.lax.stop_gradient(rewards[..., 1])
        logps = jax.lax.stop_gradient(logps)
        return total(per_pair), {
            "rewards/chosen": total(chosen), "rewards/rejected": total(rejected),
            "rewards/accuracies": total((chosen > rejected).astype(jnp.float32)),
            "rewards/margins": total(chosen - rejected),
            "logps/chosen": total(logps[..., 0]), "logps/rejected": total(logps[..., 1])}

    def count(batch):
        n = pair_sums({"n": batch["loss_mask"]}, batch, pairs)["n"]
        return jnp.sum((n[..., 0] > 0) & (n[..., 1] > 0)).astype(jnp.float32)

    fields = {**PAIR_FIELDS, **({"ref_logp": "float32"} if uses_reference else {})}
    name = f"dpo(loss={loss}, beta={beta}, label_smoothing={label_smoothing}, gamma={gamma}, pairs={pairs})"
    return Objective(name, count=count, token_terms=terms, fields=fields, spiky=False, sequence_loss=sequence_loss)


def objective_of(cfg) -> Objective:
    d = cfg.dpo
    return dpo(d.loss, d.beta, d.label_smoothing, d.gamma, cfg.model.seq_len)


def check_config(cfg) -> list[str]:
    """The `dpo` section and what preference optimisation needs of the rest (one line each)."""
    d, data = cfg.dpo, cfg.data
    dpo_run, pairs = cfg.train.objective == "dpo", data.format == "preference"
    if dpo_run != pairs:
        raise ConfigError('train.objective="dpo" and data.format="preference" go together; set both, or neither')
    if not dpo_run:
        return []
    if d.loss not in LOSSES:
        raise ConfigError(f"dpo.loss: '{d.loss}' is not one of {', '.join(LOSSES)}")
    if d.beta <= 0:
        raise ConfigError(f"dpo.beta: must be positive, got {d.beta}")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing: must be in [0, 0.5), got {d.label_smoothing}")
    if d.loss == "ipo" and d.label_smoothing:
        raise ConfigError("dpo.label_smoothing: the ipo loss has no label smoothing; set it to 0 or use sigmoid")
    if d.loss != "simpo" and d.gamma != 0.5:
        raise ConfigError(f"dpo.gamma: only the simpo loss has a target margin; leave it at 0.5 with dpo.loss={d.loss}")
    return []


class Scored:
    """The preference data with each batch's `ref_logp` from the reference parameters, `reference(params)` (as
    `train/loop.reference_params` gives it: the starting parameters in the compute dtype, or under LoRA the policy
    with its adapters off), by the trainer's forward pass (`StepFns.token_logp`) before the step. SimPO has no
    reference, so its batches pass through."""

    def __init__(self, data, fns, reference=None):
        self.data, self.fns, self.reference = data, fns, reference

    def __getattr__(self, name):  # description, steps_per_epoch, has_validation, padding_frac
        return getattr(self.data, name)

    def _scored(self, batch: dict, params) -> dict:
        if self.reference is None:
            return batch
        return {**batch, "ref_logp": self.fns.token_logp(self.reference(params), batch)}

    def train_batch(self, step: int, sharding, params) -> dict:
        return self._scored(self.data.train_batch(step, sharding), params)

    def eval_batches(self, sharding, params):
        for batch in self.data.eval_batches(sharding):
            yield self._scored(batch, params)
