"""Rollouts as rows of the batch contract (`jaxllm/batch.py`), on the host.

A prompt of P tokens and its completion of C tokens (cut after the first stop id, which it keeps) make one
row: the P + C tokens left-aligned, inputs row[:-1], targets row[1:], positions from 0, segment id 1, the
rest padding (segment 0). The completion's tokens are the targets at positions P−1 … P+C−2: the
`loss_mask`, which GRPO's fields build on (`rl/advantages.token_fields`). A completion that reached the
token limit without a stop id is truncated; with `mask_truncated` it counts for nothing (its mask is
zero), as DAPO does, else it is trained on like the others.
"""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ConfigError


def rows(prompts: list, completions: list, stopped: list, seq_len: int, mask_truncated: bool) -> dict:
    """The contract's fields, each [len(prompts), seq_len], for prompt and completion token lists."""
    n = len(prompts)
    out = {"inputs": np.zeros((n, seq_len), np.int32), "targets": np.zeros((n, seq_len), np.int32),
           "positions": np.zeros((n, seq_len), np.int32), "segment_ids": np.zeros((n, seq_len), np.int32),
           "loss_mask": np.zeros((n, seq_len), np.float32)}
    for i, (prompt, completion, done) in enumerate(zip(prompts, completions, stopped)):
        tokens = np.asarray(list(prompt) + list(completion), np.int32)
        k = len(tokens) - 1
        if k > seq_len or not len(prompt) or not len(completion):
            raise ConfigError(f"rollout {i}: a {len(prompt)}-token prompt and a {len(completion)}-token completion do "
                              f"not fit model.seq_len={seq_len} (or one is empty); raise model.seq_len or lower "
                              "the completion length")
        out["inputs"][i, :k], out["targets"][i, :k] = tokens[:-1], tokens[1:]
        out["positions"][i, :k], out["segment_ids"][i, :k] = np.arange(k), 1
        if done or not mask_truncated:
            out["loss_mask"][i, len(prompt) - 1:k] = 1.0
    return out
