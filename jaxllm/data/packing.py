"""Rows of fine-tuning examples, and which rows each step trains on.

An example of n tokens fills n-1 positions of a row: inputs ids[:-1], targets ids[1:], loss mask
learn[1:], positions 0..n-2, and its own segment id (1, 2, ... along the row), so attention and targets
never cross an example boundary. The rest of a row is padding: segment 0, token 0, nothing counted.
A preference pair (`data/preference.py`) is one item of two sequences, chosen then rejected, each its own
segment, side by side in one row, with the fields `pair_id` (the pair's index along the row) and `side`
(0 chosen, 1 rejected); padding has pair 0, side 0 and counts for nothing.

- `data.pack = true`: examples are packed once per run, first-fit-decreasing: in an order shuffled by the
  seed, longest first (ties keep the shuffled order), each into the first row with room.
- `data.pack = false`: one example per row.

Epochs: each epoch visits every row once, in an order drawn from (seed, epoch) alone, `global_batch`
rows per step; steps_per_epoch = ceil(rows / global_batch), and the last batch of an epoch is filled
with empty rows (all padding). The loss is a sum over counted tokens divided by their number, so an
empty row changes nothing but the time. A step's rows depend only on (seed, step): resuming in the
middle of an epoch continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = -1  # a row index that stands for an all-padding row
PAIR_FIELDS = ("pair_id", "side")  # the int32 fields of rows of preference pairs


@dataclass(frozen=True)
class Rows:
    examples: list  # data.examples.Example
    members: list  # per row, the indices of its examples, in order along the row
    seq_len: int

    def __len__(self) -> int:
        return len(self.members)

    def used(self, which: np.ndarray) -> int:
        """Non-padding positions in the rows `which` (EMPTY rows hold none)."""
        return sum(positions(self.examples[e]) for r in which if r != EMPTY for e in self.members[r])

    @property
    def pairs(self) -> bool:
        """Whether the items are preference pairs (and the rows carry `pair_id` and `side`)."""
        return bool(self.examples) and hasattr(self.examples[0], "parts")


def sequences(item) -> tuple:
    """An item's sequences: an example is one, a preference pair two (chosen, rejected)."""
    return getattr(item, "parts", (item,))


def positions(item) -> int:
    """The row positions an item fills: n - 1 for each sequence of n tokens."""
    return sum(len(ex.ids) - 1 for ex in sequences(item))


def first_fit_decreasing(sizes: list[int], capacity: int, order: np.ndarray) -> list[list[int]]:
    """Bins (lists of item indices) of total size ≤ capacity: items by decreasing size (stable over `order`),
    each into the first bin with room. A segment tree over bins holds each subtree's largest free space,
    so finding the first bin with room is one walk down the tree."""
    items = sorted(order.tolist(), key=lambda i: -sizes[i])
    leaves = 1 << max(1, (len(items) - 1).bit_length())
    free = [capacity] * (2 * leaves)  # unopened bins are empty, and opened ones come first
    bins: list[list[int]] = []
    for i in items:
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= sizes[i] else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[node] -= sizes[i]
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def make_rows(examples: list, seq_len: int, pack: bool, seed: int) -> Rows:
    if not pack:
        return Rows(examples, [[i] for i in range(len(examples))], seq_len)
    sizes = [positions(ex) for ex in examples]
    order = np.random.default_rng([seed]).permutation(len(examples))
    return Rows(examples, first_fit_decreasing(sizes, seq_len, order), seq_len)


def build(rows: Rows, which: np.ndarray) -> dict[str, np.ndarray]:
    """The batch fields of the rows `which` (EMPTY: an all-padding row), each [len(which), seq_len]; with
    `pair_id` and `side` when the rows hold preference pairs."""
    n, seq = len(which), rows.seq_len
    names = ("inputs", "targets", "positions", "segment_ids") + (PAIR_FIELDS if rows.pairs else ())
    out = {**{k: np.zeros((n, seq), np.int32) for k in names}, "loss_mask": np.zeros((n, seq), np.float32)}
    for i, r in enumerate(which):
        at, segment = 0, 0
        for index, e in enumerate(rows.members[r] if r != EMPTY else []):
            for side, ex in enumerate(sequences(rows.examples[e])):
                k, segment = len(ex.ids) - 1, segment + 1
                out["inputs"][i, at:at + k], out["targets"][i, at:at + k] = ex.ids[:-1], ex.ids[1:]
                out["positions"][i, at:at + k] = np.arange(k)
                out["segment_ids"][i, at:at + k] = segment
                out["loss_mask"][i, at:at + k] = ex.learn[1:]
                if rows.pairs:
                    out["pair_id"][i, at:at + k], out["side"][i, at:at + k] = index, side
                at += k
    return out


def steps_per_epoch(n_rows: int, global_batch: int) -> int:
    return -(-n_rows // global_batch)


def step_rows(n_rows: int, global_batch: int, seed: int, step: int) -> np.ndarray:
    """The rows of training step `step` (0-based), EMPTY where the epoch's last batch runs out."""
    per_epoch = steps_per_epoch(n_rows, global_batch)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n_rows)[i * global_batch:(i + 1) * global_batch]
    return np.concatenate([order, np.full(global_batch - len(order), EMPTY)])


def eval_rows(n_rows: int, global_batch: int, i: int) -> np.ndarray:
    """Validation batch i: rows in their order, the last batch filled with empty rows."""
    rows = np.arange(i * global_batch, min((i + 1) * global_batch, n_rows))
    return np.concatenate([rows, np.full(global_batch - len(rows), EMPTY)])
