"""Qwen3-Next's full-attention features: the output gate (`model.attn_output_gate`: each head's output times
σ(x W_gate + b) before the output projection) and partial RoPE (`model.rope_fraction`: RoPE on each head's first
int(head_dim × fraction) dimensions, the rest passed as they are).

- The layer: jaxllm's attention layer (gate, rope_fraction 0.25, zero-centred q/k norms, grouped queries, with and
  without biases) equals transformers' `Qwen3NextAttention` with the same weights within 1e-5 (fp32); the same
  layer without the gate, or rotating the whole head, is far from it (the comparison sees both features).
- The frequencies: `partial_rotary_factor` read from a Qwen3-Next config.json (`interop/hf_config._rope`) gives
  transformers' `Qwen3NextRotaryEmbedding` frequencies and cos/sin factor, plain and scaled (linear, llama3, yarn);
  the other model types still refuse it (`tests/test_hf_refusals.py`).
- Generation: greedy decoding with the KV cache gives the whole-sequence forward's logits token by token.
- On a mesh (slow): sp2 × tp2 (the ring, zig-zag; the gate split over tp) gives one device's loss and gradients.
- Refusals: latent attention with either key, a fraction outside (0, 1] or one rotating an odd width.

Mutants the layer test was seen to catch (then restored): the gate dropped in `project_out`; `rope_dim` ignoring
`model.rope_fraction` (the whole head rotated).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, loss_and_grads, step_fns
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.interop import hf_config
from jaxllm.models import attention, transformer
from test_generate import assert_decodes_as_the_forward

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

D, H, KV, DH, FRACTION, EPS, THETA = 64, 4, 2, 16, 0.25, 1e-6, 10000.0
B, T = 2, 12


def _hf_config(bias: bool, rope: dict | None = None):
    from transformers import Qwen3NextConfig

    rope = {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": FRACTION, **(rope or {})}
    config = Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, head_dim=DH,
                             num_hidden_layers=1, rms_norm_eps=EPS, attention_bias=bias, rope_parameters=rope,
                             max_position_embeddings=256)
    config._attn_implementation = "eager"
    return config


def _torch_layer(bias: bool):
    """transformers' Qwen3NextAttention with every weight random (q/k norm weights off their zero init), and the
    same weights as jaxllm's `attn` parameters: q_proj's per-head [query | gate] rows split into wq and wg (bq and
    bg), every projection transposed to [in, out]."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    config = _hf_config(bias)
    torch.manual_seed(0)
    layer = qn.Qwen3NextAttention(config, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.3 if "norm" in name or "bias" in name else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    w = {name: param.detach().numpy() for name, param in layer.named_parameters()}
    q_and_gate = w["q_proj.weight"].reshape(H, 2, DH, D)  # per head: [query | gate] rows
    p = {"wq": q_and_gate[:, 0].transpose(2, 0, 1), "wg": q_and_gate[:, 1].transpose(2, 0, 1),
         "wk": w["k_proj.weight"].reshape(KV, DH, D).transpose(2, 0, 1),
         "wv": w["v_proj.weight"].reshape(KV, DH, D).transpose(2, 0, 1),
         "wo": w["o_proj.weight"].T.reshape(H, DH, D),
         "q_norm": {"scale": w["q_norm.weight"]}, "k_norm": {"scale": w["k_norm.weight"]}}
    if bias:
        q_and_gate_bias = w["q_proj.bias"].reshape(H, 2, DH)
        p.update(bq=q_and_gate_bias[:, 0], bg=q_and_gate_bias[:, 1], bk=w["k_proj.bias"].reshape(KV, DH),
                 bv=w["v_proj.bias"].reshape(KV, DH), bo=w["o_proj.bias"])
    return layer, qn.Qwen3NextRotaryEmbedding(config), jax.tree.map(jnp.asarray, p)


def _model(bias: bool):
    """jaxllm's model keys for the layer: Qwen3-Next's full attention (zero-centred q/k norms: norm_offset 1)."""
    keys = {"model.family": "llama", "model.d_model": D, "model.n_heads": H, "model.n_kv_heads": KV,
            "model.head_dim": DH, "model.qk_norm": True, "model.norm_offset": 1.0, "model.norm_eps": EPS,
            "model.rope_theta": THETA, "model.rope_fraction": FRACTION, "model.attn_output_gate": True,
            "model.attn_bias": "qkvo" if bias else "none", "model.vocab_size": 301, "model.seq_len": 32,
            "precision.compute": "float32"}
    return build_config(None, keys).model


def _ours(p, x, m):
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    with jax.default_matmul_precision("float32"):
        return np.asarray(attention.attention_layer(p, jnp.asarray(x), positions, jnp.ones((B, T), jnp.int32), m,
                                                    jnp.float32))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_layer_equals_transformers_qwen3_next_attention(bias):
    layer, rotary, p = _torch_layer(bias)
    m = _model(bias)
    assert set(p) == set(transformer.param_table(m)["blocks"][0]["attn"])  # the leaves jaxllm itself lays out
    assert attention.rope_dim(m) == int(DH * FRACTION) == 2 * rotary.inv_freq.shape[0]
    x = np.random.default_rng(2).normal(size=(B, T, D)).astype(np.float32)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        cos_sin = rotary(xt, torch.arange(T)[None].expand(B, T))
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        want = layer(xt, cos_sin, causal)[0].numpy()
    got = _ours(p, x, m)
    err = np.abs(got - want).max()
    assert err <= 1e-5 * max(1.0, np.abs(want).max()), (err, np.abs(want).max())
    # the comparison sees both features: without the gate, or with RoPE over the whole head, the layer is far off
    ungated = _ours({k: v for k, v in p.items() if k not in ("wg", "bg")}, x, m)
    whole = _ours(p, x, dataclasses.replace(m, rope_fraction=1.0))
    assert min(np.abs(ungated - want).max(), np.abs(whole - want).max()) > 1e-2 * np.abs(want).max()


ROPES = {"default": {}, "linear": {"rope_type": "linear", "factor": 4.0},
         "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 40},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("kind", list(ROPES))
def test_partial_rotary_factor_imports_as_transformers_computes_it(kind, monkeypatch):
    """A Qwen3-Next config.json's `partial_rotary_factor` (in `rope_parameters`, or at the top level as older files
    have it) becomes `model.rope_fraction`, and the frequencies over the rotated width, scaled as the file says,
    are `Qwen3NextRotaryEmbedding`'s (head_dim 64, so a quarter is 16 dimensions: 8 frequencies to scale)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    head = 64
    config = _hf_config(False, ROPES[kind])
    config.head_dim = head
    rotary = qn.Qwen3NextRotaryEmbedding(config)
    # the model type's absent-key defaults may not be listed yet (its import is built elsewhere); RoPE reads none
    monkeypatch.setitem(hf_config.ABSENT, "qwen3_next", hf_config.ABSENT.get("qwen3_next", {"rope_theta": THETA}))
    file = {"model_type": "qwen3_next", "max_position_embeddings": 256, "rope_parameters": dict(config.rope_parameters)}
    older = {**file, "partial_rotary_factor": FRACTION,
             "rope_parameters": {k: v for k, v in file["rope_parameters"].items() if k != "partial_rotary_factor"}}
    for hf in (file, older):
        keys = hf_config._rope(hf)
        assert keys["rope_fraction"] == FRACTION
        m = dataclasses.replace(_model(False), head_dim=head, **keys)
        np.testing.assert_allclose(np.asarray(attention.rope_frequencies(m)), rotary.inv_freq.numpy(), rtol=1e-6)
        assert attention.rope_scale(m) == pytest.approx(rotary.attention_scaling, rel=1e-6)


# ---------------------------------------------------------------- generation

PROMPTS = [list(range(5, 16)), list(range(40, 46))]  # left-padded by 0 and 5 in one batch
NEW = 10
GATED = {"model.attn_output_gate": True, "model.rope_fraction": FRACTION, "model.head_dim": 16,
         "model.qk_norm": True, "model.norm_offset": 1.0, "model.init_std": 0.1, "model.seq_len": 64}


@pytest.mark.slow
def test_cached_generation_with_the_gate_equals_the_whole_sequence_forward():
    cfg = equivalence_config("tiny-llama", **GATED)
    params = transformer.init_params(cfg.model, jax.random.key(0))
    assert params["blocks"][0]["attn"]["wg"].shape == (cfg.model.n_layers, 64, 8, 16)
    assert_decodes_as_the_forward(params, cfg, PROMPTS, NEW)


# ---------------------------------------------------------------- refusals

MLA = {"model.attention": "mla", "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 8,
       "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 8}


@pytest.mark.parametrize("keys,named", [
    ({**MLA, "model.attn_output_gate": True}, "set model.attn_output_gate=false"),  # the fix, as a key is written
    ({**MLA, "model.rope_fraction": 0.5}, "set model.rope_fraction=1.0"),
    ({"model.rope_fraction": 0.0}, "model.rope_fraction=0.0"),
    ({"model.rope_fraction": 1.5}, "model.rope_fraction=1.5"),
    ({"model.head_dim": 12, "model.rope_fraction": 0.25}, "RoPE's dimensions (3) must be even"),
    ({"model.head_dim": 8, "model.rope_fraction": 0.1}, "RoPE's dimensions (0) must be even and at least 2"),
], ids=["mla-gate", "mla-fraction", "zero", "above-one", "odd", "none"])
def test_what_cannot_run_is_refused_in_one_line(keys, named):
    with pytest.raises(ConfigError) as refused:
        validate(equivalence_config("tiny-llama", **keys), 1)
    assert named in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_what_can_run_is_accepted():
    validate(equivalence_config("tiny-llama", **GATED), 1)
    validate(equivalence_config("tiny-llama", **{"model.head_dim": 8, "model.rope_fraction": 0.75}), 1)  # 6 dims


# ---------------------------------------------------------------- on a mesh


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow  # the layer test above is the fast tier's
def test_on_sp2_tp2_the_gated_model_equals_one_device():
    """The ring (zig-zag) over sp with the gate split over tp as the queries: the loss and every gradient, wg's
    included, of one device."""
    gated = {k: v for k, v in GATED.items() if k != "model.seq_len"}  # the harness's batches are of its seq_len
    one = equivalence_config("tiny-llama", **gated)
    params = transformer.init_params(one.model, jax.random.key(0))
    loss, grads = loss_and_grads(step_fns(one), params)
    mesh = {"mesh.sp": 2, "mesh.tp": 2, "model.cp_strategy": "ring"}
    got_loss, got = loss_and_grads(step_fns(equivalence_config("tiny-llama", **gated, **mesh)), params)
    assert abs(float(got_loss) - float(loss)) <= 1e-5 * abs(float(loss)), (float(got_loss), float(loss))
    errors = {jax.tree_util.keystr(path): rel(a, b) for (path, a), b in
              zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(grads))}
    assert max(errors.values()) <= 1e-5, {k: e for k, e in errors.items() if e > 1e-5}
    assert np.abs(np.asarray(grads["blocks"][0]["attn"]["wg"])).max() > 0
