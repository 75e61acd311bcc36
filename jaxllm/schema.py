"""The config tree's schema: one dataclass per section, with defaults and what each key means.

Below everything that reads a section (the mesh, the model, the step, the optimizer, the data):
it imports nothing of jaxllm. `config.py` builds a `Config` from files and overrides and has each
section validated by the code that owns it.

Each key's meaning is its field's metadata (`key(default, meaning)`); `meaning(key)`, `keys()` and
`reference_markdown()` (the configuration reference page) read it from here, so there is one place to
say what a key does.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from dataclasses import dataclass, field


def key(default, meaning: str, **kw):
    """A config key: its default and what it means (a list or dict default is copied for each instance)."""
    if isinstance(default, (list, dict)):
        kw["default_factory"] = lambda: copy.deepcopy(default)
    else:
        kw["default"] = default
    return field(metadata={"meaning": meaning}, **kw)


def _dcn(axis: str) -> str:
    return (f"multi-node: how many nodes/slices the `{axis}` axis spans (the slow links carry it); `mesh.{axis}` is "
            f"then its size within a node, and the axis has `mesh.{axis}` × `mesh.dcn.{axis}` devices in all")


@dataclass
class DcnConfig:
    """Mesh sizes across nodes/slices (slow links) for a hybrid mesh; the `mesh` sizes are then per node."""

    pp: int = key(1, _dcn("pp"))
    dp: int = key(1, _dcn("dp"))
    fsdp: int = key(1, _dcn("fsdp"))
    ep: int = key(1, _dcn("ep"))
    sp: int = key(1, _dcn("sp"))
    tp: int = key(1, _dcn("tp"))


@dataclass
class MeshConfig:
    """Device mesh sizes, outermost to innermost. One axis may be -1: it takes the remaining devices."""

    pp: int = key(1, "pipeline stages: the layer stack is split into `pp` contiguous stages (see \"Pipeline "
                     'parallelism")')
    dp: int = key(-1, "data-parallel replicas (parameters replicated); the default -1 gives data parallelism every "
                      "device the other axes leave")
    fsdp: int = key(1, "sharded data parallel: the axis ZeRO shards over")
    ep: int = key(1, 'expert parallel: MoE experts split over it (see "Mixture of experts"); a data axis for '
                     "everything else")
    sp: int = key(1, 'context parallel: the sequence sharded over it (see "Context parallelism")')
    tp: int = key(1, "tensor parallel: heads, MLP hidden and vocabulary sharded over it (see \"Tensor and sequence "
                     'parallelism")')
    dcn: DcnConfig = field(default_factory=DcnConfig)


@dataclass
class DistributedConfig:
    """Multi-process start-up. Explicit address/count/id, or `auto` for the cluster detection JAX has."""

    coordinator_address: str = key("", "`host:port` of process 0; set it (with `distributed.num_processes` and "
                                        "`distributed.process_id`) to start `jax.distributed` (see \"Launching\"); "
                                        '`""`: no explicit coordinator')
    num_processes: int = key(0, "how many processes there are (0: left to `jax.distributed`)")
    process_id: int = key(-1, "this process's id, 0 = the coordinator (-1: left to `jax.distributed`)")
    auto: bool = key(False, "`true`: let JAX detect the cluster (SLURM, Open MPI, TPU pods, ...); used when no "
                            "`distributed.coordinator_address` is given")


@dataclass
class MoeConfig:
    """Mixture-of-experts feed-forward, used by the "moe" blocks of `model.pattern` or `model.segments`."""

    n_experts: int = key(8, "experts per MoE layer")
    top_k: int = key(2, "how many experts each token goes to (1 as in Switch, 2 as in Mixtral)")
    d_ff: int = key(0, "each expert's hidden size; 0 = `model.d_ff`")
    n_shared_experts: int = key(0, "shared experts every token goes through, run as one dense feed-forward beside "
                                   "the routed ones (DeepSeek, Qwen2-MoE)")
    shared_d_ff: int = key(0, "that feed-forward's hidden size; 0 = `n_shared_experts × model.d_ff`")
    shared_gate: bool = key(False, "the shared experts' output times sigmoid(x·w) of a learned vector w "
                                   "(Qwen2-MoE's `shared_expert_gate`)")
    capacity_factor: float = key(1.25, "buffer slots per expert = factor × tokens × top_k / n_experts per batch "
                                       "shard; pairs past it are dropped (the token passes on through the "
                                       "residual); 0 = dropless")
    balance_weight: float = key(0.01, "weight of the Switch load-balancing loss (a mean over MoE layers)")
    z_weight: float = key(0.001, "weight of the router z-loss (a mean over MoE layers)")
    score: str = key("softmax", "the router's scores: `softmax` over the experts (Mixtral, Qwen) or `sigmoid` per "
                                "expert (DeepSeek-V3)")
    norm_topk: bool = key(True, "for top_k > 1, the chosen experts' scores renormalised to sum to 1 (transformers' "
                                "`norm_topk_prob`; Mixtral always)")
    routed_scale: float = key(1.0, "the gates multiplied by this (DeepSeek-V3's `routed_scaling_factor`)")
    n_group: int = key(1, "experts in this many equal groups; top_k is chosen within the `topk_group` best groups, "
                          "a group scored by the sum of its two highest scores (DeepSeek-V3); 1 = no groups")
    topk_group: int = key(1, "how many of the `n_group` groups a token's experts come from")
    bias_update_rate: float = key(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the "
                                       "scores to choose experts (not to weight them), moved by this much after each "
                                       "step, down for an expert busier than the mean over the step, up for one less "
                                       "busy; kept in the parameters, never trained by a gradient; 0 = no bias")
    router_bias: bool = key(False, "a per-expert bias added to the scores to choose experts (not to weight them), "
                                   "fixed unless `bias_update_rate` moves it (DeepSeek-V3's "
                                   "`e_score_correction_bias`); on whenever `bias_update_rate` > 0")
    router_logit_bias: bool = key(False, "a learned per-expert bias added to the router's logits, which choose and "
                                         "weight the experts alike (gpt-oss's router bias; trained by its gradient)")
    expert_biases: bool = key(False, "biases on each expert's projections (gpt-oss)")
    gate_input: bool = key(False, "each chosen expert's input, not its output, multiplied by the token's gate, and "
                                  "the outputs summed as they are (Llama 4)")
    seq_balance_weight: float = key(0.0, "weight of DeepSeek-V3's sequence-wise balance loss (per sequence, on scores "
                                         "normalised over the experts; a mean over MoE layers); 0 = off")


@dataclass
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), the attention of `model.attention = "mla"`: keys and values
    come from one compressed latent per token, and RoPE from a key part shared by all heads."""

    q_lora_rank: int = key(0, "the queries' compressed width (a down-projection, an RMSNorm, an up-projection); 0 = "
                              "no query compression")
    kv_lora_rank: int = key(512, "the keys' and values' compressed width, the latent a KV cache holds")
    qk_nope_head_dim: int = key(128, "each head's query/key dimensions without RoPE (from the latent)")
    qk_rope_head_dim: int = key(64, "the query/key dimensions with RoPE (the key's shared by all heads)")
    v_head_dim: int = key(128, "each head's value dimension")


@dataclass
class LinearAttnConfig:
    """Gated DeltaNet (Qwen3-Next's linear attention, `models/gated_deltanet.py`), the token mixer of the `linear`
    and `linear_moe` block kinds: a short causal convolution, then the gated delta rule's fixed-size state per
    value head in place of a KV cache."""

    num_k_heads: int = key(2, "query/key heads (transformers' `linear_num_key_heads`)")
    num_v_heads: int = key(4, "value heads, a multiple of the key heads: each q/k head serves num_v_heads / "
                              "num_k_heads consecutive value heads (`linear_num_value_heads`)")
    head_k_dim: int = key(32, "each query/key head's dimension (`linear_key_head_dim`)")
    head_v_dim: int = key(32, "each value head's dimension (`linear_value_head_dim`)")
    conv_kernel: int = key(4, "the causal depthwise convolution's width over q, k and v (`linear_conv_kernel_dim`)")
    chunk: int = key(64, "tokens per chunk of the chunked (training) form: within-chunk matmuls, a state carried "
                         "between chunks; numerics only, any value computes the same recurrence")


@dataclass
class LoraConfig:
    """Low-rank adapters on a frozen base (`model.lora`, `jaxllm/models/lora.py`): each targeted weight W is used as
    W + scale·A·B, only A and B trained; the base is held in the compute dtype (or quantized), with no optimizer
    state."""

    rank: int = key(0, "the adapters' rank r; 0 = no adapters (every parameter trained)")
    alpha: float = key(16.0, "the adapters' scale numerator: scale = alpha / r (alpha / √r with `rslora`)")
    rslora: bool = key(False, "rank-stabilised scaling, alpha / √r, as PEFT's `use_rslora`")
    targets: list = key(["q", "k", "v", "o", "gate", "up", "down"],
                        "the weights given adapters, by name: attention's `q`, `k`, `v`, `o`, the feed-forward's "
                        "`gate`, `up`, `down` (GPT-2's `in`, `out`), and `experts` (every expert's feed-forward "
                        "weights of the targeted names)")
    dropout: float = key(0.0, "the probability an adapter's input element is dropped in training, as PEFT's "
                              "`lora_dropout` (the same masks on every mesh); not with `experts` targeted yet")
    base_quant: str = key("none", "how the adapted weights of the frozen base are stored: `none` (the compute dtype), "
                                  "`int8` or `nf4` (QLoRA: blocks of 64 along d_model, dequantized at use)")
    double_quant: bool = key(True, "with `base_quant`, store the blocks' scales as int8 too (QLoRA's double "
                                   "quantization)")


# A family (`model.family`) is a shorthand for the features it is made of; a preset names a family and a
# size. Keys the user sets explicitly win over both. Here, below config.py and interop/, which both read it.
_PLAIN = dict(norm_offset=0.0, norm_placement="pre", qk_norm=False, embed_scale=False)  # what 2024's families leave
_GEMMA = dict(norm="rmsnorm", mlp="geglu_tanh", positions="rope", attn_bias="none", mlp_bias=False,
              tie_embeddings=True, norm_offset=1.0, norm_placement="sandwich", embed_scale=True)
FAMILIES: dict[str, dict] = {
    "gpt2": dict(norm="layernorm", mlp="gelu_tanh", positions="learned", attn_bias="qkvo", mlp_bias=True,
                 tie_embeddings=True, **_PLAIN),
    "llama": dict(norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias="none", mlp_bias=False,
                  tie_embeddings=False, **_PLAIN),
    "qwen2": dict(norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias="qkv", mlp_bias=False,
                  tie_embeddings=False, **_PLAIN),
    "qwen3": dict(norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias="none", mlp_bias=False,
                  tie_embeddings=False, **dict(_PLAIN, qk_norm=True)),
    "gemma2": dict(_GEMMA, qk_norm=False),
    "gemma3": dict(_GEMMA, qk_norm=True),
}


@dataclass
class ModelConfig:
    """The transformer: its sizes, the features a family is made of, positions, attention over a split sequence
    and activation recomputation; `model.moe` holds the experts."""

    preset: str = key("", "fills the model's fields: `tiny-gpt2`, `tiny-llama` (tests: 2 layers, d_model 64, 8 heads), "
                          "`small-gpt2` (the default job), `gpt2-124m`, `gpt2-350m`, `gpt2-774m`, `gpt2-1.5b`, "
                          "`llama-1b`, `llama-3b`, `llama-8b`, `tiny-moe` (tiny-llama with 8 experts, top-2, in "
                          "every layer), `mixtral-8x7b` (Mixtral's shape: 46.7B parameters, 12.9B active); keys set "
                          "explicitly win")
    family: str = key("gpt2", "a shorthand that fills the features below (`FAMILIES`), as a preset does (keys you set "
                              "win; the model code reads only the features): `gpt2` (LayerNorm, `gelu_tanh`, learned "
                              "positions, `qkvo` biases, MLP biases, tied embeddings), `llama` (RMSNorm, SwiGLU, "
                              "RoPE, no biases, untied head), `qwen2` (as `llama` with `qkv` biases), `qwen3` (as "
                              "`llama` with q/k norms), `gemma2` (RMSNorm as 1 + w, `geglu_tanh`, RoPE, sandwich "
                              "norms, a scaled embedding, tied head) or `gemma3` (as `gemma2` with q/k norms)")
    n_layers: int = key(4, "transformer blocks in the stack")
    d_model: int = key(256, "the residual stream's width")
    n_heads: int = key(4, "attention (query) heads")
    n_kv_heads: int = key(0, "key/value heads (grouped-query attention); 0 = `n_heads`")
    head_dim: int = key(0, "each head's dimension; 0 = `d_model / n_heads`")
    attention: str = key("mha", "`mha` (multi-head attention, grouped-query with `n_kv_heads`) or `mla` "
                                "(DeepSeek's multi-head latent attention, `model.mla`; `n_kv_heads` and "
                                "`head_dim` are not read)")
    d_ff: int = key(1024, "the dense feed-forward's hidden size")
    vocab_size: int = key(0, "token ids the model has; 0 = the tokenizer's; stored padded up to a multiple of 128 "
                             "(padded logits are masked)")
    seq_len: int = key(256, "training context length")
    # The features a family is made of.
    norm: str = key("layernorm", "`layernorm` (scale and bias) or `rmsnorm` (scale only)")
    mlp: str = key("gelu_tanh", "`gelu_tanh` (transformers' `gelu_new`), `swiglu` (silu(gate)·up), `geglu_tanh` "
                                "(gelu_tanh(gate)·up, Gemma) or `swiglu_clamped` (gpt-oss: the gate clamped above "
                                "at `mlp_limit`, up to ±`mlp_limit`, then (up + 1)·gate·σ(1.702·gate))")
    mlp_limit: float = key(7.0, "`swiglu_clamped`: the clamp (gpt-oss's `swiglu_limit`)")
    positions: str = key("learned", "`learned` (a table of `max_positions` rows) or `rope`")
    max_positions: int = key(0, "the longest sequence the model is for (the learned table's rows); 0 = `seq_len`; "
                                "`seq_len` may not exceed it")
    attn_bias: str = key("qkvo", "biases on the `q`, `k`, `v` (`qkv`) and output (`qkvo`) projections, or `none`")
    mlp_bias: bool = key(True, "biases on the dense feed-forward's projections (experts have none)")
    tie_embeddings: bool = key(True, "the output head is the token embedding")
    norm_eps: float = key(1e-5, "the norms' epsilon (numerics)")
    norm_offset: float = key(0.0, "every norm computes x̂·(offset + scale), q/k norms included: Gemma's 1 + w (a "
                                  "fresh scale starts at 1 − offset, so the product starts at 1)")
    norm_placement: str = key("pre", "`pre` (a norm before attention and before the MLP) or `sandwich` (also a norm "
                                     "of each one's output before the residual add: Gemma 2/3)")
    qk_norm: bool = key(False, "RMSNorm over head_dim on the queries and keys, before RoPE (Qwen3, Gemma 3)")
    embed_scale: bool = key(False, "the token embedding multiplied by √d_model, the scale rounded to the compute "
                                   "dtype first as transformers does (Gemma)")
    attn_softcap: float = key(0.0, "attention logit soft cap: scores → cap·tanh(scores/cap) before the mask (Gemma "
                                   "2); 0 = none")
    final_softcap: float = key(0.0, "output logit soft cap: logits → cap·tanh(logits/cap) (Gemma 2); 0 = none")
    attn_sinks: bool = key(False, "attention sinks (gpt-oss's): a learned logit per query head and layer "
                                  "(`attn.sinks`, [heads]) that joins each query's softmax denominator and is then "
                                  "dropped, so a query may attend to nothing; `dense`, `chunked`, the "
                                  "context-parallel islands and generation compute it, the fused kernels are "
                                  "refused; see \"Attention\"")
    attn_output_gate: bool = key(False, "an output gate on attention (Qwen3-Next's gated attention): each head's "
                                        "output × σ(x W_gate) before the output projection (`attn.wg`, [embed, "
                                        "heads, head_dim]; transformers' q_proj holds it beside each head's query)")
    query_pre_attn_scalar: float = key(0.0, "scores scaled by this^−½ instead of head_dim^−½ (Gemma's "
                                            "`query_pre_attn_scalar`); 0 = head_dim")
    rope_theta: float = key(10000.0, "RoPE's base: the wavelengths' scale")
    rope_scaling: str = key("none", "`none`, `linear` (every frequency divided by `rope_factor`), `llama3` (Llama "
                                    "3.1's frequency bands, with `rope_factor` and the `rope_*_freq_factor` and "
                                    "`rope_original_context` keys: wavelengths longer than "
                                    "original/low slowed by the factor, shorter than original/high kept, smooth "
                                    "between) or `yarn` (YaRN: frequencies between interpolated and kept by a ramp "
                                    "over the dimensions, `rope_beta_*`, and cos/sin × `rope_attention_factor`)")
    rope_fraction: float = key(1.0, "the part of each head RoPE rotates: its first head_dim × this dimensions "
                                    "(transformers' `partial_rotary_factor`, Qwen3-Next's 0.25), the rest pass as "
                                    "they are")
    rope_local_theta: float = key(0.0, "RoPE base of the `local` layers of `window_pattern`, unscaled (Gemma 3's "
                                       "local layers); 0 = every layer's RoPE is the one above")
    rope_factor: float = key(8.0, "`linear`, `llama3` and `yarn` scaling: the factor (long) wavelengths are slowed by")
    rope_low_freq_factor: float = key(1.0, "`llama3` scaling: low; wavelengths longer than `rope_original_context` / "
                                           "low are slowed by `rope_factor`")
    rope_high_freq_factor: float = key(4.0, "`llama3` scaling: high; wavelengths shorter than "
                                            "`rope_original_context` / high are kept")
    rope_original_context: int = key(8192, "`llama3` and `yarn` scaling: original, the context length the bands "
                                           "are measured against")
    rope_beta_fast: float = key(32.0, "`yarn` scaling: rotations over the original context above which a dimension "
                                      "is kept (extrapolated)")
    rope_beta_slow: float = key(1.0, "`yarn` scaling: rotations below which a dimension is interpolated")
    rope_attention_factor: float = key(0.0, "`yarn` scaling: cos and sin multiplied by it (0 = YaRN's "
                                            "0.1·ln(rope_factor) + 1)")
    rope_mscale_all_dim: float = key(0.0, "the softmax scale multiplied by (0.1·this·ln(rope_factor) + 1)² under "
                                          "a RoPE scaling (DeepSeek's `mscale_all_dim`); 0 = not")
    rope_truncate: bool = key(True, "`yarn` scaling: the ramp's ends rounded to whole dimensions (transformers' "
                                    "`truncate`)")
    sliding_window: int = key(0, "attention window: a query sees the keys whose positions are less than this far "
                                 "behind it (0 = none; Mistral's `sliding_window`); the context-parallel islands "
                                 "take it too")
    window_pattern: list = key([], "which layers `model.sliding_window` applies to: `local` (windowed) and `global` "
                                    "(not) entries repeated down the stack, e.g. `[\"local\", \"global\"]` as Gemma 2; "
                                    "its length must divide `n_layers` (a list of `n_layers` entries fits any stack); "
                                    "empty: every layer. The windows are per-layer data scanned with the layers")
    attention_chunk: int = key(0, "chunked local attention (Llama 4's `attention_chunk_size`): on the `local` layers "
                                  "of `window_pattern` (every layer if empty) a query sees only the keys of its own "
                                  "chunk of this many positions (position // chunk), causally; 0 = none")
    rope_global: bool = key(True, "RoPE on the `global` layers of `window_pattern`; false: those layers have no "
                                  "positions at all (Llama 4's NoPE layers)")
    attn_temperature_floor: int = key(0, "attention temperature tuning on the layers without RoPE (Llama 4's "
                                         "`floor_scale`): queries × (ln(1 + ⌊(position + 1) / floor⌋) · "
                                         "`attn_temperature_scale` + 1); 0 = off")
    attn_temperature_scale: float = key(0.1, "that tuning's scale (Llama 4's `attn_scale`)")
    qk_l2_norm: bool = key(False, "q and k divided by their root mean square over head_dim, without a weight, after "
                                  "RoPE, on the layers with RoPE (Llama 4's `use_qk_norm`)")
    attention_impl: str = key("auto", "how attention is computed: `dense` (the whole [t, t] score array: the readable "
                                      "reference), `chunked` (query and key blocks with an online softmax and a "
                                      "recomputing backward: O(t) memory, masked-out blocks skipped), `pallas_tpu` "
                                      "(JAX's Splash kernel, on TPU) or `pallas_gpu` (JAX's Pallas FlashAttention, on "
                                      "GPU) or `cudnn` (cuDNN's, on GPU, pre-training rows in bf16/fp16), refused where "
                                      "they cannot express the run's masks; or `auto`: per platform, on GPU cuDNN "
                                      "else `pallas_gpu`, on TPU `pallas_tpu`, where they compute every layer's masks; "
                                      "otherwise and on CPU `chunked` from `seq_len` 4096 on or with a window shorter "
                                      "than `seq_len`, else `dense`; the choice and why are logged; see \"Attention\"")
    init_std: float = key(0.02, "standard deviation of the random initialisation")
    pattern: list = key(["dense"], "the block kinds repeated down the stack: `dense` or `moe` (attention, then a dense "
                                   "or an MoE feed-forward), `linear` or `linear_moe` (Gated DeltaNet, `model.linear_"
                                   "attn`, in place of attention); `[\"dense\", \"moe\"]` puts an MoE feed-forward "
                                   "in every second layer, `[\"linear_moe\", \"linear_moe\", \"linear_moe\", "
                                   "\"moe\"]` is Qwen3-Next's stack; the stack is scanned")
    segments: list = key([], "the stack as segments run in turn, each a table `{layers = N, pattern = [...]}` (its "
                             "pattern repeated over its N layers, scanned): `[{layers = 3, pattern = [\"dense\"]}, "
                             "{layers = 58, pattern = [\"moe\"]}]` puts three dense layers first; the layers add up "
                             "to `n_layers`, and `pattern` is not read; empty: one segment, `pattern` over `n_layers`")
    remat: str = key("none", "activation recomputation per layer: `none`, `full`, `selective` (= `save-dots`: keep "
                             "the weight matmuls' outputs, recompute the attention core), `save-dots`, `save-named` "
                             "(keep q, k, v, attention output, MLP hidden), `offload-dots` and `offload-named` "
                             "(save-dots and save-named, kept in host memory); see \"Activation memory\"")
    remat_group: int = key(0, "pattern repeats per recomputed group (0: off; -1: the divisor of a stage chunk's "
                              "repeats nearest its square root; otherwise it must divide them)")
    collective_matmul: bool = key(False, "tensor-parallel projections as collective matmuls: the sequence all-gather "
                                         "and reduce-scatter ride a ring of `ppermute`s over tp interleaved with "
                                         "partial matmuls (needs `train.sequence_parallel`)")
    cp_strategy: str = key("ring", "attention when the sequence is split over `mesh.sp`: `ring` (K/V blocks rotate), "
                                   "`allgather` (K/V gathered), `ulysses` (all-to-all to head-split and back; heads "
                                   "must divide by `sp × tp`)")
    cp_load_balance: bool = key(True, "zig-zag order of the sequence over `sp` ranks so each does the same causal "
                                      "work (`seq_len` must divide by `2 × sp`)")
    mtp_depth: int = key(0, "multi-token prediction (DeepSeek-V3): this many modules after the stack, the k-th "
                            "predicting the token k + 1 ahead from the (k−1)-th's output and the embedding of the token "
                            "k ahead, each with its own norms, projection and block (the stack's last kind), sharing "
                            "the embedding and the head; training adds `train.mtp_weight` × their mean loss, "
                            "generation and evaluation ignore them; 0 = none")
    moe: MoeConfig = field(default_factory=MoeConfig)
    mla: MlaConfig = field(default_factory=MlaConfig)
    linear_attn: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ZeroPPConfig:
    """ZeRO++ over ZeRO-3 (`jaxllm/parallel/zeropp.py`): int8 weight gathers and gradient reduce-scatters,
    hierarchical partitioning. Not one device's numbers: within the bounds the README states."""

    weights: bool = key(False, "ZeRO++ qwZ under ZeRO-3: weight all-gathers move int8 blocks and fp32 scales "
                               '(see "ZeRO++")')
    grads: bool = key(False, "ZeRO++ qgZ under ZeRO-3: gradient reduce-scatters move int8 blocks (an all-to-all), "
                             "summed in fp32")
    hpz: bool = key(False, "ZeRO++ hpZ: master and optimizer state over dp × fsdp, a compute-dtype copy over fsdp: "
                           "per-layer gathers within fsdp (needs `mesh.dp` > 1)")
    block: int = key(256, "elements per quantization block, one fp32 scale each")


@dataclass
class TrainConfig:
    """The step and the loop: objective, batch, ZeRO and pipeline, optimizer and schedule, the step guard,
    logging, validation and checkpoints."""

    objective: str = key("lm", "what a step minimises: `lm` (next-token cross-entropy over the loss mask: "
                               "pre-training and fine-tuning) or `grpo` (reinforcement learning with verifiable "
                               "rewards on the model's own samples, the `rl` section; see \"Reinforcement learning "
                               '(GRPO)") or `dpo` (preference optimisation on pairs of completions, the `dpo` section '
                               'and `data.format = "preference"`; see "Preference optimisation")')
    steps: int = key(200, "optimizer steps to run")
    epochs: int = key(0, "fine-tuning data (`data.format` chat or prompt_completion): passes over the rows; when set "
                         "(> 0) it wins over `train.steps`, which becomes epochs × steps per epoch (logged)")
    schedule_steps: int = key(0, "length of the learning-rate schedule (0 = `train.steps`); fix it so a run stopped "
                                 "early and resumed follows the same schedule")
    seed: int = key(0, "initialisation and data order; the batch of step s depends only on (seed, s), never on "
                       "the mesh")
    global_batch: int = key(16, "sequences per step, over all devices; must divide by `microbatches × dp × fsdp × "
                                "ep`")
    microbatches: int = key(1, "gradient accumulation: each device's rows are split into this many microbatches; "
                               "with `mesh.pp > 1`, the microbatches that flow through the pipeline")
    zero_stage: int = key(0, "0 (DDP), 1 (optimizer state sharded over `fsdp`), 2 (+ gradients), 3 (+ parameters, "
                             "gathered at use)")
    allreduce: str = key("xla", "ZeRO-0/1's gradient all-reduce over the batch axes: `xla` (the compiler's `psum`), "
                                "or a hand-built algorithm on `ppermute`: `ring`, `tree`, `halving_doubling`, "
                                "`hierarchical` (over fsdp×ep inside, dp outside), `ps` (see \"Communication: the "
                                'all-reduce algorithms")')
    bucket_mb: float = key(25.0, "a hand-built `train.allreduce` reduces the gradients in buckets of this many "
                                 "megabytes")
    zeropp: ZeroPPConfig = field(default_factory=ZeroPPConfig)
    pp_schedule: str = key("1f1b", "with `mesh.pp > 1`: `gpipe` (all forwards, then all backwards), `1f1b` (one "
                                   "forward one backward, at most 2·pp−1 stage inputs kept), `interleaved` "
                                   "(Megatron's interleaved 1F1B; `microbatches` a multiple of `pp`), or the "
                                   "zero-bubble schedules, whose backward is split into a re-run, the input gradient "
                                   "and the weight gradients, the last in pieces filling each tick: `zb_h1` (1F1B's in-flight count) "
                                   "and `zb_v` (two chunks per stage in a V); see docs/pipeline.md")
    pp_virtual: int = key(1, "model chunks per stage for `interleaved` (the bubble shrinks roughly by this factor; "
                             "each step then moves stage weights between stages, see docs/design-notes.md); the "
                             "pattern repeats in `n_layers` must divide by `pp × pp_virtual`; `zb_v` always holds "
                             "two, so they must divide by `2 × pp`")
    pp_gather_once: bool = key(False, "with `mesh.pp > 1` and ZeRO-3: gather a stage's weights over `fsdp` once per "
                                      "step instead of at every microbatch (more memory, fewer all-gathers)")
    sequence_parallel: bool = key(False, "Megatron sequence parallelism: the residual stream (norms, residual adds) "
                                         "is split along the sequence over `tp`")
    mtp_weight: float = key(0.3, "with `model.mtp_depth` > 0: λ, the weight of the multi-token prediction modules' mean "
                                 "loss in the objective (the logged `loss` includes it; `lm_loss` and `mtp_loss` are "
                                 "the two parts)")
    loss_chunk: int = key(-1, "compute the logits this many sequence positions at a time, so [tokens × vocab] logits "
                              "never exist at once; must divide `seq_len`; 0 = all at once; -1 = by the rule: in "
                              "chunks where a token's fp32 logits outweigh its residual stream over the layers, "
                              "whole elsewhere (see \"Memory\")")
    optimizer: str = key("adamw", "`adamw`, `sgd` (with momentum), `adafactor`, `lion`, `muon` (per-layer on "
                                  "stacked weights; Adam for embeddings, head, norms)")
    lr: float = key(1e-3, "peak learning rate: linear warm-up to `lr`, cosine to `lr × min_lr_ratio`")
    min_lr_ratio: float = key(0.1, "where the cosine ends, as a share of `lr`")
    warmup_steps: int = key(20, "steps of linear warm-up to `lr`")
    warmup_ratio: float = key(0.0, "> 0: `warmup_steps` is this share of the schedule (rounded), e.g. 0.03")
    beta1: float = key(0.9, "optimizer constant: Adam's first-moment decay (AdamW 0.9)")
    beta2: float = key(0.95, "optimizer constant: Adam's second-moment decay (AdamW 0.95)")
    eps: float = key(1e-8, "optimizer constant: Adam's epsilon")
    moment_dtype: str = key("float32", "`float32` or `bfloat16`: the dtype adamw keeps its two moment estimates in "
                                       "between steps (DeepSeek-V3's bf16 halves them; each step updates them in fp32); "
                                       "the master weights stay fp32")
    momentum: float = key(0.9, "optimizer constant: momentum (`sgd`)")
    weight_decay: float = key(0.1, "decoupled weight decay on matrices only (not norms, biases)")
    grad_clip: float = key(1.0, "global-norm clipping threshold (0 = off)")
    skip_nonfinite: bool = key(True, "`true`: a step whose loss or gradients are not finite leaves the parameters "
                                     "and optimizer state as they were (its batch is spent; the learning-rate "
                                     "schedule does not advance)")
    spike_factor: float = key(0.0, "> 1: also skip a step whose loss is above this factor × the median of the last "
                                   "`spike_window` losses of applied steps, once half of them are known; 0 = off; "
                                   "never for GRPO")
    spike_window: int = key(100, "how many recent losses of applied steps `train.spike_factor`'s median looks at")
    max_consecutive_skips: int = key(10, "this many skipped steps in a row end the run in one line")
    resume: bool = key(False, "continue from the newest checkpoint in `run.dir` that reads back whole (may be on a "
                              'different mesh; see "Preemption and recovery")')
    log_every: int = key(10, "log every N steps (step 1 always)")
    eval_every: int = key(50, "validation every N steps (0 = off)")
    eval_tasks: list = key([], "benchmark task files (lm-evaluation-harness's format, see \"Evaluation\") scored at "
                               "each validation step (`train.eval_every`) and the last; metrics.jsonl gets "
                               "`eval/TASK/METRIC`, `RUN_DIR/eval/step_N.json` the results and every request's "
                               "log-likelihood")
    eval_batches: int = key(4, "validation over this many fixed batches; fine-tuning data is validated over its "
                               "whole validation split (`eval_batches` is not used)")
    checkpoint_every: int = key(100, "async Orbax checkpoint every N steps and at the end (0 = off)")
    keep_checkpoints: int = key(2, "how many of the latest checkpoints are kept")
    checkpoint_checksums: bool = key(True, "a checksum of each array saved with each checkpoint and checked when it "
                                           "is restored: a checkpoint whose values changed is set aside as damaged "
                                           '(see "Preemption and recovery")')


@dataclass
class PrecisionConfig:
    """Number formats: the compute dtype, loss scaling, fp8 matmuls and ZeRO-3's gradient reduction (see
    "Precision: loss scaling and the step guard" and "Precision: fp8 matmuls")."""

    compute: str = key("bfloat16", "`bfloat16`, `float32` or `float16`: the dtype of matmuls and activations. "
                                   "Parameters and optimizer state are always fp32; softmax, norm statistics, logits "
                                   "and the loss are fp32. `float32` also sets full-precision matmuls (no TF32) on "
                                   "GPU; `float16` wants loss scaling (`precision.loss_scale`)")
    loss_scale: str = key("auto", "`auto` (`dynamic` under float16, else `none`), `dynamic`, `static` or `none`")
    loss_scale_init: float = key(65536.0, "the first scale (65536 = 2^16; a power of two)")
    loss_scale_window: int = key(1000, "the finite steps in a row before a dynamic scale doubles")
    loss_scale_min: float = key(1.0, "the floor a dynamic scale never halves below")
    matmul: str = key("default", "`default` (the compute dtype), `fp8`: the weight matmuls of attention, MLP and "
                                 "experts multiply E4M3 operands forward and E5M2 gradients backward, each scaled "
                                 "per tensor, `fp8_block`: DeepSeek-V3's E4M3 throughout, scaled per 1 × 128 tile "
                                 "of activations and gradients and per 128 × 128 block of weights, or `mxfp8`: E4M3 "
                                 "in blocks of 32 along each contraction with power-of-two scales (OCP MX; a GPU's "
                                 "block-scaled dot, emulated elsewhere)")
    fp8_exclude: list = key(["head"], "matmul groups kept in the compute dtype under `fp8`, `fp8_block`, `mxfp8`, from "
                                      "`attention`, `mlp`, `experts`, `head`")
    grad_reduce: str = key("compute", "ZeRO-3's gradient reduce-scatter in `compute` (the compute dtype: the "
                                      "transpose of cast-then-gather) or `float32` (through the ZeRO-3 island of "
                                      "parallel/zeropp.py)")


@dataclass
class MemoryConfig:
    """Host offload of the train state (`jaxllm/trainer/offload.py`): stored in host memory, used on the device."""

    offload_optimizer: bool = key(False, "keep the optimizer state in host memory between steps (brought to the "
                                         'device for the update; see "Activation memory")')
    offload_params: bool = key(False, "keep the fp32 master parameters in host memory between steps (brought to "
                                      "the device at the step's start)")


@dataclass
class DataConfig:
    """The training data: where it comes from, its tokenizer and validation split, and how fine-tuning examples
    are read, rendered and put into rows (see "Supervised fine-tuning")."""

    source: str = key("stdlib", "`stdlib` (the Python standard library's source on this machine, split into "
                                "train/validation by file), a text file, a folder of text files, or a folder/glob of "
                                "llm.c `.bin` token shards (names containing `val` are validation), a JSONL, Parquet "
                                "or Arrow file (`data.text_key`) or a folder of them; for `chat`, "
                                "`prompt_completion` and `preference`, a JSONL file")
    tokenizer: str = key("byte", "`byte` (UTF-8 bytes + end-of-text, 257 ids), `gpt2` (tiktoken's GPT-2 BPE; needs "
                                 "`pip install -e \".[gpt2]\"` and the encoding files in tiktoken's cache, since they "
                                 "are not downloaded) or `hf:DIR` (a Hugging Face tokenizer folder); `init` takes the "
                                 "tokenizer of the `init.from = \"hf:DIR\"` folder")
    val_percent: float = key(5.0, "share held out for validation: of files (or of a single file's text, by bytes); "
                                  "of examples for fine-tuning data; 0 = no validation split (`train.eval_every` is "
                                  "then ignored, with a log line)")
    sources: list = key([], "a mixture, instead of `data.source`: a list of tables `{path, weight}` (and optionally "
                            "`name`, `text_key`), each path a source as `data.source` takes; a step's rows come from "
                            "each source in proportion to its weight (see \"Data\"); weights may change when a run "
                            "resumes")
    text_key: str = key("text", "JSONL, Parquet and Arrow sources: the field or column holding a document's text")
    document_mask: bool = key(False, "text: each document in a window gets its own segment, with positions from 0, so "
                                     "attention and RoPE stay inside a document; false: a window is one sequence")
    add_bos: bool = key(True, "text: keep the BOS an `hf:` tokenizer's tokenizer.json puts at each document's start "
                              "(false drops it; `byte` and `gpt2` add none)")
    add_eos: bool = key(False, "text: end each document with the end-of-text id, instead of starting it with one "
                               "(llm.c's layout)")
    prefetch: int = key(2, "batches built ahead on a background thread and put on the devices before their step; "
                           "0 = build each batch when its step starts")
    format: str = key("text", "`text` (pre-training), `chat` or `prompt_completion` (fine-tuning examples, one per "
                              "line), `preference` (a prompt with a chosen and a rejected completion per line, for "
                              "`train.objective = \"dpo\"`); for GRPO's prompts `text` (a string continued as it is) "
                              "or `chat` (a string as the user's message, rendered by the chat template)")
    messages_key: str = key("messages", "`chat`: the key of a line's list of {role, content} messages")
    prompt_key: str = key("prompt", "`prompt_completion`: the key of a line's prompt (strings, or lists of messages)")
    completion_key: str = key("completion", "`prompt_completion`: the key of a line's completion")
    chosen_key: str = key("chosen", "`preference`: the key of the preferred completion (a string, or a list of "
                                    "messages when the prompt is one)")
    rejected_key: str = key("rejected", "`preference`: the key of the other completion")
    max_prompt_tokens: int = key(0, "`preference`: a longer prompt is cut to this many tokens at the side "
                                    "`data.truncation_side` names; 0 = no limit")
    max_completion_tokens: int = key(0, "`preference`: a longer completion is cut to this many tokens at its end; "
                                        "0 = no limit")
    truncation_side: str = key("left", "`preference`: where `max_prompt_tokens` cuts a prompt: `left` (its start, "
                                       "keeping the text next to the completion: TRL's `keep_end`) or `right`")
    chat_template: str = key("", '`""`: the `hf:DIR` tokenizer\'s own template, or the built-in one for `byte` and '
                                 "`gpt2`; `builtin`; or a `.jinja` file")
    chat_template_kwargs: dict = key({}, "variables the chat template sees besides the messages, as transformers' "
                                         "`apply_chat_template(..., **kwargs)` passes them: e.g. `{enable_thinking = "
                                         "false}` for Qwen3")
    loss_on: str = key("assistant", "`assistant` (the replies, through their end-of-turn token) or `all` (every "
                                    "token of the example)")
    pack: bool = key(False, "`true`: several examples per row (first-fit-decreasing); `false`: one example per row, "
                            "padded")
    truncation: str = key("error", "an example longer than `seq_len + 1` tokens: `error`, `drop`, or `truncate` (cut "
                                   "its reply; dropped if nothing to learn is left); a preference pair whose two "
                                   "sequences do not fit one row: `truncate` cuts the longer completion's end until "
                                   "they do")


@dataclass
class RlConfig:
    """Reinforcement learning with verifiable rewards (`train.objective = "grpo"`): prompts from `data.source`
    (a JSONL file of `prompt`, `answer` and any column a reward reads, or the built-in task `arith`), each
    sampled `group_size` times, scored, and trained on with GRPO. `train.global_batch` counts completions:
    prompts per step × group_size."""

    group_size: int = key(8, "G, completions sampled per prompt and compared with each other; `train.global_batch` "
                             "counts completions, so it is prompts per step × G")
    max_new_tokens: int = key(64, "a completion's length limit; one that reaches it without a stop id is truncated")
    temperature: float = key(1.0, "the sampling temperature, which the log-probabilities of the ratio and the KL are "
                                  "also taken at")
    prompt_suffix: str = key("", "text put after every string prompt (an instruction, such as how to mark the "
                                 "answer)")
    rewards: list = key(["exact_match"], "the rewards, summed: a list of `\"name\"` or `\"name*weight\"` from "
                                         "`exact_match`, `gsm8k`, `boxed`, `format` (matches `rl.format_pattern`) and "
                                         "`python:module:function`")
    format_pattern: str = key("", "the `format` reward's regular expression")
    scale_rewards: str = key("group", "advantages are rewards minus the group's mean, divided by the group's "
                                      "standard deviation (`group`), the batch's (`batch`) or nothing (`none`, Dr. "
                                      "GRPO)")
    loss_norm: str = key("token", "`token` (the mean over every completion token of the batch), `sequence` (each "
                                  "completion's mean, then their mean: DeepSeekMath's GRPO) or `constant` (the token "
                                  "sum over rows × `max_new_tokens`: Dr. GRPO)")
    loss: str = key("grpo", "`grpo` (a ratio per token, clipped per token) or `gspo` (GSPO: one ratio per completion, "
                            "the exp of its tokens' mean log-ratio, clipped per completion; needs `loss_norm = "
                            "\"sequence\"`, and its paper clips at epsilon 3e-4, epsilon_high 4e-4); see "
                            "\"Reinforcement learning\"")
    epsilon: float = key(0.2, "the ratio's clip range [1 − epsilon, 1 + epsilon_high]")
    epsilon_high: float = key(0.0, "the clip range's upper epsilon; 0 = `rl.epsilon` (DAPO raises it to 0.28)")
    beta: float = key(0.0, "weight of the KL (k3) to the starting parameters; 0 keeps no reference model")
    num_iterations: int = key(1, "optimizer steps on each batch of rollouts; `train.steps` and "
                                 "`train.checkpoint_every` are multiples of it")
    sampler: str = key("static", "what samples the rollouts: `static` (`generate` on the run's mesh, one batch) or "
                                 "`engine` (the rollout engine: paged, continuously batched, a group's prompt "
                                 "prefilled once; on the run's mesh); the same tokens either way")
    engine_slots: int = key(0, "with `sampler = \"engine\"`: the completions decoded at once; 0 = all of a step's")
    engine_pages: int = key(0, "with `sampler = \"engine\"`: the pages (16 tokens each) of each data-parallel "
                               "rank's KV-cache pool, scratch included; 0 = what every slot's longest completion "
                               "needs at once; fewer and completions wait for pages (the same tokens)")
    engine_steps_per_call: int = key(1, "with `sampler = \"engine\"`: decode steps one program call runs before "
                                        "the host reads their tokens and admits completions (the same tokens); see "
                                        "\"Generation\"")
    async_steps: int = key(0, "asynchronous RL: k > 0 = each batch of rollouts is sampled, on a thread while the "
                              "trainer steps, by the parameters of k batches of rollouts before it, and the loss is "
                              "decoupled PPO (the clip against the trainer's parameters, weighted by min(π_prox/μ, "
                              "`behaviour_cap`)); 0 = synchronous; see \"Reinforcement learning\"")
    behaviour_cap: float = key(5.0, "with `async_steps` > 0: C, the cap on the behaviour weight π_prox/μ")
    max_num_gen_batches: int = key(0, "DAPO's dynamic sampling: 0 = off; N = groups whose rewards are all equal are "
                                      "dropped and the batch refilled from further prompts, at most N rounds of "
                                      "generation a batch; short after N rounds, the batch is filled with dropped "
                                      "groups that train on nothing (their loss mask zero); see \"Reinforcement "
                                      "learning\"")
    overlong_buffer: int = key(0, "DAPO's overlong reward shaping: 0 = off; L_cache = N tokens: a completion longer "
                                  "than max_new_tokens − N earns a penalty falling linearly to −1 at max_new_tokens "
                                  "(× `overlong_factor`), added to its reward")
    overlong_factor: float = key(1.0, "the overlong penalty's weight")
    mask_truncated: bool = key(False, "`true`: a completion that reached `max_new_tokens` without a stop id counts "
                                      "for nothing (DAPO's overlong filter); `false`: trained on like the others")


@dataclass
class DpoConfig:
    """Preference optimisation (`train.objective = "dpo"`) on pairs from `data.format = "preference"`. With Δ the
    chosen completion's log-ratio to the reference minus the rejected one's (log-probabilities summed over each
    completion's tokens), a pair's loss is `sigmoid` −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ) (DPO; ε = `label_smoothing`),
    `ipo` (Δ̄ − 1/(2β))² with Δ̄ from log-probabilities averaged over each completion's tokens (IPO as TRL computes
    it), or `simpo` −log σ(β(l̄_c − l̄_r) − γ) with l̄ the policy's averaged log-probability (SimPO: no reference
    model). The loss is the mean over pairs; see "Preference optimisation"."""

    loss: str = key("sigmoid", "`sigmoid` (DPO), `ipo` or `simpo`")
    beta: float = key(0.1, "β: for `sigmoid` and `ipo` the strength of the pull towards the reference (the reward is "
                           "β × the log-ratio); for `simpo` the reward's scale")
    label_smoothing: float = key(0.0, "ε in [0, 0.5): the share of pairs assumed mislabelled (`sigmoid`, `simpo`; "
                                      "conservative DPO); `ipo` refuses it")
    gamma: float = key(0.5, "γ, `simpo`'s target margin between the chosen and the rejected reward; the other "
                            "losses have none and refuse a non-default one")


@dataclass
class RunConfig:
    """The run directory, and what a run shows besides its metrics: the sample at the end, the progress bar, profiler
    traces and Weights & Biases."""

    dir: str = key("", '"": `runs/<date>-<time>`; otherwise the run directory; an existing run is never '
                       "overwritten without `train.resume=true`")
    sample_tokens: int = key(200, "tokens of the sample generated at the end (0: none)")
    sample_prompt: str = key("def ", "the prompt of the sample generated at the end")
    progress: bool = key(True, "the progress bar")
    profile_steps: list = key([], "`[start, count]`: a `jax.profiler` trace of steps start .. start + count - 1, each "
                                  "process's in `RUN_DIR/profile/process_K` (TensorBoard's profiler and Perfetto "
                                  'open it; see "Observability"); `[]`: none')
    wandb: str = key("off", "`off`, `online` or `offline` (a run in `RUN_DIR/wandb` to `wandb sync` later): "
                            "metrics.jsonl's scalars and the resolved config to Weights & Biases from process 0; a "
                            "resumed run continues the same W&B run (needs `pip install \"jaxllm[wandb]\"`)")
    wandb_project: str = key("jaxllm", "the W&B project")
    wandb_entity: str = key("", "the W&B entity (team or user); `\"\"`: your default")
    wandb_name: str = key("", "the W&B run's display name; `\"\"`: the run directory's name")
    wandb_tags: list = key([], "the W&B run's tags (strings)")


@dataclass
class InitConfig:
    """Where the parameters start. Spelled `init.from` in files and overrides (`from` is a Python keyword)."""

    from_: str = key("", 'where the parameters start: `""` (random, `model.init_std`), `"hf:DIR"` (a Hugging Face '
                         'checkpoint, see "Hugging Face checkpoints") or `"run:DIR[@STEP]"` (another run\'s '
                         "parameters, its newest or STEP checkpoint, with a fresh optimizer)")
    adapter: str = key("", "a PEFT LoRA adapter directory whose A and B the adapters start from (with `model.lora`, "
                           "its rank, alpha and targets as the directory's adapter_config.json says); `\"\"`: fresh "
                           "adapters")


@dataclass
class Config:
    """The whole configuration: one section per field, each key spelled `section.key` (or
    `section.subsection.key`) in TOML files and `key=value` overrides."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    run: RunConfig = field(default_factory=RunConfig)


# ---------------------------------------------------------------- the reference


def _key_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")  # init.from is the field from_ (`from` is a Python keyword)


def _is_section(f: dataclasses.Field) -> bool:
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


def _sections(cls=Config, prefix: str = ""):
    """(dotted section name, its dataclass) for every section, each before the sections nested in it."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield prefix + f.name, f.default_factory
            yield from _sections(f.default_factory, f"{prefix}{f.name}.")


def _fields(cls=Config, prefix: str = ""):
    """(dotted key, field) for every key, in schema order (a nested section's keys where it sits)."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield from _fields(f.default_factory, f"{prefix}{f.name}.")
        elif prefix:
            yield prefix + _key_name(f), f


def keys() -> list[str]:
    """Every dotted config key, in schema order (`init.from`, `mesh.dcn.pp`, ...)."""
    return [k for k, _ in _fields()]


def table_keys() -> frozenset[str]:
    """The keys whose value is a table (a dict of names to values, e.g. `data.chat_template_kwargs`), not a
    section of keys: TOML and the config files hold it whole."""
    return frozenset(k for k, f in _fields() if f.type in (dict, "dict"))


def _field(dotted: str) -> dataclasses.Field:
    cls, parts = Config, dotted.split(".")
    for i, part in enumerate(parts):
        fields = {_key_name(f): f for f in dataclasses.fields(cls)}
        f = fields.get(part) or fields.get(part.rstrip("_"))
        if f is None:
            where = ".".join(parts[:i]) or "the top level"
            raise KeyError(f"unknown key '{dotted}': {where} has {', '.join(fields)}")
        if i == len(parts) - 1:
            if _is_section(f):
                raise KeyError(f"'{dotted}' is a section, not a key")
            return f
        if not _is_section(f):
            raise KeyError(f"unknown key '{dotted}': '{'.'.join(parts[:i + 1])}' is a key, not a section")
        cls = f.default_factory


def meaning(dotted: str) -> str:
    """What a dotted config key (`train.steps`, `init.from`) means, as its field's metadata says."""
    return _field(dotted).metadata.get("meaning", "")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _literal(value) -> str:
    """A default as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def reference_markdown() -> str:
    """The configuration reference (tools/dev/docs_hooks.py puts it into docs/configuration.md): a `## section`
    heading per section, nested ones (`model.moe`) after their parent, each with its docstring and a table of its
    keys' types, defaults and meanings."""
    lines = []
    for name, cls in _sections():
        lines += [f"## {name}", "", inspect.cleandoc(cls.__doc__), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if _is_section(f):
                continue
            typ = f.type if isinstance(f.type, str) else f.type.__name__
            lines.append(f"| `{name}.{_key_name(f)}` | {_cell(typ)} | `{_cell(_literal(_default(f)))}` "
                         f"| {_cell(f.metadata.get('meaning', ''))} |")
        lines.append("")
    return "\n".join(lines)
