"""Multi-head / grouped-query self-attention.

`attention_layer` projects (with the biases `model.attn_bias` names), applies RoPE where
`model.positions` says so, and calls
`attend`, the one dispatch point for the attention kernel (context-parallel
strategies plug in there, so model files carry no parallelism branches).
`cached_attention_layer` is the same layer for generation: it writes its keys and values into a
KV cache and attends to the whole cache. The math itself (scores, mask, softmax) and its
implementations (`model.attention_impl`) are `ops/`, shared with those strategies.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxllm.models.layers import add_bias, column_parallel, norm, row_parallel
from jaxllm.ops.attention import (CHUNK_IMPLEMENTATIONS, FUSED_PLATFORM, IMPLEMENTATIONS, SINK_IMPLEMENTATIONS,
                                  attention, refuse_chunk, refuse_sinks)
from jaxllm.ops import cudnn_attention, paged_attention
from jaxllm.ops.pallas_attention import IMPLEMENTATIONS as PALLAS_KERNELS, supports
from jaxllm.ops.masking import Masking
from jaxllm.ops.rope import frequencies, rope, yarn, yarn_attention_factor
from jaxllm.parallel import allgather_attention, kernel_island, ring_attention, ulysses_attention
from jaxllm.errors import ConfigError
from jaxllm.sharding import constrain, current_layout, weight

CONTEXT_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
RING_KERNELS = ("pallas_gpu",)  # the fused kernels the ring runs its pairs on (`parallel/ring_attention.py`)
# the fused kernels each context-parallel island runs (Ulysses: on a rank's whole sequence, `ulysses_attention.py`)
ISLAND_KERNELS = {"ring": RING_KERNELS, "ulysses": ulysses_attention.KERNELS, "allgather": ()}


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
CHUNKED_FROM = 4096  # `auto` takes `chunked` from this seq_len on; below it every shipped config runs `dense`


WINDOW_KINDS = ("local", "global")


def local_layers(m) -> list[bool]:
    """Which layers `model.window_pattern` marks `local` (every layer when it is empty)."""
    pattern = m.window_pattern or ["local"]
    return [pattern[i % len(pattern)] == "local" for i in range(m.n_layers)]


def layer_windows(m) -> list[int]:
    """Each layer's attention window (0: none): `model.sliding_window` on the `local` layers."""
    return [m.sliding_window if local else 0 for local in local_layers(m)]


def windows_differ(m) -> bool:
    """Whether the layers' windows differ, so each layer's is data the layer scan carries."""
    return len(set(layer_windows(m))) > 1


def local_rope(m) -> list[bool]:
    """Each layer: whether its RoPE is the local one (`model.rope_local_theta` on the `local` layers)."""
    return [bool(m.rope_local_theta) and local for local in local_layers(m)]


def layer_chunks(m) -> list[int]:
    """Each layer's attention chunk (0: none): `model.attention_chunk` on the `local` layers (Llama 4's chunked
    local attention: a query sees the keys of its own chunk of positions only)."""
    return [m.attention_chunk if local else 0 for local in local_layers(m)]


def layer_rope(m) -> list[bool]:
    """Each layer: whether it applies RoPE (`model.positions = rope`; on the `global` layers only with
    `model.rope_global`, Llama 4's layers without RoPE)."""
    return [m.positions == "rope" and (local or m.rope_global) for local in local_layers(m)]


def layer_temperatures(m) -> list[float]:
    """Each layer's attention temperature scale (0: none): `model.attn_temperature_scale` on the layers without
    RoPE when `model.attn_temperature_floor` is set (`temperature`)."""
    tuned = m.attn_temperature_floor > 0
    return [m.attn_temperature_scale if tuned and not on else 0.0 for on in layer_rope(m)]


def layer_l2_norms(m) -> list[bool]:
    """Each layer: whether its queries and keys are L2-normed after RoPE (`model.qk_l2_norm`, on the RoPE layers)."""
    return [m.qk_l2_norm and on for on in layer_rope(m)]


def layer_data(m) -> dict | None:
    """What differs by layer, one row per layer, for the layer scan to carry: "window" [n_layers] int32 when the
    windows differ, "chunk" [n_layers] int32 when the attention chunks do, "rope" [n_layers, rope_dim/2] fp32
    frequencies when the RoPE does (a layer without RoPE: zeros, the identity rotation exactly), "temperature"
    [n_layers] fp32 when the temperature scales do, "l2" [n_layers] bool when the L2 q/k norms do; None when
    nothing does."""
    data = {}
    if windows_differ(m):
        data["window"] = jnp.asarray(layer_windows(m), jnp.int32)
    if len(set(layer_chunks(m))) > 1:
        data["chunk"] = jnp.asarray(layer_chunks(m), jnp.int32)
    if len(set(local_rope(m))) > 1 or len(set(layer_rope(m))) > 1:
        off = [m.positions == "rope" and not on for on in layer_rope(m)]
        data["rope"] = jnp.stack([jnp.zeros(rope_dim(m) // 2, jnp.float32) if no else rope_frequencies(m, local)
                                  for no, local in zip(off, local_rope(m))])
    if len(set(layer_temperatures(m))) > 1:
        data["temperature"] = jnp.asarray(layer_temperatures(m), jnp.float32)
    if len(set(layer_l2_norms(m))) > 1:
        data["l2"] = jnp.asarray(layer_l2_norms(m), jnp.bool_)
    return data or None


def _of_layer(m, layer, key: str, per_layer):
    """The layer's own `key` from its row of `layer_data` where it differs by layer, else every layer's value."""
    return layer[key] if layer and key in layer else per_layer(m)[0]


def masking(m, layer=None) -> Masking:
    """The model's mask features beyond causal-by-position within a segment (no model: none): the window and the
    attention chunk (the layer's own, traced int32 scalars in `layer`, where they differ by layer), the soft cap
    and the scale."""
    if m is None:
        return Masking()
    return Masking(window=_of_layer(m, layer, "window", layer_windows), softcap=m.attn_softcap,
                   scale=softmax_scale(m), chunk=_of_layer(m, layer, "chunk", layer_chunks))


def softmax_scale(m) -> float | None:
    """The score scale where it is not 1/√(the queries' width) (None): Gemma's `query_pre_attn_scalar`^−½; MLA's
    1/√(qk_nope + qk_rope) always (its cached queries are wider); times DeepSeek's (0.1·mscale_all_dim·ln(factor)
    + 1)² under a RoPE scaling, as transformers' `yarn_apply_mscale`."""
    scale = m.query_pre_attn_scalar ** -0.5 if m.query_pre_attn_scalar else None
    if m.attention == "mla":
        scale = qk_dim(m) ** -0.5
    if m.rope_mscale_all_dim and m.rope_scaling != "none":
        scale = (scale or qk_dim(m) ** -0.5) * yarn_attention_factor(m.rope_factor, m.rope_mscale_all_dim) ** 2
    return scale


def implementation(m) -> str:
    """`model.attention_impl` resolved: `auto` is `chunked` for long sequences or a window that masks, else `dense`
    (no model: `dense`)."""
    if m is None:
        return "dense"
    return _auto(m) if m.attention_impl == "auto" else m.attention_impl


def _auto(m) -> str:
    """`auto`'s choice: `chunked` from CHUNKED_FROM tokens on or under a window or an attention chunk shorter than
    seq_len (the blocks it rules out are skipped), else `dense`."""
    windowed = any(0 < w < m.seq_len for w in layer_windows(m) + layer_chunks(m))
    return "chunked" if m.seq_len >= CHUNKED_FROM or windowed else "dense"


def cache_implementation(m, queries: int = 0) -> str:
    """What generation attends over the KV cache with, for calls of `queries` tokens a row: a decode step's (one)
    `dense`, whose scores are one row of slots and which reads gathered pages as they lie (`chunked` would
    transpose them and loop over blocks; a window's pages are narrowed before: `in_window`); otherwise the run's
    implementation, except that the fused kernels mask by index and a cached call's queries are not at their keys'
    indices, so there it is `auto`'s choice."""
    if queries == 1:
        return "dense"
    impl = implementation(m)
    return _auto(m) if impl in FUSED_PLATFORM else impl


def kv_heads(m) -> int:
    """Key/value heads (`model.n_kv_heads`, 0 meaning as many as the query heads; MLA: as many)."""
    return m.n_heads if m.attention == "mla" else m.n_kv_heads or m.n_heads


def head_dim(m) -> int:
    """Each head's dimension (`model.head_dim`, 0 meaning d_model / n_heads)."""
    return m.head_dim or m.d_model // m.n_heads


def qk_dim(m) -> int:
    """The width of a head's queries and keys (MLA: qk_nope + qk_rope)."""
    return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim if m.attention == "mla" else head_dim(m)


def v_dim(m) -> int:
    """The width of a head's values (MLA: v_head_dim)."""
    return m.mla.v_head_dim if m.attention == "mla" else head_dim(m)


def score_width(m) -> int:
    """What a token's scores and weighted values cost per key, over all heads: heads × (qk + v) / 2 (the heads'
    width for MHA), the attention term of the FLOPs per token."""
    return m.n_heads * (qk_dim(m) + v_dim(m)) // 2


def rope_dim(m) -> int:
    """The dimensions RoPE rotates: each head's first int(head_dim × `model.rope_fraction`) (the whole head at 1;
    transformers' `partial_rotary_factor`, rounded as it does), or MLA's qk_rope_head_dim. The frequencies, their
    scalings and the per-layer rows are all of this width."""
    return m.mla.qk_rope_head_dim if m.attention == "mla" else int(head_dim(m) * m.rope_fraction)


def rope_frequencies(m, local: bool = False):
    """The model's RoPE frequencies ([rope_dim / 2] fp32), with `model.rope_scaling` applied; `local`: the local
    layers' (`model.rope_local_theta`, unscaled)."""
    if local:
        return frequencies(rope_dim(m), m.rope_local_theta)
    llama3 = None
    if m.rope_scaling == "llama3":
        llama3 = (m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_context)
    freqs = frequencies(rope_dim(m), m.rope_theta, llama3)
    if m.rope_scaling == "yarn":
        return yarn(freqs, rope_dim(m), m.rope_theta, m.rope_factor, m.rope_original_context, m.rope_beta_fast,
                    m.rope_beta_slow, m.rope_truncate)
    return freqs / m.rope_factor if m.rope_scaling == "linear" else freqs


def rope_scale(m) -> float:
    """What RoPE multiplies cos and sin by: YaRN's attention factor, else 1."""
    if m.rope_scaling != "yarn":
        return 1.0
    return m.rope_attention_factor or yarn_attention_factor(m.rope_factor)


def attend(q, k, v, positions, segment_ids, m=None, layer=None, sinks=None):
    """The attention kernel for this run: the dispatch point for context parallelism and the implementation.

    With the sequence split over `sp`, the layout's `context_attention` strategy
    (`model.cp_strategy`: ring, allgather or ulysses) runs as a shard_map island; otherwise
    `model.attention_impl` (resolved by `implementation`) with the model's masking. `sinks` [heads] fp32: the
    layer's attention sinks (`model.attn_sinks`; None: none), which every path but the fused kernels computes.
    """
    layout = current_layout()
    if m is not None and m.attention_chunk and implementation(m) not in CHUNK_IMPLEMENTATIONS:
        raise refuse_chunk(implementation(m))
    if layout is not None and layout.mesh.shape["sp"] > 1:
        fused = ({"kernel": m.attention_impl} if m is not None
                 and m.attention_impl in ISLAND_KERNELS[layout.context_attention] else {})
        with_sinks = {} if sinks is None else {"sinks": sinks}
        return CONTEXT_ATTENTION[layout.context_attention].attend(q, k, v, positions, segment_ids, layout,
                                                                  masking(m, layer), **fused, **with_sinks)
    impl = implementation(m)
    if layout is not None and impl in PALLAS_KERNELS:  # custom calls the partitioner cannot split
        if sinks is not None:
            raise refuse_sinks(impl)
        return kernel_island.attend(q, k, v, positions, segment_ids, layout, masking(m, layer), impl)
    return attention(q, k, v, positions, positions, segment_ids, segment_ids, masking(m, layer), impl, sinks)


def layer_sinks(p: dict):
    """The layer's attention sinks as attention reads them ([heads] fp32, split over tp as the heads), or None
    (`model.attn_sinks` off: no `sinks` leaf)."""
    return weight(p["sinks"], ("heads",), jnp.float32) if "sinks" in p else None


def _project(p: dict, x, positions, m, dtype, layer=None):
    """Column-parallel Q/K/V (heads split over tp), with their biases, q/k norms and RoPE at `positions` (the
    layer's own frequencies in `layer` when the RoPE differs by layer). Returns (q, k, v, gate): `gate` the output
    gate's logits [batch, seq, heads, head_dim] where the layer has one (`model.attn_output_gate`: `wg`, its bias
    `bg`), from the same column-parallel call as the queries (one gather of x); else None."""
    weights = [(p["wq"], ("embed", "heads", "head_dim")), (p["wk"], ("embed", "kv_heads", "head_dim")),
               (p["wv"], ("embed", "kv_heads", "head_dim"))]
    gate_weight = [(p["wg"], ("embed", "heads", "head_dim"))] if "wg" in p else []
    q, k, v, *gate = column_parallel(x, weights + gate_weight, dtype, "attention")
    gate = add_bias(gate[0], p, "bg", ("heads", "head_dim"), dtype) if gate else None
    q = add_bias(q, p, "bq", ("heads", "head_dim"), dtype)
    k = add_bias(k, p, "bk", ("kv_heads", "head_dim"), dtype)
    v = add_bias(v, p, "bv", ("kv_heads", "head_dim"), dtype)
    if m.qk_norm:  # over head_dim, before RoPE
        q = norm("rmsnorm", p["q_norm"], q, m.norm_eps, m.norm_offset)
        k = norm("rmsnorm", p["k_norm"], k, m.norm_eps, m.norm_offset)
    if m.positions == "rope" and (layer and "rope" in layer or layer_rope(m)[0]):
        q, k = apply_rope(q, positions, m, layer), apply_rope(k, positions, m, layer)
    l2 = _of_layer(m, layer, "l2", layer_l2_norms)
    if l2 is not False:  # Llama 4's weightless norm, after RoPE, on the RoPE layers
        q, k = l2_norm(q, m.norm_eps, l2), l2_norm(k, m.norm_eps, l2)
    temperature = _of_layer(m, layer, "temperature", layer_temperatures)
    if not (isinstance(temperature, (int, float)) and temperature == 0):  # the layers without RoPE
        q = tuned_queries(q, positions, m.attn_temperature_floor, temperature)
    q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "head_dim")), "query")
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "key")
    v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "head_dim")), "value")
    return q, k, v, None if gate is None else constrain(gate, ("batch", "seq", "heads", "head_dim"))


def l2_norm(x, eps: float, on=True):
    """x · rsqrt(mean(x², over head_dim) + eps) in fp32, cast back (transformers' `Llama4TextL2Norm`, no weight);
    `on` a traced bool (the layer's, where it differs by layer): x itself where false."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return normed if on is True else jnp.where(on, normed, x)


def tuned_queries(q, positions, floor: int, scale):
    """Llama 4's attention temperature tuning on the layers without RoPE: q [b, t, h, d] times
    log1p(floor((position + 1) / floor)) · scale + 1 per query, in fp32 and cast back (`scale` traced where it
    differs by layer; 0 there: a factor of exactly 1)."""
    factor = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)) * scale + 1.0
    return (q.astype(jnp.float32) * factor[:, :, None, None]).astype(q.dtype)


def apply_rope(x, positions, m, layer=None):
    """RoPE on the first rope_dim dimensions of x [batch, seq, heads, ≥ rope_dim] at `positions` (the rest pass
    unchanged: `model.rope_fraction`): the model's, or the layer's own frequencies in `layer` when the RoPE differs
    by layer."""
    freqs = layer["rope"] if layer and "rope" in layer else rope_frequencies(m, local_rope(m)[0])
    return rope(x, positions, freqs, rope_scale(m))


def output_gate(out, gate):
    """Qwen3-Next's gated attention: the heads' outputs [batch, seq, heads, head_dim] times σ(gate logits), in the
    compute dtype as transformers' `attn_output * torch.sigmoid(gate)` (applied to the attention core's output, so
    every implementation and context-parallel island runs unchanged)."""
    return out.astype(gate.dtype) * jax.nn.sigmoid(gate)


def project_out(p: dict, out, dtype, gate=None):
    """The row-parallel output projection of the heads' outputs, each first gated by σ(`gate`) where the layer has
    an output gate (`_project`'s logits; None: no gate)."""
    if gate is not None:
        out = output_gate(out, gate)
    out = constrain(out, ("batch", "seq", "heads", "head_dim"))
    out = row_parallel(out, p["wo"], ("heads", "head_dim", "embed"), dtype, "attention")
    return add_bias(out, p, "bo", None, dtype)


def attention_layer(p: dict, x, positions, segment_ids, m, dtype, layer=None):
    """Column-parallel Q/K/V (heads split over tp), attention, row-parallel output. `layer`: this layer's row of
    `layer_data` (its window, its RoPE), where those differ by layer."""
    q, k, v, gate = _project(p, x, positions, m, dtype, layer)
    out = checkpoint_name(attend(q, k, v, positions, segment_ids, m, layer, layer_sinks(p)), "attention")
    return project_out(p, out, dtype, gate)


CACHE = ("layers", "batch", "seq", "kv_heads", "head_dim")  # a KV cache's logical dimensions


class CacheView(NamedTuple):
    """One block kind's KV cache and where a call writes into it (`jaxllm/generate/cache.py` builds it).

    `k`, `v` are [repeats, batch, slots, kv_heads, head_dim], stacked over the repeats of the block
    kind like its weights; `positions` and `segment_ids` [batch, slots] describe every slot, this
    call's tokens included (segment 0: padding or not yet written, so no token attends to it).

    Paged (`pages` given, `jaxllm/generate/engine.py`): `k`, `v` are pools of pages [kv_heads, shards, repeats,
    n_pages, page, head_dim] (heads first, as the paged kernels read them, then one pool per shard of the rows,
    then the repeats, so that a shard's pages of every repeat are one [kv_heads, repeats × n_pages, page,
    head_dim] pool the kernel reads in place; latent attention's [shards, repeats, n_pages, page, r + d_r]) and
    `pages` [batch, pages a row holds] each row's page ids in order in its shard's pool (the rows split into
    `shards` equal runs, run s on pool s: on a mesh the shards are the data-parallel ranks, so each holds its own
    rows' pages), so a row's slot j is page `pages[row, j // page]`, offset `j % page`, and a token at position j
    is written there (`start` unused); a pool's page 0 is scratch, where tokens of segment 0 (padding, idle rows)
    are written. `kernel`: the paged-attention kernel a decode step's full-causal layers attend with
    (`ops/paged_attention.py`; None: the pages gathered, XLA's gather, and `attention`), `interpret` it on CPU
    (tests). `window`: the layer's attention window where it is known when tracing (the layers unrolled; 0: none,
    or not known), so that a paged decode step reads only the pages the window sees (`in_window`)."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array  # which repeat of the block kind
    start: jax.Array  # the slot of the call's first token (the same for every row: prompts are left-padded)
    positions: jax.Array
    segment_ids: jax.Array
    pages: jax.Array | None = None
    kernel: str | None = None
    interpret: bool = False
    window: int = 0


PAGED_CACHE = ("kv_heads", "page_shards", "layers", "pages", "seq", "head_dim")  # a paged pool of keys or values


def stored_names(names: tuple, paged: bool) -> tuple:
    """A cache's logical dimensions as stored: paged, the pools of each shard of the rows, pages in place of the
    batch (keys and values heads first: `PAGED_CACHE`)."""
    if not paged:
        return names
    return PAGED_CACHE if names == CACHE else ("page_shards",) + tuple("pages" if n == "batch" else n for n in names)


def _heads_first(stored) -> bool:
    """A paged pool of keys or values [kv_heads, shards, repeats, n_pages, page, head_dim] (not a latent pool)."""
    return stored.ndim == 6


def _by_shard(x, shards: int):
    """Rows [batch, ...] as [shards, batch / shards, ...]: each shard's run of rows, on its pool."""
    return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def cache_write(stored, new, cache: CacheView, positions, segment_ids):
    """One repeat's slots of `stored` with this call's `new` [batch, t, ...] written: at `cache.start`, or paged,
    each token at its position's page and offset in its row's pool (segment 0 to the scratch page 0)."""
    if cache.pages is None:
        at = (cache.layer, 0, cache.start) + (0,) * (new.ndim - 2)
        return jax.lax.dynamic_update_slice(stored, new[None].astype(stored.dtype), at)
    size = stored.shape[-2]
    page = jnp.where(segment_ids == 0, 0, jnp.take_along_axis(cache.pages, positions // size, axis=1))
    index = jnp.stack([jnp.broadcast_to(cache.layer, page.shape).astype(page.dtype), page, positions % size], -1)
    lead = 2 if _heads_first(stored) else 1  # the pool's dimensions before its repeats: (kv_heads,) shards
    shards = stored.shape[lead - 1]
    index, updates = _by_shard(index, shards), _by_shard(new.astype(stored.dtype), shards)
    if lead == 2:  # [kv_heads, shards, rows, t, d], the heads beside the pool's
        updates = jnp.moveaxis(updates, 3, 0)
        index = jnp.broadcast_to(index[None], (stored.shape[0], *index.shape))
    indexed = tuple(range(lead, lead + 3))  # the pool's repeat, page and offset dimensions
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(index.ndim - 1, updates.ndim)), inserted_window_dims=indexed,
        scatter_dims_to_operand_dims=indexed, operand_batching_dims=tuple(range(lead)),
        scatter_indices_batching_dims=tuple(range(lead)))
    return jax.lax.scatter(stored, index, updates, numbers, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def cache_read(stored, cache: CacheView):
    """One repeat's slots [batch, slots, ...]: as stored, or paged, each row's pages gathered in order; from a pool
    of keys or values heads before slots, [batch, kv_heads, slots, head_dim] (`attention`'s kv_layout "bksd")."""
    if cache.pages is None:
        return stored[cache.layer]
    rows = _gathered_pages(stored, cache.pages, cache.layer)  # [batch, (kv_heads,) pages, page, features]
    return rows.reshape(*rows.shape[:-3], rows.shape[-3] * rows.shape[-2], rows.shape[-1])


def _gathered_pages(pool, pages, layer):
    """[batch, (kv_heads,) pages a row holds, page, ...]: each row's pages of repeat `layer` from its shard's pool,
    in the order the dots read them. The heads and the shards are the gather's batching dimensions, so its output
    needs no transpose (a whole layer's cache otherwise, both ways) and a pool split over tp by heads and over the
    data axes by shards is gathered where it lies."""
    lead = 2 if _heads_first(pool) else 1
    index = _by_shard(pages, pool.shape[lead - 1])  # [shards, rows, width]
    if lead == 2:
        index = jnp.broadcast_to(index[:, :, None], (*index.shape[:2], pool.shape[0], index.shape[2]))
    index = jnp.stack([jnp.broadcast_to(layer, index.shape).astype(index.dtype), index], axis=-1)
    batch = index.ndim - 1
    numbers = jax.lax.GatherDimensionNumbers(
        offset_dims=tuple(range(batch, batch + pool.ndim - lead - 2)), collapsed_slice_dims=(lead, lead + 1),
        start_index_map=(lead, lead + 1), operand_batching_dims=tuple(range(lead)),
        start_indices_batching_dims=(2, 0) if lead == 2 else (0,))
    rows = jax.lax.gather(pool, index, numbers, (1,) * (lead + 2) + pool.shape[lead + 2:],
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return rows.reshape(pages.shape[0], *rows.shape[2:])


def in_window(cache: CacheView, positions) -> CacheView:
    """A paged decode step's view narrowed to the pages a windowed layer sees (`cache.window` known): each row's
    ⌈(window − 1) / page⌉ + 1 pages from the one holding its first visible position (position − window + 1), with
    those slots' positions and segment ids, so the gather reads them and no page wholly behind the window (as
    training's `chunked` attention skips its blocks); past a row's table, segment 0. Any other view as it is."""
    if cache.pages is None or not cache.window or positions.shape[1] != 1:
        return cache
    rows, width, page = *cache.pages.shape, cache.k.shape[-2]
    span = -(-(cache.window - 1) // page) + 1
    if span >= width:
        return cache
    first = jnp.maximum(positions[:, 0] - cache.window + 1, 0) // page
    wanted = first[:, None] + jnp.arange(span, dtype=first.dtype)  # [rows, span]
    held = jnp.minimum(wanted, width - 1)
    slots = (held[:, :, None] * page + jnp.arange(page, dtype=held.dtype)).reshape(rows, span * page)
    seen = jnp.repeat(wanted < width, page, axis=1)
    return cache._replace(pages=jnp.take_along_axis(cache.pages, held, axis=1),
                          positions=jnp.take_along_axis(cache.positions, slots, axis=1),
                          segment_ids=jnp.where(seen, jnp.take_along_axis(cache.segment_ids, slots, axis=1), 0))


def cached_attention_layer(p: dict, x, positions, segment_ids, cache: CacheView, m, dtype, layer=None):
    """`attention_layer` for generation: this call's keys and values are written into the cache
    (`cache_write`), then its queries attend to every slot of the cache (the same mask as training: causal by
    position within a segment, and the model's window). A windowed layer keeps every slot, masked: one cache
    layout for every layer and no positions to remap, at the cost of slots past the window.
    Returns (output, the cache with this layer's slots written)."""
    q, k, v, gate = _project(p, x, positions, m, dtype, layer)
    names = stored_names(CACHE, cache.pages is not None)
    keys = constrain(cache_write(cache.k, k, cache, positions, segment_ids), names)
    values = constrain(cache_write(cache.v, v, cache, positions, segment_ids), names)
    written, sinks = cache._replace(k=keys, v=values), layer_sinks(p)
    if cache.kernel is not None and q.shape[1] == 1:  # a decode step on the paged kernel
        if sinks is not None:
            raise refuse_sinks(f"{cache.kernel} paged")
        if m.attention_chunk:
            raise refuse_chunk(f"{cache.kernel} paged")
        out = _paged_kernel(q, written, positions, masking(m, layer))
    else:
        seen = in_window(written, positions)
        out = attention(q, cache_read(keys, seen), cache_read(values, seen), positions, seen.positions,
                        segment_ids, seen.segment_ids, masking(m, layer), cache_implementation(m, q.shape[1]), sinks,
                        kv_layout="bksd" if cache.pages is not None and _heads_first(keys) else "bskd")
    return project_out(p, out, dtype, gate), written


def _paged_kernel(q, cache: CacheView, positions, masking_: Masking):
    """A decode step's queries [rows, 1, h, d] over their rows' pages of this layer's pools by `cache.kernel`
    (`ops/paged_attention.py`), a row at position p seeing positions 0 .. p; in its island on a mesh."""
    heads, shards, repeats, n_pages = cache.k.shape[:4]
    # a shard's pages of every repeat as one pool, this repeat's at an offset: the pool is read in place, not sliced
    # out (a copy of the whole pool a layer, 4.2 of a 10.6 ms decode step on the H200 at 64 rows of 2,112 positions)
    k, v = (a.reshape(heads, shards, repeats * n_pages, *a.shape[4:]) for a in (cache.k, cache.v))
    pages, lengths = cache.pages + cache.layer * n_pages, positions[:, 0] + 1
    layout = current_layout()
    if layout is None:  # one device: one shard
        return paged_attention.attend(q, k[:, 0], v[:, 0], pages, lengths, masking_, cache.interpret)
    return kernel_island.paged(q, k, v, pages, lengths, layout, masking_, cache.interpret)


def _check_positions(m) -> None:
    """RoPE's keys and the attention window."""
    if m.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"model.rope_scaling: '{m.rope_scaling}' is not one of {', '.join(ROPE_SCALINGS)}")
    if not 0 < m.rope_fraction <= 1:
        raise ConfigError(f"model.rope_fraction={m.rope_fraction}: the part of each head RoPE rotates must be in "
                          "(0, 1]; 1 rotates the whole head")
    if m.positions == "rope" and (rope_dim(m) % 2 or rope_dim(m) < 2):
        raise ConfigError(f"model: RoPE's dimensions ({rope_dim(m)}) must be even and at least 2; change "
                          "model.head_dim (or d_model / n_heads) or model.rope_fraction (model.mla.qk_rope_head_dim "
                          "under MLA)")
    if m.rope_scaling == "llama3" and not (m.rope_factor >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                                           and m.rope_original_context > 0):
        raise ConfigError("model.rope_scaling=llama3 needs rope_factor ≥ 1, 0 < rope_low_freq_factor < "
                          "rope_high_freq_factor and rope_original_context > 0")
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window}: give a window of at least 1 token, or 0 for none")
    for key in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "rope_local_theta"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)}: must be positive, or 0 for none")
    if m.rope_scaling in ("linear", "yarn") and m.rope_factor < 1:
        raise ConfigError(f"model.rope_scaling={m.rope_scaling} needs rope_factor ≥ 1, got {m.rope_factor}")
    if m.rope_scaling == "yarn" and (m.rope_original_context < 1 or not 0 < m.rope_beta_slow < m.rope_beta_fast
                                     or m.rope_local_theta):
        raise ConfigError("model.rope_scaling=yarn needs rope_original_context ≥ 1 and 0 < rope_beta_slow < "
                          "rope_beta_fast, and no rope_local_theta")
    if any(kind not in WINDOW_KINDS for kind in m.window_pattern) or (m.window_pattern and
                                                                       m.n_layers % len(m.window_pattern)):
        raise ConfigError(f"model.window_pattern={m.window_pattern}: entries are local or global, and its length must "
                          f"divide model.n_layers={m.n_layers}")


def _call_shapes(m, chunks: int = 1) -> tuple:
    """The q, k and v shapes of one row's attention call (on one of `chunks` equal chunks of the sequence: the
    ring's pairs), as a fused kernel's `supports` takes them."""
    kv, t = kv_heads(m), m.seq_len // chunks
    return (1, t, m.n_heads, qk_dim(m)), (1, t, kv, qk_dim(m)), (1, t, kv, v_dim(m))


def _check_fused(m, sp: int = 1) -> None:
    """A fused kernel runs on its own backend and must express the run's masks exactly (`supports`, on each sp
    rank's block), or the run is refused: never another implementation in its place."""
    platform, backend = FUSED_PLATFORM[m.attention_impl], jax.default_backend()
    if backend != platform and not (platform == "gpu" and backend in ("cuda", "rocm")):
        raise ConfigError(f"model.attention_impl={m.attention_impl} runs on {platform}, and this run's backend is "
                          f"{backend}; use chunked or dense")
    if windows_differ(m):
        raise ConfigError(f"model.attention_impl={m.attention_impl} takes one window for every layer, and "
                          f"model.window_pattern={m.window_pattern} differs by layer; use chunked")
    if m.attention_impl == "cudnn":
        return  # what cuDNN can express depends on the data and the dtype: `check_run`
    ring = sp > 1 and m.cp_strategy == "ring"  # the ring's pairs: chunks of the sequence; Ulysses: it whole
    chunks = sp * (2 if m.cp_load_balance else 1) if ring else 1
    why = supports(m.attention_impl, masking(m), *_call_shapes(m, chunks), positions_are_index=True)
    if why:
        raise ConfigError(f"model.attention_impl={m.attention_impl}: {why}; use chunked")


def one_segment_rows(cfg) -> bool:
    """Whether every row of the run's batches is one segment at its index: pre-training text with the language-model
    objective (packed fine-tuning rows, preference pairs and GRPO's rollouts are not)."""
    return cfg.train.objective == "lm" and cfg.data.format == "text"


def check_run(cfg, sp: int) -> list[str]:
    """`model.attention_impl = cudnn` against the run: its rows must be one segment at their index (pre-training
    text with the language-model objective) and its compute dtype one cuDNN takes; so must the rows the ring runs
    on a fused kernel (one line, ConfigError). The note: what runs, and for `auto` why (`choose`, on this
    process's backend)."""
    m = cfg.model
    if sp > 1 and m.cp_strategy == "ring" and m.attention_impl in RING_KERNELS and not one_segment_rows(cfg):
        raise ConfigError(f"model.attention_impl={m.attention_impl} with mesh.sp={sp}: the ring's pairs run on it for "
                          "rows of one segment (pre-training text, train.objective=lm); use chunked")
    if m.attention_impl == "cudnn" and sp == 1:
        why = cudnn_attention.supports(masking(m), *_call_shapes(m), cfg.precision.compute, one_segment_rows(cfg))
        if why:
            raise ConfigError(f"model.attention_impl=cudnn: {why}; use chunked")
    if m.attention_impl != "auto":
        return []
    impl, why = choose(cfg, jax.default_backend(), sp)
    return [f"attention: {impl} (model.attention_impl=auto on {jax.default_backend()}: {why})"]


# ---------------------------------------------------------------- `auto`, per target platform

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # a device's platform is "gpu"; an export names "cuda" or "rocm"


def choose(cfg, platform: str, sp: int) -> tuple[str, str]:
    """`auto` for a run compiled for `platform`: (the implementation, why). On GPU cuDNN where it computes the
    run's masks exactly and this process can trace it (a GPU backend: an export for CUDA from a CPU cannot), else
    Pallas's Triton kernel where it does; on TPU Splash where it does; elsewhere, and whenever a fused kernel
    cannot compute every layer's masks, `dense` or `chunked` by length (`_auto`: CPU's choice, so CPU runs are
    unchanged). With sp > 1 the islands run `chunked`, Ulysses Pallas's kernel and the ring Pallas's GPU kernel on
    its pairs where they can (`_island_choice`)."""
    m, plain = cfg.model, _auto(cfg.model)
    gpu, tpu = platform in GPU_PLATFORMS, platform == "tpu"
    if sp > 1:
        return _island_choice(cfg, gpu, tpu, sp)
    if not (gpu or tpu):
        return plain, (f"{platform}'s choice: chunked from {CHUNKED_FROM} tokens or under a window shorter than "
                       "the sequence, else dense")
    if m.attn_sinks:
        return plain, "the fused kernels cannot add attention sinks (model.attn_sinks)"
    if m.attention_chunk:
        return plain, "the fused kernels cannot mask by attention chunks (model.attention_chunk)"
    if windows_differ(m):
        return plain, "the fused kernels take one window for every layer"
    if gpu and jax.default_backend() in GPU_PLATFORMS:
        if not cudnn_attention.supports(masking(m), *_call_shapes(m), cfg.precision.compute, one_segment_rows(cfg)):
            return "cudnn", "cuDNN computes this run's masks exactly"
    fused = "pallas_gpu" if gpu else "pallas_tpu"
    why = supports(fused, masking(m), *_call_shapes(m), positions_are_index=True)
    return (plain, f"{fused}: {why}") if why else (fused, f"{'cuDNN cannot, ' if gpu else ''}{fused} computes this "
                                                          "run's masks exactly")


def _island_choice(cfg, gpu: bool, tpu: bool, sp: int) -> tuple[str, str]:
    """`auto` with the sequence split over sp: Ulysses on Pallas's kernel for its platform (a rank's whole sequence,
    packed rows too), the ring's pairs on pallas_gpu for rows of one segment, where they compute the run's masks
    exactly; else the chunked kernel in each island."""
    m = cfg.model
    plain = "chunked", f"model.cp_strategy={m.cp_strategy} over mesh.sp={sp}: the chunked kernel in each island"
    if not (gpu or tpu) or m.attn_sinks or m.attention_chunk or windows_differ(m):
        return plain
    if m.cp_strategy == "ulysses":
        fused = "pallas_gpu" if gpu else "pallas_tpu"
        why = supports(fused, masking(m), *_call_shapes(m), positions_are_index=True)
        return ("chunked", f"Ulysses on {fused}: {why}") if why else (fused, f"Ulysses on {fused}")
    if not gpu or m.cp_strategy != "ring" or not one_segment_rows(cfg) or v_dim(m) != qk_dim(m) or m.sliding_window:
        return plain
    chunks = sp * (2 if m.cp_load_balance else 1)
    why = supports("pallas_gpu", masking(m), *_call_shapes(m, chunks), positions_are_index=True)
    return ("chunked", f"the ring's pairs on pallas_gpu: {why}") if why else (
        "pallas_gpu", "the ring's pairs on pallas_gpu")


def for_platform(cfg, platform: str, sp: int):
    """`cfg` with `auto` resolved for `platform` (`choose`): what the step's programs are built with. The run's
    config (saved with its checkpoints) keeps `auto`, so a run resumed on another platform chooses again."""
    if cfg.model.attention_impl != "auto":
        return cfg
    impl, _ = choose(cfg, platform, sp)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl))


def _check_island_kernel(m, sp: int) -> None:
    """A fused kernel in a context-parallel island: Ulysses runs it on a rank's whole sequence (what it can
    compute: `_check_fused`); the ring on its causal and full chunk pairs, exactly without a window, with values as
    wide as keys. ConfigError (one line) naming what it cannot compute."""
    key = f"model.attention_impl={m.attention_impl} with mesh.sp={sp}"
    if m.attention_impl not in ISLAND_KERNELS[m.cp_strategy]:
        raise ConfigError(f"{key}: the context-parallel islands run the chunked kernel, the ring (model.cp_strategy="
                          f"ring) {', '.join(RING_KERNELS)} too, Ulysses (model.cp_strategy=ulysses) "
                          f"{', '.join(ulysses_attention.KERNELS)}; set model.attention_impl=auto or chunked")
    if m.cp_strategy != "ring":
        return
    refused = [(m.sliding_window, "a window (model.sliding_window) makes pairs neither diagonal nor full"),
               (v_dim(m) != qk_dim(m), "values narrower than keys (latent attention)")]
    for no, why in refused:
        if no:
            raise ConfigError(f"{key}: {why}; use chunked")


def _check_implementation(m, sp: int) -> list[str]:
    """`model.attention_impl` against the mesh; the implementation that runs, as a note. With sp > 1 the islands run
    the chunked kernel, the ring a fused one where it computes the pairs exactly (`_check_ring_kernel`): another
    explicit choice is refused rather than replaced."""
    if m.attention_impl not in ("auto", *IMPLEMENTATIONS):
        raise ConfigError(f"model.attention_impl: '{m.attention_impl}' is not one of auto, "
                          f"{', '.join(IMPLEMENTATIONS)}")
    if m.attn_sinks and m.attention_impl not in ("auto", *SINK_IMPLEMENTATIONS):
        raise refuse_sinks(m.attention_impl)
    if m.attention_chunk and m.attention_impl not in ("auto", *CHUNK_IMPLEMENTATIONS):
        raise refuse_chunk(m.attention_impl)
    if sp > 1 and m.attention_impl not in ("auto", "chunked"):
        _check_island_kernel(m, sp)
    if m.attention_impl in FUSED_PLATFORM:
        _check_fused(m, sp)
    if m.attention_impl == "auto":
        return []  # `check_run` says what auto chose and why
    if sp > 1:
        kernel = m.attention_impl if m.attention_impl in ISLAND_KERNELS[m.cp_strategy] else "chunked"
        return [f"attention: model.cp_strategy={m.cp_strategy} over mesh.sp={sp} (the {kernel} kernel in each island)"]
    return [f"attention: {m.attention_impl}"]


ATTENTIONS = ("mha", "mla")


def _check_mla(m) -> None:
    """`model.attention` and, for MLA, the `model.mla` sizes and the features it is built without."""
    if m.attention not in ATTENTIONS:
        raise ConfigError(f"model.attention: '{m.attention}' is not one of {', '.join(ATTENTIONS)}")
    if m.attention != "mla":
        return
    a = m.mla
    if min(a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) < 1 or a.q_lora_rank < 0:
        raise ConfigError("model.mla: kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim must be at least "
                          "1, q_lora_rank 0 (no query compression) or more")
    wrong = [f"model.{k}={json.dumps(ok)}" for k, ok in (("positions", "rope"), ("attn_bias", "none"),
                                                          ("qk_norm", False), ("attn_sinks", False),
                                                          ("rope_global", True), ("attn_temperature_floor", 0),
                                                          ("qk_l2_norm", False), ("attn_output_gate", False),
                                                          ("rope_fraction", 1.0))
             if getattr(m, k) != ok]
    if wrong:
        raise ConfigError(f"model.attention=mla is built with RoPE on every layer (over qk_rope_head_dim, whole), no "
                          f"attention biases, no q/k norms, no attention sinks, no temperature tuning and no output "
                          f"gate; set {', '.join(wrong)}")


def check_config(m, shape: dict) -> list[str]:
    """The attention keys against the mesh: ConfigError (one line) for what cannot run; notes to log."""
    _check_mla(m)
    _check_positions(m)
    sp, tp = shape["sp"], shape["tp"]
    notes = _check_implementation(m, sp)
    if m.cp_strategy not in CONTEXT_ATTENTION:
        raise ConfigError(f"model.cp_strategy: '{m.cp_strategy}' is not one of {', '.join(CONTEXT_ATTENTION)}")
    if m.seq_len % sp:
        raise ConfigError(f"model.seq_len={m.seq_len} is not divisible by mesh.sp={sp}; change one of them")
    if sp > 1 and m.cp_load_balance and m.seq_len % (2 * sp):
        raise ConfigError(f"model.cp_load_balance: model.seq_len={m.seq_len} must divide into 2×mesh.sp={2 * sp} "
                          "chunks; change seq_len or set model.cp_load_balance=false")
    if sp > 1 and m.cp_strategy == "ulysses":
        if m.n_heads % (sp * tp):
            raise ConfigError(f"model.cp_strategy=ulysses needs model.n_heads={m.n_heads} divisible by "
                              f"mesh.sp×mesh.tp={sp * tp}; use ring or allgather, or change sp/tp")
        kv_local = max(kv_heads(m), tp) // tp
        if kv_local % sp and sp % kv_local:
            raise ConfigError(f"model.cp_strategy=ulysses: {kv_local} KV head(s) per tp rank and mesh.sp={sp}: one "
                              "must divide the other; use ring or allgather, or change sp")
    return notes
