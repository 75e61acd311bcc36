"""The batch contract: what a train step, the evaluation and every gradient path receive.

A batch is a dict of `[batch, seq]` arrays, one per field:

| field | dtype | meaning |
|---|---|---|
| `inputs` | int32 | token ids the model reads |
| `targets` | int32 | the token each position predicts |
| `positions` | int32 | each token's position in its document (RoPE, causal mask) |
| `segment_ids` | int32 | document of each token: real tokens ≥ 1, padding 0; attention stays within a segment |
| `loss_mask` | float32 | 1 where a token counts for the loss, 0 elsewhere |

plus the fields an objective declares (`trainer/objectives.py`: `Objective.fields`), such as
per-token weights, or a preference pair's `pair_id` and `side`. Whatever is per sequence (an RL
advantage, a reward) is spread over its tokens on the host, so every field has the same
`[batch, seq]` shape. Every process builds only
the rows its own devices hold (`data/loader.py`). The step, the accumulation and pipeline
paths, zig-zag reordering and microbatch splitting treat every field alike: none reads a
field by name except the model (inputs, positions, segment ids) and the objective.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.errors import DataError

FIELDS: dict[str, np.dtype] = {
    "inputs": np.dtype(np.int32),
    "targets": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "segment_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.float32),
}


def fields(extra: dict | None = None) -> dict[str, np.dtype]:
    """The contract's fields and an objective's own, by name."""
    return {**FIELDS, **{k: np.dtype(v) for k, v in (extra or {}).items()}}


def from_windows(windows: np.ndarray) -> dict[str, np.ndarray]:
    """Pre-training rows from `[rows, seq+1]` windows of consecutive tokens: inputs and targets
    shifted by one, every token counted, each row one segment."""
    windows = np.asarray(windows, np.int32)
    rows, seq = windows.shape[0], windows.shape[1] - 1
    return {
        "inputs": windows[:, :-1],
        "targets": windows[:, 1:],
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)),
        "segment_ids": np.ones((rows, seq), np.int32),
        "loss_mask": np.ones((rows, seq), np.float32),
    }


def global_arrays(batch: dict, sharding) -> dict:
    """Global arrays laid out by `sharding` from a host batch every process holds whole (tools and tests;
    the trainer's loader builds only each process's rows)."""
    return {k: jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]) for k, a in batch.items()}


def from_rows(n_rows: int, seq: int, sharding, build, names=tuple(FIELDS)) -> dict:
    """Global arrays of a batch whose rows `build(rows: slice) -> {field: [rows, seq] array}` makes: each
    process builds only the rows its own devices hold, each device block once for every field."""
    built: dict = {}

    def block(name: str, index: tuple) -> np.ndarray:
        rows, cols = tuple(index) + (slice(None),) * (2 - len(index))
        key = (rows.start, rows.stop, rows.step)
        if key not in built:
            built[key] = build(rows)
        return np.ascontiguousarray(built[key][name][:, cols])

    return {name: jax.make_array_from_callback((n_rows, seq), sharding, lambda idx, name=name: block(name, idx))
            for name in names}


def abstract(rows: int, seq: int, sharding, extra: dict | None = None) -> dict:
    """Shapes and dtypes of a batch (for lowering a step without data)."""
    return {k: jax.ShapeDtypeStruct((rows, seq), d, sharding=sharding) for k, d in fields(extra).items()}


def check(batch: dict, extra: dict | None = None) -> None:
    """DataError (one line) unless `batch` has exactly the contract's fields, their dtypes and one shape."""
    want = fields(extra)
    if set(batch) != set(want):
        missing, unknown = sorted(set(want) - set(batch)), sorted(set(batch) - set(want))
        raise DataError(f"batch: fields missing {missing}, unknown {unknown}; a batch has {sorted(want)}")
    shapes = {tuple(a.shape) for a in batch.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise DataError(f"batch: every field must be one [batch, seq] shape, got {sorted(shapes)}")
    wrong = {k: str(a.dtype) for k, a in batch.items() if np.dtype(a.dtype) != want[k]}
    if wrong:
        raise DataError(f"batch: wrong dtypes {wrong}; expected {({k: str(want[k]) for k in wrong})}")
