"""GPT-2 and its training step written as plainly as JAX allows: the baseline for `tools.bench.train_step`.

One file, one params dict, one forward function, one jitted step. No mesh, no sharding
annotations, no logical names, no config tree. It computes exactly what jaxllm's gpt2
family computes, with the same shapes and FLOPs:

- learned token and position embeddings; the token table is tied to the LM head and has
  `padded_vocab` rows (the real vocabulary rounded up to a multiple of 128);
- pre-LayerNorm blocks (fp32 statistics), causal multi-head attention with biases, scores
  and softmax in fp32, a tanh-GELU MLP; layers stacked on a leading axis and run with
  `jax.lax.scan` (as jaxllm does);
- fp32 logits; the padded columns are sliced off before the cross-entropy (jaxllm adds a
  constant -1e30 to them instead, which keeps a tp-sharded vocab intact; the loss is the same);
- `optax.chain(clip_by_global_norm, adamw)` with decay on matrices only and jaxllm's
  warm-up + cosine schedule; one `jax.jit` step that donates params and optimizer state.

`from_jaxllm(params)` maps a jaxllm parameter tree onto this one (reshapes only), so tests
can check that both models compute the same loss for the same weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class GPT:
    vocab_size: int  # real vocabulary
    padded_vocab: int  # rows of the token table (vocab_size rounded up to a multiple of 128)
    seq_len: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    eps: float = 1e-5
    init_std: float = 0.02


def init_params(c: GPT, key: jax.Array) -> dict:
    """fp32 weights: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers)."""
    L, D, F, V = c.n_layers, c.d_model, c.d_ff, c.padded_vocab
    ks = iter(jax.random.split(key, 8))
    normal = lambda shape, std=c.init_std: std * jax.random.normal(next(ks), shape, jnp.float32)
    out_std = c.init_std / (2 * L) ** 0.5
    return {
        "wte": normal((V, D)),
        "wpe": normal((c.seq_len, D)),
        "layers": {  # every leaf has a leading n_layers axis
            "ln1_g": jnp.ones((L, D)), "ln1_b": jnp.zeros((L, D)),
            "wq": normal((L, D, D)), "wk": normal((L, D, D)), "wv": normal((L, D, D)),
            "bq": jnp.zeros((L, D)), "bk": jnp.zeros((L, D)), "bv": jnp.zeros((L, D)),
            "wo": normal((L, D, D), out_std), "bo": jnp.zeros((L, D)),
            "ln2_g": jnp.ones((L, D)), "ln2_b": jnp.zeros((L, D)),
            "w_fc": normal((L, D, F)), "b_fc": jnp.zeros((L, F)),
            "w_proj": normal((L, F, D), out_std), "b_proj": jnp.zeros((L, D)),
        },
        "lnf_g": jnp.ones((D,)), "lnf_b": jnp.zeros((D,)),
    }


def from_jaxllm(p: dict) -> dict:
    """The same weights from a jaxllm gpt2 parameter tree (pattern ["dense"])."""
    (b,) = p["blocks"]
    a, mlp = b["attn"], b["mlp"]
    L, D = a["wq"].shape[:2]
    flat = lambda x: x.reshape(L, -1)  # [L, H, Dh] -> [L, D]
    return {
        "wte": p["embed"]["tok"], "wpe": p["embed"]["pos"],
        "layers": {
            "ln1_g": b["ln1"]["scale"], "ln1_b": b["ln1"]["bias"],
            "wq": a["wq"].reshape(L, D, D), "wk": a["wk"].reshape(L, D, D), "wv": a["wv"].reshape(L, D, D),
            "bq": flat(a["bq"]), "bk": flat(a["bk"]), "bv": flat(a["bv"]),
            "wo": a["wo"].reshape(L, D, D), "bo": a["bo"],
            "ln2_g": b["ln2"]["scale"], "ln2_b": b["ln2"]["bias"],
            "w_fc": mlp["w_in"], "b_fc": mlp["b_in"], "w_proj": mlp["w_out"], "b_proj": mlp["b_out"],
        },
        "lnf_g": p["final_norm"]["scale"], "lnf_b": p["final_norm"]["bias"],
    }


def layer_norm(x, g, b, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * g + b).astype(x.dtype)


def block(c: GPT, dtype, x, p):
    B, T, D = x.shape
    H = c.n_heads
    w = lambda name: p[name].astype(dtype)

    h = layer_norm(x, p["ln1_g"], p["ln1_b"], c.eps)
    q = (h @ w("wq") + w("bq")).reshape(B, T, H, D // H)
    k = (h @ w("wk") + w("bk")).reshape(B, T, H, D // H)
    v = (h @ w("wv") + w("bv")).reshape(B, T, H, D // H)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * (D // H) ** -0.5, k, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(dtype)
    att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, D)
    x = x + att @ w("wo") + w("bo")

    h = layer_norm(x, p["ln2_g"], p["ln2_b"], c.eps)
    h = jax.nn.gelu(h @ w("w_fc") + w("b_fc"), approximate=True)
    return x + h @ w("w_proj") + w("b_proj"), None


def logits(params, inputs, c: GPT, dtype=jnp.float32):
    """(fp32 logits over the real vocabulary for [batch, seq] inputs, auxiliary losses: none in GPT-2)."""
    T = inputs.shape[1]
    wte = params["wte"].astype(dtype)
    x = wte[inputs] + params["wpe"][:T].astype(dtype)
    x, _ = jax.lax.scan(functools.partial(block, c, dtype), x, params["layers"])
    x = layer_norm(x, params["lnf_g"], params["lnf_b"], c.eps)
    return jnp.einsum("btd,vd->btv", x, wte, preferred_element_type=jnp.float32)[..., :c.vocab_size], jnp.float32(0)


def loss_fn(params, tokens, c: GPT, dtype=jnp.float32):
    """Mean next-token cross-entropy over a [batch, seq_len + 1] window of tokens."""
    out, _ = logits(params, tokens[:, :-1], c, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()


def losses(params, tokens, c: GPT, dtype=jnp.float32):
    """(cross-entropy, auxiliary losses): the interface `tools/reference/plain_llama.py` has; GPT-2 has no MoE."""
    return loss_fn(params, tokens, c, dtype), jnp.float32(0)


def make_optimizer(lr=1e-3, warmup_steps=20, total_steps=200, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                   weight_decay=0.1, grad_clip=1.0) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with weight decay on the weight matrices only."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, lr * min_lr_ratio)
    if warmup_steps:
        sched = functools.partial(lambda s, count: s(count + 1), sched)  # the first step uses lr / warmup, not 0
    decay = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key.startswith("w"), params)
    adamw = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay)
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw) if grad_clip > 0 else adamw


def make_train_step(c: GPT, tx: optax.GradientTransformation, dtype=jnp.float32):
    """jitted (params, opt_state, tokens) -> (params, opt_state, loss); params and opt_state are donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, c, dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step
