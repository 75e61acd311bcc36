"""Qwen2-MoE and Qwen3-MoE on tiny random transformers checkpoints (`hf_families.py`: 3 layers, one of them dense),
and the layer stack's segments they read as. test_hf_interop.py's import/export test (logits within 1e-4,
export bitwise) and test_generate_hf.py's greedy generation run these families with the others; here: the
config.json reads as segments and shared experts, fused expert tensors read like per-expert ones, a segmented
stack computes what the same layers unrolled compute, and a run's first loss is transformers'."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from jaxllm import stack
from jaxllm.config import build_config
from jaxllm.interop import hf
from jaxllm.models import transformer

SEQ = 64
TOKENS = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_families")
    return {f: H.build(f, str(root / f)) for f in ("qwen2_moe", "qwen3_moe")}


def test_qwen_moe_configs_read_as_segments_and_shared_experts(models):
    m2, m3 = (hf.config_for(models[f]).model for f in ("qwen2_moe", "qwen3_moe"))
    assert stack.layer_kinds(m2) == ["dense", "moe", "moe"] and len(stack.segments(m2)) == 2
    assert (transformer.shared_d_ff(m2), m2.moe.shared_gate, m2.moe.norm_topk, m2.attn_bias) == (80, True, False, "qkv")
    assert stack.layer_kinds(m3) == ["moe", "dense", "moe"] and len(stack.segments(m3)) == 3
    assert (transformer.shared_d_ff(m3), m3.moe.norm_topk, m3.qk_norm, m3.moe.d_ff, m3.moe.n_experts) == (
        0, True, True, 48, 4)


def test_layer_kinds_become_the_fewest_segments():
    assert stack.from_layer_kinds(["dense", "moe"] * 3) == [{"layers": 6, "pattern": ["dense", "moe"]}]
    assert stack.from_layer_kinds(["moe"] * 4) == [{"layers": 4, "pattern": ["moe"]}]
    assert stack.from_layer_kinds(["dense"] * 3 + ["moe"] * 5) == [{"layers": 3, "pattern": ["dense"]},
                                                                   {"layers": 5, "pattern": ["moe"]}]


def _fused(src: str, out: str, m) -> None:
    """`src` rewritten with every MoE layer's experts fused as transformers 5 holds them: gate|up [x, 2f, e] and
    down [x, e, f]."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(out)
    shutil.copy(os.path.join(src, "config.json"), out)
    tensors = load_file(os.path.join(src, hf.SINGLE))
    for i, kind in enumerate(stack.layer_kinds(m)):
        if kind != "moe":
            continue
        key = f"model.layers.{i}.mlp.experts"
        pop = lambda name: [tensors.pop(f"{key}.{x}.{name}_proj.weight") for x in range(m.moe.n_experts)]
        gate, up, down = pop("gate"), pop("up"), pop("down")
        tensors[f"{key}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        tensors[f"{key}.down_proj"] = np.stack(down)
    save_file(tensors, os.path.join(out, hf.SINGLE), metadata={"format": "pt"})


def test_fused_expert_tensors_read_like_per_expert_ones(models, tmp_path):
    cfg, per_expert = hf.load_pretrained(models["qwen3_moe"])
    _fused(models["qwen3_moe"], str(tmp_path / "fused"), cfg.model)
    _, fused = hf.load_pretrained(str(tmp_path / "fused"))
    chex.assert_trees_all_equal(per_expert, fused)


def _unrolled(params: dict, m) -> dict:
    """The same weights for a one-segment stack of every layer's own kind (each block one repeat)."""
    blocks = [jax.tree.map(lambda a: a[r:r + 1], params["blocks"][seg.first_block + k])
              for seg in stack.segments(m) for r in range(seg.repeats) for k in range(len(seg.pattern))]
    return {**params, "blocks": blocks}


@pytest.mark.slow
def test_a_segmented_stack_computes_its_layers_unrolled():
    """Two dense layers then a [moe, dense] pattern twice, with windows on some layers (per-layer data read at each
    segment's own layers): the logits of the same layers as one pattern of six kinds, bitwise."""
    keys = {"model.preset": "tiny-moe", "model.n_layers": 6, "model.seq_len": 16, "model.vocab_size": 256,
            "model.moe.capacity_factor": 0.0,
            "model.sliding_window": 3, "model.window_pattern": ["global", "local", "local", "global", "global",
                                                                "local"]}
    segments = [{"layers": 2, "pattern": ["dense"]}, {"layers": 4, "pattern": ["moe", "dense"]}]
    m = build_config(None, {**keys, "model.segments": segments}).model
    flat = build_config(None, {**keys, "model.pattern": stack.layer_kinds(m)}).model
    assert [s.repeats for s in stack.segments(m)] == [2, 2] and len(stack.segments(flat)) == 1
    params = transformer.init_params(m, jax.random.key(0))
    tokens = jnp.asarray(H.sample_tokens(m.vocab_size, 2, 16, 1))
    ours = transformer.logits(params, tokens, m)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(transformer.logits(_unrolled(params, m), tokens, flat)))
    assert not np.array_equal(np.asarray(ours), np.asarray(transformer.logits(params, tokens, build_config(
        None, {**keys, "model.segments": segments, "model.window_pattern": []}).model)))  # the windows bite


@pytest.mark.slow
# Qwen2-MoE's run (a dense layer, then MoE layers with a gated shared expert); Qwen3-MoE's logits are
# test_hf_interop's, and its three segments' run path is the segmented-stack test's (the suite's time budget)
@pytest.mark.parametrize("family", ["qwen2_moe"])
def test_a_qwen_moe_run_starts_at_transformers_loss(family, models, tmp_path):
    """jaxllm train from the checkpoint on ep4×dp2 (the experts behind the all-to-alls): the first step's logged loss
    is transformers' language-model loss on the same batch."""
    from jaxllm.trainer.loop import train

    over = H.one_step_run(models[family], str(tmp_path / "run"), SEQ, **{"mesh.ep": 4, "mesh.dp": 2})
    train(build_config(None, over))
    ref = H.first_batch_loss(build_config(None, over))
    assert abs(H.first_logged_loss(over["run.dir"]) - ref) <= 1e-4 * abs(ref)


def test_an_earlier_runs_shared_expert_key_reads_as_one_shared_expert(tmp_path):
    """Run directories written before `moe.n_shared_experts` say `shared_expert = true|false`: they keep loading."""
    for on in (True, False):
        (tmp_path / "config.toml").write_text(f"[model]\npreset = \"tiny-moe\"\n[model.moe]\nshared_expert = "
                                              f"{str(on).lower()}\n")
        m = build_config(str(tmp_path / "config.toml")).model
        assert (m.moe.n_shared_experts, transformer.shared_d_ff(m)) == ((1, m.d_ff) if on else (0, 0))


def test_what_a_qwen_moe_config_cannot_say_is_refused(models, tmp_path):
    import dataclasses

    from jaxllm.errors import ModelFileError
    from jaxllm.interop import hf_config

    m = hf.config_for(models["qwen2_moe"]).model
    for moe in ({"shared_gate": False}, {"score": "sigmoid"}, {"n_shared_experts": 0, "shared_d_ff": 0}):
        with pytest.raises(ModelFileError, match="model.moe"):
            hf_config.exportable(dataclasses.replace(m, moe=dataclasses.replace(m.moe, **moe)))
    hf_config.exportable(m)
    windowed = tmp_path / "windowed"
    shutil.copytree(models["qwen3_moe"], windowed)
    config = json.load(open(windowed / "config.json"))
    json.dump({**config, "use_sliding_window": True, "sliding_window": 16}, open(windowed / "config.json", "w"))
    with pytest.raises(ModelFileError, match="use_sliding_window"):
        hf.config_for(str(windowed))
