"""Log-likelihoods of (context, continuation) id pairs through the trainer's own forward pass, on its mesh.

Each request is one row of the batch contract: the ids `(context + continuation)[-(L+1):]` (L = model.seq_len)
as inputs and targets shifted by one, right-padded, `loss_mask` on the continuation's targets; rows go in
batches of `train.global_batch` (the last padded with empty rows), sorted longest first as lm-evaluation-harness
sorts them, so a batch's rows are alike. `StepFns.token_logp` gives each target's log-probability (fp32 from the
model's logits); a request's log-likelihood is their sum over its continuation.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm import batch as batch_lib
from jaxllm.errors import DataError


def request_row(context: list[int], continuation: list[int], seq: int) -> dict[str, np.ndarray]:
    ids = (list(context) + list(continuation))[-(seq + 1):]
    n, k = len(ids) - 1, len(continuation)
    if k > n:  # nothing conditions its first tokens: refused rather than scored on part of it
        raise DataError(f"a continuation of {k} tokens does not fit model.seq_len={seq}; raise model.seq_len")
    row = {"inputs": np.zeros(seq, np.int32), "targets": np.zeros(seq, np.int32),
           "positions": np.arange(seq, dtype=np.int32), "segment_ids": np.zeros(seq, np.int32),
           "loss_mask": np.zeros(seq, np.float32)}
    row["inputs"][:n], row["targets"][:n], row["segment_ids"][:n] = ids[:-1], ids[1:], 1
    row["loss_mask"][n - k:n] = 1.0
    return row


def loglikelihoods(fns, params, pairs: list[tuple[list[int], list[int]]], seq: int, rows: int) -> list[float]:
    """The summed log-probability of each pair's continuation given its context."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    out = np.zeros(len(pairs))
    empty = request_row([0], [], seq)
    for start in range(0, len(order), rows):
        which = order[start:start + rows]
        built = [request_row(*pairs[i], seq) for i in which] + [empty] * (rows - len(which))
        batch = {k: np.stack([r[k] for r in built]) for k in batch_lib.FIELDS}
        logp = np.asarray(_on_host(fns.token_logp(params, batch_lib.global_arrays(batch, fns.batch_sharding))),
                          np.float64)
        out[which] = (logp * batch["loss_mask"])[:len(which)].sum(axis=1)
    return out.tolist()


def logits(fns, params, texts: list[list[int]], seq: int, rows: int) -> list[np.ndarray]:
    """fp32 logits [len(ids), vocabulary] of each token-id list, `rows` lists a batch (`StepFns.logits`)."""
    if max(len(ids) for ids in texts) > seq:
        raise DataError(f"a text of {max(len(ids) for ids in texts)} tokens does not fit model.seq_len={seq}; "
                        "shorten it or raise model.seq_len")
    out = []
    for start in range(0, len(texts), rows):
        which = texts[start:start + rows]
        built = [request_row(ids + [0], [], seq) for ids in which] + [request_row([0], [], seq)] * (rows - len(which))
        batch = {k: np.stack([r[k] for r in built]) for k in batch_lib.FIELDS}
        values = _on_host(fns.logits(params, batch_lib.global_arrays(batch, fns.batch_sharding)))
        out += [np.asarray(values[r, :len(ids)]) for r, ids in enumerate(which)]
    return out


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host: every process's rows gathered where several processes hold them."""
    if jax.process_count() == 1:
        return jax.device_get(x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)
