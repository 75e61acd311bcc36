"""Configuration: one typed tree of dataclasses, TOML files, dotted overrides, validation.

A run's configuration is built in three layers, later ones winning:
the dataclass defaults, then `model.preset` (which fills model fields), then the
TOML file and the `key=value` overrides. Keys given explicitly always beat the
preset, whatever their order. Values parse as TOML literals (`true`, `0`,
`1e-3`, `"text"`; a bare word that is not a TOML literal is taken as a string).

`validate(cfg, n_devices)` checks everything that can be checked before compiling, each
section by the module that owns it. Each problem is a `UserError` whose message is one line
naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing

from jaxllm.data import dataset
from jaxllm.errors import ConfigError
from jaxllm.interop import gguf_io, hf_config
from jaxllm.mesh import resolve_mesh_shape
from jaxllm.models import attention, transformer
from jaxllm.parallel import pipeline_schedules
from jaxllm.rl import prompts
from jaxllm.schema import FAMILIES, Config, RunConfig, TrainConfig, table_keys
from jaxllm.trainer import optimizer, profiling, step, wandb_log


# The shipped configs are package data, found next to this module, so they work from a checkout and installed.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT_CONFIG = os.path.join(CONFIG_DIR, "default.toml")


def shipped_configs() -> list[str]:
    """The names `--config NAME` accepts: the .toml files of jaxllm/configs/, without the suffix."""
    return sorted(f[:-len(".toml")] for f in os.listdir(CONFIG_DIR) if f.endswith(".toml"))


def config_path(value: str | None) -> str:
    """The file a config name means: none given, the default; a NAME (no slash, no .toml suffix), the shipped
    jaxllm/configs/NAME.toml, so an installed jaxllm needs no checkout; anything else, a path."""
    if value is None:
        return DEFAULT_CONFIG
    if "/" in value or os.sep in value or value.endswith(".toml"):
        return value
    if value not in shipped_configs():
        raise ConfigError(f"--config {value}: no shipped config of that name; choose from "
                          f"{', '.join(shipped_configs())}, or give a TOML file's path")
    return os.path.join(CONFIG_DIR, f"{value}.toml")


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
    if origin in (list, dict) and isinstance(value, origin):
        return value
    if isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "a table, e.g. {name = value}"}
    raise ConfigError(f"{key}: expected {names.get(origin, origin.__name__)}, got {value!r}; fix the value")


def flatten(tree: dict, prefix: str = "") -> dict[str, typing.Any]:
    """Nested TOML tables as dotted keys; a key whose value is a table (`schema.table_keys`) is kept whole."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in TABLE_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _set(cfg: Config, key: str, value) -> None:
    """Set a dotted key on the config tree, checking the key exists and the value's type."""
    obj = cfg
    parts = [KEYWORD_FIELDS.get(part, part) for part in key.split(".")]
    for i, part in enumerate(parts):
        fields = _fields(obj)
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"unknown key '{key}': {where} has {', '.join(sorted(f.rstrip('_') for f in fields))}; check the spelling")
        if i == len(parts) - 1:
            typ = typing.get_type_hints(type(obj))[part]
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{key}: is a section, not a value; set one of its keys, e.g. {key}.{next(iter(_fields(typ)))}")
            setattr(obj, part, _coerce(key, value, typ))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"unknown key '{key}': '{'.'.join(parts[:i + 1])}' is a value, not a section")


# Keys spelled as Python keywords are fields with a trailing underscore (init.from -> InitConfig.from_).
KEYWORD_FIELDS = {"from": "from_"}
TABLE_KEYS = table_keys()


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
        raise ConfigError(f"--config: no such file '{path}'; give a TOML file or a shipped config's name, "
                          "e.g. --config default")
    try:
        with open(path, "rb") as f:
            return flatten(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e}); fix the file") from None


# Keys earlier versions wrote, as what they mean now, so their run directories (config.toml, a checkpoint's saved
# config) keep loading.
RETIRED = {"model.moe.shared_expert": lambda on: {"model.moe.n_shared_experts": int(on)}}


def _current(keys: dict) -> dict:
    out = {}
    for k, v in keys.items():
        out.update(RETIRED[k](v) if k in RETIRED else {k: v})
    return out


def build_config(config_file: str | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Defaults, then the preset, then the file, then the overrides (explicit keys beat the preset)."""
    explicit: dict[str, typing.Any] = _current(load_toml(config_file)) if config_file else {}
    given = _current(dict(overrides) if isinstance(overrides, dict) else parse_overrides(list(overrides or [])))
    if "init.from" in given and "model.preset" not in given:
        explicit.pop("model.preset", None)  # the checkpoint's model replaces the file's preset
    explicit.update(given)
    cfg = Config()
    preset = explicit.get("model.preset", "")
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
        for k, v in PRESETS[preset].items():
            _set(cfg, f"model.{k}", v)
    family = explicit.get("model.family", cfg.model.family)
    if family not in FAMILIES:
        raise ConfigError(f"model.family: '{family}' is not one of {', '.join(FAMILIES)}; or set the features "
                          "(model.norm, model.mlp, model.positions, ...) yourself")
    for k, v in FAMILIES[family].items():
        _set(cfg, f"model.{k}", v)
    source = source_model_keys(explicit.get("init.from", ""))
    for k, v in source.items():
        _set(cfg, f"model.{k}", v)
    for key, value in explicit.items():
        _set(cfg, key, value)
    _check_against_source(cfg, explicit, source)
    if cfg.data.tokenizer == "init":  # the tokenizer beside the imported model
        if not cfg.init.from_.startswith(("hf:", "gguf:")):
            raise ConfigError("data.tokenizer=init reads the tokenizer of init.from's Hugging Face folder or GGUF "
                              "file; set init.from=hf:DIR or gguf:FILE, or name the tokenizer")
        cfg.data.tokenizer = cfg.init.from_
    return cfg


def split_run_source(source: str) -> tuple[str, int | None]:
    """'run:DIR[@STEP]' -> (DIR, STEP or None)."""
    path, at, step = source[len("run:"):].rpartition("@")
    if not at or not step.isdigit():
        return source[len("run:"):], None
    return path, int(step)


def source_model_keys(source: str) -> dict:
    """The architecture keys (below `model.`) that `init.from` fixes: a Hugging Face config.json's, or another
    run's config.toml's."""
    if not source:
        return {}
    if source.startswith("hf:"):
        return hf_config.model_keys(hf_config.read(source[3:]), source[3:])
    if source.startswith("gguf:"):
        return hf_config.model_keys(gguf_io.GgufFiles(source[5:]).config)
    if source.startswith("run:"):
        run_dir, _ = split_run_source(source)
        if not os.path.isfile(os.path.join(run_dir, "config.toml")):
            raise ConfigError(f"init.from={source}: '{run_dir}' is not a run directory (no config.toml); train that "
                              "run first, or point init.from at one")
        saved = _current(load_toml(os.path.join(run_dir, "config.toml")))
        keys = {k: saved[f"model.{k}"] for k in hf_config.ARCHITECTURE_KEYS if f"model.{k}" in saved}
        if keys.get("positions") == "learned" and not keys.get("max_positions"):  # its table has seq_len rows
            keys["max_positions"] = saved.get("model.seq_len", 0)
        return keys
    raise ConfigError(f"init.from: '{source}' is not \"\", \"hf:DIR\", \"gguf:FILE\" or \"run:DIR[@STEP]\"")


def _check_against_source(cfg: Config, explicit: dict, source: dict) -> None:
    """An architecture key set explicitly must agree with the checkpoint `init.from` names."""
    if not source:
        return
    if explicit.get("model.preset"):
        raise ConfigError("model.preset: the architecture comes from init.from's checkpoint; remove the preset")
    reference = Config()
    for k, v in source.items():
        _set(reference, f"model.{k}", v)
    for key in explicit:
        name = key[len("model."):]
        if key.startswith("model.") and name in hf_config.ARCHITECTURE_KEYS and name in source:
            mine, theirs = _get(cfg, key), _get(reference, key)
            if mine != theirs:
                raise ConfigError(f"{key}={mine!r} conflicts with init.from's checkpoint ({theirs!r}); remove it: "
                                  "architecture keys come from the checkpoint (README: Hugging Face checkpoints)")


def _get(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, KEYWORD_FIELDS.get(part, part))
    return obj


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
        if isinstance(v, dict):  # a table key's value, inline
            return "{" + ", ".join(f"{value(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines: list[str] = []

    def section(name: str, d: dict):
        nested = {k: v for k, v in d.items() if isinstance(v, dict) and f"{name}.{k}" not in TABLE_KEYS}
        lines.append(f"[{name}]")
        lines.extend(f"{k.rstrip('_')} = {value(v)}" for k, v in d.items() if k not in nested)
        lines.append("")
        for k, v in nested.items():
            section(f"{name}.{k}", v)

    for name, d in to_dict(cfg).items():
        section(name, d)
    return "\n".join(lines)


# ---------------------------------------------------------------- validation


def validate(cfg: Config, n_devices: int, *, data: bool = True) -> tuple[dict[str, int], list[str]]:
    """Check the config against the devices; return the mesh shape and notes to log.

    Each section is checked by the code that owns it (the mesh, the model and its attention and
    experts, the pipeline, the step, the optimizer, the data); the loop's own keys are checked
    here. Raises a UserError (one line: key and fix) for anything that cannot run. `data=False`
    leaves the data section out (its sources need not exist): for a model loaded to generate,
    score or export, which reads no training data.
    """
    m, t = cfg.model, cfg.train
    shape = resolve_mesh_shape(cfg.mesh, n_devices)
    notes = (transformer.check_config(m, t, shape) + pipeline_schedules.check_config(m, t, shape)
             + step.check_config(cfg, shape) + optimizer.check_config(t)
             + (prompts.check_config(cfg) if t.objective == "grpo" else dataset.check_config(cfg) if data else []))
    notes += attention.check_run(cfg, shape["sp"])
    _check_loop(t, cfg.run)
    profiling.check_config(cfg)
    wandb_log.check_config(cfg)
    return shape, notes


def _check_loop(t: TrainConfig, r: RunConfig) -> None:
    """The training loop's keys (the loop, `trainer/loop.py`, builds on this module)."""
    if t.steps < 1:
        raise ConfigError(f"train.steps: must be at least 1, got {t.steps}")
    for key in ("log_every", "eval_every", "checkpoint_every", "eval_batches"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be 0 or more, got {getattr(t, key)}")
    if r.sample_tokens < 0:
        raise ConfigError(f"run.sample_tokens: must be 0 (no sample) or more, got {r.sample_tokens}")
    if "://" in r.dir:
        raise ConfigError(f"run.dir '{r.dir}' is a URL, and a run directory is written with Python's file functions; "
                          "give a path every host sees (a bucket through a gcsfuse mount)")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints: must be at least 1, got {t.keep_checkpoints}")
