"""The config tree's schema: one dataclass per section, with defaults and what each key means.

Below everything that reads a section (the mesh, the model, the step, the optimizer, the data):
it imports nothing of jaxllm. `config.py` builds a `Config` from files and overrides and has each
section validated by the code that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DcnConfig:
    """Mesh sizes across nodes/slices (slow links) for a hybrid mesh; the `mesh` sizes are then per node."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    sp: int = 1
    tp: int = 1


@dataclass
class MeshConfig:
    """Device mesh sizes, outermost to innermost. One axis may be -1: it takes the remaining devices."""

    pp: int = 1
    dp: int = -1
    fsdp: int = 1
    ep: int = 1
    sp: int = 1
    tp: int = 1
    dcn: DcnConfig = field(default_factory=DcnConfig)


@dataclass
class DistributedConfig:
    """Multi-process start-up. Explicit address/count/id, or `auto` for the cluster detection JAX has."""

    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    auto: bool = False


@dataclass
class MoeConfig:
    """Mixture-of-experts feed-forward, used by the "moe" blocks of `model.pattern`."""

    n_experts: int = 8
    top_k: int = 2  # 1 as in Switch, 2 as in Mixtral
    d_ff: int = 0  # each expert's hidden size; 0: model.d_ff
    shared_expert: bool = False  # a dense feed-forward every token also goes through
    capacity_factor: float = 1.25  # buffer slots per expert = factor · tokens·top_k / n_experts; 0: dropless
    balance_weight: float = 0.01  # Switch load-balancing loss
    z_weight: float = 0.001  # router z-loss


# A family (`model.family`) is a shorthand for the features it is made of; a preset names a family and a
# size. Keys the user sets explicitly win over both. Here, below config.py and interop/, which both read it.
FAMILIES: dict[str, dict] = {
    "gpt2": dict(norm="layernorm", mlp="gelu_tanh", positions="learned", attn_bias="qkvo", mlp_bias=True,
                 tie_embeddings=True),
    "llama": dict(norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias="none", mlp_bias=False,
                  tie_embeddings=False),
    "qwen2": dict(norm="rmsnorm", mlp="swiglu", positions="rope", attn_bias="qkv", mlp_bias=False,
                  tie_embeddings=False),
}


@dataclass
class ModelConfig:
    preset: str = ""
    # A shorthand that fills the features below as a preset does (`FAMILIES` above: gpt2 | llama |
    # qwen2); keys set explicitly win. The model code reads only the features.
    family: str = "gpt2"
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads
    head_dim: int = 0  # 0: d_model / n_heads
    d_ff: int = 1024
    vocab_size: int = 0  # 0: the tokenizer's; padded up to a multiple of 128 in the parameters
    seq_len: int = 256
    # The features a family is made of.
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu_tanh"  # gelu_tanh (transformers' gelu_new) | swiglu
    positions: str = "learned"  # learned (a table of max_positions rows) | rope
    max_positions: int = 0  # the longest sequence the model is for (learned: the table's rows); 0: seq_len
    attn_bias: str = "qkvo"  # none | qkv | qkvo: biases on the query, key, value (and output) projections
    mlp_bias: bool = True  # biases on the dense feed-forward's projections (experts have none)
    tie_embeddings: bool = True  # the output head is the token embedding
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's frequency bands, with the four keys below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    sliding_window: int = 0  # attention window of a loaded model; 0: none. Only windows ≥ seq_len run
    init_std: float = 0.02
    pattern: list = field(default_factory=lambda: ["dense"])  # block kinds repeated down the stack
    remat: str = "none"  # none | full | selective (= save-dots) | save-dots | save-named | offload-dots | offload-named
    remat_group: int = 0  # pattern repeats per recomputed group (0: off; -1: the divisor nearest the square root)
    # Tensor-parallel projections overlap their sequence all-gather / reduce-scatter with partial
    # matmuls (a ring of ppermutes over tp); needs train.sequence_parallel.
    collective_matmul: bool = False
    # Attention with the sequence split over mesh.sp: ring | allgather | ulysses.
    cp_strategy: str = "ring"
    cp_load_balance: bool = True  # zig-zag order, so every sp rank does the same causal work
    moe: MoeConfig = field(default_factory=MoeConfig)


@dataclass
class ZeroPPConfig:
    """ZeRO++ over ZeRO-3 (`jaxllm/parallel/zeropp.py`): int8 weight gathers and gradient reduce-scatters,
    hierarchical partitioning. Not one device's numbers: within the bounds the README states."""

    weights: bool = False  # qwZ: the weight all-gather moves int8 blocks and fp32 scales
    grads: bool = False  # qgZ: the gradient reduce-scatter is an all-to-all of int8 blocks, summed in fp32
    hpz: bool = False  # hpZ: master and optimizer state over dp × fsdp, a compute-dtype copy over fsdp (dp > 1)
    block: int = 256  # elements per quantization block (one fp32 scale each)


@dataclass
class TrainConfig:
    # What a step minimises: lm (next-token cross-entropy over the loss mask: pre-training and fine-tuning)
    # | grpo (reinforcement learning with verifiable rewards on the model's own samples: the `rl` section).
    objective: str = "lm"
    steps: int = 200
    epochs: int = 0  # fine-tuning examples: passes over the rows; when set it wins over train.steps
    schedule_steps: int = 0  # 0: train.steps
    seed: int = 0
    global_batch: int = 16  # sequences per step
    microbatches: int = 1
    zero_stage: int = 0
    allreduce: str = "xla"  # ZeRO-0/1's gradient all-reduce: xla | ring | tree | halving_doubling | hierarchical | ps
    bucket_mb: float = 25.0  # gradients reduced in buckets of this size by a hand-built train.allreduce
    zeropp: ZeroPPConfig = field(default_factory=ZeroPPConfig)
    # Pipeline (mesh.pp > 1): the schedule, model chunks per stage (interleaved), and under ZeRO-3
    # whether a stage's weights are gathered once per step rather than at every microbatch.
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    pp_virtual: int = 1
    pp_gather_once: bool = False
    # Megatron sequence parallelism: norms and residual adds hold the sequence sharded over tp.
    sequence_parallel: bool = False
    loss_chunk: int = 0  # sequence positions per chunk of the loss; 0: all logits at once
    optimizer: str = "adamw"  # adamw | sgd | adafactor | lion | muon
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    warmup_ratio: float = 0.0  # > 0: warmup_steps = this share of the schedule
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off
    skip_nonfinite: bool = True  # a step with a non-finite loss or gradient leaves params and optimizer state alone
    spike_factor: float = 0.0  # > 1: also skip a step whose loss exceeds this × the median of recent losses; 0 = off
    spike_window: int = 100  # how many recent losses of applied steps that median looks at
    max_consecutive_skips: int = 10  # so many skipped steps in a row end the run (one line)
    resume: bool = False
    log_every: int = 10
    eval_every: int = 50  # 0: no validation
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0: no checkpoints
    keep_checkpoints: int = 2


@dataclass
class PrecisionConfig:
    compute: str = "bfloat16"  # bfloat16 | float32 | float16
    loss_scale: str = "auto"  # auto (dynamic under float16, else none) | dynamic | static | none
    loss_scale_init: float = 65536.0  # 2^16; a power of two
    loss_scale_window: int = 1000  # finite steps in a row before a dynamic scale doubles
    loss_scale_min: float = 1.0  # a dynamic scale never halves below it
    matmul: str = "default"  # default (the compute dtype) | fp8 (E4M3 forward, E5M2 gradients, per-tensor scales)
    fp8_exclude: list = field(default_factory=lambda: ["head"])  # matmul groups kept out of fp8: attention, mlp, experts, head
    # ZeRO-3's gradient reduce-scatter: in the compute dtype (the transpose of cast-then-gather), or float32
    # (through the ZeRO-3 island of parallel/zeropp.py)
    grad_reduce: str = "compute"


@dataclass
class MemoryConfig:
    """Host offload of the train state (`jaxllm/train/offload.py`): stored in host memory, used on the device."""

    offload_optimizer: bool = False  # the optimizer state lives in host memory between steps
    offload_params: bool = False  # the fp32 master parameters live in host memory between steps


@dataclass
class DataConfig:
    # text: stdlib | text file | folder | folder or glob of llm.c .bin shards; chat, prompt_completion: a JSONL file
    source: str = "stdlib"
    tokenizer: str = "byte"  # byte | gpt2 | hf:DIR (a Hugging Face tokenizer.json) | init (init.from's hf:DIR)
    val_percent: float = 5.0  # text: by file or by bytes; examples: by example; 0: no validation
    format: str = "text"  # text (pre-training) | chat | prompt_completion (fine-tuning examples, one per line)
    messages_key: str = "messages"  # chat: the key of a line's list of {role, content} messages
    prompt_key: str = "prompt"  # prompt_completion: strings, or lists of messages
    completion_key: str = "completion"
    chat_template: str = ""  # "": the tokenizer's own (hf:DIR) or the built-in one (byte, gpt2) | builtin | a .jinja file
    loss_on: str = "assistant"  # assistant (the replies, through their end-of-turn token) | all
    pack: bool = False  # several examples per row (first-fit-decreasing), else one per row
    truncation: str = "error"  # an example longer than a row: error | drop | truncate (its reply)


@dataclass
class RlConfig:
    """Reinforcement learning with verifiable rewards (`train.objective = "grpo"`): prompts from `data.source`
    (a JSONL file of `prompt`, `answer` and any column a reward reads, or the built-in task `arith`), each
    sampled `group_size` times, scored, and trained on with GRPO. `train.global_batch` counts completions:
    prompts per step × group_size."""

    group_size: int = 8  # completions per prompt (G), compared with each other
    max_new_tokens: int = 64  # a completion's length limit; one that reaches it without a stop id is truncated
    temperature: float = 1.0  # sampling temperature, also the one the log-probabilities are taken at
    prompt_suffix: str = ""  # text after every string prompt (an instruction, such as how to mark the answer)
    rewards: list = field(default_factory=lambda: ["exact_match"])  # "name" or "name*weight", summed
    format_pattern: str = ""  # the `format` reward's regular expression
    scale_rewards: str = "group"  # advantages divided by the group's std | the batch's | none (Dr. GRPO)
    loss_norm: str = "token"  # token | sequence | constant (Dr. GRPO)
    epsilon: float = 0.2  # the ratio's clip range: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = 0.0  # 0: rl.epsilon
    beta: float = 0.0  # weight of the KL (k3) to the starting parameters; 0: no reference model
    num_iterations: int = 1  # optimizer steps on each batch of rollouts
    mask_truncated: bool = False  # truncated completions count for nothing


@dataclass
class RunConfig:
    dir: str = ""  # "": runs/<date>-<time>
    sample_tokens: int = 200  # generated at the end; 0: none
    sample_prompt: str = "def "
    progress: bool = True


@dataclass
class InitConfig:
    """Where the parameters start. Spelled `init.from` in files and overrides (`from` is a Python keyword)."""

    from_: str = ""  # "": random (model.init_std) | "hf:DIR" (Hugging Face weights) | "run:DIR[@STEP]"


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    run: RunConfig = field(default_factory=RunConfig)
