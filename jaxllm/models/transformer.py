"""Decoder-only transformer as three pure pieces, its shape and parts described by features
(`model.norm`, `model.mlp`, `model.positions`, biases, tied embeddings, head_dim, RoPE scaling, q/k norms,
norm placement and offset, the embedding scale, soft caps, per-layer windows and RoPE, latent attention) rather
than by a family name: GPT-2, LLaMA 2/3, Mistral, Qwen2/3, Mixtral, Qwen MoE, Gemma 2/3 and DeepSeek-V3 are settings
of them (`models/mla.py` holds latent attention, `models/mtp.py` the multi-token prediction modules).

- `embed(params, tokens, positions)` -> residual stream [batch, seq, embed]
- `blocks(stack, x, positions, segment_ids)` over a slice of the layer stack
- `head_terms(params, x, batch, terms)` -> an objective's (sum, metric sums) from each
  target's log-probability (`head_logp`)

and for generation `cached_blocks`, the whole stack writing into and reading from a KV cache
(`jaxllm/generate`), with `compute_weights` the parameters as the forward pass reads them.

The pipeline places these on stages, context parallelism feeds reordered positions,
SFT feeds a loss mask, packing feeds segment ids (all as batch fields, `jaxllm/batch.py`). Parameters are a plain dict tree;
`param_table` gives every leaf's shape, logical dimension names and initialiser, so
sharding, weight decay and Muon's matrix dimensions all read the same table.

The layer stack is a list of segments (`jaxllm/stack.py`), each a pattern of block kinds repeated:
`params["blocks"]` holds every segment's kinds in turn, each kind's weights stacked over its
segment's repeats, and `blocks` scans each segment's repeats in turn.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm import stack as stack_lib
from jaxllm.errors import ConfigError
from jaxllm.models import attention, chunked_loss, gated_deltanet, lora, mla
from jaxllm.models import moe as moe_lib
from jaxllm.models.attention import CacheView, head_dim, kv_heads
from jaxllm.models.layers import MLPS, NORMS, feed_forward, norm
from jaxllm.ops import fp8
from jaxllm.parallel import pipeline_schedules
from jaxllm.schema import ModelConfig
from jaxllm.sharding import constrain, weight


ACT = ("batch", "residual_seq", "embed")  # the residual stream
POSITIONS = ("learned", "rope")
NORM_PLACEMENTS = ("pre", "sandwich")
ATTN_BIASES = {"none": "", "qkv": "qkv", "qkvo": "qkvo"}  # which projections have a bias


def padded_vocab(m: ModelConfig) -> int:
    """Vocabulary rounded up to a multiple of 128 (lane-friendly, and divisible by any tp up to 128)."""
    return -(-m.vocab_size // 128) * 128


@dataclass(frozen=True)
class Leaf:
    """One parameter: its shape, logical names and how it starts."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    # normal | normal_out (scaled residual output) | zeros | ones | norm_scale (1 − model.norm_offset) | a_log
    # (Gated DeltaNet's) | lora_a | lora_site
    init: str


def _norm(m: ModelConfig, lead=(), lead_names=()) -> dict:
    d = {"scale": Leaf(lead + (m.d_model,), lead_names + ("embed",), "norm_scale")}
    if m.norm == "layernorm":
        d["bias"] = Leaf(lead + (m.d_model,), lead_names + ("embed",), "zeros")
    return d


def _mla(m: ModelConfig, R: tuple, L: tuple) -> dict:
    """Latent attention's weights (`models/mla.py`): the queries' (compressed or not), the latent's down-projection
    [c | RoPE key] with its norm, the latent's up-projection to every head's [k_nope | v], the output."""
    D, H, a = m.d_model, m.n_heads, m.mla
    dqk = a.qk_nope_head_dim + a.qk_rope_head_dim
    attn = {"wkv_a": Leaf(R + (D, a.kv_lora_rank + a.qk_rope_head_dim), L + ("embed", "kv_lora"), "normal"),
            "kv_a_norm": {"scale": Leaf(R + (a.kv_lora_rank,), L + ("kv_lora",), "norm_scale")},
            "wkv_b": Leaf(R + (a.kv_lora_rank, H, a.qk_nope_head_dim + a.v_head_dim),
                          L + ("kv_lora", "heads", "head_dim"), "normal"),
            "wo": Leaf(R + (H, a.v_head_dim, D), L + ("heads", "head_dim", "embed"), "normal_out")}
    if not a.q_lora_rank:
        return {"wq": Leaf(R + (D, H, dqk), L + ("embed", "heads", "head_dim"), "normal"), **attn}
    return {"wq_a": Leaf(R + (D, a.q_lora_rank), L + ("embed", "q_lora"), "normal"),
            "q_a_norm": {"scale": Leaf(R + (a.q_lora_rank,), L + ("q_lora",), "norm_scale")},
            "wq_b": Leaf(R + (a.q_lora_rank, H, dqk), L + ("q_lora", "heads", "head_dim"), "normal"), **attn}


def _attention(m: ModelConfig, R: tuple, L: tuple) -> dict:
    if m.attention == "mla":
        return _mla(m, R, L)
    D, H, KV, Dh = m.d_model, m.n_heads, kv_heads(m), head_dim(m)
    attn = {
        "wq": Leaf(R + (D, H, Dh), L + ("embed", "heads", "head_dim"), "normal"),
        "wk": Leaf(R + (D, KV, Dh), L + ("embed", "kv_heads", "head_dim"), "normal"),
        "wv": Leaf(R + (D, KV, Dh), L + ("embed", "kv_heads", "head_dim"), "normal"),
        "wo": Leaf(R + (H, Dh, D), L + ("heads", "head_dim", "embed"), "normal_out"),
    }
    biases = {"q": Leaf(R + (H, Dh), L + ("heads", "head_dim"), "zeros"),
              "k": Leaf(R + (KV, Dh), L + ("kv_heads", "head_dim"), "zeros"),
              "v": Leaf(R + (KV, Dh), L + ("kv_heads", "head_dim"), "zeros"),
              "o": Leaf(R + (D,), L + ("embed",), "zeros")}
    attn.update({f"b{x}": biases[x] for x in ATTN_BIASES[m.attn_bias]})
    if m.attn_output_gate:  # Qwen3-Next's output gate, split over tp as the queries (with their bias, if any)
        attn["wg"] = Leaf(R + (D, H, Dh), L + ("embed", "heads", "head_dim"), "normal")
        if "bq" in attn:
            attn["bg"] = biases["q"]
    if m.qk_norm:  # RMSNorm over head_dim, one scale shared by the heads
        scale = Leaf(R + (Dh,), L + ("head_dim",), "norm_scale")
        attn.update(q_norm={"scale": scale}, k_norm={"scale": scale})
    if m.attn_sinks:  # gpt-oss's attention sinks: one logit per query head (`ops/attention.py`), read in fp32
        attn["sinks"] = Leaf(R + (H,), L + ("heads",), "zeros")
    return attn


def _mlp(m: ModelConfig, R: tuple, L: tuple, width: int = 0) -> dict:
    D, F = m.d_model, width or m.d_ff
    into, out = Leaf(R + (D, F), L + ("embed", "mlp"), "normal"), Leaf(R + (F, D), L + ("mlp", "embed"), "normal_out")
    b_into, b_out = Leaf(R + (F,), L + ("mlp",), "zeros"), Leaf(R + (D,), L + ("embed",), "zeros")
    if m.mlp == "gelu_tanh":
        mlp = {"w_in": into, "b_in": b_into, "w_out": out, "b_out": b_out}
    else:
        mlp = {"w_gate": into, "b_gate": b_into, "w_up": into, "b_up": b_into, "w_down": out, "b_down": b_out}
    return {k: v for k, v in mlp.items() if m.mlp_bias or not k.startswith("b_")}


def _dense_block(m: ModelConfig, repeats: int) -> dict:
    R, L = (repeats,), ("layers",)
    block = {"ln1": _norm(m, R, L), "attn": _attention(m, R, L), "ln2": _norm(m, R, L), "mlp": _mlp(m, R, L)}
    if m.norm_placement == "sandwich":  # a norm of each half's output, before the residual add
        block.update(post_attn_norm=_norm(m, R, L), post_mlp_norm=_norm(m, R, L))
    return block


def shared_d_ff(m: ModelConfig) -> int:
    """The hidden size of the MoE blocks' shared feed-forward (0: none)."""
    return m.moe.shared_d_ff or m.moe.n_shared_experts * m.d_ff if m.moe.n_shared_experts else 0


def _moe_block(m: ModelConfig, repeats: int) -> dict:
    """Attention as in a dense block; the feed-forward is a router and `n_experts` experts stacked on
    an `experts` dimension (and optionally shared experts as one dense feed-forward, maybe gated)."""
    block = _dense_block(m, repeats)
    R, L = (repeats,), ("layers",)
    D, E, F = m.d_model, m.moe.n_experts, m.moe.d_ff or m.d_ff
    names = ("w_in", "w_out") if m.mlp == "gelu_tanh" else ("w_gate", "w_up", "w_down")
    experts = {n: Leaf(R + (E, F, D) if n in ("w_out", "w_down") else R + (E, D, F),
                       L + (("experts", "mlp", "embed") if n in ("w_out", "w_down") else ("experts", "embed", "mlp")),
                       "normal_out" if n in ("w_out", "w_down") else "normal") for n in names}
    moe = {"router": Leaf(R + (D, E), L + ("embed", "router"), "normal"), "experts": experts}
    if shared_d_ff(m):
        moe["shared"] = _mlp(m, R, L, shared_d_ff(m))
    if m.moe.shared_gate:
        moe["shared_gate"] = Leaf(R + (D, 1), L + ("embed", "gate"), "normal")
    if moe_lib.has_router_bias(m):  # moved by `trainer/bias_balance.py` only, or fixed
        moe["router_bias"] = Leaf(R + (E,), L + ("router",), "zeros")
    if m.moe.router_logit_bias:
        moe["router_logit_bias"] = Leaf(R + (E,), L + ("router",), "zeros")
    if m.moe.expert_biases:  # b_gate, b_up [E, F] (b_in), b_down [E, D] (b_out)
        experts.update({"b" + n[1:]: Leaf(R + (E, D) if n in ("w_out", "w_down") else R + (E, F),
                                          L + ("experts", "embed" if n in ("w_out", "w_down") else "mlp"), "zeros")
                        for n in names})
    return {**{k: v for k, v in block.items() if k != "mlp"}, "moe": moe}


def _linear_attention(m: ModelConfig, R: tuple, L: tuple) -> dict:
    """Gated DeltaNet's weights (`models/gated_deltanet.py`), grouped by key head: A_log as transformers draws
    it (log of U(1, 16)), dt_bias and the gated norm's weight at 1 (it is not zero-centred)."""
    inits = {"A_log": "a_log", "dt_bias": "ones", "norm": "ones", "out_proj": "normal_out"}
    return {name: Leaf(R + shape, L + names, inits.get(name, "normal"))
            for name, (shape, names) in gated_deltanet.param_shapes(gated_deltanet.sizes_of(m), m.d_model).items()}


def _linear(block_of):
    """The block kind with Gated DeltaNet (`linear_attn`) in place of attention."""
    def block(m: ModelConfig, repeats: int) -> dict:
        mixer = _linear_attention(m, (repeats,), ("layers",))
        return {("linear_attn" if k == "attn" else k): (mixer if k == "attn" else v)
                for k, v in block_of(m, repeats).items()}
    return block


BLOCK_KINDS = {"dense": _dense_block, "moe": _moe_block, "linear": _linear(_dense_block),
               "linear_moe": _linear(_moe_block)}


def _mtp(m: ModelConfig) -> dict:
    """Multi-token prediction's modules (`models/mtp.py`), stacked over `model.mtp_depth` (logical "depth": never
    split over pp): norms of the embedding and of the previous hidden state, the projection of the two joined, a
    block of the stack's last kind and a final norm."""
    D, R, L = m.mtp_depth, (m.mtp_depth,), ("depth",)
    block = jax.tree.map(lambda leaf: Leaf(leaf.shape, L + leaf.names[1:], leaf.init),
                         BLOCK_KINDS[stack_lib.kinds(m)[-1]](m, D), is_leaf=_is_leaf)
    return {"enorm": _norm(m, R, L), "hnorm": _norm(m, R, L),
            "eh_proj": Leaf(R + (2 * m.d_model, m.d_model), L + ("mtp_in", "embed"), "normal"), "block": block,
            "final_norm": _norm(m, R, L)}


def param_table(m: ModelConfig) -> dict:
    """The tree of `Leaf`s describing every parameter."""
    V, D = padded_vocab(m), m.d_model
    table = {
        "embed": {"tok": Leaf((V, D), ("vocab", "embed"), "normal")},
        "blocks": [lora.adapt_block(BLOCK_KINDS[kind](m, seg.repeats), m, Leaf)
                   for seg in stack_lib.segments(m) for kind in seg.pattern],
        "final_norm": _norm(m),
    }
    if m.positions == "learned":
        table["embed"]["pos"] = Leaf((max_positions(m), D), ("pos", "embed"), "normal")
    if not m.tie_embeddings:
        table["head"] = {"w": Leaf((D, V), ("embed", "vocab"), "normal")}
    if m.mtp_depth:
        table["mtp"] = _mtp(m)
    return table


def max_positions(m: ModelConfig) -> int:
    """The longest sequence the model is for (`model.max_positions`, 0 meaning seq_len)."""
    return m.max_positions or m.seq_len


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def fan_in(leaf: Leaf) -> int:
    """An adapter A's input size: its dimensions but the stacking ones and the rank."""
    return math.prod(n for n, name in zip(leaf.shape, leaf.names) if name not in lora.LEAD + (lora.RANK,))


def param_names(m: ModelConfig):
    return jax.tree.map(lambda l: l.names, param_table(m), is_leaf=_is_leaf)


def param_shapes(m: ModelConfig):
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, jnp.float32), param_table(m), is_leaf=_is_leaf)


def count_params(m: ModelConfig, embeddings: bool = True, active: bool = False) -> int:
    """Parameter count; without embeddings drops the token/position tables and the output head (tied or
    not: FLOPs count the head's matmul once, as d_model·vocab); `active` counts only the top_k of n_experts
    experts a token goes through (for FLOPs)."""
    table = param_table(m)
    total = sum(math.prod(l.shape) for l in jax.tree.leaves(table, is_leaf=_is_leaf))
    if not embeddings:
        outside = {k: table[k] for k in ("embed", "head") if k in table}
        total -= sum(math.prod(l.shape) for l in jax.tree.leaves(outside, is_leaf=_is_leaf))
    if active:
        blocks = table["blocks"] + ([table["mtp"]["block"]] if "mtp" in table else [])
        experts = [l for block in blocks if "moe" in block
                   for l in jax.tree.leaves(block["moe"]["experts"], is_leaf=_is_leaf)]
        total -= round(sum(math.prod(l.shape) for l in experts) * (1 - m.moe.top_k / m.moe.n_experts))
    return total


def published_params(m: ModelConfig) -> int:
    """The parameter count as the model's published files hold it (transformers' count): without the rows the
    vocabulary is padded with (the embedding's, and the head's where it is untied)."""
    padding = (padded_vocab(m) - m.vocab_size) * m.d_model
    return count_params(m) - padding * (1 if m.tie_embeddings else 2)


def layer_costs(m: ModelConfig) -> pipeline_schedules.Costs:
    """What a layer's forward, recomputation, input gradient and weight gradients cost, from its flops per token
    (the zero-bubble tables are built for these): its matmuls (2 per weight), attention's scores and values
    over the whole sequence (4 · seq_len · width, as XLA computes them), and the MLP's last matmul, which a
    middle stage's R does not run."""
    matmul = 2 * count_params(m, embeddings=False, active=True) / m.n_layers
    return pipeline_schedules.layer_costs(matmul, 4 * m.seq_len * attention.score_width(m), 2 * m.d_model * m.d_ff)


def _init_leaf(m: ModelConfig, key: jax.Array, leaf: Leaf):
    if leaf.init == "zeros":
        return jnp.zeros(leaf.shape, jnp.float32)
    if leaf.init == "norm_scale":
        return jnp.full(leaf.shape, 1.0 - m.norm_offset, jnp.float32)
    if leaf.init == "ones":
        return jnp.ones(leaf.shape, jnp.float32)
    if leaf.init == "a_log":  # Gated DeltaNet's decay rates, as transformers draws them
        return jnp.log(jax.random.uniform(key, leaf.shape, jnp.float32, 1.0, 16.0))
    if leaf.init == "lora_a":  # PEFT's default: Kaiming-uniform with a = √5, i.e. uniform in ±1/√fan_in
        bound = fan_in(leaf) ** -0.5
        return jax.random.uniform(key, leaf.shape, jnp.float32, -bound, bound)
    if leaf.init == "lora_site":  # a weight's dropout stream, one per layer (`models/lora.py`)
        return jax.random.bits(key, leaf.shape, jnp.uint32)
    std = m.init_std / (2 * m.n_layers) ** 0.5 if leaf.init == "normal_out" else m.init_std
    return std * jax.random.normal(key, leaf.shape, jnp.float32)  # GPT-2: residual outputs scaled by 1/sqrt(2L)


def with_adapters(base, m: ModelConfig, key: jax.Array):
    """The base's parameters with fresh adapters (`model.lora`), drawn from a stream of `key` of their own."""
    adapters = jax.random.fold_in(key, lora.ADAPTER_STREAM)
    return lora.attach(base, param_table(m), lambda i, leaf: _init_leaf(m, jax.random.fold_in(adapters, i), leaf),
                       _is_leaf)


def init_params(m: ModelConfig, key: jax.Array):
    """Fresh fp32 parameters. Each leaf draws from its own key (folded from its index), so with
    partitionable threefry the values do not depend on how the result is sharded. Under LoRA the base
    draws what it draws without adapters, and each adapter from a key of its own."""
    if m.lora.rank:
        return with_adapters(init_params(lora.base_model(m), key), m, key)
    leaves, treedef = jax.tree.flatten(param_table(m), is_leaf=_is_leaf)
    return jax.tree.unflatten(treedef, [_init_leaf(m, jax.random.fold_in(key, i), l) for i, l in enumerate(leaves)])


# ---------------------------------------------------------------- the three seams


@jax.named_scope("embed")  # the model's parts are named scopes: profiler traces show them on each op
def embed(params: dict, tokens: jax.Array, positions: jax.Array, m: ModelConfig, dtype) -> jax.Array:
    table = weight(params["embed"]["tok"], ("vocab", "embed"), dtype)
    x = jnp.take(table, tokens, axis=0)
    if m.embed_scale:  # √d_model rounded to the compute dtype first, as transformers does
        x = x * jnp.asarray(m.d_model ** 0.5, x.dtype)
    if m.positions == "learned":
        x = x + jnp.take(weight(params["embed"]["pos"], ("pos", "embed"), dtype), positions, axis=0)
    # The vocabulary is split over tp: each rank looks up its own rows and the lookup is summed
    # over tp at full sequence length, then enters the residual stream (under sequence
    # parallelism: split along the sequence, an all-reduce + slice, i.e. a reduce-scatter).
    # Constraining straight to the residual layout lets the partitioner gather the table instead.
    return constrain(constrain(x, ("batch", "seq", "embed")), ACT)


def norm_of(m: ModelConfig, p: dict, x):
    return norm(m.norm, p, x, m.norm_eps, m.norm_offset)


def _residual(m: ModelConfig, p: dict, x, y, post: str):
    """x + y, y normed first (`post`) under `model.norm_placement = "sandwich"`."""
    return constrain(x + (norm_of(m, p[post], y) if post in p else y), ACT)


def _mixer(p: dict, h, positions, segment_ids, m: ModelConfig, dtype, cache=None, layer=None):
    """The block's token mixer on the normed stream h: attention (`attn`; latent under `model.attention = "mla"`)
    or Gated DeltaNet (`linear_attn`); (its output, the cache or state with this layer written)."""
    if "linear_attn" in p:
        with jax.named_scope("linear_attention"):
            w = gated_deltanet.used_weights(p["linear_attn"], dtype)
            sizes, chunk = gated_deltanet.sizes_of(m), m.linear_attn.chunk
            if cache is None:
                return gated_deltanet.gated_deltanet(w, h, sizes, chunk, segment_ids), None
            return gated_deltanet.cached_gated_deltanet(w, h, sizes, cache.state, cache.resets, chunk)
    kind = mla if m.attention == "mla" else attention
    with jax.named_scope("attention"):
        if cache is None:
            return kind.attention_layer(p["attn"], h, positions, segment_ids, m, dtype, layer), None
        return kind.cached_attention_layer(p["attn"], h, positions, segment_ids, cache, m, dtype, layer)


def _attention_half(p: dict, x, positions, segment_ids, m: ModelConfig, dtype, cache=None, layer=None):
    """The first half of every block: (residual stream after the token mixer, its normed copy for the
    feed-forward, the KV cache (or linear state) with this layer written when generating with one). `layer`:
    the layer's row of `attention.layer_data` (its window, its RoPE), where those differ by layer."""
    h = norm_of(m, p["ln1"], x)
    y, cache = _mixer(p, h, positions, segment_ids, m, dtype, cache, layer)
    x = _residual(m, p, x, y, "post_attn_norm")
    return x, norm_of(m, p["ln2"], x), cache


def _dense_apply(p: dict, x, positions, segment_ids, m: ModelConfig, dtype, cache=None, layer=None):
    x, h, cache = _attention_half(p, x, positions, segment_ids, m, dtype, cache, layer)
    with jax.named_scope("mlp"):
        y = feed_forward(m)(p["mlp"], h, dtype)
    return _residual(m, p, x, y, "post_mlp_norm"), {}, cache


def _moe_apply(p: dict, x, positions, segment_ids, m: ModelConfig, dtype, cache=None, layer=None):
    x, h, cache = _attention_half(p, x, positions, segment_ids, m, dtype, cache, layer)
    with jax.named_scope("moe"):
        y, stats = moe_lib.moe_ffn(p["moe"], h, m, dtype)
        if "shared" in p["moe"]:
            shared = feed_forward(m)(p["moe"]["shared"], h, dtype)
            if "shared_gate" in p["moe"]:
                w = weight(p["moe"]["shared_gate"], ("embed", "gate"), dtype)
                shared = shared * jax.nn.sigmoid(jnp.einsum("bsd,dg->bsg", h, w))
            y = y + shared
    return _residual(m, p, x, y, "post_mlp_norm"), stats, cache


BLOCK_APPLY = {"dense": _dense_apply, "moe": _moe_apply, "linear": _dense_apply, "linear_moe": _moe_apply}

SAVED_NAMES = ("query", "key", "value", "attention", "mlp_hidden")  # the activations save-named keeps
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls against weights are saved; attention scores and elementwise work are recomputed.
    "save-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Megatron's selective recomputation (keep the linear layers' outputs, recompute the attention core)
    # is exactly save-dots: the attention core's matmuls have batch dimensions, the weights' do not.
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save-named": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
    # save-dots and save-named, with what they save moved to host memory until the backward pass needs it.
    "offload-dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "offload-named": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=SAVED_NAMES, offload_src="device",
        offload_dst="pinned_host"),
}


def remat_group(m: ModelConfig, repeats: int) -> int:
    """`model.remat_group` for a slice of `repeats` pattern repeats: 0 (no groups), or the repeats per
    group, -1 resolved to the divisor of `repeats` nearest its square root (the smaller on a tie)."""
    if m.remat_group >= 0:
        return m.remat_group
    return min((d for d in range(1, repeats + 1) if repeats % d == 0), key=lambda d: (abs(d - math.sqrt(repeats)), d))


def _grouped_scan(body, carry, stack: list, group: int):
    """scan `body` over the stack in groups of `group` repeats: an outer scan over the groups, each one
    recomputed in the backward pass (only the groups' inputs are kept: O(√L) for √L-sized groups), and an
    inner scan over the group's repeats, which keeps what `body`'s own remat policy keeps."""
    grouped = jax.tree.map(lambda a: a.reshape(a.shape[0] // group, group, *a.shape[1:]), stack)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # saves nothing inside: the group's input is kept
    def one_group(carry, layers):
        return jax.lax.scan(body, carry, layers)[0], None

    return jax.lax.scan(one_group, carry, grouped)[0]


def scanned_layer_data(m: ModelConfig, seg: stack_lib.Segment, repeats: int, first=0):
    """`attention.layer_data` of segment `seg` as [repeats, len(pattern), ...] rows for its repeats first ..
    first + repeats − 1, scanned with the layers (`first` may be traced: a pipeline stage's chunk); None when no
    layer differs."""
    data = attention.layer_data(m)
    if data is None:
        return None
    layers = slice(seg.first_layer, seg.first_layer + seg.repeats * len(seg.pattern))
    rows = lambda a: jax.lax.dynamic_slice_in_dim(a[layers].reshape(-1, len(seg.pattern), *a.shape[1:]), first, repeats)
    return {k: rows(a) for k, a in data.items()}


def _apply_repeat(pattern, layer, data, x, total, positions, segment_ids, m: ModelConfig, dtype, caches=None):
    """One repeat of a block pattern: (x, `total` plus the router statistics, the caches written)."""
    written = []
    for i, (kind, p) in enumerate(zip(pattern, layer)):
        own = None if data is None else {k: a[i] for k, a in data.items()}
        cache = None if caches is None else caches[i]
        x, stats, cache = BLOCK_APPLY[kind](p, x, positions, segment_ids, m, dtype, cache, own)
        total = jax.tree.map(jnp.add, total, stats) if stats else total
        written.append(cache)
    return x, total, written


def _segment(seg: stack_lib.Segment, layers: list, x, total, positions, segment_ids, m: ModelConfig, dtype, first):
    """Scan one segment's repeats (or a pipeline chunk of them, from repeat `first`): (x, total)."""

    def body(carry, xs):
        x, total = carry
        layer, data = xs
        x, total, _ = _apply_repeat(seg.pattern, layer, data, x, total, positions, segment_ids, m, dtype)
        return (x, total), None

    if m.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[m.remat], prevent_cse=False)
    repeats = jax.tree.leaves(layers)[0].shape[0]
    xs = (layers, scanned_layer_data(m, seg, repeats, first))
    group = remat_group(m, repeats)
    if group:
        return _grouped_scan(body, (x, total), xs, group)
    return jax.lax.scan(body, (x, total), xs)[0]


def blocks(stack: list, x: jax.Array, positions, segment_ids, m: ModelConfig, dtype, first=0, segments=None):
    """Run the layer stack, its segments in turn, each a scan over repeats of its block pattern (with each
    layer's window and RoPE where they differ). `segments`: the stack's segments `stack` holds the blocks of,
    in turn (default: all); a pipeline stage passes a chunk of the last segment and `first`, the chunk's first
    repeat in that segment.

    Returns (x, stats): the MoE layers' router statistics summed over the layers run (see
    `models/moe.py`; empty for a dense model)."""
    segments = stack_lib.segments(m) if segments is None else segments
    total, offset = zero_aux(m), segments[0].first_block
    for seg in segments:
        layers = stack[seg.first_block - offset:seg.first_block - offset + len(seg.pattern)]
        x, total = _segment(seg, layers, x, total, positions, segment_ids, m, dtype, first)
    return x, total


def _cache_view(kv: dict, slots: CacheView, r, resets, window: int = 0):
    """What one block's cached step reads from its cache entry: a linear block's state and resets, or the KV
    cache's view (MLA's: no "v") at repeat r, with the layer's window where known (`CacheView.window`)."""
    if "state" in kv:
        return gated_deltanet.LinearView(gated_deltanet.LinearState(kv["conv"][r], kv["state"][r]), resets)
    return slots._replace(k=kv["k"], v=kv.get("v"), layer=r, window=window)


def _cache_entry(kv: dict, written, r) -> dict:
    """A block's cache entry with what its cached step wrote (a linear block's state at repeat r)."""
    if isinstance(written, gated_deltanet.LinearState):
        return {"conv": kv["conv"].at[r].set(written.conv), "state": kv["state"].at[r].set(written.state)}
    return {"k": written.k, "v": written.v} if written.v is not None else {"k": written.k}


def cache_resets(segment_ids, slots: CacheView):
    """[b, t] where the tokens written at `slots.start` begin a document: their segment id differs from the
    previous token's (the slot before the first, or none at slot 0): a linear layer's state and window restart
    there (a prompt's first token after left padding)."""
    before = jax.lax.dynamic_slice_in_dim(slots.segment_ids, jnp.maximum(slots.start - 1, 0), 1, axis=1)
    before = jnp.where(slots.start > 0, before, -1)
    return segment_ids != jnp.concatenate([before, segment_ids[:, :-1]], axis=1)


def cached_blocks(stack: list, cache: list, x: jax.Array, positions, segment_ids, slots: CacheView,
                  m: ModelConfig, dtype):
    """`blocks` over the whole stack for generation: each layer writes its keys and values into the
    KV cache (`cache[i]` the i-th block's {"k", "v"}, stacked over its segment's repeats) at `slots.start`
    and attends to every slot `slots` describes; a linear block carries its state instead (`cache[i]` its
    {"conv", "state"}: `generate/cache.py`). Returns (x, the cache with x's slots written)."""
    written, windows = [], attention.layer_windows(m)
    resets = cache_resets(segment_ids, slots) if stack_lib.has_linear(m) else None  # only linear layers read them
    for seg in stack_lib.segments(m):

        def body(carry, xs, seg=seg):
            x, cache = carry
            layer, r, data = xs
            first = seg.first_layer + r * len(seg.pattern) if isinstance(r, int) else None  # unrolled: known
            views = [_cache_view(kv, slots, r, resets, 0 if first is None else windows[first + i])
                     for i, kv in enumerate(cache)]
            x, _, views = _apply_repeat(seg.pattern, layer, data, x, zero_aux(m), positions, segment_ids, m, dtype,
                                        views)
            return (x, [_cache_entry(kv, view, r) for kv, view in zip(cache, views)]), None

        layers, data = stack[seg.blocks], scanned_layer_data(m, seg, seg.repeats)
        if is_per_repeat(stack):  # each repeat's own arrays, read as they are: the layers unrolled, nothing sliced
            carry = (x, cache[seg.blocks])
            for r in range(seg.repeats):
                carry, _ = body(carry, ([blk[r] for blk in layers], r, jax.tree.map(lambda a, r=r: a[r], data)))
            x, seg_cache = carry
        else:
            (x, seg_cache), _ = jax.lax.scan(body, (x, cache[seg.blocks]), (layers, jnp.arange(seg.repeats), data))
        written += seg_cache
    return x, written


def per_repeat(params: dict) -> dict:
    """`params` with each block kind's weights split into its repeats' own arrays (a tuple over the repeats), as
    the rollout engine holds them: a layer scan's slice of a stacked weight is a copy of it (every layer's weights
    copied at every decode step), where `cached_blocks` reads a repeat's own arrays in place."""
    split = lambda blk: tuple(jax.tree.map(lambda a, r=r: a[r], blk)
                              for r in range(jax.tree.leaves(blk)[0].shape[0]))
    return {**params, "blocks": [split(blk) for blk in params["blocks"]]}


def is_per_repeat(stack: list) -> bool:
    """Whether the blocks are `per_repeat`'s (a tuple of each repeat's weights per block kind)."""
    return isinstance(stack[0], tuple)


def _head_weight(params: dict, m: ModelConfig, dtype) -> tuple[jax.Array, str]:
    """(the head's weight as its matmul uses it: cast and laid out, the matmul's einsum spec)."""
    if m.tie_embeddings:
        return weight(params["embed"]["tok"], ("vocab", "embed"), dtype), "bsd,vd->bsv"
    return weight(params["head"]["w"], ("embed", "vocab"), dtype), "bsd,dv->bsv"


def _finish_logits(logits: jax.Array, m: ModelConfig) -> jax.Array:
    """The head matmul's fp32 output laid out (split over tp), soft-capped where the model caps, and its
    padding columns pushed to -1e30."""
    logits = constrain(logits, ("batch", "seq", "vocab"))
    if m.final_softcap:  # Gemma 2's, before the padding
        logits = m.final_softcap * jnp.tanh(logits / m.final_softcap)
    # An additive constant rather than a select: its gradient is the identity, so the backward
    # pass makes no second pass over [tokens, vocab] (BENCHMARKS.md measured the difference).
    padding = jnp.where(jnp.arange(logits.shape[-1]) < m.vocab_size, 0.0, -1e30).astype(jnp.float32)
    return logits + padding


@jax.named_scope("head")
def _logits(params: dict, x: jax.Array, m: ModelConfig, dtype) -> jax.Array:
    """fp32 logits over the padded vocabulary (split over tp) for normed x; padding columns are pushed to -1e30."""
    w, spec = _head_weight(params, m, dtype)
    return _finish_logits(fp8.einsum("head", spec, x, w, jnp.float32), m)


def head_logits(params: dict, x: jax.Array, m: ModelConfig, dtype) -> jax.Array:
    """fp32 logits over the padded vocabulary for the residual stream x."""
    return _logits(params, norm_of(m, params["final_norm"], x), m, dtype)


def head_logits_at(params: dict, x: jax.Array, at: jax.Array, m: ModelConfig, dtype) -> jax.Array:
    """fp32 logits [rows, padded vocabulary] of one position a row, `at` [rows], of the residual stream x [rows, t,
    d]: the final norm over every position as `head_logits` (so its numbers are the same), the head on that one
    alone (not [rows, t, vocab] to read a row of)."""
    normed = norm_of(m, params["final_norm"], x)
    return _logits(params, jnp.take_along_axis(normed, at[:, None, None], axis=1), m, dtype)[:, 0]


def head_logp(params: dict, x, targets, m: ModelConfig, dtype, temperature: float = 1.0):
    """(log-probability of each target, log-sum-exp of the logits), both [batch, seq] fp32, for normed x,
    the logits divided by `temperature`.

    With the vocabulary split over tp, each rank holds [tokens, vocab/tp] logits; the
    max and the sum of exponentials reduce over tp as small [tokens] all-reduces, and
    the target logit is a masked sum over each rank's slice plus one more, so no device ever holds
    full-vocabulary logits (tests/test_tensor_parallel.py reads the compiled program).
    """
    return _logp_lse(_logits(params, x, m, dtype), targets, temperature)


def _logp_lse(logits: jax.Array, targets: jax.Array, temperature: float):
    if temperature != 1.0:
        logits = logits / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The target logit as a masked sum rather than a gather: each tp rank sums its own slice of
    # the vocabulary and one [tokens] all-reduce adds them. (A gather along the split vocabulary,
    # with the batch split over an axis the compiler owns, crashes XLA's partitioner inside the
    # pipeline island, JAX 0.10; the masked sum's backward is a select, not a scatter.)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return target_logit - lse, lse


def head_terms(params: dict, x: jax.Array, batch: dict, m: ModelConfig, dtype, terms, chunk: int = 0,
               temperature: float = 1.0, finish=None):
    """An objective's token terms over the whole batch: `terms(logp, lse, batch) -> (sum, metric sums)`
    (`trainer/objectives.py`), summed over loss chunks, in fp32; then `finish(sum, metric sums)` where given (a
    sequence objective's stage, once its per-sequence sums are whole).

    `chunk` > 0 (`train.loss_chunk`) computes the logits `chunk` sequence positions at a
    time, so only [batch, chunk, vocab] logits exist at once, in the backward pass too
    (`chunked_loss`; a rematerialised scan where fp8 covers the head). Chunk j takes positions
    j, j + n, j + 2n, ... (n chunks) of every batch field: strided, so a sequence split in
    contiguous blocks over a mesh axis stays split.
    """
    x = constrain(norm_of(m, params["final_norm"], x), ("batch", "seq", "embed"))

    def evaluate(x, batch):
        return terms(*head_logp(params, x, batch["targets"], m, dtype, temperature), batch)

    finish = finish or (lambda *terms: terms)
    if not chunk or chunk >= x.shape[1]:
        return finish(*evaluate(x, batch))
    b, s = batch["targets"].shape
    n = s // chunk

    def split(a):  # [b, s, ...] -> [n, b, chunk, ...]
        return jnp.moveaxis(a.reshape(b, chunk, n, *a.shape[2:]), 2, 0)

    pieces = (split(x), jax.tree.map(split, batch))
    if fp8.covers("head"):  # its fp8 matmul differentiates itself: JAX's transpose of a rematerialised scan
        return finish(*_rematerialised_chunks(evaluate, pieces))
    w, spec = _head_weight(params, m, dtype)

    def tail(logits, batch):
        return terms(*_logp_lse(_finish_logits(logits, m), batch["targets"], temperature), batch)

    with jax.named_scope("head"):
        return finish(*chunked_loss.chunk_sum(tail, spec, w, *pieces))


def _rematerialised_chunks(evaluate, pieces):
    """Σ over the chunks of evaluate(x chunk, batch chunk), each chunk recomputed in the backward pass."""
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(carry, xs):
        return jax.tree.map(jnp.add, carry, evaluate(*xs)), None

    start = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         jax.eval_shape(evaluate, *jax.tree.map(lambda a: a[0], pieces)))
    return jax.lax.scan(body, start, pieces)[0]


MIN_LOSS_CHUNK = 256  # positions: the head's matmul keeps this many rows a chunk, so it stays an accelerator's size


def logit_bytes_per_token(m: ModelConfig, tp: int = 1) -> int:
    """Bytes of a token's fp32 logits on one device (the padded vocabulary split over tp): the head's largest
    temporary, as many again for its gradient."""
    return 4 * padded_vocab(m) // tp


def residual_bytes_per_token(m: ModelConfig, dtype) -> int:
    """Bytes of a token's residual stream over the layers in the compute dtype: what the trunk keeps for the
    backward even under full recomputation."""
    return m.d_model * m.n_layers * jnp.dtype(dtype).itemsize


def default_loss_chunk(m: ModelConfig, dtype, sp: int = 1, tp: int = 1) -> int:
    """`train.loss_chunk = -1`'s positions per chunk (0: whole). The rule: where a token's fp32 logits are no larger
    than its residual stream over the layers, the loss runs whole (the trunk sets the step's memory); where they
    are, in the fewest chunks whose logits are each within the residual stream's bytes, each chunk at least
    MIN_LOSS_CHUNK positions, dividing seq_len in multiples of sp (strided chunks: `head_terms`)."""
    needed = -(-logit_bytes_per_token(m, tp) // residual_bytes_per_token(m, dtype))
    if needed <= 1:
        return 0
    s = m.seq_len
    fits = [n for n in range(2, s + 1) if s % n == 0 and (s // n) % sp == 0 and s // n >= MIN_LOSS_CHUNK]
    n = next((n for n in fits if n >= needed), fits[-1] if fits else 1)
    return 0 if n == 1 else s // n


# ---------------------------------------------------------------- whole model


def forward(params: dict, batch: dict, m: ModelConfig, dtype, terms, loss_chunk: int = 0, temperature: float = 1.0,
            finish=None):
    """The whole model on one batch: (objective sum, its metric sums, the blocks' auxiliary terms)."""
    x = embed(params, batch["inputs"], batch["positions"], m, dtype)
    x, aux = blocks(params["blocks"], x, batch["positions"], batch["segment_ids"], m, dtype)
    total, sums = head_terms(params, x, batch, m, dtype, terms, loss_chunk, temperature, finish)
    return total, sums, aux


def target_logp(params: dict, batch: dict, m: ModelConfig, dtype, temperature: float = 1.0) -> jax.Array:
    """Each target's log-probability [batch, seq], fp32, with the logits divided by `temperature`."""
    x = embed(params, batch["inputs"], batch["positions"], m, dtype)
    x, _ = blocks(params["blocks"], x, batch["positions"], batch["segment_ids"], m, dtype)
    x = constrain(norm_of(m, params["final_norm"], x), ("batch", "seq", "embed"))
    return head_logp(params, x, batch["targets"], m, dtype, temperature)[0]


def batch_logits(params: dict, batch: dict, m: ModelConfig, dtype) -> jax.Array:
    """fp32 logits [batch, seq, vocabulary] of a batch's inputs at its positions and segments (the padded
    vocabulary's columns cut off)."""
    x = embed(params, batch["inputs"], batch["positions"], m, dtype)
    x, _ = blocks(params["blocks"], x, batch["positions"], batch["segment_ids"], m, dtype)
    return head_logits(params, x, m, dtype)[..., :m.vocab_size]


def zero_aux(m: ModelConfig) -> dict:
    """The blocks' auxiliary terms of no layer: the start of a sum over layers and microbatches."""
    return moe_lib.zero_stats(m) if stack_lib.has_moe(m) else {}


def aux_loss(aux: dict, m: ModelConfig, layers=None) -> jax.Array:
    """What the blocks' auxiliary terms add to the objective (MoE: load-balancing and z-losses); `layers`: the
    MoE layers to average over when `aux` holds a part of them (a pipeline stage's), else those it holds."""
    return moe_lib.objective(aux, m, layers)


def aux_metrics(aux: dict) -> dict:
    """The blocks' auxiliary terms as logged metrics (MoE: router statistics; none for a dense model)."""
    return moe_lib.metrics(aux)


# Leaves the forward pass reads in fp32 whatever the compute dtype: norm scales and biases (applied to
# fp32 statistics), the router and its bias (routing is fp32), attention sinks (logits of the fp32 softmax) and
# Gated DeltaNet's decay parameters (its g is computed in fp32).
# Every other leaf is cast to the compute dtype at use.
READ_IN_FP32 = ("ln1", "ln2", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm",
                "final_norm", "enorm", "hnorm", "router", "router_bias", "router_logit_bias",
                "sinks", "A_log", "dt_bias")


def compute_weights(params: dict, dtype) -> dict:
    """The parameters as the forward pass reads them: cast to the compute dtype except `READ_IN_FP32`,
    so a copy made once (generation's) computes exactly what casting at each use computes."""
    def cast(path, w):
        keys = {getattr(k, "key", None) for k in path}
        return w if keys & set(READ_IN_FP32) else w.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def logits_at(params: dict, tokens: jax.Array, m: ModelConfig, dtype) -> jax.Array:
    """fp32 logits over the padded vocabulary of tokens [batch, seq] at positions 0..seq-1, one segment."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    segment_ids = jnp.ones((b, t), jnp.int32)
    x = embed(params, tokens, positions, m, dtype)
    x, _ = blocks(params["blocks"], x, positions, segment_ids, m, dtype)
    return head_logits(params, x, m, dtype)


def logits(params: dict, tokens: jax.Array, m: ModelConfig) -> jax.Array:
    """fp32 logits [batch, seq, vocab_size] (padding columns dropped) of tokens [batch, seq] at positions
    0..seq-1, every matmul in full fp32 (what transformers computes in fp32)."""
    with jax.default_matmul_precision("float32"):
        return logits_at(params, tokens, m, jnp.float32)[..., :m.vocab_size]


# ---------------------------------------------------------------- the model section of the config


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"model.{key}: '{value}' is not one of {', '.join(choices)}")


def _check_features(m: ModelConfig) -> None:
    for key, choices in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS), ("attn_bias", ATTN_BIASES),
                         ("norm_placement", NORM_PLACEMENTS)):
        _check_choice(key, getattr(m, key), tuple(choices))
    for key in ("attention_chunk", "attn_temperature_floor"):  # Llama 4's (`models/attention.py`)
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)}: must be positive, or 0 for none")
    if m.max_positions < 0 or m.head_dim < 0:
        raise ConfigError("model.max_positions and model.head_dim must be 0 (derived) or more")
    if m.seq_len > max_positions(m):
        raise ConfigError(f"model.seq_len={m.seq_len} is longer than model.max_positions={m.max_positions}, the "
                          "longest sequence the model is for; lower seq_len")


def _check_shape(m: ModelConfig) -> None:
    _check_features(m)
    if m.remat not in ("none", *REMAT_POLICIES):
        raise ConfigError(f"model.remat: '{m.remat}' is not one of {', '.join(('none', *REMAT_POLICIES))}")
    for key in ("n_layers", "d_model", "n_heads", "d_ff", "seq_len", "vocab_size"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}: must be at least 1, got {getattr(m, key)}")
    if not m.head_dim and m.attention == "mha" and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; change one of "
                          "them or set model.head_dim")
    kv = kv_heads(m)
    if m.n_heads % kv:
        raise ConfigError(f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads}; pick a divisor of n_heads")
    stack_lib.check(m)


def _check_remat_group(m: ModelConfig, t, pp: int) -> None:
    """Groups are cut from each segment's repeats, the last (pipelined) segment's per stage chunk,
    R / (pp · pp_virtual)."""
    chunks = pp * (pipeline_schedules.model_chunks(t.pp_schedule, t.pp_virtual) if pp > 1 else 1)
    *lead, last = stack_lib.segments(m)
    for seg in (*lead, last):
        repeats = seg.repeats // chunks if seg is last else seg.repeats
        if m.remat_group < -1 or (m.remat_group > 0 and repeats % m.remat_group):
            raise ConfigError(f"model.remat_group={m.remat_group} does not divide the {repeats} pattern repeats of a "
                              "segment's stage chunk (layers / pattern / (pp·pp_virtual)); use a divisor, 0 (off) or "
                              "-1 (nearest √)")


def _check_tensor_parallel(m: ModelConfig, t, tp: int) -> list[str]:
    notes, kv = [], kv_heads(m)
    if m.n_heads % tp:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by mesh.tp={tp}; use a tp that divides the heads")
    if kv % tp:
        if tp % kv:
            raise ConfigError(f"model.n_kv_heads={kv} and mesh.tp={tp}: one must divide the other; change mesh.tp")
        notes.append(f"model.n_kv_heads={kv} < mesh.tp={tp}: KV heads are replicated across tp ranks")
    if m.d_ff % tp:
        raise ConfigError(f"model.d_ff={m.d_ff} is not divisible by mesh.tp={tp}; use a tp that divides d_ff")
    if padded_vocab(m) % tp:
        raise ConfigError(f"padded vocabulary {padded_vocab(m)} is not divisible by mesh.tp={tp}; use a smaller tp")
    if m.collective_matmul and not t.sequence_parallel:
        raise ConfigError("model.collective_matmul=true needs train.sequence_parallel=true (it overlaps SP's "
                          "all-gather and reduce-scatter); turn sequence_parallel on or collective_matmul off")
    return notes


def _check_mtp(m: ModelConfig, t) -> None:
    """Multi-token prediction: a language-model objective, and one window and RoPE for every layer (the modules'
    blocks take the model's)."""
    if m.mtp_depth < 0 or t.mtp_weight < 0:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} and train.mtp_weight={t.mtp_weight} must be 0 or more")
    if not m.mtp_depth:
        return
    if t.objective != "lm":
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with train.objective={t.objective}: multi-token prediction "
                          "trains with the language-model objective; set model.mtp_depth=0 or train.objective=lm")
    if stack_lib.is_linear(stack_lib.kinds(m)[-1]):
        raise ConfigError(f"model.mtp_depth={m.mtp_depth}: a prediction module's block is the stack's last kind, "
                          f"here linear attention ({stack_lib.kinds(m)[-1]}); end the pattern with an attention "
                          "block (as Qwen3-Next's does) or set model.mtp_depth=0")
    if attention.layer_data(m) is not None:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth}: the windows or RoPE differ by layer "
                          f"(model.window_pattern={m.window_pattern}), and a prediction module has no layer of its "
                          "own; set one window for every layer or model.mtp_depth=0")


def check_config(m: ModelConfig, t, shape: dict) -> list[str]:
    """The model section against the mesh (and the training keys it depends on): ConfigError (one line:
    key and fix) for what cannot run; notes to log."""
    _check_shape(m)
    _check_mtp(m, t)
    _check_remat_group(m, t, shape["pp"])
    notes = _check_tensor_parallel(m, t, shape["tp"])
    if stack_lib.has_moe(m):
        notes += moe_lib.check_config(m, t, shape)
    if stack_lib.has_linear(m):
        gated_deltanet.check_config(m, shape)
    return notes + attention.check_config(m, shape)
