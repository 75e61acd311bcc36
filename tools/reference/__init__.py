"""The models written plainly in JAX, independently of `jaxllm/models/`: the references the tests compare
jaxllm with and the bench's baseline. `plain_model(m)` picks the one for a jaxllm model config."""


def plain_model(m):
    """(module, its config) of the model `plain_gpt.py` or `plain_llama.py` writes plainly for
    jaxllm model config `m`: the same shapes and numerics (llama: every layer dense or every layer MoE).
    Each covers one family's features exactly (`schema.FAMILIES`); ValueError for any other setting."""
    from jaxllm.schema import FAMILIES
    from jaxllm.models.attention import head_dim, kv_heads, layer_windows
    from jaxllm.models.moe import has_router_bias
    from jaxllm.models.transformer import padded_vocab, shared_d_ff
    from tools.reference import plain_gpt, plain_llama

    features = {k: getattr(m, k) for k in FAMILIES["gpt2"]}
    extras = (m.max_positions not in (0, m.seq_len) or m.rope_scaling != "none" or m.attn_softcap or m.final_softcap
              or m.query_pre_attn_scalar or m.rope_local_theta or any(0 < w < m.seq_len for w in layer_windows(m))
              or (m.moe.score, m.moe.norm_topk, m.moe.routed_scale, m.moe.n_group) != ("softmax", True, 1.0, 1)
              or has_router_bias(m) or m.moe.seq_balance_weight or m.attention != "mha"
              or m.rope_mscale_all_dim)
    if features not in (FAMILIES["gpt2"], FAMILIES["llama"]) or extras:
        raise ValueError(f"no plain reference for the features {features}")
    if features == FAMILIES["gpt2"]:
        if (m.segments or m.pattern != ["dense"] or kv_heads(m) != m.n_heads or m.mtp_depth
                or m.head_dim not in (0, m.d_model // m.n_heads)):
            raise ValueError("plain_gpt has no mixture of experts, grouped-query attention, free head_dim or "
                             "multi-token prediction")
        return plain_gpt, plain_gpt.GPT(vocab_size=m.vocab_size, padded_vocab=padded_vocab(m), seq_len=m.seq_len,
                                        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff,
                                        eps=m.norm_eps, init_std=m.init_std)
    if m.segments or m.pattern not in (["dense"], ["moe"]):
        raise ValueError("plain_llama has every layer dense or every layer MoE")
    e = m.moe
    return plain_llama, plain_llama.Llama(
        vocab_size=m.vocab_size, padded_vocab=padded_vocab(m), seq_len=m.seq_len, n_layers=m.n_layers,
        d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=kv_heads(m), d_ff=m.d_ff, eps=m.norm_eps,
        rope_theta=m.rope_theta, head_dim=head_dim(m), init_std=m.init_std, n_experts=e.n_experts if m.pattern == ["moe"] else 0,
        top_k=e.top_k, expert_d_ff=e.d_ff, shared_d_ff=shared_d_ff(m), shared_gate=e.shared_gate,
        balance_weight=e.balance_weight,
        z_weight=e.z_weight, mtp_depth=m.mtp_depth)
