"""The KV cache generation writes and reads, laid out by the same logical rules as everything else.

Per block of the stack (`params["blocks"]`: each segment's kinds), keys and values [repeats, batch,
slots, kv_heads, head_dim] in the compute dtype, stacked over its segment's repeats like that block's
weights (`attention.CACHE` names the dimensions). Under `generation_layout` the batch is split over the
data axes (dp, fsdp, ep) and the KV heads over tp; layers and slots stay whole. Beside them, per slot,
its position and segment id ([batch, slots] int32, shared by all layers): segment 0 marks left padding
and slots not yet written, so `ops/attention.py`'s causal-by-position, same-segment mask serves prefill
and decode.

Bytes per device: 2 · n_layers · batch/(dp·fsdp·ep) · slots · kv_heads/tp · head_dim · B, B the
compute dtype's size (`cache_bytes`, read from the layout); kv_heads fewer than tp are repeated up to tp,
as the weights are (`sharding.heads_as_used`). Latent attention (`model.attention = "mla"`) caches one
[latent | RoPE key] row per token instead, [repeats, batch, slots, kv_lora_rank + qk_rope_head_dim] under
"k" (`mla.LATENT_CACHE`, whole on every tp rank): n_layers · batch/(dp·fsdp·ep) · slots · (kv_lora_rank +
qk_rope_head_dim) · B. A linear (Gated DeltaNet) block holds no KV cache but its fixed-size state
(`gated_deltanet.LinearState`): {"conv": [repeats, batch, K − 1, hk · conv_width] in the compute dtype,
"state": [repeats, batch, hv, dk, dv] fp32}, the key-head groups over tp, whatever the number of slots
(`LINEAR_CACHE`, `gated_deltanet.state_bytes`; `per_row_state` its formula, `cache_parts` the bytes of each kind
of layer, for `jaxllm plan`). `layout_for` turns what a caller has (a StepFns, Layout or Mesh) into generation's
layout.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax.sharding import Mesh

from jaxllm.mesh import batch_shards
from jaxllm.models.attention import CACHE, head_dim, kv_heads, stored_names
from jaxllm.models import gated_deltanet
from jaxllm.models.mla import LATENT_CACHE
from jaxllm.stack import is_linear, layer_kinds, segments
from jaxllm.sharding import ACTIVATION_RULES, WEIGHT_RULES, Layout, constrain, heads_as_used, with_rule


def generation_layout(layout: Layout) -> Layout:
    """Where generation's arrays live on a training mesh: weights as used (never split over fsdp or pp: the
    transient gathered copy), activations and the cache with the batch over the data axes and heads over
    tp, the sequence whole (pp and sp ranks repeat the work of their data-parallel group)."""
    activations = with_rule(with_rule(ACTIVATION_RULES, "seq", ()), "residual_seq", ()) + (("layers", ()),)
    return Layout(mesh=layout.mesh, params=WEIGHT_RULES, activations=activations, weights=WEIGHT_RULES)


def layout_for(on, as_stored: bool = False) -> Layout | None:
    """Generation's layout on a Layout, a StepFns (its layout) or a Mesh (parameters stored as used); None:
    one device, no layout. `as_stored`: the given layout itself (where the parameters live)."""
    if on is None:
        return None
    given = Layout(mesh=on, params=WEIGHT_RULES) if isinstance(on, Mesh) else (
        on if isinstance(on, Layout) else on.layout)
    return given if as_stored else generation_layout(given)


def padded_rows(rows: int, layout: Layout | None) -> int:
    """Rows padded to a multiple of the batch shards (dp × fsdp × ep)."""
    shards = 1 if layout is None else batch_shards(dict(layout.mesh.shape))
    return -(-rows // shards) * shards


def _entries(m, paged: bool = False) -> dict[str, tuple]:
    """What a block's cache holds, each entry's logical dimensions: keys and values, or MLA's latent rows (paged:
    a pool of pages per shard of the rows, in place of the batch)."""
    if m.attention == "mla":
        return {"k": stored_names(LATENT_CACHE, paged)}
    return {"k": stored_names(CACHE, paged), "v": stored_names(CACHE, paged)}


def _shape(m, repeats: int, rows: int, slots: int, layout: Layout | None, paged: bool = False) -> tuple[int, ...]:
    """A block's cache shape: [repeats, rows, slots, ...], or paged, `rows` pages of `slots` tokens in each shard's
    pool (`attention.CacheView`), one shard per data-parallel rank (`padded_rows`)."""
    shards = (padded_rows(1, layout),) if paged else ()
    if m.attention == "mla":
        return shards + (repeats, rows, slots, per_token(m)[0])
    tp = 1 if layout is None else layout.mesh.shape["tp"]
    heads = heads_as_used(kv_heads(m), tp)
    return (heads, *shards, repeats, rows, slots, head_dim(m)) if paged else (repeats, rows, slots, heads, head_dim(m))


def per_token(m) -> tuple[int, str]:
    """(values cached per token per layer, the formula that gives them), before any split over devices."""
    if m.attention == "mla":
        r, dr = m.mla.kv_lora_rank, m.mla.qk_rope_head_dim
        return r + dr, f"kv_lora_rank + qk_rope_head_dim = {r} + {dr}"
    kv, d = kv_heads(m), head_dim(m)
    return 2 * kv * d, f"2 × kv_heads × head_dim = 2 × {kv} × {d}"


LINEAR_CACHE = {"conv": ("layers", "batch", "conv_kernel", "linear_heads"),
                "state": ("layers", "batch", "linear_heads", "head_dim", "head_dim")}


def _linear_state(m, repeats: int, rows: int, dtype) -> dict:
    """A linear block's empty generation state, stacked over its repeats, laid out by `LINEAR_CACHE`."""
    empty = gated_deltanet.empty_state(gated_deltanet.sizes_of(m), rows, dtype)
    return {n: constrain(jnp.zeros((repeats,) + a.shape, a.dtype), LINEAR_CACHE[n])
            for n, a in zip(("conv", "state"), empty)}


def init_cache(m, rows: int, slots: int, dtype, layout: Layout | None, paged: bool = False) -> list[dict]:
    """An empty cache: one {"k", "v"} ({"k"} under MLA) per attention block of the stack, zeros laid out by their
    names, and a linear block's empty state. `paged`: the rollout engine's pools of `rows` pages of `slots`
    tokens, one per data-parallel rank (no linear blocks: `generate/engine.py` refuses them)."""
    def entry(kind: str, repeats: int) -> dict:
        if is_linear(kind):
            return _linear_state(m, repeats, rows, dtype)
        return {n: constrain(jnp.zeros(_shape(m, repeats, rows, slots, layout, paged), dtype), names)
                for n, names in _entries(m, paged).items()}
    return [entry(kind, seg.repeats) for seg in segments(m) for kind in seg.pattern]


def _own_bytes(shape: tuple, names: tuple, layout: Layout | None, itemsize: int) -> int:
    own = shape if layout is None else layout.sharding(names, layout.activations, shape).shard_shape(shape)
    return math.prod(own) * itemsize


def layer_counts(m) -> tuple[int, int]:
    """(attention layers, linear layers) of the stack: the ones with a KV cache and the ones with a fixed state."""
    kinds = layer_kinds(m)
    linear = sum(map(is_linear, kinds))
    return len(kinds) - linear, linear


def per_row_state(m) -> tuple[int, int, str]:
    """A linear layer's state per row, before any split, whatever the length: (values in the compute dtype, fp32
    values, the formula that gives them), `gated_deltanet.state_bytes` in values: the convolution's last K − 1
    inputs of every group's q, k and v, and the recurrence's state per value head."""
    s = gated_deltanet.sizes_of(m)
    k, hk, hv, dk, dv, r = s.conv_kernel, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim, s.group
    formula = (f"(K − 1) × hk × (2·dk + r·dv) = {k - 1} × {hk} × (2 × {dk} + {r} × {dv}) in the compute dtype"
               f" + hv × dk × dv = {hv} × {dk} × {dv} in fp32")
    return (k - 1) * hk * (2 * dk + r * dv), hv * dk * dv, formula


def _kv_bytes(m, layers: int, rows: int, slots: int, itemsize: int, layout: Layout | None) -> int:
    if not layers:
        return 0
    shape = _shape(m, layers, rows, slots, layout)  # every attention layer's, as one stack
    return sum(_own_bytes(shape, names, layout, itemsize) for names in _entries(m).values())


def _state_bytes(m, layers: int, rows: int, dtype, layout: Layout | None) -> int:
    if not layers:
        return 0
    empty = gated_deltanet.empty_state(gated_deltanet.sizes_of(m), rows, dtype)
    return sum(_own_bytes((layers,) + a.shape, LINEAR_CACHE[n], layout, a.dtype.itemsize)
               for n, a in zip(("conv", "state"), empty))


def cache_parts(m, rows: int, slots: int, dtype, on) -> dict[str, int]:
    """Bytes of the cache on one device for `rows` prompts (padded as generation pads them) on `on`'s mesh, by
    kind of layer: {"attention": their KV cache (grows with the slots), "linear": their states (does not)}."""
    layout = layout_for(on)
    rows = padded_rows(rows, layout)
    attention_layers, linear_layers = layer_counts(m)
    return {"attention": _kv_bytes(m, attention_layers, rows, slots, jnp.dtype(dtype).itemsize, layout),
            "linear": _state_bytes(m, linear_layers, rows, dtype, layout)}


def pool_bytes(m, pages: int, page: int, dtype, on) -> int:
    """Bytes on one device of the rollout engine's page pools (`generate/engine.py`): every attention layer's pools
    of `pages` pages of `page` tokens, one pool per data-parallel shard (a device holds its own), keys and values
    split over tp by heads as the KV cache is, latent rows whole."""
    layout, layers = layout_for(on), layer_counts(m)[0]
    if not layers:
        return 0
    shape = _shape(m, layers, pages, page, layout, paged=True)  # every attention layer's, as one stack
    return sum(_own_bytes(shape, names, layout, jnp.dtype(dtype).itemsize) for names in _entries(m, True).values())


def cache_bytes(m, rows: int, slots: int, dtype, on) -> int:
    """Bytes of the cache on one device for `rows` prompts (padded as generation pads them) on `on`'s mesh: the
    attention layers' KV cache and the linear layers' states."""
    return sum(cache_parts(m, rows, slots, dtype, on).values())
