"""LLaMA (and a Mixtral-style dropless MoE) and its training step written as plainly as JAX allows.

The independent reference for jaxllm's llama family, as `tools/reference/plain_gpt.py` is for
gpt2: one file, one params dict, nothing imported from `jaxllm`. Tests check that
jaxllm computes the same loss and gradients as this file, on one device and on
meshes; `tools.bench.train_step` times it as the llama baseline. It follows Hugging Face's
`LlamaForCausalLM` / `MixtralForCausalLM` conventions:

- token embedding (`padded_vocab` rows), no position embedding; untied LM head;
- pre-RMSNorm blocks (fp32 statistics, no mean subtracted, no bias);
- rotary position embedding in the rotate-half form: the head dimension's first and
  second halves are the two coordinates of each rotated pair, frequency
  theta^(-2i/head_dim) for pair i;
- grouped-query attention by repeating each KV head for the query heads that use it
  (`repeat_kv`: query head h reads KV head h // (n_heads / n_kv_heads)); causal mask
  from `tril`; scores and softmax in fp32;
- SwiGLU feed-forward: (silu(x W_gate) * x W_up) W_down;
- with `n_experts > 0`, every layer's feed-forward is a mixture of experts: softmax
  router in fp32, top-k, the k gates renormalised to sum to 1 when k > 1, and every
  expert run on every token (dense, so no token is ever dropped), weighted by the gate
  it got (0 if not chosen); optionally a shared SwiGLU every token goes through. The
  objective adds Switch's load-balancing loss E·Σ_e f_e·P_e and the router z-loss
  mean(logsumexp(logits)²), each weighted and averaged over the layers;
- fp32 logits; the padded vocabulary columns are sliced off before the cross-entropy;
- with `mtp_depth` D > 0, DeepSeek-V3's multi-token prediction: module k = 1..D joins
  RMSNorm(embedding of token i + k) and RMSNorm(the previous hidden state) (the main model's last,
  before its final norm), projects them back to d_model, runs one more layer (the stack's kind)
  and predicts token i + k + 1 through its own final norm and the shared head; positions whose
  token k + 1 ahead is past the window count zero, and each module's cross-entropy sum is divided
  by all the window's tokens (DeepSeek-V3 eq. 24); mtp_weight times their mean joins the loss,
  and its MoE layers join the auxiliary losses' mean.

`from_jaxllm(params)` maps a jaxllm llama parameter tree onto this one (reshapes only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class Llama:
    vocab_size: int  # real vocabulary
    padded_vocab: int  # rows of the embedding and columns of the head
    seq_len: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int = 0  # 0: d_model // n_heads
    init_std: float = 0.02
    n_experts: int = 0  # 0: dense feed-forward
    top_k: int = 2
    expert_d_ff: int = 0  # 0: d_ff
    shared_d_ff: int = 0  # with experts: a shared SwiGLU of this width beside them (0: none)
    shared_gate: bool = False  # that shared output times sigmoid(h @ w)
    balance_weight: float = 0.01
    z_weight: float = 0.001
    mtp_depth: int = 0  # multi-token prediction modules (0: none)
    mtp_weight: float = 0.3


def init_params(c: Llama, key: jax.Array) -> dict:
    """fp32 weights: N(0, init_std), residual output projections scaled by 1/sqrt(2 * n_layers)."""
    L, D, F, V, E = c.n_layers, c.d_model, c.d_ff, c.padded_vocab, c.n_experts
    Dh = c.head_dim or D // c.n_heads
    ks = iter(jax.random.split(key, 16))
    normal = lambda shape, std=c.init_std: std * jax.random.normal(next(ks), shape, jnp.float32)
    out_std = c.init_std / (2 * L) ** 0.5
    layers = {
        "attn_norm": jnp.ones((L, D)), "mlp_norm": jnp.ones((L, D)),
        "wq": normal((L, D, c.n_heads * Dh)), "wk": normal((L, D, c.n_kv_heads * Dh)),
        "wv": normal((L, D, c.n_kv_heads * Dh)), "wo": normal((L, c.n_heads * Dh, D), out_std),
    }
    if E:
        Fe = c.expert_d_ff or F
        layers.update(router=normal((L, D, E)), expert_gate=normal((L, E, D, Fe)), expert_up=normal((L, E, D, Fe)),
                      expert_down=normal((L, E, Fe, D), out_std))
    if not E or c.shared_d_ff:
        Fs = c.shared_d_ff if E else F
        layers.update(w_gate=normal((L, D, Fs)), w_up=normal((L, D, Fs)), w_down=normal((L, Fs, D), out_std))
    if E and c.shared_gate:
        layers.update(shared_gate=normal((L, D, 1)))
    return {"wte": normal((V, D)), "layers": layers, "norm": jnp.ones((D,)), "lm_head": normal((D, V))}


def from_jaxllm(p: dict) -> dict:
    """The same weights from a jaxllm llama parameter tree (pattern ["dense"] or ["moe"])."""
    (b,) = p["blocks"]
    out = {"wte": p["embed"]["tok"], "layers": _layers(b), "norm": p["final_norm"]["scale"], "lm_head": p["head"]["w"]}
    if "mtp" in p:
        mtp = p["mtp"]
        out["mtp"] = {"enorm": mtp["enorm"]["scale"], "hnorm": mtp["hnorm"]["scale"], "eh_proj": mtp["eh_proj"],
                      "layer": _layers(mtp["block"]), "norm": mtp["final_norm"]["scale"]}
    return out


def _layers(b: dict) -> dict:
    """One jaxllm block kind's weights, stacked over its layers, as this file's layer dict."""
    a = b["attn"]
    L, D = a["wq"].shape[:2]
    flat_in = lambda w: w.reshape(L, D, -1)  # [L, D, heads, Dh] -> [L, D, heads·Dh]
    layers = {
        "attn_norm": b["ln1"]["scale"], "mlp_norm": b["ln2"]["scale"],
        "wq": flat_in(a["wq"]), "wk": flat_in(a["wk"]), "wv": flat_in(a["wv"]), "wo": a["wo"].reshape(L, -1, D),
    }
    dense = b.get("mlp") or b["moe"].get("shared")
    if dense is not None:
        layers.update(w_gate=dense["w_gate"], w_up=dense["w_up"], w_down=dense["w_down"])
    if "moe" in b:
        ex = b["moe"]["experts"]
        layers.update(router=b["moe"]["router"], expert_gate=ex["w_gate"], expert_up=ex["w_up"],
                      expert_down=ex["w_down"])
        if "shared_gate" in b["moe"]:
            layers.update(shared_gate=b["moe"]["shared_gate"])
    return layers


def rms_norm(x, g, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * g).astype(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_tables(c: Llama, T: int):
    """cos and sin, [T, head_dim], for positions 0..T-1."""
    Dh = c.head_dim or c.d_model // c.n_heads
    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh))
    freqs = jnp.outer(jnp.arange(T, dtype=jnp.float32), inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def attention(c: Llama, dtype, x, p, cos, sin):
    B, T, D = x.shape
    H, KV, Dh = c.n_heads, c.n_kv_heads, c.head_dim or D // c.n_heads
    w = lambda name: p[name].astype(dtype)
    q = (x @ w("wq")).reshape(B, T, H, Dh)
    k = (x @ w("wk")).reshape(B, T, KV, Dh)
    v = (x @ w("wv")).reshape(B, T, KV, Dh)
    c_, s_ = cos[None, :, None, :], sin[None, :, None, :]
    q = (q.astype(jnp.float32) * c_ + rotate_half(q.astype(jnp.float32)) * s_).astype(dtype)
    k = (k.astype(jnp.float32) * c_ + rotate_half(k.astype(jnp.float32)) * s_).astype(dtype)
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)  # repeat_kv
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(Dh))
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, H * Dh)
    return out @ w("wo")


def swiglu(h, w_gate, w_up, w_down):
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def moe(c: Llama, dtype, h, p):
    """Dense mixture of experts on h [B, T, D]: (output, balance loss, z-loss)."""
    logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), p["router"].astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, chosen = jax.lax.top_k(probs, c.top_k)  # [B, T, k]
    if c.top_k > 1:
        top = top / top.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(chosen, c.n_experts, dtype=jnp.float32)  # [B, T, k, E]
    weight = jnp.einsum("btk,btke->bte", top, onehot)  # each expert's gate, 0 where not chosen
    w = lambda name: p[name].astype(dtype)
    gate = jnp.einsum("btd,edf->ebtf", h, w("expert_gate"))
    up = jnp.einsum("btd,edf->ebtf", h, w("expert_up"))
    every = jnp.einsum("ebtf,efd->ebtd", jax.nn.silu(gate) * up, w("expert_down"))  # every expert, every token
    out = jnp.einsum("ebtd,bte->btd", every, weight.astype(dtype))
    if c.shared_d_ff:
        shared = swiglu(h, w("w_gate"), w("w_up"), w("w_down"))
        out = out + (shared * jax.nn.sigmoid(h @ w("shared_gate")) if c.shared_gate else shared)
    f = onehot.reshape(-1, c.n_experts).mean(0)  # share of the (token, choice) pairs each expert got
    importance = probs.reshape(-1, c.n_experts).mean(0)
    balance = c.n_experts * jnp.sum(f * importance)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return out, balance, z


def block(c: Llama, dtype, cos, sin, carry, p):
    x, aux = carry
    x = x + attention(c, dtype, rms_norm(x, p["attn_norm"], c.eps), p, cos, sin)
    h = rms_norm(x, p["mlp_norm"], c.eps)
    if c.n_experts:
        y, balance, z = moe(c, dtype, h, p)
        aux = aux + c.balance_weight * balance + c.z_weight * z
    else:
        y = swiglu(h, p["w_gate"].astype(dtype), p["w_up"].astype(dtype), p["w_down"].astype(dtype))
    return (x + y, aux), None


def head(params, x, norm, c: Llama, dtype):
    """fp32 logits over the real vocabulary of x after the final norm `norm`."""
    x = rms_norm(x, norm, c.eps)
    out = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dtype), preferred_element_type=jnp.float32)
    return out[..., :c.vocab_size]


def hidden(params, inputs, c: Llama, dtype=jnp.float32):
    """(the last layer's output for [batch, seq] inputs, the MoE auxiliary losses summed over the layers)."""
    cos, sin = rope_tables(c, inputs.shape[1])
    x = params["wte"].astype(dtype)[inputs]
    (x, aux), _ = jax.lax.scan(functools.partial(block, c, dtype, cos, sin), (x, jnp.float32(0)), params["layers"])
    return x, aux


def logits(params, inputs, c: Llama, dtype=jnp.float32):
    """(fp32 logits over the real vocabulary for [batch, seq] inputs, the MoE auxiliary losses averaged over
    the layers (0 for a dense model))."""
    x, aux = hidden(params, inputs, c, dtype)
    return head(params, x, params["norm"], c, dtype), aux / c.n_layers


def mtp_losses(params, tokens, x, c: Llama, dtype=jnp.float32):
    """(the mean over the D modules of each one's cross-entropy sum / the window's tokens, their MoE auxiliary
    losses summed) for a [batch, T + 1] window and the main model's last hidden state x [batch, T]."""
    b, T = x.shape[:2]
    ahead = jnp.concatenate([tokens, jnp.zeros((b, c.mtp_depth), tokens.dtype)], axis=1)  # zeros past the window
    cos, sin = rope_tables(c, T)
    total, aux, h = jnp.float32(0), jnp.float32(0), x
    for k in range(1, c.mtp_depth + 1):
        p = jax.tree.map(lambda a: a[k - 1], params["mtp"])
        e = params["wte"].astype(dtype)[ahead[:, k:k + T]]  # token i + k
        joined = jnp.concatenate([rms_norm(e, p["enorm"], c.eps), rms_norm(h, p["hnorm"], c.eps)], axis=-1)
        layer = jax.tree.map(lambda a: a[None], p["layer"])  # one layer, as `block` scans them
        (h, aux), _ = jax.lax.scan(functools.partial(block, c, dtype, cos, sin),
                                   (joined @ p["eh_proj"].astype(dtype), aux), layer)
        ce = optax.softmax_cross_entropy_with_integer_labels(head(params, h, p["norm"], c, dtype),
                                                             ahead[:, k + 1:k + 1 + T])
        total = total + jnp.sum(jnp.where(jnp.arange(T) < T - k, ce, 0.0)) / (b * T)  # token i + k + 1 in the window
    return total / c.mtp_depth, aux


def losses(params, tokens, c: Llama, dtype=jnp.float32):
    """(mean next-token cross-entropy over a [batch, seq_len + 1] window of tokens, plus mtp_weight times the
    prediction modules' mean loss with `mtp_depth`; the MoE auxiliary losses averaged over the MoE layers (0 for
    a dense model))."""
    x, aux = hidden(params, tokens[:, :-1], c, dtype)
    lm = optax.softmax_cross_entropy_with_integer_labels(head(params, x, params["norm"], c, dtype), tokens[:, 1:]).mean()
    if not c.mtp_depth:
        return lm, aux / c.n_layers
    mtp, more = mtp_losses(params, tokens, x, c, dtype)
    return lm + c.mtp_weight * mtp, (aux + more) / (c.n_layers + (c.mtp_depth if c.n_experts else 0))


def loss_fn(params, tokens, c: Llama, dtype=jnp.float32):
    """The objective: cross-entropy plus the MoE auxiliary losses."""
    lm, aux = losses(params, tokens, c, dtype)
    return lm + aux


def make_optimizer(lr=1e-3, warmup_steps=20, total_steps=200, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                   weight_decay=0.1, grad_clip=1.0) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with weight decay on the matrices that touch the model
    dimension (not the norms, not the router)."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, lr * min_lr_ratio)
    if warmup_steps:
        sched = functools.partial(lambda s, count: s(count + 1), sched)  # the first step uses lr / warmup, not 0
    decay = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: not path[-1].key.endswith("norm") and path[-1].key != "router", params)
    adamw = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay)
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw) if grad_clip > 0 else adamw


def make_train_step(c: Llama, tx: optax.GradientTransformation, dtype=jnp.float32):
    """jitted (params, opt_state, tokens) -> (params, opt_state, loss); params and opt_state are donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, c, dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step
