"""Checksums of a checkpoint's arrays (`train.checkpoint_checksums`): written with each save, verified at restore.

Orbax keeps none, so a bit flipped in an array's stored data (a failing disk, a bad copy, a bug elsewhere)
restores silently. Each array's checksum is two sums of its bits read as unsigned 32-bit words (8- and 16-bit
elements widened), modulo 2^32: the plain sum, and the sum weighted by 2·i + 1 for the word's row-major position
i. One flipped bit changes a word by ±2^k, so the plain sum (and, the weight being odd, the weighted one); the
weights catch words swapped or moved, which leave the plain sum alone. Sums modulo 2^32 do not depend on the
order of the additions, so an array's checksum is the same on any mesh: a checkpoint saved on fsdp=8 verifies
when restored onto dp=2 × fsdp=4.

Each process sums the shards it holds (one copy of each: replica 0), on the host with numpy (a view of the
buffer on CPU; a copy from the device elsewhere, as Orbax's save makes), and the processes add their sums (a few
bytes per array). The weighted sum needs no index array: Σ (2i + 1)·w = Σ w + 2 Σ_axes stride · Σ_j position_j ·
(the sum of the words at position j along that axis). No program is compiled. The checksums go in the
checkpoint's JSON metadata as {array: [dtype, sum, weighted sum]}.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm.errors import CheckpointError

_MOD = 2**32


def _words(data: np.ndarray) -> np.ndarray:
    """A shard's bits as unsigned 32-bit words (64-bit elements: two words each, along the last axis)."""
    if data.dtype == np.bool_:
        return data.astype(np.uint32)
    if data.dtype.itemsize >= 4:
        return (data if data.flags.c_contiguous else data.copy()).view(np.uint32)
    return data.view(np.dtype(f"uint{8 * data.dtype.itemsize}")).astype(np.uint32)


def _shard_sums(words: np.ndarray, offsets: tuple, shape: tuple) -> tuple[int, int]:
    """(sum, Σ (2i + 1)·w) mod 2^32 of a block of words at `offsets` in an array of word shape `shape`. The
    uint64 products and sums wrap modulo 2^64, which 2^32 divides: their values modulo 2^32 are exact."""
    if words.ndim == 0:
        value = int(words) % _MOD
        return value, value
    while words.ndim > 2 and words.shape[1] == shape[1]:  # fold the first two axes: one reduction fewer
        words = words.reshape((-1,) + words.shape[2:])
        offsets, shape = (offsets[0] * shape[1],) + offsets[2:], (shape[0] * shape[1],) + shape[2:]
    total, weighted = None, 0
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for axis in range(words.ndim):
        others = tuple(d for d in range(words.ndim) if d != axis)
        along = np.add.reduce(words, axis=others, dtype=np.uint32).astype(np.uint64)  # per position, mod 2^32
        positions = np.arange(offsets[axis], offsets[axis] + words.shape[axis], dtype=np.uint64)
        weighted += strides[axis] * int(np.dot(along, positions))
        total = int(along.sum()) if total is None else total
    return total % _MOD, (total + 2 * weighted) % _MOD


def _blocks(x):
    """(host data, its offsets in x) of each block of x this process sums: its replica-0 shards (a numpy
    array, as a restore onto no sharding gives, is one block, summed by process 0)."""
    if not isinstance(x, jax.Array):
        return [(np.asarray(x), (0,) * np.ndim(x))] if jax.process_index() == 0 else []
    return [(np.asarray(shard.data), tuple(s.start or 0 for s in shard.index))
            for shard in x.addressable_shards if shard.replica_id == 0]


def _array_sums(x) -> np.ndarray:
    """This process's part of x's two sums."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    sums = [0, 0]
    wide = 2 if x.dtype.itemsize == 8 else 1  # words per element
    shape = x.shape[:-1] + (x.shape[-1] * wide,) if x.ndim else ()
    for data, starts in _blocks(x):
        offsets = starts[:-1] + (starts[-1] * wide,) if starts else ()
        total, weighted = _shard_sums(_words(data), offsets, shape)
        sums = [(sums[0] + total) % _MOD, (sums[1] + weighted) % _MOD]
    return np.asarray(sums, np.uint64)


def _name(path) -> str:
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def of(tree) -> dict[str, list]:
    """{array name ("params/blocks/0/attn/wq"): [dtype, sum, weighted sum]} for every array of `tree` (every
    process computes its part, and all get the whole)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = np.stack([_array_sums(x) for _, x in leaves]) if leaves else np.zeros((0, 2), np.uint64)
    if jax.process_count() > 1:
        sums = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32))).astype(np.uint64).sum(0) % _MOD
    return {_name(path): [str(x.dtype), int(s[0]), int(s[1])] for (path, x), s in zip(leaves, sums)}


def verify(tree, saved: dict) -> None:
    """CheckpointError naming the first array of `tree` whose checksum is not the one `saved` recorded (arrays it
    has no record of, or read back in another dtype, are not checked)."""
    for name, now in of(tree).items():
        then = saved.get(name)
        if then is not None and then[0] == now[0] and then != now:
            raise CheckpointError(f"array {name} does not match the checksum saved with it (its stored data "
                                  "changed after the save)")
