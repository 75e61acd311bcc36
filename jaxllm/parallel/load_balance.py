"""Causal load balancing for context parallelism: the zig-zag order of the sequence.

With the sequence split over sp in order, rank r's queries see r+1 of the sp key blocks:
the last rank does sp times the causal work of the first. Cut the sequence into 2·sp
chunks and give rank r chunks r and 2·sp-1-r: every rank then holds one early and one
late chunk and does the same work. The step applies this order to every field of the
batch (tokens, targets, positions, segment ids, loss mask), so positions — learned or
RoPE — travel with their tokens, the mask (causal by position) is unchanged, and the
loss, a sum over tokens, is the same number.
"""

from __future__ import annotations

import numpy as np


def zigzag_order(seq_len: int, sp: int) -> np.ndarray:
    """Indices into the sequence: the order in which its positions are laid out over sp ranks."""
    chunks = np.arange(seq_len).reshape(2 * sp, seq_len // (2 * sp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * sp - 1 - r]]) for r in range(sp)])


def visible_blocks(positions: np.ndarray, sp: int, pieces: int = 2) -> list[int]:
    """Per sp rank: how many (query piece, key piece) score blocks have any query that may see a key.

    `positions` is the laid-out order of one sequence; each rank holds seq_len/sp of it,
    cut into `pieces` query blocks, against every rank's key blocks (the block pairs the ring's
    chunked kernel computes rather than skips, with blocks of seq_len/(sp·pieces) rows).
    """
    per_rank = np.split(np.asarray(positions), sp)
    pieces_all = [p for block in per_rank for p in np.split(block, pieces)]
    return [sum(int(q.max() >= k.min()) for q in np.split(block, pieces) for k in pieces_all) for block in per_rank]
