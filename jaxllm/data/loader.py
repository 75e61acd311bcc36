"""Batches as global jax.Arrays: the windows of a step depend only on (seed, step), never on the mesh or
the number of processes, so a run resumes and rescales reproducibly; each process reads only the rows
(and columns) its own devices hold.

A row is a window of seq_len+1 consecutive tokens; a batch is the contract's dict of fields
(`jaxllm/batch.py`): inputs row[:-1], targets row[1:], every token counted. With the documents' start offsets
(`data.document_mask`) each document in a window is its own segment, its positions counted from 0 where it
starts (a document cut by the window's start counts from the window's start); without, a row is one segment.
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


def global_batch(tokens, seed: int, step: int, global_batch: int, seq_len: int, sharding, docs=None) -> dict:
    """The training batch of `step`: the contract's fields, each (global_batch, seq_len), laid out by `sharding`."""
    starts = window_starts(len(tokens), seed, step, global_batch, seq_len)
    return windows_array(tokens, starts, seq_len, sharding, docs)


def eval_batch(tokens, i: int, n_batches: int, global_batch: int, seq_len: int, sharding, docs=None) -> dict:
    """The i-th of n_batches fixed validation batches: windows evenly spaced over the whole stream,
    so every evaluation measures the same tokens."""
    if not 0 <= i < n_batches:
        raise ValueError(f"eval_batch: i={i} is not in [0, {n_batches})")
    _check_length(len(tokens), seq_len)
    n_windows = n_batches * global_batch
    last_start = len(tokens) - seq_len - 1
    starts = np.arange(n_windows, dtype=np.int64) * last_start // max(n_windows - 1, 1)
    return windows_array(tokens, starts[i * global_batch:(i + 1) * global_batch], seq_len, sharding, docs)


def _check_length(n_tokens: int, seq_len: int) -> None:
    if n_tokens < seq_len + 1:
        raise DataError(f"data: a token stream has {n_tokens} tokens but one window needs model.seq_len+1 = "
                        f"{seq_len + 1}; give more data, lower data.val_percent (for validation) or lower model.seq_len")


def _gather(tokens, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """tokens[start + offset] for each start (rows) and offset (columns), as int32."""
    return np.asarray(tokens[starts[:, None] + offsets[None, :]], dtype=np.int32)


def document_fields(starts: np.ndarray, seq_len: int, docs: np.ndarray) -> dict[str, np.ndarray]:
    """Segment ids and positions of the windows at `starts` from the documents' sorted start offsets `docs`."""
    at = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len)
    doc = np.searchsorted(docs, at, side="right") - 1
    first = np.maximum(docs[np.maximum(doc, 0)], at[:, :1])  # a document's start, or the window's
    return {"segment_ids": (doc - doc[:, :1] + 1).astype(np.int32), "positions": (at - first).astype(np.int32)}


def window_fields(tokens, starts: np.ndarray, seq_len: int, docs=None) -> dict[str, np.ndarray]:
    """The contract's fields of the windows at `starts` (documents masked where their starts `docs` are given)."""
    fields = batch_lib.from_windows(_gather(tokens, starts, np.arange(seq_len + 1)))
    return fields if docs is None else {**fields, **document_fields(starts, seq_len, docs)}


def windows_array(tokens, starts: np.ndarray, seq_len: int, sharding, docs=None) -> dict:
    """The batch's global arrays of the windows at `starts`; each device block reads only its own rows' windows."""
    return batch_lib.from_rows(len(starts), seq_len, sharding,
                               lambda rows: window_fields(tokens, starts[rows], seq_len, docs))
