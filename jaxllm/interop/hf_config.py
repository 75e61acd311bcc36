"""A Hugging Face `config.json` as jaxllm model keys, and back.

`model_keys(hf)` reads the transformers-5 form (`rope_parameters`, `dtype`) and the older one (`rope_theta`,
`rope_scaling`, `torch_dtype`) into the same `model.*` keys, and refuses (ModelFileError, one line naming
the key) whatever jaxllm would not compute exactly as transformers does. `hf_config(m, ...)` writes the
older form, which transformers 4.x and 5.x both read.
"""

from __future__ import annotations

import json
import os

from jaxllm.errors import ModelFileError
from jaxllm.models import attention
from jaxllm.schema import FAMILIES, ModelConfig

MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "mixtral")
# What transformers 5's config classes assume when a key is absent, where the families differ.
ABSENT = {
    "llama": dict(num_key_value_heads=None, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=None,
                  max_position_embeddings=2048),
    "mistral": dict(num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                    max_position_embeddings=131072),
    "qwen2": dict(num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                  max_position_embeddings=32768),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                    max_position_embeddings=131072),
}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh form of GELU
# The model.* keys a checkpoint fixes (everything else a run may set: seq_len, remat, cp_*, ...).
ARCHITECTURE_KEYS = ("family", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                     "norm", "mlp", "positions", "max_positions", "attn_bias", "mlp_bias", "tie_embeddings",
                     "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_original_context", "sliding_window", "window_pattern", "pattern",
                     "moe.n_experts", "moe.top_k", "moe.d_ff", "moe.shared_expert")


def read(path: str) -> dict:
    """DIR/config.json as a dict; ModelFileError naming what is wrong."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ModelFileError(f"{path}: no such directory; give a Hugging Face model directory (config.json and "
                             "*.safetensors)")
    if not os.path.isfile(file):
        raise ModelFileError(f"{path}: no config.json; a Hugging Face model directory holds config.json and "
                             "*.safetensors")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{file}: not readable JSON ({e}); fix or replace the file") from None


def _refuse(hf: dict, key: str, why: str):
    raise ModelFileError(f"config.json {key}={hf.get(key)!r}: {why}; jaxllm refuses what it would not compute "
                         "exactly as transformers does")


def _gpt2(hf: dict) -> dict:
    if hf.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS:
        _refuse(hf, "activation_function", "gpt2 models here use gelu_new (tanh GELU)")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False)):
        if hf.get(key, ok) != ok:
            _refuse(hf, key, f"only {str(ok).lower()} is supported")
    d = hf["n_embd"]
    return dict(FAMILIES["gpt2"], family="gpt2", n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"], n_kv_heads=hf["n_head"],
                head_dim=0, d_ff=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"],
                max_positions=hf["n_positions"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=hf.get("tie_word_embeddings", True), pattern=["dense"], rope_scaling="none",
                sliding_window=0)


def _rope(hf: dict) -> dict:
    """RoPE keys from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (before)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", ABSENT[hf["model_type"]]["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    for key, value in (("partial_rotary_factor", hf.get("partial_rotary_factor")),
                       (f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"))):
        if value not in (None, 1.0):
            raise ModelFileError(f"config.json {key}={value!r}: RoPE on part of each head is not implemented; jaxllm "
                                 "refuses what it would not compute exactly as transformers does")
    if kind == "default":
        return dict(rope_theta=float(theta), rope_scaling="none")
    if kind != "llama3":
        raise ModelFileError(f"config.json {where}.rope_type={kind!r}: not supported (jaxllm has default and llama3 RoPE, "
                             "not linear, dynamic, yarn or longrope); jaxllm refuses what it would not compute "
                             "exactly as transformers does")
    return dict(rope_theta=float(theta), rope_scaling="llama3", rope_factor=float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_context=int(params["original_max_position_embeddings"]))


def _windows(hf: dict) -> dict:
    """`model.sliding_window` and `model.window_pattern` (which layers slide; empty: all) from config.json."""
    window = hf.get("sliding_window", ABSENT[hf["model_type"]]["sliding_window"]) or 0
    if hf.get("model_type") != "qwen2" or not window:
        return {"sliding_window": window, "window_pattern": []}
    if hf.get("layer_types") is not None:
        sliding = [kind == "sliding_attention" for kind in hf["layer_types"]]
    else:  # transformers 4.x: layers from max_window_layers on slide, when use_sliding_window
        n = hf["num_hidden_layers"]
        sliding = [hf.get("use_sliding_window", False) and i >= hf.get("max_window_layers", 0) for i in range(n)]
    if not any(sliding):
        return {"sliding_window": 0, "window_pattern": []}
    pattern = [] if all(sliding) else ["local" if s else "global" for s in sliding]
    return {"sliding_window": window, "window_pattern": pattern}


def _head_dim(hf: dict) -> int:
    """0 (d_model / n_heads) unless config.json names another head dimension."""
    named = hf.get("head_dim") or 0
    return 0 if named == hf["hidden_size"] // hf["num_attention_heads"] else named


def _llama_like(hf: dict) -> dict:
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(hf, "hidden_act", f"{hf['model_type']} models here use silu (SwiGLU)")
    if hf.get("pretraining_tp", 1) != 1:
        _refuse(hf, "pretraining_tp", "only 1 is supported")
    kind = hf["model_type"]
    attn_bias = "qkv" if kind == "qwen2" else "qkvo" if hf.get("attention_bias", False) else "none"
    absent = ABSENT[kind]
    family = "qwen2" if kind == "qwen2" else "llama"
    keys = dict(FAMILIES[family], family=family, n_layers=hf["num_hidden_layers"],
                d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads", absent["num_key_value_heads"]) or hf["num_attention_heads"],
                head_dim=_head_dim(hf), d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                attn_bias=attn_bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_embeddings=hf.get("tie_word_embeddings", False),
                max_positions=hf.get("max_position_embeddings", absent["max_position_embeddings"]),
                norm_eps=hf.get("rms_norm_eps", absent["rms_norm_eps"]),
                pattern=["dense"], **_windows(hf), **_rope(hf))
    if kind == "mixtral":
        if (hf.get("router_jitter_noise") or 0.0) > 0:
            _refuse(hf, "router_jitter_noise", "routing with noise is not deterministic; set it to 0")
        keys.update({"pattern": ["moe"], "moe.n_experts": hf["num_local_experts"],
                     "moe.top_k": hf["num_experts_per_tok"], "moe.d_ff": hf["intermediate_size"],
                     "moe.shared_expert": False,
                     # a run may change these three: dropless computes what transformers does; Mixtral trains
                     # with its load-balancing loss only
                     "moe.capacity_factor": 0.0, "moe.balance_weight": hf.get("router_aux_loss_coef", 0.02),
                     "moe.z_weight": 0.0})
    return keys


def model_keys(hf: dict) -> dict:
    """The `model.*` keys (dotted below `model`) of a Hugging Face config."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ModelFileError(f"config.json model_type={kind!r}: not supported; jaxllm reads "
                             f"{', '.join(MODEL_TYPES)}")
    return _gpt2(hf) if kind == "gpt2" else _llama_like(hf)


def source_dtype(hf: dict) -> str | None:
    """The dtype the config names (`dtype`, or `torch_dtype` before transformers 5), if any."""
    return hf.get("dtype") or hf.get("torch_dtype")


def model_type(m: ModelConfig) -> str:
    """The transformers model type that computes what `m` describes."""
    if m.mlp == "gelu_tanh":
        return "gpt2"
    if "moe" in m.pattern:
        return "mixtral"
    if m.attn_bias == "qkv":
        return "qwen2"
    return "mistral" if any(attention.layer_windows(m)) else "llama"


def _rope_out(m: ModelConfig) -> dict:
    if m.rope_scaling == "none":
        return {"rope_theta": m.rope_theta, "rope_scaling": None}
    return {"rope_theta": m.rope_theta, "rope_scaling": {
        "rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
        "high_freq_factor": m.rope_high_freq_factor, "original_max_position_embeddings": m.rope_original_context}}


def _qwen2_windows(m: ModelConfig) -> dict:
    """Qwen2's window keys: which layers slide as `layer_types` (transformers 5) and, where the sliding layers are
    the last ones, `max_window_layers` (4.x)."""
    windows = attention.layer_windows(m)
    if not m.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    sliding = [w > 0 for w in windows]
    out = {"use_sliding_window": True, "sliding_window": m.sliding_window,
           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    first = sliding.index(True)
    if all(sliding[first:]):
        out["max_window_layers"] = first
    return out


def hf_config(m: ModelConfig, dtype: str, extra: dict | None = None) -> dict:
    """config.json for `m` (transformers 4.x and 5.x read it); `extra` keeps a source's token ids and such."""
    kind = model_type(m)
    out = {k: v for k, v in (extra or {}).items() if k.endswith("token_id")}
    out.update(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=m.vocab_size,
               tie_word_embeddings=m.tie_embeddings, torch_dtype=dtype)
    if kind == "gpt2":
        if any(attention.layer_windows(m)):
            raise ModelFileError(f"model.sliding_window={m.sliding_window}: GPT-2's config.json has no attention "
                                 "window; export a model without one")
        out.update(n_layer=m.n_layers, n_embd=m.d_model, n_head=m.n_heads, n_inner=m.d_ff,
                   n_positions=m.max_positions or m.seq_len, layer_norm_epsilon=m.norm_eps,
                   activation_function="gelu_new")
        return out
    out.update(num_hidden_layers=m.n_layers, hidden_size=m.d_model, num_attention_heads=m.n_heads,
               num_key_value_heads=m.n_kv_heads or m.n_heads, head_dim=m.head_dim or m.d_model // m.n_heads,
               intermediate_size=m.d_ff, rms_norm_eps=m.norm_eps, hidden_act="silu",
               max_position_embeddings=m.max_positions or m.seq_len, **_rope_out(m))
    if kind == "llama":
        out.update(attention_bias=m.attn_bias == "qkvo", mlp_bias=m.mlp_bias)
    if kind in ("mistral", "mixtral"):
        if attention.windows_differ(m):
            raise ModelFileError(f"model.window_pattern={m.window_pattern}: a {kind} config.json has one window for "
                                 "every layer; export a model whose layers share one window")
        out["sliding_window"] = attention.layer_windows(m)[0] or None
    if kind == "qwen2":
        out.update(_qwen2_windows(m))
    if kind == "mixtral":
        out.update(num_local_experts=m.moe.n_experts, num_experts_per_tok=m.moe.top_k, router_jitter_noise=0.0,
                   intermediate_size=m.moe.d_ff or m.d_ff)
    return out


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}


def exportable(m: ModelConfig) -> None:
    """ModelFileError unless some transformers model computes exactly what `m` describes."""
    kind = model_type(m)
    fixed = ("norm", "mlp", "positions") + (("attn_bias", "mlp_bias") if kind == "gpt2" else ())  # the rest vary
    want = FAMILIES["gpt2" if kind == "gpt2" else "llama"]
    wrong = [f"model.{k}={getattr(m, k)!r}" for k in fixed if getattr(m, k) != want[k]]
    if kind == "qwen2" and m.mlp_bias:
        wrong.append("model.mlp_bias=true")
    if m.pattern not in (["dense"], ["moe"]) or m.moe.shared_expert and "moe" in m.pattern:
        wrong.append(f"model.pattern={m.pattern}")
    if kind == "gpt2" and (m.n_kv_heads not in (0, m.n_heads) or m.head_dim not in (0, m.d_model // m.n_heads)):
        wrong.append("grouped-query attention or a free head_dim")
    if wrong:
        raise ModelFileError(f"no transformers model type computes this model ({', '.join(wrong)} with "
                             f"model.mlp={m.mlp!r}); export supports {', '.join(MODEL_TYPES)}")
