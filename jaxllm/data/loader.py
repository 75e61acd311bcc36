"""Batches as global jax.Arrays: the windows of a step depend only on (seed, step), never on the mesh or
the number of processes, so a run resumes and rescales reproducibly; each process reads only the rows
(and columns) its own devices hold.

A row is a window of seq_len+1 consecutive tokens; a batch is the contract's dict of fields
(`jaxllm/batch.py`): inputs row[:-1], targets row[1:], every token counted.
"""

from __future__ import annotations

import numpy as np

from jaxllm import batch as batch_lib
from jaxllm.errors import DataError


def window_starts(n_tokens: int, seed: int, step: int, global_batch: int, seq_len: int) -> np.ndarray:
    """Random start offsets of the global_batch windows of one step."""
    _check_length(n_tokens, seq_len)
    return np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len - 1 + 1, size=global_batch,
                                                        dtype=np.int64)


def batch_rows(tokens, starts: np.ndarray, rows: slice, seq_len: int) -> np.ndarray:
    """Rows `rows` of the batch whose windows start at `starts`, as int32 (len(rows), seq_len+1)."""
    return _gather(tokens, np.asarray(starts)[rows], np.arange(seq_len + 1))


def global_batch(tokens, seed: int, step: int, global_batch: int, seq_len: int, sharding) -> dict:
    """The training batch of `step`: the contract's fields, each (global_batch, seq_len), laid out by `sharding`."""
    starts = window_starts(len(tokens), seed, step, global_batch, seq_len)
    return _array(tokens, starts, seq_len, sharding)


def eval_batch(tokens, i: int, n_batches: int, global_batch: int, seq_len: int, sharding) -> dict:
    """The i-th of n_batches fixed validation batches: windows evenly spaced over the whole stream,
    so every evaluation measures the same tokens."""
    if not 0 <= i < n_batches:
        raise ValueError(f"eval_batch: i={i} is not in [0, {n_batches})")
    _check_length(len(tokens), seq_len)
    n_windows = n_batches * global_batch
    last_start = len(tokens) - seq_len - 1
    starts = np.arange(n_windows, dtype=np.int64) * last_start // max(n_windows - 1, 1)
    return _array(tokens, starts[i * global_batch:(i + 1) * global_batch], seq_len, sharding)


def _check_length(n_tokens: int, seq_len: int) -> None:
    if n_tokens < seq_len + 1:
        raise DataError(f"data: a token stream has {n_tokens} tokens but one window needs model.seq_len+1 = "
                        f"{seq_len + 1}; give more data, lower data.val_percent (for validation) or lower model.seq_len")


def _gather(tokens, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """tokens[start + offset] for each start (rows) and offset (columns), as int32."""
    return np.asarray(tokens[starts[:, None] + offsets[None, :]], dtype=np.int32)


def _array(tokens, starts: np.ndarray, seq_len: int, sharding) -> dict:
    """The batch's global arrays; each device block reads only its own rows' windows."""
    build = lambda rows: batch_lib.from_windows(_gather(tokens, starts[rows], np.arange(seq_len + 1)))
    return batch_lib.from_rows(len(starts), seq_len, sharding, build)
