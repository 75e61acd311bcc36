"""Which Hugging Face tensor holds which jaxllm parameter, and in what layout: one small table per family.

An `Entry` names a file key (with `{i}` for the layer and `{x}` for the expert), the jaxllm leaf (its path
inside `params`, or inside one block for per-layer leaves) and an einops pattern from the file's layout to
ours for one layer (and one expert). Letters: v vocabulary, n positions, e d_model, h heads, d head_dim,
f feed-forward, x experts, p the parts of GPT-2's fused q|k|v projection (`select` picks one).
torch's Linear stores [out, in], so its weights read transposed; GPT-2's Conv1D stores [in, out].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    key: str  # file key; {i}: layer, {x}: expert
    path: tuple[str, ...]  # jaxllm leaf: from the top of params, or (for keys with {i}) inside a block
    pattern: str  # einops, file layout -> jaxllm layout (one layer, one expert)
    select: int | None = None  # the part p of a fused tensor this leaf is


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


def _llama(biases: str, mlp_bias: bool, tied: bool, moe: bool, placement: str = "pre",
           qk_norm: bool = False) -> list[Entry]:
    """LLaMA's table, and the families built like it: Mistral, Qwen2/3, Mixtral, Gemma 2/3."""
    top = [Entry("model.embed_tokens.weight", ("embed", "tok"), "v e -> v e"),
           Entry("model.norm.weight", ("final_norm", "scale"), "e -> e")]
    if not tied:
        top.append(Entry("lm_head.weight", ("head", "w"), "v e -> e v"))
    layer = [Entry(f"model.layers.{{i}}.{name}.weight", (ours, "scale"), "e -> e")
             for name, ours in _NORMS[placement].items()]
    layer += _llama_attention(biases, qk_norm)
    if moe:
        moe_key = "model.layers.{i}.block_sparse_moe"
        layer += [Entry(f"{moe_key}.gate.weight", ("moe", "router"), "x e -> e x"),
                  Entry(f"{moe_key}.experts.{{x}}.w1.weight", ("moe", "experts", "w_gate"), "f e -> e f"),
                  Entry(f"{moe_key}.experts.{{x}}.w3.weight", ("moe", "experts", "w_up"), "f e -> e f"),
                  Entry(f"{moe_key}.experts.{{x}}.w2.weight", ("moe", "experts", "w_down"), "e f -> f e")]
        return top + layer
    for n, ours, pattern in (("gate", "w_gate", "f e -> e f"), ("up", "w_up", "f e -> e f"),
                             ("down", "w_down", "e f -> f e")):
        layer.append(Entry(f"model.layers.{{i}}.mlp.{n}_proj.weight", ("mlp", ours), pattern))
        if mlp_bias:
            layer.append(Entry(f"model.layers.{{i}}.mlp.{n}_proj.bias", ("mlp", "b_" + n),
                               "f -> f" if n != "down" else "e -> e"))
    return top + layer


def entries(m) -> list[Entry]:
    """The table for model config `m` (whose features `hf_config.exportable` accepts)."""
    if m.mlp == "gelu_tanh":
        return _gpt2()
    return _llama({"none": "", "qkv": "qkv", "qkvo": "qkvo"}[m.attn_bias], m.mlp_bias, m.tie_embeddings,
                  "moe" in m.pattern, m.norm_placement, m.qk_norm)
