"""What jaxllm refuses to import from a Hugging Face checkpoint, and how.

Each refusal is a UserError of a definite class (ModelFileError for what a model directory says or lacks,
ConfigError for a run key that does not fit it) whose message is one line naming the offending key, raised
before anything is written. Each class has its accepted counterpart next to it (the same checkpoint with
the supported value, a window as long as the sequence, a key equal to the checkpoint's), so a refusal that
fired on everything would fail too.

The checkpoints are tiny random models transformers itself builds and saves (`tests/hf_families.py`), each
built once for this file; the refusals of a value transformers would not write edit a copy's config.json.
Only `hf:DIR` is read here (no step is compiled), so the file takes seconds, most of it importing
transformers; the one command line started as a subprocess is `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import hf_families as families
from harness import CORPUS, REPO, subprocess_env
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError, ModelFileError
from jaxllm.models import attention
from jaxllm.interop.hf import load_pretrained
from jaxllm.cli import train as run_cli

N_DEVICES = 8


# ---------------------------------------------------------------- checkpoints and helpers


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(name, family, **build_kwargs)`: the checkpoint directory, built the first time a name is asked for."""
    cache: dict[str, str] = {}

    def get(name: str, family: str | None = None, **kwargs) -> str:
        if name not in cache:
            cache[name] = families.build(family or name, str(tmp_path_factory.mktemp(name.replace(".", "_"))),
                                         **kwargs)
        return cache[name]

    return get


def edited(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` in `dst` whose config.json dict `edit` changed in place."""
    dst = str(dst)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def config_json(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def snapshot(path) -> dict:
    """Every file under `path`: its size and modification time (empty when `path` does not exist)."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), path)] = (st.st_size, st.st_mtime_ns)
    return out


def refused(error: type, key: str, fn, *args, watch=(), **kwargs) -> str:
    """`fn(*args, **kwargs)` raises exactly `error` (not a subclass of it, not a sibling), with a one-line message
    naming `key`, and leaves every directory in `watch` as it was; returns the message."""
    before = {str(w): snapshot(w) for w in watch}
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert type(info.value) is error, repr(info.value)
    msg = str(info.value)
    assert msg.strip() and "\n" not in msg, msg
    assert key in msg, f"{key!r} not named in: {msg}"
    for w, files in before.items():
        assert snapshot(w) == files, f"{w} was written to"
    return msg


def import_config(path: str, **overrides):
    """The run config `init.from=hf:path` gives (keys as `model.x`, ... in `overrides`)."""
    return build_config(None, {"init.from": f"hf:{path}", **overrides})


def config_refused(error: type, key: str, path: str, **overrides) -> str:
    return refused(error, key, import_config, path, watch=[path], **overrides)


def validate_refused(key: str, path: str, **overrides) -> str:
    """The config builds, and `validate` refuses it (ConfigError naming `key`)."""
    cfg = import_config(path, **overrides)
    return refused(ConfigError, key, validate, cfg, N_DEVICES, watch=[path])


# ---------------------------------------------------------------- 1. RoPE scalings jaxllm does not have

# Parameters each rope_type needs (transformers 5 validates them when it reads the config).
ROPE_PARAMETERS = {
    "dynamic": {"factor": 2.0},
    "longrope": {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("rope_type", ROPE_PARAMETERS)
def test_unsupported_rope_type_is_refused(built, tmp_path, rope_type):
    path = edited(built("llama3"), tmp_path / "model",
                  lambda c: c["rope_parameters"].update(rope_type=rope_type, **ROPE_PARAMETERS[rope_type]))
    msg = config_refused(ModelFileError, "rope_type", path)
    assert repr(rope_type) in msg, msg
    # the edited directory is a checkpoint transformers reads with that scaling
    transformers = families._transformers()
    assert transformers.AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == rope_type


def test_unsupported_rope_scaling_in_the_v4_form_is_refused(built, tmp_path):
    """transformers 4.x wrote `rope_scaling` ({"type": ...} before 4.43) next to a top-level `rope_theta`."""
    path = edited(built("llama3-v4", "llama3", config_form="v4"), tmp_path / "model",
                  lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert "rope_parameters" not in config_json(path)
    msg = config_refused(ModelFileError, "rope", path)
    assert "'dynamic'" in msg, msg


@pytest.mark.parametrize("form", ["v5", "v4"])
def test_default_and_llama3_rope_are_accepted(built, form):
    plain = import_config(built(f"llama3-{form}", "llama3", config_form=form)).model
    scaled = import_config(built(f"llama3.1-{form}", "llama3.1", config_form=form)).model
    assert (plain.rope_scaling, plain.rope_theta) == ("none", 500000.0)
    assert (scaled.rope_scaling, scaled.rope_factor) == ("llama3", 8.0)
    assert scaled.rope_original_context == families.LLAMA31_ORIGINAL_CONTEXT


def test_linear_rope_is_read(built):
    """Linear scaling (every frequency divided by the factor) is read, not refused; its numbers against
    transformers are the Gemma 3 checkpoint's (global layers linear), tests/test_hf_interop.py."""
    path = built("llama3-linear", "llama3", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    m = import_config(path).model
    assert (m.rope_scaling, m.rope_factor, m.rope_theta) == ("linear", 2.0, 1e4)


GEMMA_EDITS = {  # config.json key -> (edit, what the refusal names)
    "hidden_activation": (lambda c: c.update(hidden_activation="gelu"), "hidden_activation"),
    "use_bidirectional_attention": (lambda c: c.update(use_bidirectional_attention=True),
                                    "use_bidirectional_attention"),
    "scaled local RoPE": (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
                          "sliding_attention.rope_type"),
}


@pytest.mark.parametrize("edit", GEMMA_EDITS)
def test_gemma_features_jaxllm_lacks_are_refused(built, tmp_path, edit):
    change, named = GEMMA_EDITS[edit]
    path = edited(built("gemma3"), tmp_path / "model", change)
    msg = config_refused(ModelFileError, named, path)
    assert named in msg, msg


# ---------------------------------------------------------------- 2. partial rotary embeddings


def test_partial_rotary_factor_is_refused(built):
    """transformers 5 keeps it in `rope_parameters`."""
    path = built("llama3-partial", "llama3", partial_rotary_factor=0.5)
    assert config_json(path)["rope_parameters"]["partial_rotary_factor"] == 0.5
    config_refused(ModelFileError, "partial_rotary_factor", path)


def test_partial_rotary_factor_at_the_top_level_is_refused(built, tmp_path):
    """Older configs (and transformers 4.x) have it as a top-level key."""
    path = edited(built("llama3-v4", "llama3", config_form="v4"), tmp_path / "model",
                  lambda c: c.update(partial_rotary_factor=0.5))
    msg = config_refused(ModelFileError, "partial_rotary_factor", path)
    assert "0.5" in msg, msg


def test_partial_rotary_factor_refusal_shows_the_value(built):
    msg = config_refused(ModelFileError, "partial_rotary_factor",
                         built("llama3-partial", "llama3", partial_rotary_factor=0.5))
    assert "0.5" in msg, msg


def test_partial_rotary_factor_one_is_accepted(built, tmp_path):
    def one(c):
        c["partial_rotary_factor"] = c["rope_parameters"]["partial_rotary_factor"] = 1.0

    path = edited(built("llama3"), tmp_path / "model", one)
    assert import_config(path).model.rope_scaling == "none"


# ---------------------------------------------------------------- 3. sliding windows on some layers only


def test_mistral_window_shorter_than_seq_len_runs(built):
    """A window shorter than the sequence is computed now (test_generate_hf.py checks it against transformers),
    and `auto` takes the chunked kernel for it."""
    cfg = import_config(built("mistral-w32", "mistral", sliding_window=32), **{"model.seq_len": 64})
    assert cfg.model.sliding_window == 32
    validate(cfg, N_DEVICES)
    assert attention.implementation(cfg.model) == "chunked"


# max_window_layers 0: every layer slides; 1: only the second of the two does (a per-layer window pattern).
@pytest.mark.parametrize("form", ["v5", "v4"])
@pytest.mark.parametrize("full_layers", [0, 1])
def test_qwen2_windows_on_every_layer_or_some_run(built, form, full_layers):
    path = built(f"qwen2-sliding{full_layers}-{form}", "qwen2", config_form=form, use_sliding_window=True,
                 max_window_layers=full_layers, sliding_window=32)
    hf = config_json(path)
    if form == "v5":  # transformers 5 writes which layers slide
        assert hf["layer_types"] == ["full_attention"] * full_layers + ["sliding_attention"] * (2 - full_layers)
    else:  # 4.x: use_sliding_window and max_window_layers say it
        assert "layer_types" not in hf and hf["use_sliding_window"] and hf["max_window_layers"] == full_layers
    cfg = import_config(path, **{"model.seq_len": 64})
    assert cfg.model.sliding_window == 32
    assert cfg.model.window_pattern == ([] if not full_layers else ["global", "local"])
    validate(cfg, N_DEVICES)


def test_windows_that_differ_by_layer_run_with_a_pipeline_and_context_parallelism(built):
    """(Refused until each pipeline chunk read its own layers' windows and the islands took windows; the runs
    themselves: tests/test_pipeline.py, tests/test_context_parallel.py.)"""
    path = built("qwen2-sliding1-v5", "qwen2", config_form="v5", use_sliding_window=True, max_window_layers=1,
                 sliding_window=32)
    for mesh in ({"mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2}, {"mesh.sp": 2, "mesh.dp": 4}):
        validate(import_config(path, **{"model.seq_len": 64, **mesh}), N_DEVICES)


def test_windows_no_shorter_than_seq_len_are_accepted(built):
    mistral = import_config(built("mistral-w64", "mistral", sliding_window=64), **{"model.seq_len": 64})
    qwen2 = import_config(built("qwen2-sliding0-v5", "qwen2", config_form="v5", use_sliding_window=True,
                                max_window_layers=0, sliding_window=32), **{"model.seq_len": 32})
    # use_sliding_window with max_window_layers = num_hidden_layers: no layer slides, whatever the window
    for form in ("v5", "v4"):
        unused = import_config(built(f"qwen2-nosliding-{form}", "qwen2", config_form=form, use_sliding_window=True,
                                     max_window_layers=2, sliding_window=32), **{"model.seq_len": 64})
        assert unused.model.sliding_window == 0
        validate(unused, N_DEVICES)
    assert mistral.model.sliding_window == 64 and qwen2.model.sliding_window == 32
    validate(mistral, N_DEVICES)
    validate(qwen2, N_DEVICES)
    validate(import_config(built("mistral")), N_DEVICES)  # window 4096, seq_len 256


# ---------------------------------------------------------------- 4. GPT-2 attention variants


@pytest.mark.parametrize("key,value", [("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                                       ("scale_attn_weights", False)])
def test_gpt2_attention_variant_is_refused(built, key, value):
    path = built(f"gpt2-{key}", "gpt2", **{key: value})
    assert config_json(path)[key] is value
    msg = config_refused(ModelFileError, key, path)
    assert repr(value) in msg, msg


def test_gpt2_default_attention_is_accepted(built):
    hf = config_json(built("gpt2"))
    assert (hf["scale_attn_weights"], hf["scale_attn_by_inverse_layer_idx"], hf["reorder_and_upcast_attn"]) == (
        True, False, False)
    assert import_config(built("gpt2")).model.mlp == "gelu_tanh"


# ---------------------------------------------------------------- 5. another activation


@pytest.mark.parametrize("family,key,value", [("llama3", "hidden_act", "gelu"),
                                              ("gpt2", "activation_function", "relu")])
def test_another_activation_is_refused(built, family, key, value):
    path = built(f"{family}-{value}", family, **{key: value})
    assert config_json(path)[key] == value
    msg = config_refused(ModelFileError, key, path)
    assert repr(value) in msg, msg


def test_tanh_gelu_under_its_other_name_is_accepted(built):
    model = import_config(built("gpt2-gelu_pytorch_tanh", "gpt2", activation_function="gelu_pytorch_tanh")).model
    assert model.mlp == "gelu_tanh"


# ---------------------------------------------------------------- 6. Mixtral router noise


def test_mixtral_router_jitter_noise_is_refused(built):
    path = built("mixtral-jitter", "mixtral", router_jitter_noise=0.1)
    msg = config_refused(ModelFileError, "router_jitter_noise", path)
    assert "0.1" in msg, msg
    assert config_json(built("mixtral"))["router_jitter_noise"] == 0.0
    assert import_config(built("mixtral")).model.pattern == ["moe"]


def test_one_expert_per_token_with_normalised_weights_is_refused(built, tmp_path):
    """transformers normalises a top-1 weight to 1 (Mixtral always, Qwen and DeepSeek with norm_topk_prob);
    jaxllm's top-1 keeps the router's score: refused. Unnormalised top-1 (Qwen2-MoE's default) computes alike."""
    path = edited(built("mixtral"), tmp_path / "top1", lambda c: c.update(num_experts_per_tok=1))
    config_refused(ModelFileError, "num_experts_per_tok=1", path)
    plain = edited(built("qwen2_moe"), tmp_path / "qwen_top1", lambda c: c.update(num_experts_per_tok=1))
    assert import_config(plain).model.moe.top_k == 1


# ---------------------------------------------------------------- 7. what is not a checkpoint jaxllm reads


def test_unsupported_model_type_is_refused(built, tmp_path):
    path = edited(built("llama3"), tmp_path / "model", lambda c: c.update(model_type="phi3"))
    msg = config_refused(ModelFileError, "model_type", path)
    assert "'phi3'" in msg, msg


def test_directory_without_config_json_is_refused(built, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(built("llama3"), path)
    os.remove(path / "config.json")
    msg = config_refused(ModelFileError, "config.json", str(path))
    assert str(path) in msg, msg  # the directory, not what an empty config lacks


def test_missing_directory_is_refused(tmp_path):
    path = tmp_path / "no-such-model"
    msg = refused(ModelFileError, str(path), import_config, str(path), watch=[tmp_path])
    assert "no such directory" in msg, msg
    assert not path.exists()


def test_directory_without_safetensors_is_refused_when_loading(built, tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(os.path.join(built("llama3"), "config.json"), path)
    import_config(str(path))  # the config alone is fine
    refused(ModelFileError, "model.safetensors", load_pretrained, str(path), watch=[path])


MISSING = "model.layers.1.self_attn.k_proj.weight"


def test_safetensors_missing_a_tensor_is_refused_when_loading(built, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = built("llama3")  # float32: numpy reads it
    path = tmp_path / "model"
    shutil.copytree(src, path)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors[MISSING]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    refused(ModelFileError, MISSING, load_pretrained, str(path), watch=[path])
    # and the whole file loads
    cfg, params = load_pretrained(src)
    assert cfg.model.d_model == families.HIDDEN and params["embed"]["tok"].shape[1] == families.HIDDEN


# ---------------------------------------------------------------- 8. run keys against init.from's checkpoint

CONFLICTS = [("llama3", "model.d_model", 999), ("llama3", "model.n_layers", 3), ("llama3", "model.n_kv_heads", 4),
             ("llama3", "model.vocab_size", 32000), ("llama3", "model.tie_embeddings", True),
             ("llama3", "model.rope_theta", 10000.0), ("llama3", "model.family", "gpt2"),
             ("gpt2", "model.max_positions", 1024), ("mixtral", "model.moe.n_experts", 8)]


@pytest.mark.parametrize("family,key,value", CONFLICTS, ids=[f"{f}-{k}" for f, k, _ in CONFLICTS])
def test_architecture_key_conflicting_with_the_checkpoint_is_refused(built, family, key, value):
    msg = config_refused(ConfigError, key, built(family), **{key: value})
    assert f"{key}={value!r}" in msg, msg


def test_architecture_keys_equal_to_the_checkpoint_are_accepted(built):
    same = {"model.family": "llama", "model.d_model": families.HIDDEN, "model.n_layers": families.LAYERS,
            "model.n_heads": families.HEADS, "model.n_kv_heads": families.KV_HEADS, "model.d_ff": families.INTERMEDIATE,
            "model.vocab_size": families.VOCAB_SIZE, "model.tie_embeddings": False, "model.rope_theta": 500000.0,
            "model.norm": "rmsnorm", "model.max_positions": families.MAX_POSITIONS}
    model = import_config(built("llama3"), **same).model
    assert {k: getattr(model, k[len("model."):]) for k in same} == same


def test_preset_with_init_from_is_refused(built):
    config_refused(ConfigError, "model.preset", built("llama3"), **{"model.preset": "tiny-llama"})


def test_run_keys_are_accepted(built):
    run_keys = {"model.seq_len": families.GPT2_POSITIONS, "model.remat": "full", "model.collective_matmul": True,
                "model.cp_strategy": "allgather", "model.cp_load_balance": False}
    model = import_config(built("gpt2"), **run_keys).model
    assert {k: getattr(model, k[len("model."):]) for k in run_keys} == run_keys
    assert (model.d_model, model.max_positions) == (families.HIDDEN, families.GPT2_POSITIONS)
    mixtral = import_config(built("mixtral"), **{"model.moe.capacity_factor": 1.25}).model
    assert mixtral.moe.capacity_factor == 1.25 and mixtral.moe.n_experts == 4
    # seq_len up to the checkpoint's positions validates (collective_matmul needs sequence parallelism: off here)
    validate(import_config(built("gpt2"), **{"model.seq_len": families.GPT2_POSITIONS}), N_DEVICES)


def test_seq_len_beyond_gpt2_positions_is_refused(built):
    validate_refused("model.seq_len", built("gpt2"), **{"model.seq_len": families.GPT2_POSITIONS + 32})


# ---------------------------------------------------------------- 9. the command line


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_cli_conflict_is_one_line_exit_2_nothing_written(built, tmp_path, capsys):
    """In-process (as tests/test_run.py does): the default config file's preset gives way to init.from, and the
    conflicting key is the one line."""
    run_dir = tmp_path / "run"
    assert run_cli.main([f"init.from=hf:{built('llama3')}", "model.d_model=999", f"run.dir={run_dir}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: model.d_model=999 ") and "init.from" in line, line
    assert not run_dir.exists()


def test_cli_checkpoint_without_weights_writes_nothing(built, tmp_path, capsys):
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(os.path.join(built("llama3"), "config.json"), path)
    run_dir = tmp_path / "run"
    code = run_cli.main([f"init.from=hf:{path}", "model.seq_len=32", "train.steps=1", "train.eval_every=0",
                         "run.sample_tokens=0", f"data.source={CORPUS}", f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.safetensors" in err.strip().splitlines()[-1], err
    assert not run_dir.exists(), os.listdir(run_dir)


@pytest.mark.slow
def test_cli_subprocess_conflict_is_one_line_exit_2_nothing_written(built, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "jaxllm", "train", f"init.from=hf:{built('llama3')}",
                          "model.d_model=999", f"run.dir={run_dir}"], cwd=REPO, env=subprocess_env(1),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [res.stderr.strip()], res.stderr
    assert res.stderr.startswith("error: model.d_model=999 ") and "init.from" in res.stderr, res.stderr
    assert not run_dir.exists()


def test_windows_a_config_json_cannot_hold_are_refused_at_export():
    """Mistral's config.json has one window for every layer and GPT-2's none: a model whose windows differ by
    layer, or a GPT-2 with a window, is refused rather than exported without them; Qwen2 writes its layer_types."""
    from jaxllm.interop.hf_config import hf_config

    def model(preset, **over):
        keys = {"model.preset": preset, "model.vocab_size": 257, "model.sliding_window": 16, **over}
        return build_config(None, keys).model

    alternating = model("tiny-llama", **{"model.window_pattern": ["local", "global"]})
    refused(ModelFileError, "model.window_pattern", hf_config, alternating, "float32")
    refused(ModelFileError, "model.sliding_window", hf_config, model("tiny-gpt2"), "float32")
    qwen2 = hf_config(model("tiny-llama", **{"model.family": "qwen2", "model.window_pattern": ["global", "local"]}),
                      "float32")
    assert qwen2["layer_types"] == ["full_attention", "sliding_attention"] and qwen2["max_window_layers"] == 1


@pytest.mark.parametrize("over, named", [
    ({"model.norm_placement": "sandwich"}, "model.norm_placement"),  # LLaMA's layout with Gemma's norms
    ({"model.attn_softcap": 30.0}, "model.attn_softcap"),  # a soft cap outside Gemma
    ({"model.family": "gemma2", "model.rope_local_theta": 1e4}, "model.rope_local_theta"),  # Gemma 2: one RoPE
    ({"model.family": "qwen3", "model.attn_bias": "qkv"}, "model.attn_bias"),
])
def test_feature_mixes_no_transformers_type_computes_are_refused_at_export(over, named):
    """A model whose features no transformers model type computes is refused in one line naming the feature."""
    from jaxllm.interop.hf_config import exportable

    m = build_config(None, {"model.preset": "tiny-llama", "model.vocab_size": 257, **over}).model
    refused(ModelFileError, named, exportable, m)
