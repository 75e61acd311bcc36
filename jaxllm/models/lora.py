"""Low-rank adapters (LoRA) as parameters: a targeted weight W is used as x·W + scale·(x·A)·B.

`model.lora.rank` > 0 turns each targeted weight of the parameter table into a `LoraWeight` node holding
the frozen base W and the adapters A [..., in, r] and B [..., r, out] (the leading layer dimension as W's,
the rank dimension `lora_rank` replicated, the others named and so sharded as W's own input and output
dimensions). Every other parameter is frozen too. The projections (`layers.column_parallel`,
`layers.row_parallel`) apply a node unmerged, so a bf16 base never absorbs the adapters' small product.

The step trains the *trainable part* of the parameters (`split`): the adapters alone under LoRA, every
parameter otherwise. A is initialised as PEFT does by default (Kaiming-uniform with a = √5: uniform in
±1/√fan_in), B as zeros, so a fresh adapter leaves the base's outputs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError
from jaxllm.models import base_quant

RANK = "lora_rank"  # the rank dimension's logical name: replicated on every mesh
# target name -> where its weights sit in a block (a dense MLP, or an MoE block's shared experts)
TARGETS = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down"),
           "in": ("mlp", "w_in"), "out": ("mlp", "w_out"),
           # latent attention's (`models/mla.py`): q without q_lora_rank, else q_a and q_b
           "q_a": ("attn", "wq_a"), "q_b": ("attn", "wq_b"), "kv_a": ("attn", "wkv_a"), "kv_b": ("attn", "wkv_b")}
LATENT = ("q_a", "q_b", "kv_a", "kv_b")
LEAD = ("layers", "depth", "experts")  # stacking dimensions: an adapter keeps them (an expert has its own)
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "w_in", "w_out")
ADAPTER_STREAM = 0x10A  # init_params folds this into its key for the adapters' draws


@flax.struct.dataclass
class LoraWeight:
    """A frozen weight with its adapters; `scale` (alpha / r, or alpha / √r) and the adapter input's dropout
    `rate` are static. With dropout, `site` holds one frozen uint32 per layer naming this weight's dropout
    stream (drawn once; None without dropout)."""

    w: Any
    a: Any
    b: Any
    site: Any = None
    scale: float = flax.struct.field(pytree_node=False, default=1.0)
    rate: float = flax.struct.field(pytree_node=False, default=0.0)


def is_node(x) -> bool:
    return isinstance(x, LoraWeight)


def scale_of(m) -> float:
    lc = m.lora
    return lc.alpha / (math.sqrt(lc.rank) if lc.rslora else lc.rank)


def _adapter_leaves(leaf, make_leaf, rank: int, output_last: bool):
    """(A, B) Leafs for a base Leaf: input dims are the first non-stacking one (column-parallel weights,
    [embed, ...]) or all but the last (row-parallel, [..., embed])."""
    lead = sum(1 for n in leaf.names if n in LEAD)
    cut = len(leaf.names) - 1 if output_last else lead + 1
    a = make_leaf(leaf.shape[:cut] + (rank,), leaf.names[:cut] + (RANK,), "lora_a")
    b = make_leaf(leaf.shape[:lead] + (rank,) + leaf.shape[cut:], leaf.names[:lead] + (RANK,) + leaf.names[cut:],
                  "zeros")
    return a, b


def adapt_block(block: dict, m, make_leaf) -> dict:
    """A block's table with its targeted weights as `LoraWeight` nodes (`make_leaf(shape, names, init)`)."""
    if not m.lora.rank:
        return block
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in block.items()}
    if "moe" in out:
        out["moe"] = {k: dict(v) if isinstance(v, dict) else v for k, v in out["moe"].items()}
    places = []
    for target in m.lora.targets:
        if target == "experts" and "moe" in out:
            places += [(out["moe"]["experts"], name) for name in EXPERT_WEIGHTS]
        elif target in TARGETS:
            part, name = TARGETS[target]
            places += [(out.get(part), name)]
            if part == "mlp" and "shared" in out.get("moe", {}):
                places += [(out["moe"]["shared"], name)]
    for place, name in places:
        if place is not None and name in place:
            leaf = place[name]
            a, b = _adapter_leaves(leaf, make_leaf, m.lora.rank, output_last=name in ("wo", "w_down", "w_out"))
            w = leaf if m.lora.base_quant == "none" else base_quant.table_node(
                leaf, make_leaf, m.lora.base_quant, m.lora.double_quant)
            lead = sum(1 for n in leaf.names if n in LEAD)
            site = make_leaf(leaf.shape[:lead], leaf.names[:lead], "lora_site") if m.lora.dropout else None
            place[name] = LoraWeight(w, a, b, site, scale_of(m), m.lora.dropout)
    return out


def base_model(m):
    """The model without adapters: the base's parameter table, as a checkpoint or Hugging Face holds it."""
    return dataclasses.replace(m, lora=dataclasses.replace(m.lora, rank=0))


def attach(base, table, make, is_leaf):
    """The base's parameters with adapters at the table's `LoraWeight` nodes: `make(i, leaf)` gives the i-th
    adapter array (A, B, then the dropout site, node by node) for its table leaf."""
    count = [0]

    def one(t, w):
        if not is_node(t):
            return w
        i, count[0] = count[0], count[0] + 3
        if base_quant.is_quantized(t.w):  # QLoRA: the base stored quantized (`models/base_quant.py`)
            w = base_quant.quantize(w, t.w.kind, t.w.axis, double_quant=base_quant.is_quantized(t.w.scale))
        site = None if t.site is None else make(i + 2, t.site)
        return LoraWeight(w, make(i, t.a), make(i + 1, t.b), site, t.scale, t.rate)

    return jax.tree.map(one, table, base, is_leaf=lambda x: is_node(x) or is_leaf(x))


def bases(tree):
    """A tree with `LoraWeight` nodes as the base's: each node replaced by its `w` (stored quantized under QLoRA)."""
    return jax.tree.map(lambda x: x.w if is_node(x) else x, tree, is_leaf=is_node)


def adapters_off(params):
    """The parameters with every B zero: the base's function, sharing its arrays (GRPO's reference policy)."""
    return jax.tree.map(lambda x: x.replace(b=jnp.zeros_like(x.b)) if is_node(x) else x, params, is_leaf=is_node)


def trainable_mask(table, m):
    """A tree of bools like the parameters: what the step trains (the adapters under LoRA, else everything)."""
    if not m.lora.rank:
        return jax.tree.map(lambda _: True, table, is_leaf=is_node)
    return jax.tree.map(lambda x: x.replace(w=False, a=True, b=True, site=None if x.site is None else False)
                        if is_node(x) else False, table, is_leaf=is_node)


def split(tree, mask):
    """(trainable part, frozen part) of a parameter-like tree: each with None where the other holds a leaf (or,
    for a quantized base, a subtree)."""
    train = jax.tree.map(lambda k, x: x if k else None, mask, tree)
    frozen = jax.tree.map(lambda k, x: None if k else x, mask, tree)
    return train, frozen


def combine(train, frozen):
    """The inverse of `split`."""
    return jax.tree.map(lambda t, f: f if t is None else t, train, frozen, is_leaf=lambda x: x is None)


def base(w, names: tuple[str, ...], dtype, weight) -> jax.Array:
    """The frozen weight of a node (dequantized where QLoRA stores it quantized), or the weight itself, as
    `weight(w, names, dtype)` lays a weight out for use."""
    w = w.w if is_node(w) else w
    return base_quant.used(w, names, dtype, weight) if base_quant.is_quantized(w) else weight(w, names, dtype)


def merged(w, names: tuple[str, ...], dtype, weight) -> jax.Array:
    """W + scale·A·B as used (`weight` lays out each part as the base weight's use does); the weight itself when it
    has no adapters. For a use that multiplies by W more than once (latent attention's absorbed cache), no dropout."""
    if not is_node(w):
        return weight(w, names, dtype)
    n_in = w.a.ndim - 1
    a, b = weight(w.a, names[:n_in] + (RANK,), dtype), weight(w.b, (RANK,) + names[n_in:], dtype)
    return base(w, names, dtype, weight) + (w.scale * jnp.tensordot(a, b, axes=1)).astype(dtype)


def expert_parts(w, names: tuple[str, ...], dtype, weight):
    """An expert weight [E, in, out] as the experts' matmuls take it (`ops/moe.expert_ffn`): the array, or for a
    `LoraWeight` (W, scale·A, B), each laid out as the weight is."""
    if not is_node(w):
        return weight(w, names, dtype)
    a = weight(w.a, names[:2] + (RANK,), dtype)
    return base(w, names, dtype, weight), (w.scale * a).astype(dtype), weight(w.b, (names[0], RANK) + names[2:], dtype)


def low_rank(x: jax.Array, node: LoraWeight, names: tuple[str, ...], n_in: int, dtype, weight) -> jax.Array:
    """scale·(dropout(x)·A)·B for a weight named `names` whose first n_in dimensions are its input: x [b, s, *in]
    -> [b, s, *out]. `weight(w, names, dtype)` casts and lays out A and B as the base weight's use does."""
    a = weight(node.a, names[:n_in] + (RANK,), dtype)
    b = weight(node.b, (RANK,) + names[n_in:], dtype)
    x = dropout(x, node, _salt.get())
    return (node.scale * jnp.tensordot(jnp.tensordot(x, a, axes=n_in), b, axes=1)).astype(dtype)


# ---------------------------------------------------------------- adapter dropout
#
# PEFT's lora_dropout drops an adapter's input elements with probability p (the rest scaled by 1/(1-p)). Here a
# mask is a hash of (the token's salt, the weight's site, the element's index in the input), so it is the same on
# every mesh, microbatching and pipeline schedule: the salt is a batch field, a function of (train.seed, step,
# the token's index in the global batch), laid out, split and reordered with the batch; the site a frozen
# per-layer uint32 of the weight. Only training steps carry the salt: evaluation and generation see no dropout.

SALT = "lora_salt"  # the batch field
_salt: contextvars.ContextVar = contextvars.ContextVar("jaxllm_lora_salt", default=None)


@contextlib.contextmanager
def dropout_salt(batch: dict):
    """Make the adapters drop their inputs by `batch`'s salt while tracing (no salt: no dropout)."""
    token = _salt.set(batch.get(SALT))
    try:
        yield
    finally:
        _salt.reset(token)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def salted(batch: dict, m, seed: int, step, place) -> dict:
    """The batch with its dropout salt (`model.lora.dropout` > 0; else as it is): [rows, seq] uint32 of each token's
    index in the global batch, the step and the seed, `place`d as the batch's rows (a sharding constraint)."""
    if not (m.lora.rank and m.lora.dropout):
        return batch
    rows, seq = batch["inputs"].shape
    index = jnp.arange(rows * seq, dtype=jnp.uint32).reshape(rows, seq)
    step = jnp.asarray(step).astype(jnp.uint32)
    salt = _mix(index * jnp.uint32(0x9E3779B1) ^ _mix(step * jnp.uint32(0x85EBCA77) ^ jnp.uint32(seed)))
    return {**batch, SALT: place(salt)}


def dropout(x: jax.Array, node: LoraWeight, salt) -> jax.Array:
    """x [b, s, *in] with each element kept with probability 1 − rate (and scaled by 1 / (1 − rate)), or x."""
    if salt is None or node.site is None or not node.rate:
        return x
    width = math.prod(x.shape[2:])
    element = jnp.arange(width, dtype=jnp.uint32).reshape(x.shape[2:])
    site = _mix(node.site.astype(jnp.uint32) * jnp.uint32(0xC2B2AE3D))
    h = _mix(salt.reshape(salt.shape + (1,) * (x.ndim - 2)) ^ site ^ (element * jnp.uint32(0x27D4EB2F)))
    keep = h >= jnp.uint32(min(int(node.rate * 2**32), 2**32 - 1))
    return jnp.where(keep, x / (1 - node.rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def check_config(m, cfg, zeropp_plan) -> list[str]:
    """`model.lora` against the model and the run: ConfigError for what the adapters cannot do yet."""
    lc = m.lora
    if cfg.init.adapter and not (lc.rank and cfg.init.from_):
        raise ConfigError("init.adapter: a LoRA adapter needs the base it was trained on (init.from) and "
                          "model.lora.rank > 0; set both")
    if cfg.init.adapter and not os.path.isfile(os.path.join(cfg.init.adapter, "adapter_config.json")):
        raise ConfigError(f"init.adapter: no adapter_config.json in '{cfg.init.adapter}'; give a PEFT adapter "
                          "directory (`jaxllm hf export RUN_DIR OUT --adapter` writes one)")
    if not lc.rank:
        return []
    base_quant.check_config(m)
    if lc.rank < 0:
        raise ConfigError(f"model.lora.rank: must be 0 (off) or positive, got {lc.rank}")
    unknown = [t for t in lc.targets if t not in TARGETS and t != "experts"]
    if unknown or not lc.targets:
        raise ConfigError(f"model.lora.targets: {unknown or 'empty'}; choose from {', '.join([*TARGETS, 'experts'])}")
    refusals = [
        (not 0 <= lc.dropout < 1, f"model.lora.dropout={lc.dropout} must be in [0, 1)"),
        (lc.dropout and "experts" in lc.targets, "model.lora.dropout with adapters on the routed experts is not "
                                                 "supported yet (their tokens are dispatched without their salt); "
                                                 "set dropout 0 or drop 'experts'"),
        (m.attention == "mla" and {"k", "v"} & set(lc.targets), "model.lora.targets: latent attention has no k or "
                                                                "v projection; name q_a, q_b, kv_a, kv_b, o instead"),
        (m.attention != "mla" and set(LATENT) & set(lc.targets), "model.lora.targets: q_a, q_b, kv_a and kv_b are "
                                                                 "latent attention's (model.attention=mla)"),
        (lc.base_quant != "none" and {"q_b", "kv_b"} & set(lc.targets), f"model.lora.base_quant={lc.base_quant} "
         "quantizes along d_model, which q_b and kv_b (up from a latent) have not; take them out of targets"),
        (m.moe.bias_update_rate, "model.lora with model.moe.bias_update_rate is not supported yet (the base, its "
                                 "routing bias too, is frozen); set it 0"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)
    stored = "" if lc.base_quant == "none" else f" and stored as {lc.base_quant}"
    return [f"LoRA: rank {lc.rank}, scale {scale_of(m):g}, on {', '.join(lc.targets)}; the base is frozen{stored}"]
