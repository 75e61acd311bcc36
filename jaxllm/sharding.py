"""Logical sharding rules as data, and the two calls model code makes: `constrain` and `weight`.

Model code names the dimensions of its arrays with logical names (`batch`, `seq`,
`residual_seq`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `layers`,
`pos`). A rule table maps each logical name to mesh axes. There are three tables per run:

- `activations`: how activations are laid out (batch over dp×fsdp×ep, seq over sp,
  heads/mlp/vocab over tp). `residual_seq` is the sequence dimension of the residual
  stream (norms, residual adds): over sp, and with Megatron sequence parallelism over
  sp×tp too, so the partitioner turns each tensor-parallel all-reduce into a
  reduce-scatter into the residual stream and an all-gather out of it;
- `params`: how the stored fp32 parameters are laid out (ZeRO-3 adds `embed`→fsdp);
- `weights`: how a weight looks where it is used (never sharded over fsdp: under
  ZeRO-3 this is where the all-gather happens).

With no layout active (a single-device reference) both calls are the identity, so the
same model code runs everywhere. A rule whose mesh axes do not divide a dimension falls
back to replication for that dimension and says so in the log once.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger("jaxllm")

Rules = tuple[tuple[str, tuple[str, ...]], ...]

BATCH_AXES = ("dp", "fsdp", "ep")

# The model's own dimensions, laid out alike in activations and in weights: Megatron's
# tensor-parallel split of heads, the MLP hidden dimension and the vocabulary.
TENSOR_RULES: Rules = (
    ("embed", ()),
    ("heads", ("tp",)),
    ("kv_heads", ("tp",)),
    ("head_dim", ()),
    ("mlp", ("tp",)),
    ("vocab", ("tp",)),
    ("experts", ("ep",)),  # expert parallelism: each ep rank owns a share of the experts
    ("router", ()),  # the router's expert dimension: every rank routes to all experts
    ("gate", ()),  # a scalar gate's single output (Qwen2-MoE's shared-expert gate)
    ("q_lora", ()),  # latent attention's compressed query (`models/mla.py`): every tp rank projects all heads from it
    ("kv_lora", ()),  # and its compressed key-value latent (with the RoPE key), likewise whole on every tp rank
    ("depth", ()),  # the multi-token prediction modules' stack (`models/mtp.py`): replicated over pp like the head
    ("mtp_in", ()),  # their projection's input, the embedding and the hidden state joined
    ("lora_rank", ()),  # a LoRA adapter's rank (`models/lora.py`): small, whole on every device
    ("linear_heads", ("tp",)),  # Gated DeltaNet's key-head groups (`models/gated_deltanet.py`), split like heads
    ("linear_group", ()),  # a group's channels (its q, k, r value heads, their gates)
    ("conv_kernel", ()),  # the short convolution's taps (and the generation state's window)
    ("linear_conv", ()),  # its channels as transformers orders them (q, k, v of every head): small, whole
)

# The rollout engine's page pool (`generate/engine.py`): one pool of "pages" per "page_shards", split over the
# batch axes as the rows are, so each data-parallel rank holds the pages of its own rows and no other's
ACTIVATION_RULES: Rules = (("batch", BATCH_AXES), ("seq", ("sp",)), ("residual_seq", ("sp",)),
                           ("page_shards", BATCH_AXES), ("pages", ())) + TENSOR_RULES

WEIGHT_RULES: Rules = (("layers", ()), ("pos", ())) + TENSOR_RULES


def with_rule(rules: Rules, name: str, axes: tuple[str, ...]) -> Rules:
    return tuple((n, axes if n == name else a) for n, a in rules)


def activation_rules(sequence_parallel: bool) -> Rules:
    """Activation layout: with Megatron sequence parallelism the residual stream's sequence is split over tp too."""
    return with_rule(ACTIVATION_RULES, "residual_seq", ("sp", "tp")) if sequence_parallel else ACTIVATION_RULES


def param_rules(shard_over_fsdp: bool, hpz: bool = False) -> Rules:
    """Stored parameter layout: the use layout with the layer stack split over pipeline stages
    (contiguous, in canonical order), plus `embed` over fsdp when ZeRO shards it (over fsdp × dp,
    fsdp major, under ZeRO++'s hpZ: `parallel/zeropp.py`)."""
    rules = with_rule(WEIGHT_RULES, "layers", ("pp",))
    return with_rule(rules, "embed", ("fsdp", "dp") if hpz else ("fsdp",)) if shard_over_fsdp else rules


_warned: set = set()


def logical_spec(names: tuple[str, ...], rules: Rules, mesh: Mesh, shape: tuple[int, ...] | None = None) -> P:
    """PartitionSpec for an array with these logical dimension names under `rules`.

    Each mesh axis is used at most once; axes of size 1 are dropped; a dimension the
    axes do not divide is replicated (logged once).
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        axes = tuple(a for a in table[name] if a not in used and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and shape is not None and shape[i] % size:
            key = (name, axes, shape[i])
            if key not in _warned:
                _warned.add(key)
                log.info("sharding: '%s' of size %d does not divide over %s=%d; replicated instead",
                         name, shape[i], "×".join(axes), size)
            axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def manual_spec(names: tuple[str, ...], rules: Rules, mesh: Mesh, shape, axes: set[str]) -> P:
    """The spec of `names` under `rules`, keeping only the mesh `axes` an island is manual over
    (one entry per dimension; a dimension split over other axes too keeps just these)."""
    spec = list(logical_spec(tuple(names), rules, mesh, shape))
    spec += [None] * (len(shape) - len(spec))
    out = []
    for e in spec:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


@dataclass(frozen=True)
class Layout:
    """Where arrays live on one mesh: the rule tables in force for a run."""

    mesh: Mesh
    params: Rules
    activations: Rules = ACTIVATION_RULES
    weights: Rules = WEIGHT_RULES

    # True inside a shard_map island: constraints are then bare PartitionSpecs, resolved
    # against the island's mesh (whose manual axes the rules must not name).
    manual: bool = False

    # Tensor-parallel projections run as collective matmuls (jaxllm/parallel/collective_matmul.py).
    collective_matmul: bool = False

    # How attention runs when the sequence is split over sp: ring | allgather | ulysses.
    context_attention: str = "ring"

    # The order in which the sequence's positions are laid out (the zig-zag over sp, `parallel/load_balance.py`);
    # None: in order. What depends on token order (a capacity's queue) reads the sequence in order through it.
    sequence_order: tuple[int, ...] | None = None

    # ZeRO++ (inside its island, `parallel/zeropp.py`): (w, names, dtype) -> the weight gathered over fsdp
    # where it is used, for weights with an `embed` dimension; None: the partitioner gathers.
    use_site_gather: Callable | None = None

    def sharding(self, names, rules: Rules, shape=None) -> NamedSharding:
        return NamedSharding(self.mesh, logical_spec(tuple(names), rules, self.mesh, shape))

    def constraint(self, names, rules: Rules, shape) -> NamedSharding | P:
        spec = logical_spec(tuple(names), rules, self.mesh, shape)
        return spec if self.manual else NamedSharding(self.mesh, spec)


def island_mesh(layout: Layout):
    """The mesh a shard_map island maps over: inside another island (gradient accumulation,
    manual over the batch axes) the context's abstract mesh, which records those axes as manual."""
    return jax.sharding.get_abstract_mesh() if layout.manual else layout.mesh


_layout: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("jaxllm_layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None):
    """Make `constrain`/`weight` place constraints for this layout while tracing."""
    token = _layout.set(layout)
    try:
        yield layout
    finally:
        _layout.reset(token)


def current_layout() -> Layout | None:
    return _layout.get()


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Pin an activation's layout at a logical boundary (identity without a layout)."""
    layout = _layout.get()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.constraint(names, layout.activations, x.shape))


def weight(w: jax.Array, names: tuple[str, ...], dtype) -> jax.Array:
    """A parameter as used: cast to the compute dtype, then laid out as `weights` says.

    Casting first means a ZeRO-3 gather moves compute-dtype bytes, not fp32 (ZeRO++'s island gathers
    by its own collectives: `Layout.use_site_gather`).
    KV heads fewer than tp are repeated up to tp first (`replicated_heads`).
    """
    layout = _layout.get()
    if layout is not None and layout.use_site_gather is not None and "embed" in names:
        w = layout.use_site_gather(w, names, dtype)
    w = w.astype(dtype)
    if layout is None:
        return w
    w = replicated_heads(w, names)
    return jax.lax.with_sharding_constraint(w, layout.constraint(names, layout.weights, w.shape))


def replicated_heads(w: jax.Array, names: tuple[str, ...], axis_name: str = "kv_heads") -> jax.Array:
    """Repeat the `kv_heads` dimension of a use-site weight up to the tp size when it is smaller
    (identity otherwise).

    Each tp rank then holds a copy of the KV head its query heads attend to, as
    Megatron does, and computes only that head; the gradients of the copies add up in
    the transpose of the repeat. Grouped-query attention reads `heads // kv_heads` from
    the shapes, so the larger KV count keeps every query head on its own KV head.
    """
    layout = _layout.get()
    if layout is None or axis_name not in names:
        return w
    i = names.index(axis_name)
    tp = math.prod(layout.mesh.shape[a] for a in dict(layout.weights)[axis_name])
    if heads_as_used(w.shape[i], tp) == w.shape[i]:
        return w
    return jnp.repeat(w, tp // w.shape[i], axis=i)


def heads_as_used(kv_heads: int, tp: int) -> int:
    """How many KV heads a tp group uses: fewer than tp (and dividing it) are repeated up to tp."""
    return tp if kv_heads < tp and tp % kv_heads == 0 else kv_heads


def is_names(x) -> bool:
    """Whether x is one leaf's logical names (a tuple of strings): `is_leaf` for trees of names."""
    return isinstance(x, tuple) and all(isinstance(e, str) for e in x)


def tree_shardings(names_tree, shapes_tree, layout: Layout, rules: Rules):
    """NamedShardings for a tree of arrays given a matching tree of logical names."""
    return jax.tree.map(lambda n, s: layout.sharding(n, rules, s.shape), names_tree, shapes_tree,
                        is_leaf=is_names)
