"""Checksums of a checkpoint's arrays (`train.checkpoint_checksums`): written with each save, verified at restore.

Orbax keeps none, so a bit flipped in an array's stored data (a failing disk, a bad copy, a bug elsewhere)
restores silently. Each array's checksum is two sums of its bits read as unsigned 32-bit words (8- and 16-bit
elements widened), modulo 2^32: the plain sum, and the sum weighted by 2·i + 1 for the word's row-major position
i. One flipped bit changes a word by ±2^k, so the plain sum (and, the weight being odd, the weighted one); the
weights catch words swapped or moved, which leave the plain sum alone. Sums modulo 2^32 do not depend on the order of the additions, so an array's checksum is the same on
any mesh: a checkpoint saved on fsdp=8 verifies when restored onto dp=2 × fsdp=4. One compiled program sums the
whole state on the devices (each device its shards; a few bytes per array cross the mesh); the checksums go
in the checkpoint's JSON metadata as {array: [dtype, sum, weighted sum]}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import CheckpointError


def _words(x: jax.Array) -> jax.Array:
    """x's bits as unsigned 32-bit words, in x's own shape (with a trailing axis for 64-bit elements)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)


def _positions(shape: tuple) -> jax.Array:
    """Each element's row-major index in an array of `shape`, modulo 2^32."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _sums(x: jax.Array) -> jax.Array:
    w = _words(x)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * (2 * _positions(w.shape) + 1), dtype=jnp.uint32)])


_all_sums = jax.jit(lambda tree: jax.tree.map(_sums, tree))


def _name(path) -> str:
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def of(tree) -> dict[str, list]:
    """{array name ("params/blocks/0/attn/wq"): [dtype, sum, weighted sum]} for every array of `tree` (every
    process computes them together and gets them all)."""
    sums = _all_sums(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    host = [np.asarray(s.addressable_shards[0].data) for s in jax.tree.leaves(sums)]  # replicated on every process
    return {_name(path): [str(leaf.dtype), int(s[0]), int(s[1])] for (path, leaf), s in zip(leaves, host)}


def verify(tree, saved: dict) -> None:
    """CheckpointError naming the first array of `tree` whose checksum is not the one `saved` recorded (arrays it
    has no record of, or read back in another dtype, are not checked)."""
    for name, now in of(tree).items():
        then = saved.get(name)
        if then is not None and then[0] == now[0] and then != now:
            raise CheckpointError(f"array {name} does not match the checksum saved with it (its stored data "
                                  "changed after the save)")
