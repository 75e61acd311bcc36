"""Configuration: one typed tree of dataclasses, TOML files, dotted overrides, validation.

A run's configuration is built in three layers, later ones winning:
the dataclass defaults, then `model.preset` (which fills model fields), then the
TOML file and the `key=value` overrides. Keys given explicitly always beat the
preset, whatever their order. Values parse as TOML literals (`true`, `0`,
`1e-3`, `"text"`; a bare word that is not a TOML literal is taken as a string).

`validate(cfg, n_devices)` checks everything that can be checked before compiling.
Each problem is a `ConfigError` whose message is one line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field

from jaxllm.errors import ConfigError

MESH_AXES = ("pp", "dp", "fsdp", "ep", "sp", "tp")


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


@dataclass
class ModelConfig:
    preset: str = ""
    family: str = "gpt2"  # gpt2 | llama
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads
    d_ff: int = 1024
    vocab_size: int = 0  # 0: the tokenizer's; padded up to a multiple of 128 in the parameters
    seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    pattern: list = field(default_factory=lambda: ["dense"])  # block kinds repeated down the stack
    remat: str = "none"  # none | full | save-dots | save-named
    # Tensor-parallel projections overlap their sequence all-gather / reduce-scatter with partial
    # matmuls (a ring of ppermutes over tp); needs train.sequence_parallel.
    collective_matmul: bool = False
    # Attention with the sequence split over mesh.sp: ring | allgather | ulysses.
    cp_strategy: str = "ring"
    cp_load_balance: bool = True  # zig-zag order, so every sp rank does the same causal work
    moe: MoeConfig = field(default_factory=MoeConfig)


@dataclass
class TrainConfig:
    steps: int = 200
    schedule_steps: int = 0  # 0: train.steps
    seed: int = 0
    global_batch: int = 16  # sequences per step
    microbatches: int = 1
    zero_stage: int = 0
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
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off
    resume: bool = False
    log_every: int = 10
    eval_every: int = 50  # 0: no validation
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0: no checkpoints
    keep_checkpoints: int = 2


@dataclass
class PrecisionConfig:
    compute: str = "bfloat16"  # bfloat16 | float32


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text file | folder | folder or glob of llm.c .bin shards
    tokenizer: str = "byte"  # byte | gpt2
    val_percent: float = 5.0


@dataclass
class RunConfig:
    dir: str = ""  # "": runs/<date>-<time>
    sample_tokens: int = 200  # generated at the end; 0: none
    sample_prompt: str = "def "
    progress: bool = True


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)


# Presets fill model fields; keys the user sets explicitly win over them.
_GPT2 = dict(family="gpt2", vocab_size=50257, seq_len=1024)
_LLAMA = dict(family="llama", vocab_size=128256, seq_len=2048, rope_theta=500000.0)
PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(family="gpt2", n_layers=2, d_model=64, n_heads=8, n_kv_heads=8, d_ff=256, seq_len=64),
    "tiny-llama": dict(family="llama", n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, d_ff=128, seq_len=64),
    "small-gpt2": dict(family="gpt2", n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=1024, seq_len=256),
    "gpt2-124m": dict(_GPT2, n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=3072),
    "gpt2-350m": dict(_GPT2, n_layers=24, d_model=1024, n_heads=16, n_kv_heads=16, d_ff=4096),
    "gpt2-774m": dict(_GPT2, n_layers=36, d_model=1280, n_heads=20, n_kv_heads=20, d_ff=5120),
    "gpt2-1.5b": dict(_GPT2, n_layers=48, d_model=1600, n_heads=25, n_kv_heads=25, d_ff=6400),
    "llama-1b": dict(_LLAMA, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192),
    "llama-3b": dict(_LLAMA, n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, d_ff=8192),
    "llama-8b": dict(_LLAMA, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336),
    # tiny-llama with 8 experts, top-2, in every layer
    "tiny-moe": dict(family="llama", n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, d_ff=128, seq_len=64,
                     pattern=["moe"], **{"moe.n_experts": 8, "moe.top_k": 2}),
    # Mixtral 8x7B's shape: 32 layers of 8 experts, top-2, d_ff 14336, 8 KV heads, 32k vocabulary
    "mixtral-8x7b": dict(_LLAMA, vocab_size=32000, seq_len=4096, rope_theta=1e6, n_layers=32, d_model=4096,
                         n_heads=32, n_kv_heads=8, d_ff=14336, pattern=["moe"],
                         **{"moe.n_experts": 8, "moe.top_k": 2}),
}

CHOICES = {
    "model.family": ("gpt2", "llama"),
    "model.remat": ("none", "full", "save-dots", "save-named"),
    "model.cp_strategy": ("ring", "allgather", "ulysses"),
    "train.pp_schedule": ("gpipe", "1f1b", "interleaved"),
    "train.optimizer": ("adamw", "sgd", "adafactor", "lion", "muon"),
    "precision.compute": ("bfloat16", "float32"),
    "data.tokenizer": ("byte", "gpt2"),
}


# ---------------------------------------------------------------- parsing


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _parse_value(text: str):
    """A command-line value as a TOML literal; a bare word that is not one is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value, typ):
    """Check a value against a field's type; an int is accepted where a float is expected."""
    origin = typing.get_origin(typ) or typ
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list and isinstance(value, list):
        return value
    if isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    raise ConfigError(f"{key}: expected {names.get(origin, origin.__name__)}, got {value!r}; fix the value")


def _flatten(tree: dict, prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _set(cfg: Config, key: str, value) -> None:
    """Set a dotted key on the config tree, checking the key exists and the value's type."""
    obj = cfg
    parts = key.split(".")
    hints_owner = obj
    for i, part in enumerate(parts):
        fields = _fields(obj)
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"unknown key '{key}': {where} has {', '.join(sorted(fields))}; check the spelling")
        if i == len(parts) - 1:
            typ = typing.get_type_hints(type(obj))[part]
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{key}: is a section, not a value; set one of its keys, e.g. {key}.{next(iter(_fields(typ)))}")
            setattr(obj, part, _coerce(key, value, typ))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"unknown key '{key}': '{'.'.join(parts[:i + 1])}' is a value, not a section")
        hints_owner = obj
    del hints_owner


def parse_overrides(args: list[str]) -> dict[str, typing.Any]:
    out = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"'{arg}' is not key=value; write overrides like train.steps=100")
        key, text = arg.split("=", 1)
        out[key.strip()] = _parse_value(text.strip())
    return out


def load_toml(path: str) -> dict[str, typing.Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such file '{path}'; give a TOML file, e.g. experiments/configs/default.toml")
    try:
        with open(path, "rb") as f:
            return _flatten(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e}); fix the file") from None


def build_config(config_file: str | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Defaults, then the preset, then the file, then the overrides (explicit keys beat the preset)."""
    explicit: dict[str, typing.Any] = {}
    if config_file:
        explicit.update(load_toml(config_file))
    if isinstance(overrides, dict):
        explicit.update(overrides)
    elif overrides:
        explicit.update(parse_overrides(list(overrides)))
    cfg = Config()
    preset = explicit.get("model.preset", "")
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
        for k, v in PRESETS[preset].items():
            _set(cfg, f"model.{k}", v)
    for key, value in explicit.items():
        _set(cfg, key, value)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved configuration as TOML (written to each run directory)."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines: list[str] = []

    def section(name: str, d: dict):
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in d.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    for name, d in to_dict(cfg).items():
        section(name, d)
    return "\n".join(lines)


# ---------------------------------------------------------------- derived values


def kv_heads(m: ModelConfig) -> int:
    return m.n_kv_heads or m.n_heads


def padded_vocab(m: ModelConfig) -> int:
    """Vocabulary rounded up to a multiple of 128 (lane-friendly, and divisible by any tp up to 128)."""
    return -(-m.vocab_size // 128) * 128


def schedule_steps(t: TrainConfig) -> int:
    return t.schedule_steps or t.steps


def warmup_steps(t: TrainConfig) -> int:
    """Warm-up length, kept inside the schedule so a short run still decays."""
    return min(t.warmup_steps, schedule_steps(t) - 1)


def resolve_mesh_shape(mc: MeshConfig, n_devices: int) -> dict[str, int]:
    """Per-axis sizes over all devices (ICI size × DCN size), with the one -1 axis filled in."""
    sizes = {a: getattr(mc, a) for a in MESH_AXES}
    dcn = {a: getattr(mc.dcn, a) for a in MESH_AXES}
    for a in MESH_AXES:
        if sizes[a] == 0 or sizes[a] < -1:
            raise ConfigError(f"mesh.{a}: must be a positive size or -1, got {sizes[a]}")
        if dcn[a] < 1:
            raise ConfigError(f"mesh.dcn.{a}: must be a positive size, got {dcn[a]}")
    free = [a for a in MESH_AXES if sizes[a] == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in free)}; give the others sizes")
    fixed = math.prod(sizes[a] * dcn[a] for a in MESH_AXES if sizes[a] != -1)
    if free:
        a = free[0]
        if n_devices % (fixed * dcn[a]):
            raise ConfigError(
                f"mesh: the fixed axes use {fixed * dcn[a]} devices, which does not divide the {n_devices} available; "
                "change the mesh sizes")
        sizes[a] = n_devices // (fixed * dcn[a])
    total = {a: sizes[a] * dcn[a] for a in MESH_AXES}
    if math.prod(total.values()) != n_devices:
        desc = "×".join(f"{a}={total[a]}" for a in MESH_AXES if total[a] > 1) or "1"
        raise ConfigError(
            f"mesh: {desc} uses {math.prod(total.values())} devices but {n_devices} are available; "
            "make the product of mesh.* match, or set one axis to -1")
    return total


def batch_shards(mesh_shape: dict[str, int]) -> int:
    """Devices that split the batch: dp × fsdp × ep."""
    return mesh_shape["dp"] * mesh_shape["fsdp"] * mesh_shape["ep"]


# ---------------------------------------------------------------- validation


def _validate_moe(m: ModelConfig, t: TrainConfig, shape: dict[str, int]) -> None:
    e = m.moe
    if e.n_experts < 1 or not 1 <= e.top_k <= e.n_experts:
        raise ConfigError(f"model.moe: need n_experts ≥ 1 and 1 ≤ top_k ≤ n_experts, got n_experts={e.n_experts}, "
                          f"top_k={e.top_k}")
    if e.capacity_factor < 0 or e.d_ff < 0 or e.balance_weight < 0 or e.z_weight < 0:
        raise ConfigError("model.moe: capacity_factor, d_ff, balance_weight and z_weight must be 0 or more")
    ep = shape["ep"]
    if e.n_experts % ep:
        raise ConfigError(f"model.moe.n_experts={e.n_experts} is not divisible by mesh.ep={ep}; each ep rank owns "
                          "an equal share of the experts")
    if (e.d_ff or m.d_ff) % shape["tp"]:
        raise ConfigError(f"model.moe.d_ff={e.d_ff or m.d_ff} is not divisible by mesh.tp={shape['tp']}")
    if shape["pp"] > 1:
        raise ConfigError("model.pattern with 'moe' blocks and mesh.pp>1 is not supported yet; set mesh.pp=1")
    if shape["sp"] > 1:
        raise ConfigError(f"model.pattern with 'moe' blocks and mesh.sp={shape['sp']} is not supported yet (routing "
                          "and capacity are per batch shard, not per sequence shard); set mesh.sp=1")
    if batch_shards(shape) > 1 and t.microbatches > 1 and t.zero_stage <= 1:
        raise ConfigError("model.pattern with 'moe' blocks, train.microbatches>1 and train.zero_stage≤1 on more than "
                          "one batch shard is not supported yet (ZeRO-0/1 accumulation runs per device, so routing "
                          "statistics would not be global); use train.zero_stage≥2 or one microbatch")



def validate(cfg: Config, n_devices: int) -> tuple[dict[str, int], list[str]]:
    """Check the config against the devices; return the mesh shape and notes to log.

    Raises ConfigError (one line: key and fix) for anything that cannot run.
    """
    notes: list[str] = []
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v not in allowed:
            raise ConfigError(f"{key}: '{v}' is not one of {', '.join(allowed)}")
    m, t = cfg.model, cfg.train
    shape = resolve_mesh_shape(cfg.mesh, n_devices)
    for key, v in [("model.n_layers", m.n_layers), ("model.d_model", m.d_model), ("model.n_heads", m.n_heads),
                   ("model.d_ff", m.d_ff), ("model.seq_len", m.seq_len), ("model.vocab_size", m.vocab_size),
                   ("train.global_batch", t.global_batch), ("train.microbatches", t.microbatches)]:
        if v < 1:
            raise ConfigError(f"{key}: must be at least 1, got {v}")
    if t.steps < 1:
        raise ConfigError(f"train.steps: must be at least 1, got {t.steps}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; change one of them")
    kv = kv_heads(m)
    if m.n_heads % kv:
        raise ConfigError(f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads}; pick a divisor of n_heads")
    if m.family == "gpt2" and kv != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={kv}: the gpt2 family has no grouped-query attention; set it to {m.n_heads} or 0")
    if m.family == "llama" and (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model: head dimension {m.d_model // m.n_heads} must be even for RoPE; change d_model or n_heads")
    if not m.pattern or any(k not in ("dense", "moe") for k in m.pattern):
        raise ConfigError(f"model.pattern: {m.pattern} — block kinds are 'dense' and 'moe', e.g. [\"dense\", \"moe\"] "
                          "for an MoE feed-forward every second layer")
    if m.n_layers % len(m.pattern):
        raise ConfigError(f"model.n_layers={m.n_layers} is not a multiple of the pattern length {len(m.pattern)}")
    if "moe" in m.pattern:
        _validate_moe(m, t, shape)
    tp = shape["tp"]
    if m.n_heads % tp:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by mesh.tp={tp}; use a tp that divides the heads")
    if kv % tp:
        if tp % kv:
            raise ConfigError(f"model.n_kv_heads={kv} and mesh.tp={tp}: one must divide the other; change mesh.tp")
        notes.append(f"model.n_kv_heads={kv} < mesh.tp={tp}: KV heads are replicated across tp ranks")
    if m.d_ff % tp:
        raise ConfigError(f"model.d_ff={m.d_ff} is not divisible by mesh.tp={tp}; use a tp that divides d_ff")
    if padded_vocab(m) % tp:
        raise ConfigError(f"padded vocabulary {padded_vocab(m)} is not divisible by mesh.tp={tp}; use a smaller tp")
    if t.sequence_parallel and m.seq_len % (shape["sp"] * tp):
        raise ConfigError(f"train.sequence_parallel: model.seq_len={m.seq_len} is not divisible by mesh.sp×mesh.tp="
                          f"{shape['sp'] * tp}; change seq_len or tp")
    if t.sequence_parallel and tp == 1:
        notes.append("train.sequence_parallel=true with mesh.tp=1: nothing to shard the sequence over; it has no effect")
    if m.collective_matmul and not t.sequence_parallel:
        raise ConfigError("model.collective_matmul=true needs train.sequence_parallel=true (it overlaps SP's "
                          "all-gather and reduce-scatter); turn sequence_parallel on or collective_matmul off")
    if m.collective_matmul and shape["sp"] > 1:
        raise ConfigError("model.collective_matmul=true with mesh.sp>1 is not supported yet; set mesh.sp=1 or "
                          "collective_matmul=false")
    if t.loss_chunk < 0 or (t.loss_chunk and m.seq_len % t.loss_chunk):
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} must be 0 or divide model.seq_len={m.seq_len}; "
                          "pick a divisor of seq_len")
    if t.loss_chunk and t.loss_chunk % shape["sp"]:
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} is not divisible by mesh.sp={shape['sp']}; "
                          "make it a multiple of sp")
    sp = shape["sp"]
    if sp > 1 and m.cp_load_balance and m.seq_len % (2 * sp):
        raise ConfigError(f"model.cp_load_balance: model.seq_len={m.seq_len} must divide into 2×mesh.sp={2 * sp} "
                          "chunks; change seq_len or set model.cp_load_balance=false")
    if sp > 1 and m.cp_strategy == "ulysses":
        if m.n_heads % (sp * tp):
            raise ConfigError(f"model.cp_strategy=ulysses needs model.n_heads={m.n_heads} divisible by "
                              f"mesh.sp×mesh.tp={sp * tp}; use ring or allgather, or change sp/tp")
        kv_local = max(kv, tp) // tp
        if kv_local % sp and sp % kv_local:
            raise ConfigError(f"model.cp_strategy=ulysses: {kv_local} KV head(s) per tp rank and mesh.sp={sp}: one "
                              "must divide the other; use ring or allgather, or change sp")
    if m.seq_len % shape["sp"]:
        raise ConfigError(f"model.seq_len={m.seq_len} is not divisible by mesh.sp={shape['sp']}; change one of them")
    pp, v = shape["pp"], t.pp_virtual
    if v < 1:
        raise ConfigError(f"train.pp_virtual: must be at least 1, got {v}")
    repeats = m.n_layers // len(m.pattern)
    if repeats % (pp * v):
        raise ConfigError(f"model.n_layers={m.n_layers} ({repeats} repeats of the pattern) does not split into "
                          f"mesh.pp×train.pp_virtual={pp}×{v}={pp * v} equal chunks; change n_layers, pp or pp_virtual")
    if pp > 1:
        from jaxllm.parallel.pipeline_schedules import check

        try:
            check(t.pp_schedule, pp, t.microbatches, v)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # The islands' ppermutes inside a stage's branch wait for every device of the mesh on XLA:CPU,
        # while only that stage's devices take the branch: they hang (docs/design-notes.md).
        if shape["sp"] > 1:
            raise ConfigError(f"mesh.pp={pp} with mesh.sp={shape['sp']}: context parallelism inside pipeline stages "
                              "is not supported yet; set mesh.sp=1 or mesh.pp=1")
        if m.collective_matmul:
            raise ConfigError(f"model.collective_matmul=true with mesh.pp={pp} is not supported yet; set "
                              "collective_matmul=false (sequence_parallel works) or mesh.pp=1")
    elif v > 1:
        raise ConfigError(f"train.pp_virtual={v} needs mesh.pp>1; set mesh.pp or pp_virtual=1")
    if t.pp_gather_once and (pp == 1 or t.zero_stage != 3):
        notes.append("train.pp_gather_once=true only matters with mesh.pp>1 and train.zero_stage=3; it has no effect")
    rows = t.microbatches * batch_shards(shape)
    if t.global_batch % rows:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by microbatches×dp×fsdp×ep = "
            f"{t.microbatches}×{shape['dp']}×{shape['fsdp']}×{shape['ep']} = {rows}; make it a multiple of {rows}")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage: must be 0, 1, 2 or 3, got {t.zero_stage}")
    if schedule_steps(t) < t.steps:
        raise ConfigError(f"train.schedule_steps={t.schedule_steps} is shorter than train.steps={t.steps}; raise it or set 0")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps: must be 0 or more, got {t.warmup_steps}")
    if t.warmup_steps >= schedule_steps(t):
        notes.append(f"train.warmup_steps={t.warmup_steps} is not shorter than the schedule "
                     f"({schedule_steps(t)} steps): warming up over {warmup_steps(t)} steps instead")
    for key in ("log_every", "eval_every", "checkpoint_every", "eval_batches"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be 0 or more, got {getattr(t, key)}")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints: must be at least 1, got {t.keep_checkpoints}")
    if t.lr <= 0:
        raise ConfigError(f"train.lr: must be positive, got {t.lr}")
    src = cfg.data.source
    if src != "stdlib" and not any(ch in src for ch in "*?[") and not os.path.exists(src):
        raise ConfigError(f"data.source: no such file or folder '{src}'; give a path, a glob of .bin shards, or 'stdlib'")
    if not 0 < cfg.data.val_percent < 100:
        raise ConfigError(f"data.val_percent: must be between 0 and 100, got {cfg.data.val_percent}")
    return shape, notes
