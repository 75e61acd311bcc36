"""A Hugging Face `config.json` as jaxllm model keys, and back.

`model_keys(hf)` reads the transformers-5 form (`rope_parameters`, `dtype`) and the older one (`rope_theta`,
`rope_scaling`, `torch_dtype`) into the same `model.*` keys, and refuses (ModelFileError, one line naming
the key) whatever jaxllm would not compute exactly as transformers does. `hf_config(m, ...)` writes the
older form, which transformers 4.x and 5.x both read.
"""

from __future__ import annotations

import functools
import json
import os

from jaxllm import stack
from jaxllm.errors import ModelFileError
from jaxllm.models import attention
from jaxllm.models.moe import has_router_bias
from jaxllm.models.transformer import shared_d_ff
from jaxllm.ops.activations import CLAMPED_ALPHA
from jaxllm.ops.rope import yarn_attention_factor
from jaxllm.schema import FAMILIES, ModelConfig

MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
               "gemma3_text", "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_next")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
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
    "qwen3": dict(num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                  max_position_embeddings=32768, head_dim=128),
    "qwen2_moe": dict(num_key_value_heads=16, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                      max_position_embeddings=32768, decoder_sparse_step=1, shared_expert_intermediate_size=5632,
                      norm_topk_prob=False, router_aux_loss_coef=0.001, qkv_bias=True),
    "qwen3_moe": dict(num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                      max_position_embeddings=32768, head_dim=None, decoder_sparse_step=1, norm_topk_prob=False,
                      router_aux_loss_coef=0.001),
    "gemma2": dict(num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                   max_position_embeddings=8192, head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6, sliding_window=4096,
                        max_position_embeddings=131072, head_dim=256, query_pre_attn_scalar=256,
                        attn_logit_softcapping=None, final_logit_softcapping=None, rope_local_base_freq=10000.0,
                        sliding_window_pattern=6),
    "gpt_oss": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                    max_position_embeddings=131072, head_dim=64, swiglu_limit=7.0, swiglu_alpha=CLAMPED_ALPHA,
                    attention_bias=True, router_aux_loss_coef=0.001),
    "llama4_text": dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, sliding_window=None,
                        max_position_embeddings=131072, head_dim=128, intermediate_size_mlp=16384,
                        interleave_moe_layer_step=1, no_rope_layer_interval=4, attention_chunk_size=8192,
                        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                        num_experts_per_tok=1, num_local_experts=16, router_aux_loss_coef=0.001, attention_bias=False),
    "qwen3_next": dict(num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=None,
                       max_position_embeddings=32768, head_dim=256, partial_rotary_factor=0.25, decoder_sparse_step=1,
                       num_experts=512, norm_topk_prob=True, router_aux_loss_coef=0.001,
                       shared_expert_intermediate_size=512, linear_conv_kernel_dim=4),
    "deepseek_v3": dict(num_key_value_heads=None, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=None,
                        max_position_embeddings=4096, head_dim=None, first_k_dense_replace=3, n_shared_experts=1,
                        n_routed_experts=256, num_experts_per_tok=8, norm_topk_prob=True, routed_scaling_factor=2.5,
                        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048, rope_interleave=True),
}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # Gemma's tanh GELU, under either name
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh form of GELU
# The model.* keys a checkpoint fixes (everything else a run may set: seq_len, remat, cp_*, ...).
ARCHITECTURE_KEYS = ("family", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
                     "norm", "mlp", "positions", "max_positions", "attn_bias", "mlp_bias", "tie_embeddings",
                     "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_original_context", "sliding_window", "window_pattern", "pattern",
                     "norm_offset", "norm_placement", "qk_norm", "embed_scale", "attn_softcap", "final_softcap",
                     "query_pre_attn_scalar", "rope_local_theta", "rope_beta_fast", "rope_beta_slow",
                     "rope_attention_factor", "rope_truncate",
                     "segments", "moe.n_experts", "moe.top_k", "moe.d_ff", "moe.n_shared_experts", "moe.shared_d_ff",
                     "moe.shared_gate", "moe.score", "moe.norm_topk", "moe.routed_scale", "moe.n_group",
                     "moe.topk_group", "moe.router_bias", "attention", "mla.q_lora_rank", "mla.kv_lora_rank",
                     "mla.qk_nope_head_dim", "mla.qk_rope_head_dim", "mla.v_head_dim", "rope_mscale_all_dim",
                     "mtp_depth", "mlp_limit", "attn_sinks", "moe.router_logit_bias", "moe.expert_biases",
                     "moe.gate_input", "attention_chunk", "rope_global", "attn_temperature_floor",
                     "attn_temperature_scale", "qk_l2_norm")


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_map(path: str) -> dict[str, str]:
    """Which file of the model directory `path` holds each tensor (from the index, or the single file's header)."""
    from safetensors import safe_open

    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            return dict(json.load(f)["weight_map"])
    if not os.path.isfile(os.path.join(path, SINGLE)):
        raise ModelFileError(f"{path}: neither {SINGLE} nor {INDEX}; jaxllm reads safetensors weights (convert "
                             ".bin files with transformers' save_pretrained(safe_serialization=True))")
    with safe_open(os.path.join(path, SINGLE), "numpy") as f:
        return {k: SINGLE for k in f.keys()}


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
    """RoPE keys from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (before); Gemma 3's
    per-layer-type parameters (`full_attention`, `sliding_attention`) or `rope_local_base_freq`;
    `partial_rotary_factor` as `rope_fraction` where the model type's attention rotates part of each head
    (Qwen3-Next's), refused for the others (their default RoPE ignores it and rotates the whole head, their
    scaled RoPE fails on it)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    local = {}
    if "full_attention" in params:  # transformers 5, one entry per layer type
        sliding = dict(params.get("sliding_attention") or {})
        if sliding.get("rope_type", "default") != "default":
            raise ModelFileError(f"config.json {where}.sliding_attention.rope_type={sliding['rope_type']!r}: jaxllm's "
                                 "local layers take unscaled RoPE; jaxllm refuses what it would not compute exactly as "
                                 "transformers does")
        local = {"rope_local_theta": float(sliding.get("rope_theta", ABSENT["gemma3_text"]["rope_local_base_freq"]))}
        params, where = dict(params["full_attention"]), f"{where}.full_attention"
    elif hf["model_type"] == "gemma3_text":
        local = {"rope_local_theta": float(hf.get("rope_local_base_freq") or
                                           ABSENT["gemma3_text"]["rope_local_base_freq"])}
    theta = params.get("rope_theta", hf.get("rope_theta", ABSENT[hf["model_type"]]["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",  # transformers' precedence
                                                         ABSENT[hf["model_type"]].get("partial_rotary_factor")))
    for key, value in (("partial_rotary_factor", hf.get("partial_rotary_factor")),
                       (f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"))):
        if value not in (None, 1.0) and hf["model_type"] != "qwen3_next":
            raise ModelFileError(f"config.json {key}={value!r}: transformers' {hf['model_type']} rotates the whole "
                                 "head with default RoPE whatever this says (and fails with a scaled one); jaxllm "
                                 "refuses what it would not compute exactly as transformers does")
    if partial not in (None, 1.0):  # returned beside the local layers' keys, whatever the RoPE type
        local["rope_fraction"] = float(partial)
    if kind == "default":
        return dict(rope_theta=float(theta), rope_scaling="none", **local)
    if kind == "linear":
        return dict(rope_theta=float(theta), rope_scaling="linear", rope_factor=float(params["factor"]), **local)
    if kind == "yarn":
        return dict(rope_theta=float(theta), **_yarn(hf, params, where), **local)
    if kind != "llama3":
        raise ModelFileError(f"config.json {where}.rope_type={kind!r}: not supported (jaxllm has default, linear, "
                             "llama3 and yarn RoPE, not dynamic or longrope); jaxllm refuses what it would not compute "
                             "exactly as transformers does")
    return dict(rope_theta=float(theta), rope_scaling="llama3", rope_factor=float(params["factor"]), **local,
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_context=int(params["original_max_position_embeddings"]))


def _yarn(hf: dict, params: dict, where: str) -> dict:
    """YaRN's keys as transformers' `_compute_yarn_parameters` reads them: the factor (or max / original
    positions), the attention factor (given, or from mscale and mscale_all_dim, or from the factor), the betas
    and `truncate`."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ModelFileError(f"config.json {where}.original_max_position_embeddings: yarn needs it; jaxllm refuses "
                             "what it would not compute exactly as transformers does")
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
    return dict(rope_scaling="yarn", rope_factor=float(factor), rope_original_context=int(original),
                rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                rope_attention_factor=float(attention or 0.0), rope_truncate=bool(params.get("truncate", True)))


def _windows(hf: dict) -> dict:
    """`model.sliding_window` and `model.window_pattern` (which layers slide; empty: all) from config.json."""
    kind, n = hf.get("model_type"), hf["num_hidden_layers"]
    if kind in QWEN_MOE:  # no windows (`_qwen_moe` refuses use_sliding_window)
        return {"sliding_window": 0, "window_pattern": []}
    window = hf.get("sliding_window", ABSENT[kind]["sliding_window"]) or 0
    if kind not in ("qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss") or not window:
        return {"sliding_window": window, "window_pattern": []}
    if hf.get("layer_types") is not None:
        sliding = [t == "sliding_attention" for t in hf["layer_types"]]
    elif kind == "gemma2":  # transformers 4.x: every even layer slides
        sliding = [i % 2 == 0 for i in range(n)]
    elif kind == "gemma3_text":  # 4.x: all but every sliding_window_pattern-th layer
        every = hf.get("sliding_window_pattern") or ABSENT[kind]["sliding_window_pattern"]
        sliding = [(i + 1) % every != 0 for i in range(n)]
    else:  # Qwen, transformers 4.x: layers from max_window_layers on slide, when use_sliding_window
        sliding = [hf.get("use_sliding_window", False) and i >= hf.get("max_window_layers", 0) for i in range(n)]
    if not any(sliding):
        return {"sliding_window": 0, "window_pattern": []}
    pattern = [] if all(sliding) else ["local" if s else "global" for s in sliding]
    return {"sliding_window": window, "window_pattern": pattern}


def _head_dim(hf: dict) -> int:
    """0 (d_model / n_heads) unless config.json names another head dimension."""
    named = hf.get("head_dim") or 0
    return 0 if named == hf["hidden_size"] // hf["num_attention_heads"] else named


def _value(hf: dict, key: str):
    """config.json's `key`, or what transformers 5 assumes for the model type when the file lacks it (`ABSENT`)."""
    return hf.get(key, ABSENT[hf["model_type"]].get(key))


def _decoder(hf: dict, family: str, tied: bool) -> dict:
    """The keys every llama-shaped config.json gives alike: the family's features, the sizes, the head, norms,
    windows and RoPE; a key the file lacks takes the family's transformers default (`ABSENT`; `tied` for the
    head)."""
    value = functools.partial(_value, hf)
    return dict(FAMILIES[family], family=family, n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
                n_heads=hf["num_attention_heads"], n_kv_heads=value("num_key_value_heads") or hf["num_attention_heads"],
                head_dim=_head_dim({**hf, "head_dim": value("head_dim")}), d_ff=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], tie_embeddings=hf.get("tie_word_embeddings", tied),
                max_positions=value("max_position_embeddings"), norm_eps=value("rms_norm_eps"), pattern=["dense"],
                **_windows(hf), **_rope(hf))


def _llama_like(hf: dict) -> dict:
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(hf, "hidden_act", f"{hf['model_type']} models here use silu (SwiGLU)")
    if hf.get("pretraining_tp", 1) != 1:
        _refuse(hf, "pretraining_tp", "only 1 is supported")
    kind = hf["model_type"]
    family = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}.get(kind, "llama")
    attn_bias = "qkv" if family == "qwen2" else "qkvo" if hf.get("attention_bias", False) else "none"
    keys = dict(_decoder(hf, family, tied=False), attn_bias=attn_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)))
    if kind == "mixtral":
        if (hf.get("router_jitter_noise") or 0.0) > 0:
            _refuse(hf, "router_jitter_noise", "routing with noise is not deterministic; set it to 0")
        keys.update(_experts(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], True,
                             hf.get("router_aux_loss_coef", 0.02)), pattern=["moe"])
    if kind in QWEN_MOE:
        keys.update(_qwen_moe(hf))
    return keys


def _experts(n: int, k: int, d_ff: int, norm_topk: bool, balance_weight: float, shared: int = 0,
             gate: bool = False) -> dict:
    """An MoE checkpoint's expert keys: softmax top-k routing (transformers' Mixtral and Qwen MoE routers), `shared`
    the hidden size of a shared expert (0: none), maybe gated. One expert per token with normalised weights is
    refused: transformers gives it the weight 1, jaxllm's top-1 the router's score (Switch's gate)."""
    if k == 1 and norm_topk:
        raise ModelFileError("config.json num_experts_per_tok=1 with normalised top-k weights (norm_topk_prob, or "
                             "Mixtral's router): transformers weighs the one expert by 1, jaxllm's top-1 by the "
                             "router's score; jaxllm refuses what it would not compute exactly as transformers does")
    return {"moe.n_experts": n, "moe.top_k": k, "moe.d_ff": d_ff, "moe.n_shared_experts": int(shared > 0),
            "moe.shared_d_ff": shared, "moe.shared_gate": gate and shared > 0, "moe.score": "softmax",
            "moe.norm_topk": norm_topk, "moe.routed_scale": 1.0, "moe.n_group": 1, "moe.topk_group": 1,
            # a run may change these three: dropless computes what transformers does; it trains with its
            # load-balancing loss only
            "moe.capacity_factor": 0.0, "moe.balance_weight": balance_weight, "moe.z_weight": 0.0}


def _stack_keys(kinds: list[str]) -> dict:
    """`model.pattern` or `model.segments` for each layer's block kind (one pattern where the kinds repeat one)."""
    segments = stack.from_layer_kinds(kinds)
    return {"pattern": segments[0]["pattern"], "segments": []} if len(segments) == 1 else {"segments": segments}


def _gpt_oss(hf: dict) -> dict:
    """gpt-oss: attention sinks, q/k/v/o biases, windows on the layers `layer_types` names, YaRN; every layer MoE,
    the router with a bias and a softmax over the chosen experts' logits (= the softmax over all of them
    renormalised over the chosen: `norm_topk`), experts with biases and the clamped SwiGLU."""
    value = functools.partial(_value, hf)
    if value("swiglu_alpha") != CLAMPED_ALPHA:
        _refuse(hf, "swiglu_alpha", f"jaxllm's clamped SwiGLU has gpt-oss's {CLAMPED_ALPHA}")
    keys = dict(_decoder(hf, "llama", tied=False), attn_bias="qkvo" if value("attention_bias") else "none",
                mlp_bias=False, mlp="swiglu_clamped", mlp_limit=float(value("swiglu_limit")), attn_sinks=True,
                pattern=["moe"])
    keys.update(_experts(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], True,
                         value("router_aux_loss_coef")))
    return {**keys, "moe.router_logit_bias": True, "moe.expert_biases": True}


def _llama4(hf: dict) -> dict:
    """Llama 4's text model: the layers `no_rope_layers` marks 1 have RoPE (interleaved pairs, read as halves by
    the table), chunked local attention (`attention_chunk_size`) and the weightless q/k norm (`use_qk_norm`), the
    others no positions and attention temperature tuning (`floor_scale`, `attn_scale`); `moe_layers` (or every
    `interleave_moe_layer_step`-th layer) MoE with one shared expert and top-k sigmoid routing whose score scales
    the expert's input, the rest dense of `intermediate_size_mlp`."""
    value, n = functools.partial(_value, hf), hf["num_hidden_layers"]
    if (hf.get("router_jitter_noise") or 0.0) > 0:
        _refuse(hf, "router_jitter_noise", "routing with noise is not deterministic; set it to 0")
    rope = hf.get("no_rope_layers") or [int((i + 1) % value("no_rope_layer_interval") != 0) for i in range(n)]
    step = value("interleave_moe_layer_step")
    moe_layers = hf.get("moe_layers")
    moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
    chunk = hf.get("attention_chunk_size", ABSENT["llama4_text"]["attention_chunk_size"]) or 0
    keys = dict(_decoder(hf, "llama", tied=False), d_ff=value("intermediate_size_mlp"), mlp_bias=False,
                attn_bias="qkvo" if value("attention_bias") else "none", sliding_window=0,
                window_pattern=[] if all(rope) else ["local" if r else "global" for r in rope],
                attention_chunk=chunk, rope_global=all(rope), qk_l2_norm=bool(value("use_qk_norm")),
                attn_temperature_floor=value("floor_scale") if value("attn_temperature_tuning") else 0,
                attn_temperature_scale=float(value("attn_scale")),
                **_stack_keys(["moe" if i in moe_layers else "dense" for i in range(n)]))
    d_ff = hf["intermediate_size"]
    keys.update(_experts(value("num_local_experts"), value("num_experts_per_tok"), d_ff, False,
                         value("router_aux_loss_coef"), shared=d_ff))
    return {**keys, "moe.score": "sigmoid", "moe.gate_input": True}


def _qwen_moe(hf: dict) -> dict:
    """Qwen2-MoE and Qwen3-MoE: which layers are MoE (`mlp_only_layers`, `decoder_sparse_step`) as the stack's
    segments, the experts and Qwen2-MoE's gated shared expert."""
    kind, value = hf["model_type"], functools.partial(_value, hf)
    if hf.get("use_sliding_window"):
        _refuse(hf, "use_sliding_window", f"windows in {kind} are not implemented")
    if kind == "qwen2_moe" and not value("qkv_bias"):
        _refuse(hf, "qkv_bias", "Qwen2-MoE here has q, k and v biases")
    n = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]  # Qwen3-MoE in transformers 5: the latter
    step, dense = value("decoder_sparse_step"), set(hf.get("mlp_only_layers") or [])
    kinds = ["moe" if i not in dense and n > 0 and (i + 1) % step == 0 else "dense"
             for i in range(hf["num_hidden_layers"])]
    layout = _stack_keys(kinds)
    shared = value("shared_expert_intermediate_size") if kind == "qwen2_moe" else 0
    return {**layout, **_experts(n, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                                 bool(value("norm_topk_prob")), value("router_aux_loss_coef"), shared, gate=True)}


LAYER_KINDS = {(False, False): "dense", (False, True): "moe", (True, False): "linear", (True, True): "linear_moe"}


def _qwen3_next(hf: dict, tensors=lambda: ()) -> dict:
    """Qwen3-Next: Qwen3's attention with an output gate (`attn_output_gate`), partial RoPE and zero-centred norms
    (x̂ · (1 + w): `norm_offset` 1); Gated DeltaNet on the `linear_attention` layers of `layer_types`
    (`model.linear_attn`); MoE layers (`mlp_only_layers`, `decoder_sparse_step`) with a sigmoid-gated shared
    expert, the rest dense; its prediction module (`mtp.*`, which transformers does not read) as `model.mtp_depth`
    = 1 where the files hold it."""
    value, n = functools.partial(_value, hf), hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(hf, "hidden_act", "Qwen3-Next here uses silu (SwiGLU)")
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if set(types) - {"linear_attention", "full_attention"}:
        _refuse(hf, "layer_types", "Qwen3-Next's layers are linear_attention or full_attention")
    experts, step, dense = value("num_experts"), value("decoder_sparse_step"), set(hf.get("mlp_only_layers") or [])
    moe = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]
    keys = dict(_decoder(hf, "qwen3", tied=False), norm_offset=1.0, attn_output_gate=True, mlp_bias=False,
                attn_bias="qkvo" if hf.get("attention_bias") else "none",
                **_stack_keys([LAYER_KINDS[t == "linear_attention", e] for t, e in zip(types, moe)]),
                **{"linear_attn.num_k_heads": hf["linear_num_key_heads"],
                   "linear_attn.num_v_heads": hf["linear_num_value_heads"],
                   "linear_attn.head_k_dim": hf["linear_key_head_dim"],
                   "linear_attn.head_v_dim": hf["linear_value_head_dim"],
                   "linear_attn.conv_kernel": value("linear_conv_kernel_dim")},
                mtp_depth=_qwen3_next_mtp(hf, tensors))
    if any(moe):
        keys.update(_experts(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                             bool(value("norm_topk_prob")), value("router_aux_loss_coef"),
                             value("shared_expert_intermediate_size"), gate=True))
    return keys


def _qwen3_next_mtp(hf: dict, tensors) -> int:
    """1 if the files hold Qwen3-Next's prediction module (its projection `mtp.fc`), else 0; more than one module
    (whose blocks would share one projection and norms, used in turn) refused."""
    if "mtp.fc.weight" not in tensors():
        return 0
    depth = hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 1
    if depth != 1:
        _refuse(hf, "num_nextn_predict_layers", "jaxllm reads Qwen3-Next's one prediction module (each of its own "
                "modules has its own projection and norms)")
    return 1


def _deepseek(hf: dict, tensors=lambda: ()) -> dict:
    """DeepSeek-V3: latent attention; `first_k_dense_replace` dense layers, then MoE layers with sigmoid scores,
    group-limited top-k, the routing bias (`e_score_correction_bias`, fixed unless a run moves it) and shared
    experts; the softmax scale's `mscale_all_dim`; the multi-token prediction layers
    (`num_nextn_predict_layers`) where the files hold them (`tensors()`: their tensor names; transformers saves
    none)."""
    value = functools.partial(_value, hf)
    if hf.get("attention_bias"):
        _refuse(hf, "attention_bias", "not implemented")
    if value("num_key_value_heads") not in (None, hf["num_attention_heads"]):
        _refuse(hf, "num_key_value_heads", "latent attention expands the latent to every query head")
    n, dense = hf["num_hidden_layers"], value("first_k_dense_replace")
    layout = _stack_keys(["dense"] * min(dense, n) + ["moe"] * max(n - dense, 0))
    moe_d_ff = value("moe_intermediate_size")
    experts = _experts(value("n_routed_experts"), value("num_experts_per_tok"), moe_d_ff, bool(value("norm_topk_prob")),
                       0.0, moe_d_ff * value("n_shared_experts"))
    experts.update({"moe.n_shared_experts": value("n_shared_experts"), "moe.score": "sigmoid",
                    "moe.routed_scale": float(value("routed_scaling_factor")), "moe.n_group": value("n_group"),
                    "moe.topk_group": value("topk_group"), "moe.router_bias": True})
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    return dict(_decoder(hf, "llama", tied=False), **layout, **experts, attention="mla", n_kv_heads=0, head_dim=0,
                **{"mla.q_lora_rank": value("q_lora_rank") or 0, "mla.kv_lora_rank": value("kv_lora_rank"),
                   "mla.qk_nope_head_dim": value("qk_nope_head_dim"), "mla.qk_rope_head_dim": value("qk_rope_head_dim"),
                   "mla.v_head_dim": value("v_head_dim")},
                rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0) if scaled else 0.0,
                mtp_depth=_mtp_layers(hf, tensors))


def _mtp_layers(hf: dict, tensors) -> int:
    """The multi-token prediction layers config.json names, if the files hold the first one's projection."""
    depth = hf.get("num_nextn_predict_layers") or 0
    return depth if depth and f"model.layers.{hf['num_hidden_layers']}.eh_proj.weight" in tensors() else 0


def rope_interleaved(hf: dict) -> bool:
    """Whether a checkpoint's RoPE dimensions are interleaved pairs (DeepSeek-V3's `rope_interleave`), read as
    halves at import (`hf_tables`)."""
    return hf.get("model_type") == "deepseek_v3" and bool(_value(hf, "rope_interleave"))


def _gemma(hf: dict) -> dict:
    """Gemma 2 and Gemma 3 (text): the llama-like shape with Gemma's features."""
    kind = hf["model_type"]
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in GEMMA_ACTIVATIONS:
        _refuse(hf, "hidden_activation", "Gemma models here use the tanh GELU (gelu_pytorch_tanh)")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(key):
            _refuse(hf, key, "not implemented")
    value = functools.partial(_value, hf)
    return dict(_decoder(hf, "gemma3" if kind == "gemma3_text" else "gemma2", tied=True),
                query_pre_attn_scalar=float(value("query_pre_attn_scalar")),
                attn_softcap=float(value("attn_logit_softcapping") or 0.0),
                final_softcap=float(value("final_logit_softcapping") or 0.0))


def text_config(hf: dict) -> dict:
    """The language model's config.json keys: a multimodal Gemma 3's or Llama 4's `text_config`, or `hf` itself."""
    text = {"gemma3": "gemma3_text", "llama4": "llama4_text"}.get(hf.get("model_type"))
    if text is None:
        return hf
    return {"model_type": text, **hf.get("text_config", {})}


def fp8_blocks(hf: dict) -> tuple[int, int] | None:
    """The weight block (rows, columns) of a block-FP8 checkpoint (`quantization_config` with `quant_method` fp8,
    as DeepSeek-V3 and Qwen3's FP8 releases publish them: E4M3 weights, `weight_scale_inv` per block); None
    without a quantization_config; ModelFileError (one line) for another kind of quantization."""
    q = hf.get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFileError(f"config.json quantization_config={q!r}: jaxllm reads block FP8 (quant_method 'fp8', "
                             "fmt e4m3, weight_block_size [rows, columns]); dequantize other kinds to bf16 first")
    return block[0], block[1]


def model_keys(hf: dict, path: str | None = None) -> dict:
    """The `model.*` keys (dotted below `model`) of a Hugging Face config (a multimodal Gemma 3: its text tower);
    `path`, the model directory, where the weights decide a key (DeepSeek-V3's prediction layers)."""
    fp8_blocks(hf)  # block-FP8 weights are dequantized as they are read (`hf.Files`); other quantization is refused
    hf = text_config(hf)
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ModelFileError(f"config.json model_type={kind!r}: not supported; jaxllm reads "
                             f"{', '.join(MODEL_TYPES)} and gemma3's text tower")
    if kind == "gpt2":
        return _gpt2(hf)
    if kind == "deepseek_v3":
        return _deepseek(hf, lambda: weight_map(path) if path else {})
    if kind == "gpt_oss":
        return _gpt_oss(hf)
    if kind == "llama4_text":
        return _llama4(hf)
    if kind == "qwen3_next":
        return _qwen3_next(hf, lambda: weight_map(path) if path else {})
    return _gemma(hf) if kind.startswith("gemma") else _llama_like(hf)


def source_dtype(hf: dict) -> str | None:
    """The dtype the config names (`dtype`, or `torch_dtype` before transformers 5), if any."""
    return hf.get("dtype") or hf.get("torch_dtype")


def model_type(m: ModelConfig) -> str:
    """The transformers model type that computes what `m` describes."""
    if m.mlp == "swiglu_clamped":
        return "gpt_oss"
    if any(_qwen3_next_features(m).values()):
        return "qwen3_next"
    if any(_llama4_features(m).values()):
        return "llama4_text"
    if m.mlp == "gelu_tanh":
        return "gpt2"
    if m.mlp == "geglu_tanh":
        return "gemma3_text" if m.qk_norm else "gemma2"
    if m.attention == "mla":
        return "deepseek_v3"
    if stack.has_moe(m):
        return "qwen3_moe" if m.qk_norm else "qwen2_moe" if m.attn_bias == "qkv" else "mixtral"
    if m.qk_norm:
        return "qwen3"
    if m.attn_bias == "qkv":
        return "qwen2"
    return "mistral" if any(attention.layer_windows(m)) else "llama"


def _rope_out(m: ModelConfig) -> dict:
    if m.rope_scaling == "none":
        scaling = None
    elif m.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": m.rope_factor}
    elif m.rope_scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": m.rope_factor, "original_max_position_embeddings":
                   m.rope_original_context, "beta_fast": m.rope_beta_fast, "beta_slow": m.rope_beta_slow,
                   "truncate": m.rope_truncate}
        if m.rope_attention_factor:  # 0: YaRN's own, from the factor
            scaling["attention_factor"] = m.rope_attention_factor
    else:
        scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                   "high_freq_factor": m.rope_high_freq_factor,
                   "original_max_position_embeddings": m.rope_original_context}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}


def _layer_types(m: ModelConfig) -> list[str]:
    return ["sliding_attention" if w else "full_attention" for w in attention.layer_windows(m)]


def _qwen2_windows(m: ModelConfig) -> dict:
    """Qwen2's (and Qwen3's) window keys: which layers slide as `layer_types` (transformers 5) and, where the sliding
    layers are the last ones, `max_window_layers` (4.x)."""
    windows = attention.layer_windows(m)
    if not m.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    sliding = [w > 0 for w in windows]
    out = {"use_sliding_window": True, "sliding_window": m.sliding_window, "layer_types": _layer_types(m)}
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
               intermediate_size=m.d_ff, rms_norm_eps=m.norm_eps, max_position_embeddings=m.max_positions or m.seq_len,
               **_rope_out(m))
    if kind.startswith("gemma"):
        out.update(_gemma_out(m))
        return out
    out["hidden_act"] = "silu"
    if kind in ("llama", "qwen3"):
        out.update(attention_bias=m.attn_bias == "qkvo", mlp_bias=m.mlp_bias)
    if kind in ("mistral", "mixtral"):
        if attention.windows_differ(m):
            raise ModelFileError(f"model.window_pattern={m.window_pattern}: a {kind} config.json has one window for "
                                 "every layer; export a model whose layers share one window")
        out["sliding_window"] = attention.layer_windows(m)[0] or None
    if kind in ("qwen2", "qwen3"):
        out.update(_qwen2_windows(m))
    if kind == "mixtral":
        out.update(num_local_experts=m.moe.n_experts, num_experts_per_tok=m.moe.top_k, router_jitter_noise=0.0,
                   intermediate_size=m.moe.d_ff or m.d_ff)
    if kind in QWEN_MOE:
        out.update(_qwen_moe_out(m))
    if kind == "deepseek_v3":
        out.update(_deepseek_out(m))
    if kind == "llama4_text":
        out.update(_llama4_out(m))
    if kind == "qwen3_next":
        out.update(_qwen3_next_out(m))
    if kind == "gpt_oss":
        out.update(attention_bias=m.attn_bias == "qkvo", sliding_window=m.sliding_window or None,
                   layer_types=_layer_types(m), num_local_experts=m.moe.n_experts, num_experts_per_tok=m.moe.top_k,
                   intermediate_size=m.moe.d_ff or m.d_ff, swiglu_limit=m.mlp_limit, swiglu_alpha=CLAMPED_ALPHA,
                   router_aux_loss_coef=m.moe.balance_weight)
    return out


def _deepseek_out(m: ModelConfig) -> dict:
    """DeepSeek-V3's keys: the latent attention's sizes (RoPE rows written interleaved, as published), the dense
    layers first, the experts and their routing, the multi-token prediction layers."""
    e, a, kinds = m.moe, m.mla, stack.layer_kinds(m)
    moe_d_ff = e.d_ff or m.d_ff
    out = {"num_key_value_heads": m.n_heads, "head_dim": a.qk_rope_head_dim, "q_lora_rank": a.q_lora_rank or None,
           "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
           "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": True,
           "attention_bias": False, "num_nextn_predict_layers": m.mtp_depth,
           "first_k_dense_replace": kinds.index("moe") if "moe" in kinds else len(kinds),
           "n_routed_experts": e.n_experts, "num_experts_per_tok": e.top_k, "moe_intermediate_size": moe_d_ff,
           "n_shared_experts": shared_d_ff(m) // moe_d_ff, "norm_topk_prob": e.norm_topk,
           "routed_scaling_factor": e.routed_scale, "n_group": e.n_group, "topk_group": e.topk_group}
    if m.rope_mscale_all_dim and m.rope_scaling != "none":
        out["rope_scaling"] = dict(_rope_out(m)["rope_scaling"] or {}, mscale_all_dim=m.rope_mscale_all_dim)
    return out


def _llama4_out(m: ModelConfig) -> dict:
    """Llama 4's keys: which layers have RoPE (and chunks, the q/k norm) and which are MoE, the two widths, the
    temperature tuning."""
    rope = [m.rope_global or local for local in attention.local_layers(m)]
    return {"attention_bias": m.attn_bias == "qkvo", "intermediate_size": m.moe.d_ff or m.d_ff,
            "intermediate_size_mlp": m.d_ff, "num_local_experts": m.moe.n_experts,
            "num_experts_per_tok": m.moe.top_k, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": m.moe.balance_weight,
            "moe_layers": [i for i, k in enumerate(stack.layer_kinds(m)) if k == "moe"],
            "no_rope_layers": [int(r) for r in rope], "attention_chunk_size": m.attention_chunk or None,
            "use_qk_norm": m.qk_l2_norm, "attn_temperature_tuning": m.attn_temperature_floor > 0,
            "floor_scale": m.attn_temperature_floor or 8192, "attn_scale": m.attn_temperature_scale}


def _qwen_moe_out(m: ModelConfig) -> dict:
    """Qwen MoE's expert keys; which layers are dense as `mlp_only_layers`."""
    out = {"num_experts": m.moe.n_experts, "num_experts_per_tok": m.moe.top_k, "moe_intermediate_size":
           m.moe.d_ff or m.d_ff, "norm_topk_prob": m.moe.norm_topk, "router_aux_loss_coef": m.moe.balance_weight,
           "decoder_sparse_step": 1, "mlp_only_layers": [i for i, k in enumerate(stack.layer_kinds(m)) if k == "dense"],
           "use_sliding_window": False}
    if m.qk_norm:
        out["attention_bias"] = m.attn_bias == "qkvo"
    else:
        out.update(qkv_bias=True, shared_expert_intermediate_size=shared_d_ff(m))
    return out


def _qwen3_next_out(m: ModelConfig) -> dict:
    """Qwen3-Next's own keys: which layers are linear (`layer_types`) and which dense (`mlp_only_layers`), the
    linear layers' sizes, the partial RoPE, the experts."""
    a, kinds = m.linear_attn, stack.layer_kinds(m)
    out = {"attention_bias": m.attn_bias == "qkvo", "partial_rotary_factor": m.rope_fraction,
           "layer_types": ["linear_attention" if stack.is_linear(k) else "full_attention" for k in kinds],
           "linear_num_key_heads": a.num_k_heads, "linear_num_value_heads": a.num_v_heads,
           "linear_key_head_dim": a.head_k_dim, "linear_value_head_dim": a.head_v_dim,
           "linear_conv_kernel_dim": a.conv_kernel, "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i, k in enumerate(kinds) if not stack.is_moe(k)]}
    if stack.has_moe(m):
        out.update(num_experts=m.moe.n_experts, num_experts_per_tok=m.moe.top_k, moe_intermediate_size=m.moe.d_ff
                   or m.d_ff, shared_expert_intermediate_size=shared_d_ff(m), norm_topk_prob=m.moe.norm_topk,
                   router_aux_loss_coef=m.moe.balance_weight)
    else:
        out["num_experts"] = 0
    return out


def _gemma_out(m: ModelConfig) -> dict:
    """Gemma 2's and Gemma 3's own keys: activation, score scale, soft caps, which layers slide, local RoPE."""
    scalar = m.query_pre_attn_scalar or m.head_dim or m.d_model // m.n_heads
    out = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
           "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # transformers: an int
           "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None,
           "sliding_window": m.sliding_window or None, "layer_types": _layer_types(m)}
    if m.qk_norm:  # gemma3_text: its local layers' RoPE, and the 4.x form of which layers slide where it has one
        out["rope_local_base_freq"] = m.rope_local_theta or m.rope_theta
        every = len(m.window_pattern)
        if m.window_pattern == ["local"] * (every - 1) + ["global"]:
            out["sliding_window_pattern"] = every
    return out


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}


def _deepseek_wrong(m: ModelConfig) -> list[str]:
    """What of the stack and the experts DeepSeek-V3's config.json cannot say: dense layers after MoE ones, softmax
    scores, shared experts not a whole number of experts wide or gated, no routing bias."""
    e, kinds, wrong = m.moe, stack.layer_kinds(m), []
    moe_d_ff = e.d_ff or m.d_ff
    if "moe" not in kinds or "dense" in kinds[kinds.index("moe"):]:
        wrong.append(f"model.segments={m.segments} (DeepSeek-V3: dense layers, then MoE layers only)")
    if e.score != "sigmoid" or e.shared_gate or not shared_d_ff(m) or shared_d_ff(m) % moe_d_ff:
        wrong.append(f"model.moe (score={e.score!r}, shared_gate={e.shared_gate}, shared_d_ff={shared_d_ff(m)}: "
                     "DeepSeek-V3 has sigmoid scores and ungated shared experts of whole experts' width)")
    if not has_router_bias(m):
        wrong.append("model.moe.router_bias=false (DeepSeek-V3 has the routing bias: set it true)")
    return wrong


def _gpt_oss_features(m: ModelConfig) -> dict[str, bool]:
    """The features gpt-oss alone has: key -> whether `m` has it."""
    return {"model.attn_sinks": m.attn_sinks, "model.moe.router_logit_bias": m.moe.router_logit_bias,
            "model.moe.expert_biases": m.moe.expert_biases}


def _llama4_features(m: ModelConfig) -> dict[str, bool]:
    """The features Llama 4 alone has: key -> whether `m` has it."""
    return {"model.attention_chunk": bool(m.attention_chunk), "model.rope_global=false": not m.rope_global,
            "model.attn_temperature_floor": bool(m.attn_temperature_floor), "model.qk_l2_norm": m.qk_l2_norm,
            "model.moe.gate_input": m.moe.gate_input}


def _qwen3_next_features(m: ModelConfig) -> dict[str, bool]:
    """The features Qwen3-Next alone has: key -> whether `m` has it."""
    return {"model.pattern with linear layers": stack.has_linear(m), "model.attn_output_gate": m.attn_output_gate,
            "model.rope_fraction": m.rope_fraction != 1.0}


def _qwen3_next_wrong(m: ModelConfig) -> list[str]:
    """What of Qwen3-Next a model lacks: the gate on every attention layer, its experts (softmax top-k, a
    sigmoid-gated shared expert)."""
    e, wrong = m.moe, []
    if not m.attn_output_gate:
        wrong.append("model.attn_output_gate=false (Qwen3-Next gates every attention layer)")
    if stack.has_moe(m) and ((e.score, e.routed_scale, e.n_group, e.shared_gate) != ("softmax", 1.0, 1, True)
                             or not shared_d_ff(m) or has_router_bias(m)):
        wrong.append("model.moe other than Qwen3-Next's (softmax top-k, one sigmoid-gated shared expert)")
    return wrong


def _gpt_oss_wrong(m: ModelConfig) -> list[str]:
    """What of gpt-oss's features a model lacks: MoE layers only, its router and experts, the sinks."""
    e, wrong = m.moe, []
    if m.segments or m.pattern != ["moe"]:
        wrong.append(f"model.pattern={m.pattern}, model.segments={m.segments} (gpt-oss: MoE layers only)")
    features = {**_gpt_oss_features(m), "model.moe.norm_topk": e.norm_topk}
    wrong += [f"{k}=false (gpt-oss has it)" for k, v in features.items() if not v]
    if (e.score, e.routed_scale, e.n_group, bool(shared_d_ff(m)), has_router_bias(m)) != ("softmax", 1.0, 1, False,
                                                                                         False):
        wrong.append("model.moe routing or shared experts other than gpt-oss's (softmax top-k, none shared)")
    return wrong


def _llama4_wrong(m: ModelConfig) -> list[str]:
    """What of Llama 4's text model a model lacks or has beyond it: no windows (chunks instead), RoPE on the local
    layers, top-k sigmoid scores on the experts' inputs, one ungated shared expert as wide as an expert."""
    e, wrong = m.moe, []
    if m.sliding_window:
        wrong.append(f"model.sliding_window={m.sliding_window} (Llama 4 has chunks, not windows)")
    if stack.has_moe(m) and ((e.score, e.gate_input, e.norm_topk, e.routed_scale, e.n_group, e.shared_gate)
                             != ("sigmoid", True, False, 1.0, 1, False) or has_router_bias(m)
                             or shared_d_ff(m) != (e.d_ff or m.d_ff)):
        wrong.append("model.moe other than Llama 4's (sigmoid top-k on the inputs, one ungated shared expert as "
                     "wide as an expert)")
    return wrong


def _stack_wrong(m: ModelConfig, kind: str) -> list[str]:
    """What of the layer stack and the experts `kind`'s config.json cannot say."""
    e = m.moe
    wrong = [f"{k} ({name}'s alone)" for own, name, features in (("gpt_oss", "gpt-oss", _gpt_oss_features(m)),
                                                                  ("llama4_text", "Llama 4", _llama4_features(m)),
                                                                  ("qwen3_next", "Qwen3-Next",
                                                                   _qwen3_next_features(m)))
             if kind != own for k, on in features.items() if on]
    if kind == "deepseek_v3":
        return wrong + _deepseek_wrong(m)
    if kind == "gpt_oss":
        return wrong + _gpt_oss_wrong(m)
    if kind == "llama4_text":
        return wrong + _llama4_wrong(m)
    if kind == "qwen3_next":
        return wrong + _qwen3_next_wrong(m)
    if kind not in QWEN_MOE and (m.segments or m.pattern not in (["dense"], ["moe"])):
        wrong.append(f"model.pattern={m.pattern}, model.segments={m.segments}")
    if kind not in ("mixtral", *QWEN_MOE):
        return wrong
    if has_router_bias(m):
        wrong.append(f"model.moe.router_bias (a routing bias {kind} does not have)")
    if (e.score, e.routed_scale, e.n_group) != ("softmax", 1.0, 1):
        wrong.append(f"model.moe routing (score={e.score!r}, routed_scale={e.routed_scale}, n_group={e.n_group})")
    shared = kind == "qwen2_moe"  # its gated shared expert, always there; the others have none
    if (bool(shared_d_ff(m)), e.shared_gate) != (shared, shared) or (kind == "mixtral" and not e.norm_topk):
        wrong.append(f"model.moe shared experts (n_shared_experts={e.n_shared_experts}, shared_gate={e.shared_gate}) "
                     f"or norm_topk={e.norm_topk} for {kind}")
    return wrong


def exportable(m: ModelConfig) -> None:
    """ModelFileError unless some transformers model computes exactly what `m` describes."""
    kind = model_type(m)
    family = {"gpt2": "gpt2", "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen3": "qwen3", "qwen3_moe": "qwen3",
              "qwen3_next": "qwen3"}.get(kind, "llama")
    own = {"gpt_oss": {"mlp": "swiglu_clamped"}, "qwen3_next": {"norm_offset": 1.0}}.get(kind, {})
    want = {**FAMILIES[family], **own}
    fixed = ("norm", "mlp", "positions", "norm_offset", "norm_placement", "qk_norm", "embed_scale")
    fixed += ("attn_bias", "mlp_bias") if kind in ("gpt2", "gemma2", "gemma3_text") else ()
    wrong = [f"model.{k}={getattr(m, k)!r}" for k in fixed if getattr(m, k) != want[k]]
    if kind in ("qwen2", "qwen3", "gpt_oss", "qwen3_next", *QWEN_MOE) and m.mlp_bias:
        wrong.append("model.mlp_bias=true")
    if kind in ("qwen3", "qwen3_moe", "qwen3_next") and m.attn_bias == "qkv":
        wrong.append("model.attn_bias='qkv'")
    if not kind.startswith("gemma"):
        wrong += [f"model.{k}={getattr(m, k)!r}" for k in ("attn_softcap", "final_softcap", "query_pre_attn_scalar",
                                                           "rope_local_theta") if getattr(m, k)]
    elif kind == "gemma2" and m.rope_local_theta:
        wrong.append(f"model.rope_local_theta={m.rope_local_theta!r}")
    elif m.rope_scaling != "none" and not m.rope_local_theta and any(attention.layer_windows(m)):
        wrong.append(f"model.rope_scaling={m.rope_scaling!r} on local layers (set model.rope_local_theta)")
    wrong += _stack_wrong(m, kind)
    if m.mtp_depth and kind != "deepseek_v3" and (kind, m.mtp_depth) != ("qwen3_next", 1):
        wrong.append(f"model.mtp_depth={m.mtp_depth} (DeepSeek-V3's files hold prediction layers, Qwen3-Next's one)")
    if kind == "gpt2" and (m.n_kv_heads not in (0, m.n_heads) or m.head_dim not in (0, m.d_model // m.n_heads)):
        wrong.append("grouped-query attention or a free head_dim")
    if wrong:
        raise ModelFileError(f"no transformers model type computes this model ({', '.join(wrong)} with "
                             f"model.mlp={m.mlp!r}); export supports {', '.join(MODEL_TYPES)}")
