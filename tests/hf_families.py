"""Tiny random Hugging Face checkpoints of every family, built by transformers itself.

A test helper (no tests here): `build` makes a two-layer model of a family with transformers,
perturbs its weights so that nothing is at its initial value (norm weights off 1, biases off 0,
weights large enough that logits are far from uniform), and saves it with `save_pretrained` as a
real checkpoint directory (config.json, safetensors, optionally sharded with an index, optionally
with a config.json rewritten into the form transformers 4.x wrote). `reference_logits`,
`reference_loss` and `router_margins` load such a directory back with transformers and compute
what an importer must reproduce.

Needs transformers >= 5 (the configs are given with `rope_parameters`; Mixtral's experts are fused
in memory and saved per expert by transformers' reverse weight conversion).

Nothing is built at import time; torch and transformers are imported inside the functions, so
importing this module is cheap.

Sizes: every family has 2 layers, hidden 64, 4 query heads, a vocabulary of 301 (not a multiple
of 128) and, except GPT-2, 2 key/value heads (GQA) with head_dim 16 = hidden / heads.
`hf_config("llama3", head_dim=24)` gives a head_dim unlike hidden / heads (q_proj [96, 64],
o_proj [64, 96]); transformers supports it (it only requires hidden % heads == 0).
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import numpy as np

FAMILIES: tuple[str, ...] = ("gpt2", "llama2", "llama3", "llama3.1", "llama3.2", "mistral", "qwen2", "mixtral", "qwen3",
                              "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4",
                              "qwen3_next")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4", "qwen3_next")

VOCAB_SIZE = 301
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
INTERMEDIATE = 128
GPT2_POSITIONS = 96
MAX_POSITIONS = 256
# llama3.1 / llama3.2 RoPE scaling. With head_dim 16 and rope_theta 5e5 the wavelengths 2*pi/inv_freq
# are 6.3, 32.5, 167, 864, ...; original_max_position_embeddings 40 puts the bands' edges at
# high_freq_wavelen = 40/4 = 10 and low_freq_wavelen = 40/1 = 40, so the first frequency is kept,
# the second is smoothed and the rest are divided by 8 (hf_config asserts all three bands occur).
# head_dim 24 (hf_config("llama3.1", head_dim=24)) also covers the three: 6.3, 18.7, 55.8, ...
# A test sequence of 64 tokens goes past the original context of 40.
LLAMA31_ORIGINAL_CONTEXT = 40
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": LLAMA31_ORIGINAL_CONTEXT,
}
MISTRAL_SLIDING_WINDOW = 4096
# Gemma: more layers than the rest, local and global ones mixed (Gemma 3's pattern of 3 does not divide its 5
# layers), windows shorter than a 64-token test sequence, soft caps that some scores and logits pass (the
# caps are small because the tiny model's scores are), a query scalar other than head_dim, and Gemma 3's
# global RoPE linearly scaled with its local layers at their own base.
GEMMA_LAYERS = {"gemma2": 4, "gemma3": 5}
# Qwen MoE: which of 3 layers is dense (`mlp_only_layers`): the stack becomes segments
QWEN_MOE_DENSE_LAYERS = {"qwen2_moe": (0,), "qwen3_moe": (1,)}
# DeepSeek-V3: latent attention with query compression (widths unlike each other and the heads'), 8 routed experts
# in 4 groups (top-2 groups, top-2 experts), a shared expert, the first of 3 layers dense; its RoPE interleaved as
# published. `yarn` swaps in YaRN with DeepSeek's mscale_all_dim (the softmax scale then changes too).
DEEPSEEK = dict(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=HEADS, q_lora_rank=32,
                kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.6}
# gpt-oss: 4 layers (2 windowed, 2 full, alternating), a window shorter than a 64-token test sequence, 4 experts
# (top-2) with biases, a clamp the tiny activations exceed (gates and ups of std ~0.8), YaRN without truncation over
# an original context of 32, and the sinks (random, as every weight).
GPT_OSS = dict(num_hidden_layers=4, head_dim=HEAD_DIM, intermediate_size=48, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=12, swiglu_limit=0.5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
# Llama 4 (text): 4 layers, RoPE (chunked attention, chunks of 8 < the sequence; the weightless q/k norm) on layers
# 0, 1, 3 and none on layer 2 (temperature tuning with floor 4, so the scale passes 1 within 16 positions); MoE on
# layers 1 and 3 (4 experts, top-1 sigmoid scores on the inputs, a shared expert), dense ones of another width;
# llama3-scaled interleaved RoPE.
LLAMA4 = dict(num_hidden_layers=4, head_dim=HEAD_DIM, intermediate_size=48, intermediate_size_mlp=96,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
              attention_chunk_size=8, floor_scale=4, attn_scale=0.1, use_qk_norm=True, tie_word_embeddings=False,
              rope_parameters=dict(LLAMA31_ROPE))
# Qwen3-Next: 4 layers, Gated DeltaNet on 0, 1, 2 and gated attention (RoPE on a quarter of each head) on 3; MoE
# (4 experts, top-2, normalised, a sigmoid-gated shared expert) on every layer but 1, which is dense; grouped value
# heads (2 key heads, 4 value heads) of widths unlike the attention's.
QWEN3_NEXT = dict(num_hidden_layers=4, head_dim=HEAD_DIM, layer_types=["linear_attention"] * 3 + ["full_attention"],
                  mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=True, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
ZERO_CENTRED_NORMS = ("Qwen3NextRMSNorm",)  # norms applied as x̂ · (1 + w), as their checkpoints hold them
GEMMA_WINDOW = 12
GEMMA_QUERY_SCALAR = 24
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 5.0}
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                      "sliding_attention"]
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

# Perturbation scales (see _perturb).
WEIGHT_STD = 0.1
# Embeddings and lm_head: logits are lm_head . norm(h) with |norm(h)| ~ sqrt(hidden) = 8, so std 0.25
# gives logits of std ~2 (far from uniform); the input side is normalised before use, so the same
# scale for a tied embedding is harmless.
EMBED_STD = 0.25
# Router logits are router_weight . rmsnorm(h) with |rmsnorm(h)| ~ sqrt(hidden) = 8, so std 0.1 gives
# logits of std ~0.8. A larger std (0.5: logits ~4) saturates the softmax: the k-th and (k+1)-th
# probabilities are then both tiny and their gap falls under 1e-3 on nearly every draw.
ROUTER_STD = 0.1
NORM_STD = 0.1
BIAS_STD = 0.1
MIN_ROUTER_MARGIN = 1e-3

# `max_shard_size` that splits the tiny checkpoints into at least 5 safetensors files with a
# model.safetensors.index.json (save_pretrained counts 1 KB = 1000 bytes and puts a tensor larger
# than the limit in a file of its own). The float32 llama model is 450,304 bytes (embed_tokens and
# lm_head 77 KB each; per layer q/o 16 KB, k/v 8 KB, gate/up/down 33 KB each). Files per size,
# transformers 5.23, float32 / bfloat16:
#   "100KB": llama 5/3, llama3.2 and qwen2 4/2, gpt2 7/3, mixtral 10/5
#   "60KB":  llama 9/4, llama3.2 and qwen2 8/4, gpt2 10/6, mixtral 10/10
#   "40KB":  llama 12/7, llama3.2 and qwen2 11/6, gpt2 9/8, mixtral 12/10  (float16 as bfloat16)
# so "40KB" gives >= 5 files for every family and dtype.
SHARD_SIZE_FOR_5 = "40KB"

DTYPES = ("float32", "bfloat16", "float16")
CONFIG_FORMS = ("v5", "v4")
# What `config_form="v4"` writes as transformers_version.
V4_TRANSFORMERS_VERSION = "4.46.3"


def _transformers():
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise RuntimeError(f"tests/hf_families.py needs transformers >= 5, found {transformers.__version__}")
    return transformers


def _family_kwargs(family: str) -> tuple[str, dict]:
    """(config class name, constructor kwargs) for the tiny model of `family`."""
    llama_like = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        hidden_act="silu",
        rms_norm_eps=1e-5,
    )
    if family == "gpt2":
        return "GPT2Config", dict(
            vocab_size=VOCAB_SIZE,
            n_positions=GPT2_POSITIONS,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=None,  # 4 * n_embd, as every real GPT-2 config
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            bos_token_id=VOCAB_SIZE - 1,
            eos_token_id=VOCAB_SIZE - 1,
        )
    if family == "llama2":
        return "LlamaConfig", dict(
            llama_like, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False
        )
    if family == "llama3":
        return "LlamaConfig", dict(
            llama_like, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False
        )
    if family == "llama3.1":
        return "LlamaConfig", dict(llama_like, rope_parameters=dict(LLAMA31_ROPE), tie_word_embeddings=False)
    if family == "llama3.2":
        return "LlamaConfig", dict(llama_like, rope_parameters=dict(LLAMA31_ROPE), tie_word_embeddings=True)
    if family == "mistral":
        return "MistralConfig", dict(
            llama_like,
            head_dim=HEAD_DIM,
            sliding_window=MISTRAL_SLIDING_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        )
    if family == "qwen2":
        kw = dict(llama_like, rms_norm_eps=1e-6)
        return "Qwen2Config", dict(
            kw,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=MISTRAL_SLIDING_WINDOW,  # ignored: use_sliding_window is False (stored as null)
            max_window_layers=1,  # as real Qwen2.5 configs: < num_hidden_layers, inert while sliding is off
        )
    if family == "mixtral":
        return "MixtralConfig", dict(
            llama_like,
            intermediate_size=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        )
    if family == "qwen3":
        return "Qwen3Config", dict(
            llama_like, head_dim=HEAD_DIM, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if family in QWEN_MOE_DENSE_LAYERS:  # 3 layers, one dense (first or middle) among MoE layers
        qwen_moe = dict(llama_like, num_hidden_layers=3, mlp_only_layers=list(QWEN_MOE_DENSE_LAYERS[family]),
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, use_sliding_window=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                        rms_norm_eps=1e-6)
        if family == "qwen2_moe":  # Qwen1.5-MoE's unnormalised top-k weights and a gated shared expert
            return "Qwen2MoeConfig", dict(qwen_moe, norm_topk_prob=False, shared_expert_intermediate_size=80)
        return "Qwen3MoeConfig", dict(qwen_moe, norm_topk_prob=True, head_dim=HEAD_DIM)
    if family == "deepseek_v3":
        return "DeepseekV3Config", dict(llama_like, **DEEPSEEK)
    if family == "gpt_oss":
        return "GptOssConfig", dict(llama_like, **GPT_OSS)
    if family == "llama4":
        return "Llama4TextConfig", dict(llama_like, **LLAMA4)
    if family == "qwen3_next":
        return "Qwen3NextConfig", dict(llama_like, **QWEN3_NEXT)
    if family in GEMMA_LAYERS:
        gemma = dict(llama_like, num_hidden_layers=GEMMA_LAYERS[family], head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                     hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=GEMMA_QUERY_SCALAR,
                     sliding_window=GEMMA_WINDOW, tie_word_embeddings=True, pad_token_id=0)
        gemma.pop("hidden_act")
        if family == "gemma2":
            return "Gemma2Config", dict(gemma, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                        **GEMMA2_SOFTCAPS)
        return "Gemma3TextConfig", dict(gemma, layer_types=list(GEMMA3_LAYER_TYPES),
                                        rope_parameters={k: dict(v) for k, v in GEMMA3_ROPE.items()})
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _llama3_bands(config) -> tuple[int, int, int]:
    """How many RoPE frequencies fall (below high_freq_wavelen, between, above low_freq_wavelen)
    for a llama3-scaled config: the same comparisons as transformers' _compute_llama3_parameters."""
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = rope["rope_theta"]
    inv_freq = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    old = rope["original_max_position_embeddings"]
    low_wavelen = old / rope["low_freq_factor"]
    high_wavelen = old / rope["high_freq_factor"]
    wavelens = [2 * math.pi / f for f in inv_freq]
    high = sum(w < high_wavelen for w in wavelens)
    low = sum(w > low_wavelen for w in wavelens)
    return high, len(wavelens) - high - low, low


def hf_config(family: str, **overrides):
    """The tiny transformers config of `family`; `overrides` replace constructor arguments."""
    transformers = _transformers()
    cls_name, kwargs = _family_kwargs(family)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    if family in ("llama3.1", "llama3.2") and config.rope_parameters.get("rope_type") == "llama3":
        bands = _llama3_bands(config)
        assert all(n > 0 for n in bands), (
            f"{family}: llama3 RoPE frequencies per band (high-freq kept, smoothed, low-freq divided) are {bands}; "
            "the tiny config must exercise all three (change original_max_position_embeddings or head_dim)"
        )
    return config


def sample_tokens(vocab_size: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Uniform random token ids, int32 [batch, seq]."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, seq)).astype(np.int32)


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {DTYPES}")
    return getattr(torch, dtype)


def _is_router(name: str, module) -> bool:
    return (type(module).__name__.endswith("TopKRouter") or type(module).__name__ == "Llama4Router"
            or name.endswith("block_sparse_moe.gate"))


def _router_logits(module, out):
    """A router module's logits from its output (Llama 4's returns (scores, logits); the others' logits first)."""
    if type(module).__name__ == "Llama4Router":
        return out[1]
    return out[0] if isinstance(out, tuple) else out


def _perturb(model, generator) -> None:
    """Overwrite every parameter: norm weights 1 + 0.1 N(0,1), norm and linear biases 0.1 N(0,1),
    routers ROUTER_STD N(0,1), embeddings (token and GPT-2 position) and lm_head EMBED_STD N(0,1),
    every other weight (Linear, Conv1D, fused experts) WEIGHT_STD N(0,1).
    Tied weights are visited once (named_parameters de-duplicates). DeepSeek's routing biases
    (`e_score_correction_bias`, buffers) BIAS_STD N(0,1) too."""
    import torch

    seen = set()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=generator, dtype=torch.float32))
        for name, module in model.named_modules():
            is_norm = "norm" in type(module).__name__.lower()
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                if is_norm and pname == "weight":  # about 1 as applied: a zero-centred norm's (x̂ · (1 + w)) about 0
                    value = (type(module).__name__ not in ZERO_CENTRED_NORMS) + NORM_STD * noise
                elif pname == "bias" or pname.endswith("_bias"):
                    value = BIAS_STD * noise
                elif _is_router(name, module):
                    value = ROUTER_STD * noise
                elif isinstance(module, torch.nn.Embedding) or name.endswith("lm_head"):
                    value = EMBED_STD * noise
                else:
                    value = WEIGHT_STD * noise
                p.copy_(value.to(p.dtype))


def _round_to(model, dtype: str) -> None:
    """Round the float32 parameters to `dtype` and back, in place (so that what is measured on the
    float32 model is what a float32 reload of the saved checkpoint computes)."""
    import torch

    tdt = _torch_dtype(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(tdt).to(torch.float32))


def _router_layer_margins(model, tokens) -> list[float]:
    """Per MoE layer, the smallest gap over tokens between the k-th and (k+1)-th router probability."""
    import torch

    top_k = model.config.num_experts_per_tok
    captured = []
    hooks = [
        module.register_forward_hook(lambda m, _inp, out: captured.append(_router_logits(m, out)))
        for name, module in model.named_modules()
        if _is_router(name, module)
    ]
    assert hooks, "no router modules found"
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    finally:
        for h in hooks:
            h.remove()
    margins = []
    for logits in captured:
        probs = torch.softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
        top = torch.topk(probs, top_k + 1, dim=-1).values
        margins.append(float((top[:, top_k - 1] - top[:, top_k]).min()))
    return margins


def _reseed_routers(model, tokens, dtype: str, seed: int) -> float:
    """Redraw routers, layer by layer from the first, until every layer's margin on `tokens` is
    above MIN_ROUTER_MARGIN; return the smallest margin. A layer's router only changes the layers
    after it, so fixing them in order converges (each draw succeeds about a third of the time with
    ROUTER_STD: one draw for all 256 decisions of both layers at once succeeds about 1 time in 5)."""
    import torch

    tdt = _torch_dtype(dtype)
    routers = [m for n, m in model.named_modules() if _is_router(n, m)]
    for layer, router in enumerate(routers):
        attempt = 0
        while _router_layer_margins(model, tokens)[layer] <= MIN_ROUTER_MARGIN:
            attempt += 1
            assert attempt <= 200, f"router of layer {layer}: no draw with margin > {MIN_ROUTER_MARGIN}"
            gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 1009 * layer + attempt)
            with torch.no_grad():
                noise = torch.randn(router.weight.shape, generator=gen, dtype=torch.float32)
                router.weight.copy_((ROUTER_STD * noise).to(tdt).to(torch.float32))
    margin = min(_router_layer_margins(model, tokens))
    assert margin > MIN_ROUTER_MARGIN, f"router margin {margin}"
    return margin


def build(
    family: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    seed: int = 0,
    config_form: str = "v5",
    **overrides,
) -> str:
    """Build the tiny random model of `family`, save it to `out_dir` (created), return `out_dir`.

    dtype: the dtype the weights are cast to and saved in (safetensors).
    max_shard_size: passed to save_pretrained (e.g. SHARD_SIZE_FOR_5) for a sharded checkpoint.
    config_form: "v5" keeps the config.json transformers 5 writes; "v4" rewrites it into the form
        transformers 4.x wrote (see _to_v4_config).
    overrides: passed to hf_config.
    Mixtral: routers are redrawn until router_margins(out_dir, sample_tokens(vocab_size, 2, 64, seed))
        > MIN_ROUTER_MARGIN (asserted), so top-k routing is unambiguous on those tokens (only those).
    Deterministic: the same arguments give byte-identical safetensors files.
    """
    import torch

    transformers = _transformers()
    if config_form not in CONFIG_FORMS:
        raise ValueError(f"config_form {config_form!r} not in {CONFIG_FORMS}")
    tdt = _torch_dtype(dtype)
    config = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    _perturb(model, generator)
    _round_to(model, dtype)

    if family in MOE_FAMILIES and getattr(config, "num_experts", 1):
        _reseed_routers(model, sample_tokens(config.vocab_size, 2, 64, seed), dtype, seed)

    model = model.to(tdt)
    os.makedirs(out_dir, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _no_progress_bars():
        model.save_pretrained(out_dir, **save_kwargs)
    if config_form == "v4":
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump(_to_v4_config(family, cfg), f, indent=2, sort_keys=True)
            f.write("\n")
    return out_dir


def build_multimodal(family: str, out: str, config_class: str, text_class: str, vision: dict, **keys) -> str:
    """A tiny `*ForConditionalGeneration` (`config_class` with `family`'s tiny text model as `text_class` beside
    the small vision tower `vision`; `keys` the rest of the config), perturbed as `build` perturbs, saved to `out`."""
    import torch

    transformers = _transformers()
    _, text = _family_kwargs(family)
    config = getattr(transformers, config_class)(text_config=getattr(transformers, text_class)(**text).to_dict(),
                                                 vision_config=vision, **keys)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    _perturb(model, torch.Generator().manual_seed(0))
    model.save_pretrained(out)
    return out


def _to_v4_config(family: str, cfg: dict) -> dict:
    """Rewrite a transformers-5 config.json dict into what transformers 4.x wrote for the family.

    - `dtype` -> `torch_dtype` (4.x name; 5 still reads it).
    - RoPE: `rope_parameters` -> top-level `rope_theta`, plus for Llama and Qwen2 (whose 4.x configs
      had it) `rope_scaling`: null for plain RoPE, else the scaling dict with `rope_type` (4.x, since
      4.43, wrote "rope_type"; older checkpoints used "type", which 5 also reads) and without
      `rope_theta`. Mistral and Mixtral 4.x configs had no `rope_scaling` key at all.
    - `head_dim` dropped where it is null or equals hidden/heads (Llama before 4.45, Mixtral and
      Qwen2 configs of the hub lack it; Mistral-Nemo style configs keep an explicit unequal one).
    - Qwen2: no `layer_types` (4.x before 4.53 and most hub Qwen2/2.5 configs lack it) and an
      integer `sliding_window` next to `use_sliding_window: false`, as hub Qwen2.5 configs have.
    - GPT-2: `n_ctx` = n_positions, as the original GPT-2 configs have (5 keeps it as an extra
      attribute and ignores it).
    - Qwen3 as Qwen2. Gemma 2: no `layer_types` (4.x slid every even layer). Gemma 3: `rope_theta` and
      `rope_scaling` for the global layers, `rope_local_base_freq` for the local ones, and
      `sliding_window_pattern` (every n-th layer global) instead of `layer_types`.
    """
    cfg = dict(cfg)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = V4_TRANSFORMERS_VERSION
    rope = cfg.pop("rope_parameters", None)
    if family == "gemma3":  # 4.x: the global RoPE as rope_theta + rope_scaling, the local base on its own
        full, sliding = dict(rope["full_attention"]), rope["sliding_attention"]
        cfg["rope_theta"], cfg["rope_local_base_freq"] = full.pop("rope_theta"), sliding["rope_theta"]
        cfg["rope_scaling"] = None if full.get("rope_type", "default") == "default" else full
        cfg["sliding_window_pattern"] = cfg.pop("layer_types").index("full_attention") + 1
        rope = None
    if family == "gemma2":
        cfg.pop("layer_types")  # 4.x: every even layer slides
    if rope is not None:
        rope = dict(rope)
        cfg["rope_theta"] = rope.pop("rope_theta")
        if family.startswith("llama") or family in ("qwen2", "qwen3"):
            cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if family not in ("gpt2", "qwen3", "gemma2", "gemma3"):  # whose 4.x config classes always wrote head_dim
        if "head_dim" in cfg and cfg["head_dim"] in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
            cfg.pop("head_dim")
    if family in ("qwen2", "qwen3"):
        cfg.pop("layer_types", None)
        if cfg.get("sliding_window") is None:
            cfg["sliding_window"] = MISTRAL_SLIDING_WINDOW
    if family == "gpt2":
        cfg["n_ctx"] = cfg["n_positions"]
    return cfg


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' tqdm bars ("Writing model shards", "Loading weights") off for a while."""
    hf_logging = _transformers().utils.logging
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load(model_dir: str):
    """The checkpoint loaded by transformers in float32, eager attention, eval mode."""
    import torch

    transformers = _transformers()
    with _no_progress_bars():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        )
    return model.eval()


def reference_logits(model_dir: str, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [batch, seq, vocab_size] of the checkpoint loaded by transformers in float32."""
    import torch

    model = _load(model_dir)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def reference_loss(model_dir: str, tokens: np.ndarray) -> float:
    """Mean next-token cross entropy transformers computes with labels=tokens (float32)."""
    import torch

    model = _load(model_dir)
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return float(out.loss)


def router_margins(model_dir: str, tokens) -> float:
    """Mixtral: the smallest gap, over layers and tokens, between the k-th and (k+1)-th router
    probability (k = num_experts_per_tok), with the checkpoint loaded in float32."""
    return min(_router_layer_margins(_load(model_dir), tokens))


def one_step_run(path: str, run_dir: str, seq: int, **keys) -> dict:
    """The keys of a one-step fp32 run from checkpoint `path` on the standard library's text that logs its first loss
    in `run_dir` (no evaluation, checkpoint or sample); `keys` add or replace some (a mesh)."""
    return {"init.from": f"hf:{path}", "model.seq_len": seq, "train.global_batch": 8, "train.steps": 1,
            "train.eval_every": 0, "train.checkpoint_every": 0, "precision.compute": "float32", "run.dir": run_dir,
            "run.sample_tokens": 0, "run.progress": False, "data.source": "stdlib", **keys}


def first_logged_loss(run_dir: str) -> float:
    """The loss a run logged at its first step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def first_batch_loss(cfg) -> float:
    """transformers' language-model loss (float32) on the first batch of the run `cfg` describes: its
    `init.from = "hf:DIR"` checkpoint on its data's first `train.global_batch` windows of `model.seq_len` + 1."""
    import torch

    from jaxllm.data.loader import window_starts
    from jaxllm.trainer.loop import prepare

    seq, rows = cfg.model.seq_len, cfg.train.global_batch
    corpus = prepare(cfg)[3].corpus
    starts = window_starts(len(corpus.train), cfg.train.seed, 0, rows, seq)
    windows = torch.as_tensor(np.stack([np.asarray(corpus.train[s:s + seq + 1], np.int64) for s in starts]))
    model = _load(cfg.init.from_[len("hf:"):])
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)
