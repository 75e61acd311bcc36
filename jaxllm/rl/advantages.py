"""From rewards to GRPO's batch fields, on the host.

- `group_advantages`: each completion's reward minus its group's mean, divided per `rl.scale_rewards` by
  `group` (the group's standard deviation), `batch` (the whole batch's) or `none` (Dr. GRPO: not divided).
  Standard deviations are the sample ones (ddof = 1, as torch's default in TRL's GRPO) plus ε = 1e-4, so a
  group whose rewards are all equal gets advantage 0, never NaN.
- `token_fields`: advantages spread over each completion's tokens, with the loss weights and the
  denominator (`norm`) of `rl.loss_norm`: `token` (the mean over every completion token of the batch),
  `sequence` (each completion's token mean, then the mean over completions: GRPO as DeepSeekMath writes
  it) or `constant` (the sum over tokens divided by rows × the longest completion allowed: Dr. GRPO).
"""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ConfigError

SCALE_REWARDS = ("group", "batch", "none")
LOSS_NORMS = ("token", "sequence", "constant")
STD_EPS = 1e-4


def group_advantages(rewards, group_size: int, scale: str) -> np.ndarray:
    """[n] advantages of [n] rewards laid out group after group (n a multiple of group_size ≥ 2)."""
    if scale not in SCALE_REWARDS:
        raise ConfigError(f"rl.scale_rewards: {scale!r} is not one of {', '.join(SCALE_REWARDS)}")
    if group_size < 2:
        raise ConfigError(f"rl.group_size: a group needs at least 2 completions to compare, got {group_size}")
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centered = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif scale == "batch":
        centered = centered / (r.std(ddof=1) + STD_EPS)
    return centered.ravel()


def token_fields(advantages, completion_mask, loss_norm: str, max_completion: int) -> dict[str, np.ndarray]:
    """`advantages`, `weights` and `norm`, each [rows, seq] float32, for completions marked by
    `completion_mask` [rows, seq] (1 where a target is a completion token the loss counts)."""
    if loss_norm not in LOSS_NORMS:
        raise ConfigError(f"rl.loss_norm: {loss_norm!r} is not one of {', '.join(LOSS_NORMS)}")
    mask = np.asarray(completion_mask, np.float64)
    adv = np.asarray(advantages, np.float64)[:, None] * mask
    if loss_norm == "token":
        weights = norm = mask
    elif loss_norm == "sequence":
        weights = norm = mask / np.maximum(mask.sum(axis=1, keepdims=True), 1)
    else:
        weights, norm = mask, np.full_like(mask, max_completion / mask.shape[1])
    return {k: np.asarray(v, np.float32) for k, v in (("advantages", adv), ("weights", weights), ("norm", norm))}
