"""Tapped projections: a weight's gradient computed apart from the backward that makes its inputs (the split backward
of the zero-bubble pipelines, `parallel/pipeline.py`).

A projection y = x·W (`layers.column_parallel`, `layers.row_parallel`) gives W the gradient Σ_rows x ⊗ dy, where dy
is y's cotangent. To compute that later, the pipeline's R takes the VJP of a chunk with its projection weights
closed over (so its pullback makes no weight gradient) and each projected weight as a `Tap`: the weight with two zero
probes, one like the projection's input and one like its output. `layers` passes x through `keep` and y through
`pass_back`, whose VJPs make the probes' cotangents x itself and dy. B runs the pullback; the probes' cotangents,
stacked over the chunk's layers by the scan's transpose, are the "W stash"; `Taps.weight_grads` turns a stash into
the weights' gradients (W): one contraction over the rows per weight, pulled back through the weight's cast and
layout (`sharding.weight`), so the result is the gradient the fused backward computes, added up in another order.

What the stash holds, per token and layer: each projection's input and output, in the compute dtype; the input of
Q, K and V (and of the gated MLP's gate and up) is the same x, kept once per weight (`stash_elements` counts them).
Under `model.remat` the pullback recomputes, in B, what the remat policy dropped in R; W recomputes nothing. Every
other parameter of the chunk (norms, biases, routers, experts) gets its gradient in B, as in a fused backward.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm import sharding
from jaxllm.models import lora
from jaxllm.ops import fp8
from jaxllm.sharding import is_names, weight

LEAD = 1  # a pipeline chunk's leaves carry one stacking dimension, the layer repeats


@flax.struct.dataclass
class Tap:
    """A projection weight `w` with its probes: `x` (zeros like the projection's input) and `dy` (like its
    output), each [batch, seq, ...]."""

    w: Any
    x: Any
    dy: Any


def is_tap(node) -> bool:
    return isinstance(node, Tap)


def weight_of(node):
    """The weight of a `Tap`, or the node itself."""
    return node.w if is_tap(node) else node


@jax.custom_vjp
def _keep(x, probe):
    return x


_keep.defvjp(lambda x, probe: (x, x), lambda x, ct: (ct, x))  # the probe's "cotangent" is the value itself


@jax.custom_vjp
def _pass_back(y, probe):
    return y


_pass_back.defvjp(lambda y, probe: (y, None), lambda _, ct: (ct, ct))  # the probe's cotangent is y's


def keep(x: jax.Array, node) -> jax.Array:
    """x, the input of `node`'s projection; a `Tap` hands it out as its probe's cotangent."""
    return _keep(x, node.x) if is_tap(node) else x


def pass_back(y: jax.Array, node) -> jax.Array:
    """y, the output of `node`'s projection; a `Tap` hands out its cotangent as its probe's."""
    return _pass_back(y, node.dy) if is_tap(node) else y


def is_tapped(path, names: tuple[str, ...]) -> bool:
    """Whether the weight at `path` of a block (logical `names`, the layer dimension first) is tapped: the
    projections of attention and of a dense MLP (`lora.TARGETS`: the weights `layers` uses through
    column_parallel and row_parallel)."""
    keys = tuple(getattr(k, "key", None) for k in path[-2:])
    return keys in set(lora.TARGETS.values()) and "embed" in (names[LEAD], names[-1])


def matmul_group(path, names: tuple[str, ...]) -> str:
    """The `ops/fp8.py` group of a tapped weight's matmul: attention's projections or the MLP's."""
    return "attention" if any(getattr(k, "key", None) == "attn" for k in path) else "mlp"


def contracted(names: tuple[str, ...]) -> int:
    """How many of a tapped weight's leading dimensions (after the layers') its input contracts: one for a
    column-parallel weight [embed, ...], all but the last for a row-parallel one [..., embed]."""
    return 1 if names[LEAD] == "embed" else len(names) - LEAD - 1


def stash_elements(blocks: list, tp: int) -> int:
    """Elements of the W stash per token and per repeat of the blocks' pattern on one device (`blocks`: the
    parameter table's blocks, leaves with `shape` and `names`): each tapped weight's input and output, their
    heads and MLP dimensions split over tp (KV heads fewer than tp repeated up to it, as `sharding.weight` does)."""
    def size(names, shape):
        n = 1
        for name, dim in zip(names, shape):
            dim = sharding.heads_as_used(dim, tp) if name == "kv_heads" else dim
            n *= dim // tp if name in ("heads", "kv_heads", "mlp") and dim % tp == 0 else dim
        return n

    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(blocks, is_leaf=lambda x: hasattr(x, "names"))[0]:
        if is_tapped(path, leaf.names):
            k = LEAD + contracted(leaf.names)
            total += size(leaf.names[LEAD:k], leaf.shape[LEAD:k]) + size(leaf.names[k:], leaf.shape[k:])
    return total


class Taps:
    """The tapped weights of a pipeline chunk (`is_tapped`) and the operations on them. `names` is the chunk's tree
    of logical names (the parameter table's, with the layer dimension first)."""

    def __init__(self, names):
        self.names = names
        self.structure = jax.tree.structure(names, is_leaf=is_names)
        self.mask = self.structure.flatten_up_to(jax.tree_util.tree_map_with_path(is_tapped, names, is_leaf=is_names))
        self.groups = jax.tree_util.tree_map_with_path(matmul_group, names, is_leaf=is_names)  # for precision.matmul

    def split(self, chunk):
        """(tapped weights, the rest): two trees like `chunk`, each None where the other holds a leaf."""
        leaves = self.structure.flatten_up_to(chunk)
        tapped = [a if k else None for k, a in zip(self.mask, leaves)]
        rest = [None if k else a for k, a in zip(self.mask, leaves)]
        return self.structure.unflatten(tapped), self.structure.unflatten(rest)

    def _each(self, fn, *trees):
        """fn(names, *leaves) over the tapped positions (None elsewhere)."""
        names = self.structure.flatten_up_to(self.names)
        columns = [self.structure.flatten_up_to(t) for t in trees]
        out = [None if leaves[0] is None else fn(n, *leaves) for n, *leaves in zip(names, *columns)]
        return self.structure.unflatten(out)

    def probes(self, tapped, rows: tuple[int, int], dtype):
        """Zero probes {x, dy} for each tapped weight [R, ...]: [R, batch, seq, input dims] and [R, batch, seq,
        output dims] of the weight as used (KV heads repeated up to tp where `sharding.weight` repeats them)."""
        def one(names, w):
            one_layer = jax.ShapeDtypeStruct(w.shape[LEAD:], w.dtype)
            used = jax.eval_shape(lambda a: weight(a, names[LEAD:], dtype), one_layer).shape
            k = contracted(names)
            lead = (w.shape[0], *rows)
            return {"x": jnp.zeros(lead + used[:k], dtype), "dy": jnp.zeros(lead + used[k:], dtype)}
        return self._each(one, tapped)

    def join(self, tapped, probes, rest):
        """The chunk as the model takes it: each tapped weight as a `Tap` with its probes, the rest as it is."""
        full = self._each(lambda _, w, pr: Tap(w, pr["x"], pr["dy"]), tapped, probes)
        return lora.combine(rest, full)

    def stash_names(self, probes):
        """The logical names of each stash array's [batch, seq, ...] dimensions (after the layer dimension)."""
        def one(names, _):
            k = contracted(names)
            return {"x": ("batch", "seq") + names[LEAD:LEAD + k], "dy": ("batch", "seq") + names[LEAD + k:]}
        return self._each(one, probes)

    def weight_grads(self, tapped, stash):
        """W: the gradients of the tapped weights [R, ...] from a stash ({x, dy} per weight, [R, batch, seq, ...]),
        in fp32; through fp8 where the program covers the weight's matmul group (`fp8.weight_grad`)."""
        def one(names, w, group, st):
            def layer(w, x, dy):
                used, pull = jax.vjp(lambda a: weight(a, names[LEAD:], x.dtype), w)
                return pull(fp8.weight_grad(group, x, dy).astype(used.dtype))[0].astype(jnp.float32)
            return jax.vmap(layer)(w, st["x"], st["dy"])
        return self._each(one, tapped, self.groups, stash)
