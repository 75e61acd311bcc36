"""All-reduce algorithms built by hand on `ppermute`, for use inside a shard_map island manual over `axis`.

Axis: any mesh axis, or a tuple of axes taken as one (ranks numbered as `axis_index` numbers them); the
two-level algorithms take two. Collectives: `collective-permute` only, one per round; every function
states its rounds and the bytes each device sends. Notation: N devices on the axis, S the bytes of the
message (x, padded up to a multiple of N where it is cut in N chunks), log = log2.

| algorithm | rounds | bytes sent per device (max) |
|---|---|---|
| `parameter_server` | 2(N-1) | (N-1)·S at the server, S elsewhere |
| `reduce_broadcast` (binomial trees) | 2⌈log N⌉ | ⌈log N⌉·S at the root |
| `ring` | 2(N-1) | 2(N-1)/N·S |
| `halving_doubling` (Rabenseifner) | 2 log N | 2(N-1)/N·S |
| `butterfly` | log N | log N·S |
| `binary_tree` | 2·(levels' left and right sides) | 3S at an inner node |
| `hierarchical` (inner, outer) | 2(Ni-1) + 2(No-1) | 2(Ni-1)/Ni·S + 2(No-1)/No·S/Ni |
| `torus` (rows, then columns) | 2(Nr-1) + 2(Nc-1) | 2(Nr-1)/Nr·S + 2(Nc-1)/Nc·S |

halving_doubling and butterfly need N a power of two (ValueError otherwise, one line); the others take
any N. Every device ends with the same sum; floats are summed in each algorithm's own order, so results
equal `psum`'s to rounding (integers exactly).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def axis_size(axis) -> int:
    return jax.lax.psum(1, axis)


def _chunks(x: jax.Array, n: int):
    """x as [n, c] chunks of its flattened elements (zero-padded), and the function that undoes it."""
    flat = x.reshape(-1)
    c = -(-flat.size // n)
    padded = jnp.pad(flat, (0, n * c - flat.size)).reshape(n, c)
    return padded, lambda chunks: chunks.reshape(-1)[:flat.size].reshape(x.shape)


def _take(chunks, k):
    return jax.lax.dynamic_index_in_dim(chunks, k, keepdims=False)


def _put(chunks, k, value):
    return jax.lax.dynamic_update_index_in_dim(chunks, value, k, 0)


def _send(x, axis, pairs):
    """One round: each (source, target) pair sends x; a device no pair targets receives zeros."""
    return jax.lax.ppermute(x, axis, pairs)


def _received(axis, pairs) -> jax.Array:
    """Whether this device is a target of `pairs` this round."""
    targets = np.zeros(axis_size(axis), bool)
    targets[[t for _, t in pairs]] = True
    return jnp.asarray(targets)[jax.lax.axis_index(axis)]


def _power_of_two(n: int, name: str) -> int:
    if n & (n - 1):
        raise ValueError(f"{name} all-reduce needs a power-of-two number of devices, got {n}; use ring or tree")
    return n.bit_length() - 1


# ---------------------------------------------------------------- the ring's two halves


def ring_reduce_scatter(x: jax.Array, axis) -> jax.Array:
    """Reduce-scatter around the ring: N-1 rounds, each sending one chunk (S/N) to the right neighbour.
    Returns the [N, c] chunks of x's flattened (padded) elements; on device i chunk i holds the sum (the
    others partial sums)."""
    n, i = axis_size(axis), jax.lax.axis_index(axis)
    chunks, _ = _chunks(x, n)
    right = [(j, (j + 1) % n) for j in range(n)]
    for r in range(n - 1):
        got = _send(_take(chunks, (i - r - 1) % n), axis, right)
        k = (i - r - 2) % n
        chunks = _put(chunks, k, _take(chunks, k) + got)
    return chunks


def ring_all_gather(chunks: jax.Array, axis) -> jax.Array:
    """All-gather around the ring of [N, c] chunks of which device i holds chunk i: N-1 rounds of one chunk."""
    n, i = axis_size(axis), jax.lax.axis_index(axis)
    right = [(j, (j + 1) % n) for j in range(n)]
    for r in range(n - 1):
        got = _send(_take(chunks, (i - r) % n), axis, right)
        chunks = _put(chunks, (i - r - 1) % n, got)
    return chunks


def ring(x: jax.Array, axis) -> jax.Array:
    """Ring all-reduce: reduce-scatter, then all-gather. 2(N-1) rounds of S/N: 2(N-1)/N·S per device."""
    n = axis_size(axis)
    if n == 1:
        return x
    _, restore = _chunks(x, n)
    return restore(ring_all_gather(ring_reduce_scatter(x, axis), axis))


# ---------------------------------------------------------------- star and trees


def parameter_server(x: jax.Array, axis) -> jax.Array:
    """Rank 0 is the server: every worker pushes x (one per round: the server has one link), the server
    sums, then sends the sum back to each. 2(N-1) rounds; a worker sends S, the server (N-1)·S."""
    n = axis_size(axis)
    total = x
    for r in range(1, n):
        total = total + _send(x, axis, [(r, 0)])  # zeros everywhere but on the server
    for r in range(1, n):
        pairs = [(0, r)]
        total = jnp.where(_received(axis, pairs), _send(total, axis, pairs), total)
    return total


def reduce_to_root(x: jax.Array, axis) -> jax.Array:
    """Binomial-tree reduce: at distance d = 1, 2, 4, ... rank i with i mod 2d = d sends its partial sum
    to i - d. ⌈log N⌉ rounds of S; rank 0 ends with the sum (the others with partial sums)."""
    n = axis_size(axis)
    for level in range(math.ceil(math.log2(n)) if n > 1 else 0):
        d = 1 << level
        x = x + _send(x, axis, [(i, i - d) for i in range(d, n, 2 * d)])
    return x


def broadcast_from_root(x: jax.Array, axis) -> jax.Array:
    """Binomial-tree broadcast of rank 0's x: at distance d = 2^(⌈log N⌉-1), ..., 1, rank i with i mod 2d = 0
    sends to i + d. ⌈log N⌉ rounds of S; the root sends ⌈log N⌉·S."""
    n = axis_size(axis)
    for level in reversed(range(math.ceil(math.log2(n)) if n > 1 else 0)):
        d = 1 << level
        pairs = [(i, i + d) for i in range(0, n - d, 2 * d)]
        x = jnp.where(_received(axis, pairs), _send(x, axis, pairs), x)
    return x


def reduce_broadcast(x: jax.Array, axis) -> jax.Array:
    """Reduce to rank 0, then broadcast from it (binomial trees): 2⌈log N⌉ rounds of S."""
    return broadcast_from_root(reduce_to_root(x, axis), axis)


def _tree_levels(n: int) -> list[list[tuple[int, int]]]:
    """The rounds of a binary heap (children 2p+1, 2p+2) from the deepest level up: per level, its left
    children's (child, parent) pairs, then its right children's (a parent has one of each)."""
    rounds = []
    for depth in reversed(range(1, n.bit_length())):
        level = range((1 << depth) - 1, min((1 << (depth + 1)) - 1, n))
        for side in (1, 0):  # odd indices are left children
            pairs = [(c, (c - 1) // 2) for c in level if c % 2 == side]
            if pairs:
                rounds.append(pairs)
    return rounds


def binary_tree(x: jax.Array, axis) -> jax.Array:
    """Binary-tree all-reduce: children send partial sums to their parents level by level (left children,
    then right: a parent receives one per round), then the root's sum goes down the same edges. Rounds:
    twice the number of (level, side) pairs, 2(2⌊log N⌋ - 1) when the last level has no right child
    (N = 2, 4, 8: 2, 6, 10). Each send is S; an inner node sends S up and 2S down."""
    rounds = _tree_levels(axis_size(axis))
    for pairs in rounds:
        x = x + _send(x, axis, pairs)
    for pairs in reversed(rounds):
        down = [(p, c) for c, p in pairs]
        x = jnp.where(_received(axis, down), _send(x, axis, down), x)
    return x


# ---------------------------------------------------------------- recursive halving and doubling


def halving_doubling(x: jax.Array, axis) -> jax.Array:
    """Rabenseifner: reduce-scatter by recursive halving (partner i xor d for d = N/2, ..., 1; each keeps
    the half of its segment its bit names and sends the other half), then all-gather by recursive
    doubling. 2 log N rounds; (N/2 + ... + 1)·S/N twice: 2(N-1)/N·S per device. N a power of two."""
    n = axis_size(axis)
    k = _power_of_two(n, "halving_doubling")
    if n == 1:
        return x
    i = jax.lax.axis_index(axis)
    chunks, restore = _chunks(x, n)
    for s in range(k):  # halving: the segment [start, start + 2d) shrinks to its half of length d
        d = n >> (s + 1)
        start = (i // (2 * d)) * (2 * d)
        upper = (i & d) != 0
        keep, give = jnp.where(upper, start + d, start), jnp.where(upper, start, start + d)
        got = _send(jax.lax.dynamic_slice_in_dim(chunks, give, d), axis, [(j, j ^ d) for j in range(n)])
        mine = jax.lax.dynamic_slice_in_dim(chunks, keep, d) + got
        chunks = jax.lax.dynamic_update_slice_in_dim(chunks, mine, keep, 0)
    for s in reversed(range(k)):  # doubling: device i holds [start, start + d), gets its partner's
        d = n >> (s + 1)
        start = (i // d) * d
        got = _send(jax.lax.dynamic_slice_in_dim(chunks, start, d), axis, [(j, j ^ d) for j in range(n)])
        chunks = jax.lax.dynamic_update_slice_in_dim(chunks, got, start ^ d, 0)
    return restore(chunks)


def butterfly(x: jax.Array, axis) -> jax.Array:
    """Recursive doubling of the whole message: partners i xor d for d = 1, 2, ..., N/2 exchange and add.
    log N rounds of S: log N·S per device. N a power of two."""
    n = axis_size(axis)
    for s in range(_power_of_two(n, "butterfly")):
        x = x + _send(x, axis, [(j, j ^ (1 << s)) for j in range(n)])
    return x


# ---------------------------------------------------------------- two levels


def hierarchical(x: jax.Array, inner, outer) -> jax.Array:
    """Reduce-scatter over `inner` (a ring), all-reduce each chunk over `outer` (a ring), all-gather over
    `inner`: 2(Ni-1) + 2(No-1) rounds, 2(Ni-1)/Ni·S + 2(No-1)/No·S/Ni per device (the slow outer links
    carry 1/Ni of the message)."""
    ni = axis_size(inner)
    if ni == 1:
        return ring(x, outer)
    i = jax.lax.axis_index(inner)
    _, restore = _chunks(x, ni)
    chunks = ring_reduce_scatter(x, inner)
    chunks = _put(chunks, i, ring(_take(chunks, i), outer))
    return restore(ring_all_gather(chunks, inner))


def torus(x: jax.Array, rows, cols) -> jax.Array:
    """2D torus: a ring all-reduce along `rows`, then one along `cols`. 2(Nr-1) + 2(Nc-1) rounds,
    2(Nr-1)/Nr·S + 2(Nc-1)/Nc·S per device."""
    return ring(ring(x, rows), cols)


# ---------------------------------------------------------------- the primitives, on the same rounds


def reduce(x: jax.Array, axis) -> jax.Array:
    """The sum on rank 0 (`psum` kept on the root), zeros elsewhere: `reduce_to_root`, ⌈log N⌉ rounds of S."""
    return jnp.where(jax.lax.axis_index(axis) == 0, reduce_to_root(x, axis), jnp.zeros_like(x))


def broadcast(x: jax.Array, axis) -> jax.Array:
    """Rank 0's x everywhere: `broadcast_from_root`, ⌈log N⌉ rounds of S."""
    return broadcast_from_root(x, axis)


def scatter(x: jax.Array, axis) -> jax.Array:
    """Rank 0's x[i] on rank i (x: [N, ...] on every rank; only the root's is read): N-1 rounds, the root
    sending one block of S/N to each other rank."""
    mine = x[0]  # the root keeps its own block
    for r in range(1, axis_size(axis)):
        pairs = [(0, r)]
        mine = jnp.where(_received(axis, pairs), _send(x[r], axis, pairs), mine)
    return mine


def gather(x: jax.Array, axis) -> jax.Array:
    """Every rank's x stacked [N, ...] on rank 0 (`all_gather` kept on the root), zeros elsewhere: N-1
    rounds, each other rank sending its S/N once."""
    n, i = axis_size(axis), jax.lax.axis_index(axis)
    blocks = jnp.zeros((n, *x.shape), x.dtype).at[0].set(x)
    for r in range(1, n):
        blocks = blocks.at[r].set(_send(x, axis, [(r, 0)]))
    return jnp.where(i == 0, blocks, jnp.zeros_like(blocks))


def all_gather(x: jax.Array, axis) -> jax.Array:
    """Every rank's x stacked [N, ...] everywhere: the ring's all-gather, N-1 rounds of one block each."""
    n, i = axis_size(axis), jax.lax.axis_index(axis)
    mine = jnp.zeros((n, x.size), x.dtype).at[i].set(x.reshape(-1))
    return ring_all_gather(mine, axis).reshape(n, *x.shape)


def reduce_scatter(x: jax.Array, axis) -> jax.Array:
    """Block i of the sum on rank i (x: [N, ...]; `psum_scatter`): the ring's reduce-scatter, N-1 rounds of
    one block each."""
    return _take(ring_reduce_scatter(x, axis), jax.lax.axis_index(axis)).reshape(x.shape[1:])


def all_to_all(x: jax.Array, axis) -> jax.Array:
    """Rank i's result[j] = rank j's x[i] (x: [N, ...]): N-1 rounds, in round r every rank sending the block
    for rank i + r (S/N each)."""
    n, i = axis_size(axis), jax.lax.axis_index(axis)
    out = jnp.zeros_like(x).at[i].set(_take(x, i))
    for r in range(1, n):
        got = _send(_take(x, (i + r) % n), axis, [(j, (j + r) % n) for j in range(n)])
        out = _put(out, (i - r) % n, got)
    return out


def send_recv(x: jax.Array, axis, source: int, target: int) -> jax.Array:
    """Rank `source`'s x on rank `target`, zeros elsewhere: one round of S from one device."""
    return _send(x, axis, [(source, target)])


PRIMITIVES = {"reduce": reduce, "broadcast": broadcast, "scatter": scatter, "gather": gather,
              "all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}

ALGORITHMS = {"ring": ring, "tree": binary_tree, "halving_doubling": halving_doubling, "butterfly": butterfly,
              "reduce_broadcast": reduce_broadcast, "ps": parameter_server}
CHOICES = ("xla", "ring", "tree", "halving_doubling", "hierarchical", "ps")  # train.allreduce


def buckets(leaves: list, bucket_bytes: int) -> list[list[int]]:
    """Leaf indices in order, cut into buckets of at most `bucket_bytes` (a larger leaf is a bucket alone)."""
    out, size = [[]], 0
    for k, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if out[-1] and size + nbytes > bucket_bytes:
            out, size = out + [[]], 0
        out[-1].append(k)
        size += nbytes
    return out


def all_reduce_tree(tree, algorithm: str, axes: tuple, outer: str, bucket_bytes: int):
    """Sum `tree` over the mesh axes `axes` (a shard_map island manual over them) with `algorithm`
    (`train.allreduce`): `xla` is one `psum`; the others concatenate the float leaves into buckets of
    `bucket_bytes` (`train.bucket_mb`; DDP's buckets) and reduce each with the hand-built algorithm;
    `hierarchical` runs over `outer` and the rest of `axes`. Other leaves go through `psum`."""
    if algorithm == "xla":
        return jax.lax.psum(tree, axes)
    leaves, treedef = jax.tree.flatten(tree)
    floats = [k for k, v in enumerate(leaves) if jnp.issubdtype(v.dtype, jnp.floating)]
    out = [jax.lax.psum(v, axes) if k not in floats else None for k, v in enumerate(leaves)]
    inner = tuple(a for a in axes if a != outer)
    reduce = (lambda v: hierarchical(v, inner, outer)) if algorithm == "hierarchical" else (
        lambda v: ALGORITHMS[algorithm](v, axes))
    for bucket in buckets([leaves[k] for k in floats], bucket_bytes):
        members = [floats[j] for j in bucket]
        flat = jnp.concatenate([leaves[k].reshape(-1).astype(jnp.float32) for k in members])
        summed, offset = reduce(flat), 0
        for k in members:
            out[k] = summed[offset:offset + leaves[k].size].reshape(leaves[k].shape).astype(leaves[k].dtype)
            offset += leaves[k].size
    return jax.tree.unflatten(treedef, out)
