"""Which Hugging Face tensor holds which jaxllm parameter, and in what layout: one small table per family.

An `Entry` names a file key (with `{i}` for the layer and `{x}` for the expert), the jaxllm leaf (its path
inside `params`, or inside one block for per-layer leaves) and an einops pattern from the file's layout to
ours for one layer (and one expert). Letters: v vocabulary, n positions, e d_model, h heads, d head_dim,
f feed-forward, x experts, p the parts of GPT-2's fused q|k|v projection (`select` picks one), r a latent
attention's compressed width, c its latent with the RoPE key (Gated DeltaNet's: a key-head group's channels, or
the convolution's), k the convolution's taps, 1 a unit axis of the file's.
torch's Linear stores [out, in], so its weights read transposed; GPT-2's Conv1D stores [in, out].
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.interop.hf_config import model_type


@dataclass(frozen=True)
class Entry:
    key: str  # file key; {i}: layer, {x}: expert
    path: tuple[str, ...]  # jaxllm leaf: from the top of params, or (for keys with {i}) inside a block
    pattern: str  # einops, file layout -> jaxllm layout (one layer, one expert)
    select: int | None = None  # the part p of a fused tensor this leaf is
    parts: int = 3  # how many parts p that tensor has
    # (a letter of our layout, the file's index for each of our indices along it): DeepSeek's interleaved RoPE
    # dimensions read as halves and written back interleaved. The dimension is never split over devices.
    order: tuple[str, tuple[int, ...]] | None = None


def _gpt2() -> list[Entry]:
    """GPT-2, keys as transformers writes them (files published without the `transformer.` prefix read too)."""
    t, h = "transformer.", "transformer.h.{i}."
    vector = lambda key, path: Entry(key, path, "e -> e")
    top = [Entry(t + "wte.weight", ("embed", "tok"), "v e -> v e"),
           Entry(t + "wpe.weight", ("embed", "pos"), "n e -> n e"),
           vector(t + "ln_f.weight", ("final_norm", "scale")), vector(t + "ln_f.bias", ("final_norm", "bias"))]
    layer = [vector(h + "ln_1.weight", ("ln1", "scale")), vector(h + "ln_1.bias", ("ln1", "bias")),
             vector(h + "ln_2.weight", ("ln2", "scale")), vector(h + "ln_2.bias", ("ln2", "bias")),
             Entry(h + "attn.c_proj.weight", ("attn", "wo"), "(h d) e -> h d e"),
             vector(h + "attn.c_proj.bias", ("attn", "bo")),
             Entry(h + "mlp.c_fc.weight", ("mlp", "w_in"), "e f -> e f"),
             Entry(h + "mlp.c_fc.bias", ("mlp", "b_in"), "f -> f"),
             Entry(h + "mlp.c_proj.weight", ("mlp", "w_out"), "f e -> f e"),
             vector(h + "mlp.c_proj.bias", ("mlp", "b_out"))]
    for part, name in enumerate("qkv"):  # the fused projection's columns are q | k | v
        layer += [Entry(h + "attn.c_attn.weight", ("attn", f"w{name}"), "e (p h d) -> p e h d", part),
                  Entry(h + "attn.c_attn.bias", ("attn", f"b{name}"), "(p h d) -> p h d", part)]
    return top + layer


def _llama_attention(biases: str, qk_norm: bool) -> list[Entry]:
    attn = [Entry(f"model.layers.{{i}}.self_attn.{n}_proj.weight", ("attn", f"w{n}"), "(h d) e -> e h d")
            for n in "qkv"]
    if qk_norm:  # Qwen3, Gemma 3: RMSNorm over head_dim
        attn += [Entry(f"model.layers.{{i}}.self_attn.{n}_norm.weight", ("attn", f"{n}_norm", "scale"), "d -> d")
                 for n in "qk"]
    attn.append(Entry("model.layers.{i}.self_attn.o_proj.weight", ("attn", "wo"), "e (h d) -> h d e"))
    attn += [Entry(f"model.layers.{{i}}.self_attn.{n}_proj.bias", ("attn", f"b{n}"), "(h d) -> h d") for n in "qkv"
             if n in biases]
    if "o" in biases:
        attn.append(Entry("model.layers.{i}.self_attn.o_proj.bias", ("attn", "bo"), "e -> e"))
    return attn


# The layer norms by placement: Gemma's post_attention_layernorm is the attention output's own norm, where
# LLaMA's is the norm before the MLP.
_NORMS = {"pre": {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"},
          "sandwich": {"input_layernorm": "ln1", "post_attention_layernorm": "post_attn_norm",
                       "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "post_mlp_norm"}}


def _mlp(prefix: str, ours: tuple, bias: bool = False) -> list[Entry]:
    """A SwiGLU feed-forward's gate, up and down projections (and their biases)."""
    out = []
    for n, leaf, pattern in (("gate", "w_gate", "f e -> e f"), ("up", "w_up", "f e -> e f"),
                             ("down", "w_down", "e f -> f e")):
        out.append(Entry(f"{prefix}.{n}_proj.weight", (*ours, leaf), pattern))
        if bias:
            out.append(Entry(f"{prefix}.{n}_proj.bias", (*ours, "b_" + n), "f -> f" if n != "down" else "e -> e"))
    return out


def _mixtral_experts() -> list[Entry]:
    moe_key = "model.layers.{i}.block_sparse_moe"
    return [Entry(f"{moe_key}.gate.weight", ("moe", "router"), "x e -> e x"),
            Entry(f"{moe_key}.experts.{{x}}.w1.weight", ("moe", "experts", "w_gate"), "f e -> e f"),
            Entry(f"{moe_key}.experts.{{x}}.w3.weight", ("moe", "experts", "w_up"), "f e -> e f"),
            Entry(f"{moe_key}.experts.{{x}}.w2.weight", ("moe", "experts", "w_down"), "e f -> f e")]


def _routed_experts(key: str, fused: bool) -> list[Entry]:
    """The router and the experts of an MoE layer whose keys start `key` (Qwen MoE, DeepSeek-V3): per expert as
    published, or fused as transformers 5 holds them in memory: gate|up [x, 2f, e] and down [x, e, f]."""
    ours = ("moe", "experts")
    out = [Entry(f"{key}.gate.weight", ("moe", "router"), "x e -> e x")]
    if not fused:
        return out + _mlp(f"{key}.experts.{{x}}", ours)
    out += [Entry(f"{key}.experts.gate_up_proj", (*ours, leaf), "x (p f) e -> p x e f", part, parts=2)
            for part, leaf in enumerate(("w_gate", "w_up"))]
    return out + [Entry(f"{key}.experts.down_proj", (*ours, "w_down"), "x e f -> x f e")]


def _gpt_oss(m) -> list[Entry]:
    """gpt-oss: LLaMA's attention with q/k/v/o biases and the sinks; every layer's router (weight and bias) and
    experts as published: gate|up [x, e, 2f] with gate and up interleaved along the last axis (`(f p)`), its bias
    likewise, down [x, f, e] and its bias."""
    key, ours = "model.layers.{i}.mlp", ("moe", "experts")
    attention = _llama_attention("qkvo", False) + [Entry("model.layers.{i}.self_attn.sinks", ("attn", "sinks"),
                                                         "h -> h")]
    experts = [Entry(f"{key}.router.weight", ("moe", "router"), "x e -> e x"),
               Entry(f"{key}.router.bias", ("moe", "router_logit_bias"), "x -> x"),
               Entry(f"{key}.experts.down_proj", (*ours, "w_down"), "x f e -> x f e"),
               Entry(f"{key}.experts.down_proj_bias", (*ours, "b_down"), "x e -> x e")]
    for part, name in enumerate(("gate", "up")):
        experts += [Entry(f"{key}.experts.gate_up_proj", (*ours, f"w_{name}"), "x e (f p) -> p x e f", part, parts=2),
                    Entry(f"{key}.experts.gate_up_proj_bias", (*ours, f"b_{name}"), "x (f p) -> p x f", part, parts=2)]
    return _llama("", False, m.tie_embeddings, attention=attention, feed_forward=experts)


def _llama4(m) -> list[Entry]:
    """Llama 4's text model: LLaMA's attention with q's and k's rows read from RoPE's interleaved pairs as halves
    (every layer alike: a layer without RoPE computes the same scores either way) and written back as pairs;
    `feed_forward` the dense layers' SwiGLU, or the MoE layers' router, experts (gate|up [x, e, 2f] halves, down
    [x, f, e]) and shared expert."""
    key, head_dim = "model.layers.{i}.feed_forward", m.head_dim or m.d_model // m.n_heads
    pairs = ("d", halves(0, head_dim))
    attention = [Entry(e.key, e.path, e.pattern, order=pairs) if e.path[1] in ("wq", "wk") else e
                 for e in _llama_attention("qkvo" if m.attn_bias == "qkvo" else "", False)]
    experts = [Entry(f"{key}.router.weight", ("moe", "router"), "x e -> e x"),
               Entry(f"{key}.experts.down_proj", ("moe", "experts", "w_down"), "x f e -> x f e"),
               *[Entry(f"{key}.experts.gate_up_proj", ("moe", "experts", leaf), "x e (p f) -> p x e f", part, parts=2)
                 for part, leaf in enumerate(("w_gate", "w_up"))],
               *_mlp(f"{key}.shared_expert", ("moe", "shared")), *_mlp(key, ("mlp",))]
    return _llama("", False, m.tie_embeddings, attention=attention, feed_forward=experts)


def _qwen_experts(fused: bool) -> list[Entry]:
    """Qwen2-MoE's and Qwen3-MoE's router and experts, and shared expert with its gate (Qwen2-MoE)."""
    key = "model.layers.{i}.mlp"
    return _routed_experts(key, fused) + _mlp(f"{key}.shared_expert", ("moe", "shared")) + [
        Entry(f"{key}.shared_expert_gate.weight", ("moe", "shared_gate"), "g e -> e g")]


def _qwen3_next(m, fused: bool) -> list[Entry]:
    """Qwen3-Next: Qwen3's attention with q_proj holding each head's [query | output gate] (`wq`, `wg`: parts of
    `(h p d)`); the linear layers' Gated DeltaNet as `models/gated_deltanet.py` lays it out by key-head group
    (`h` key heads, `c` a group's channels; the convolution's taps as the file holds them, `1` its unit axis);
    Qwen's MoE layers with the shared expert and its gate, and dense layers; the prediction module's norms and
    projection (`mtp.*`, its block's keys the stack's under `mtp.layers.`: `mtp_layers`)."""
    key, bias = "model.layers.{i}.self_attn", m.attn_bias == "qkvo"
    attention = [e for e in _llama_attention("qkvo" if bias else "", True) if e.path[1] not in ("wq", "bq")]
    for part, name in enumerate("qg"):
        attention.append(Entry(f"{key}.q_proj.weight", ("attn", f"w{name}"), "(h p d) e -> p e h d", part, parts=2))
        if bias:
            attention.append(Entry(f"{key}.q_proj.bias", ("attn", f"b{name}"), "(h p d) -> p h d", part, parts=2))
    linear, ours = "model.layers.{i}.linear_attn", "linear_attn"
    attention += [Entry(f"{linear}.in_proj_qkvz.weight", (ours, "in_proj_qkvz"), "(h c) e -> e h c"),
                  Entry(f"{linear}.in_proj_ba.weight", (ours, "in_proj_ba"), "(h c) e -> e h c"),
                  Entry(f"{linear}.conv1d.weight", (ours, "conv1d"), "c 1 k -> c k"),
                  Entry(f"{linear}.dt_bias", (ours, "dt_bias"), "(h c) -> h c"),
                  Entry(f"{linear}.A_log", (ours, "A_log"), "(h c) -> h c"),
                  Entry(f"{linear}.norm.weight", (ours, "norm"), "d -> d"),
                  Entry(f"{linear}.out_proj.weight", (ours, "out_proj"), "e (h c) -> h c e")]
    prediction = [Entry("mtp.pre_fc_norm_embedding.weight", ("mtp", "enorm", "scale"), "e -> 1 e"),
                  Entry("mtp.pre_fc_norm_hidden.weight", ("mtp", "hnorm", "scale"), "e -> 1 e"),
                  Entry("mtp.fc.weight", ("mtp", "eh_proj"), "e c -> 1 c e"),
                  Entry("mtp.norm.weight", ("mtp", "final_norm", "scale"), "e -> 1 e")]  # one module (`mtp_layers`)
    return _llama("", False, m.tie_embeddings, attention=attention, feed_forward=_qwen_experts(fused) + _mlp(
        "model.layers.{i}.mlp", ("mlp",))) + prediction


def mtp_layers(m) -> tuple[str, int]:
    """Where the files hold the prediction modules' blocks: (what replaces `model.layers.` in their keys, the file's
    number of module 0's block): DeepSeek-V3's after the stack's layers, Qwen3-Next's under `mtp.layers.` from 0 (its
    one module's projection and norms are `mtp.*` without a number)."""
    return ("mtp.layers.", 0) if model_type(m) == "qwen3_next" else ("model.layers.", m.n_layers)


def halves(nope: int, rope: int) -> tuple[int, ...]:
    """The file's index of each of our dimensions when its last `rope` are interleaved RoPE pairs (x0, x1), (x2, x3),
    ...: the first `nope` stay, then the pairs' first members, then their second, as RoPE's halves."""
    return (*range(nope), *(nope + i for i in range(0, rope, 2)), *(nope + i for i in range(1, rope, 2)))


def _deepseek(m, fused: bool, interleaved: bool) -> list[Entry]:
    """DeepSeek-V3: latent attention (`models/mla.py`'s weights), dense layers' MLP, MoE layers' router with its bias,
    experts and shared experts; the multi-token prediction layers' own norms and projection (their blocks'
    entries are the stack's; their copies of the embedding and head are written, not read)."""
    a, key = m.mla, "model.layers.{i}.self_attn"
    q_order = ("d", halves(a.qk_nope_head_dim, a.qk_rope_head_dim)) if interleaved else None
    kv_order = ("c", halves(a.kv_lora_rank, a.qk_rope_head_dim)) if interleaved else None
    if a.q_lora_rank:
        attn = [Entry(f"{key}.q_a_proj.weight", ("attn", "wq_a"), "r e -> e r"),
                Entry(f"{key}.q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), "r -> r"),
                Entry(f"{key}.q_b_proj.weight", ("attn", "wq_b"), "(h d) r -> r h d", order=q_order)]
    else:
        attn = [Entry(f"{key}.q_proj.weight", ("attn", "wq"), "(h d) e -> e h d", order=q_order)]
    attn += [Entry(f"{key}.kv_a_proj_with_mqa.weight", ("attn", "wkv_a"), "c e -> e c", order=kv_order),
             Entry(f"{key}.kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), "r -> r"),
             Entry(f"{key}.kv_b_proj.weight", ("attn", "wkv_b"), "(h d) r -> r h d"),
             Entry(f"{key}.o_proj.weight", ("attn", "wo"), "e (h d) -> h d e")]
    mlp = "model.layers.{i}.mlp"
    experts = [Entry(f"{mlp}.gate.e_score_correction_bias", ("moe", "router_bias"), "x -> x"),
               *_routed_experts(mlp, fused), *_mlp(f"{mlp}.shared_experts", ("moe", "shared"))]
    prediction = "model.layers.{i}"  # the multi-token prediction layers: numbered after the stack's
    mtp = [Entry(f"{prediction}.enorm.weight", ("mtp", "enorm", "scale"), "e -> e"),
           Entry(f"{prediction}.hnorm.weight", ("mtp", "hnorm", "scale"), "e -> e"),
           Entry(f"{prediction}.eh_proj.weight", ("mtp", "eh_proj"), "e c -> c e"),
           Entry(f"{prediction}.shared_head.norm.weight", ("mtp", "final_norm", "scale"), "e -> e")]
    return _llama("", False, m.tie_embeddings, "", "pre", False, False, attn) + experts + mtp


def _llama(biases: str, mlp_bias: bool, tied: bool, experts: str = "", placement: str = "pre",
           qk_norm: bool = False, fused: bool = False, attention: list[Entry] | None = None,
           feed_forward: list[Entry] | None = None) -> list[Entry]:
    """LLaMA's table, and the families built like it: Mistral, Qwen2/3, Mixtral, Qwen MoE, Gemma 2/3, DeepSeek-V3,
    gpt-oss, Llama 4 (`experts`: whose MoE layers, "mixtral" or "qwen"; `fused`: Qwen's experts as fused tensors;
    `attention`, `feed_forward`: the attention's and the feed-forwards' entries where they are not LLaMA's)."""
    top = [Entry("model.embed_tokens.weight", ("embed", "tok"), "v e -> v e"),
           Entry("model.norm.weight", ("final_norm", "scale"), "e -> e")]
    if not tied:
        top.append(Entry("lm_head.weight", ("head", "w"), "v e -> e v"))
    layer = [Entry(f"model.layers.{{i}}.{name}.weight", (ours, "scale"), "e -> e")
             for name, ours in _NORMS[placement].items()]
    layer += _llama_attention(biases, qk_norm) if attention is None else attention
    if feed_forward is not None:
        return top + layer + feed_forward
    if experts:  # the MoE layers' entries; the dense layers' (Qwen MoE's dense layers) stay beside them
        layer += _mixtral_experts() if experts == "mixtral" else _qwen_experts(fused)
    return top + layer + _mlp("model.layers.{i}.mlp", ("mlp",), mlp_bias)


def entries(m, fused: bool = False, interleaved: bool = False) -> list[Entry]:
    """The table for model config `m` (whose features `hf_config.exportable` accepts); `fused`: an MoE checkpoint's
    experts are fused tensors; `interleaved`: a DeepSeek checkpoint's RoPE dimensions are interleaved pairs."""
    if m.mlp == "gelu_tanh":
        return _gpt2()
    kind = model_type(m)
    if kind == "deepseek_v3":
        return _deepseek(m, fused, interleaved)
    if kind == "gpt_oss":
        return _gpt_oss(m)
    if kind == "llama4_text":
        return _llama4(m)
    if kind == "qwen3_next":
        return _qwen3_next(m, fused)
    experts = {"mixtral": "mixtral", "qwen2_moe": "qwen", "qwen3_moe": "qwen"}.get(kind, "")
    return _llama({"none": "", "qkv": "qkv", "qkvo": "qkvo"}[m.attn_bias], m.mlp_bias, m.tie_embeddings,
                  experts, m.norm_placement, m.qk_norm, fused)
