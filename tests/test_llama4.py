"""Llama 4's text model on tiny random transformers checkpoints (`hf_families.py` "llama4": 4 layers, RoPE with
chunked attention and the weightless q/k norm on layers 0, 1 and 3, no positions with temperature tuning on layer
2, MoE (top-1 sigmoid scores on the experts' inputs, a shared expert) on layers 1 and 3, dense layers of another
width). test_hf_interop.py's import/export test and test_generate_hf.py's greedy generation run this family with
the others, tests/test_llama4_attention.py its attention against float64 references and on meshes; here: what
config.json reads as, the text model of a multimodal `Llama4ForConditionalGeneration`, and a run's first loss."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

import hf_families as H
from jaxllm import stack
from jaxllm.config import build_config
from jaxllm.interop import hf

SEQ = 64
TOKENS = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    return H.build("llama4", str(tmp_path_factory.mktemp("llama4") / "hf"))


@pytest.mark.slow  # builds its own checkpoint; test_hf_interop's llama4 case imports one in the fast tier
def test_llama4_config_reads_as_its_features(llama4):
    m = hf.config_for(llama4).model
    assert (m.window_pattern, m.sliding_window, m.attention_chunk, m.rope_global) == (
        ["local", "local", "global", "local"], 0, 8, False)
    assert (m.attn_temperature_floor, m.attn_temperature_scale, m.qk_l2_norm, m.rope_scaling) == (4, 0.1, True, "llama3")
    assert stack.layer_kinds(m) == ["dense", "moe", "dense", "moe"] and (m.d_ff, m.moe.d_ff) == (96, 48)
    assert (m.moe.score, m.moe.top_k, m.moe.gate_input, m.moe.norm_topk, m.moe.shared_d_ff, m.moe.shared_gate) == (
        "sigmoid", 1, True, False, 48, False)


def multimodal_llama4(out: str) -> str:
    """A tiny `Llama4ForConditionalGeneration` (the text model of hf_families' "llama4", a one-layer vision model),
    perturbed as hf_families perturbs, saved: its text model under `language_model.*`."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5)
    return H.build_multimodal("llama4", out, "Llama4Config", "Llama4TextConfig", vision, image_token_index=300,
                              boi_token_index=298, eoi_token_index=299)


@pytest.mark.slow
def test_a_multimodal_llama4_gives_its_text_model(tmp_path, caplog):
    """Its text model's logits are transformers' Llama4ForCausalLM's on the same weights (1e-4), the vision model
    skipped with one log line; exported, it is a llama4_text checkpoint transformers loads with those logits."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from jaxllm.models import transformer

    path = multimodal_llama4(str(tmp_path / "mm"))
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "llama4"
    full = transformers.Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    causal = full.language_model.eval()  # a Llama4ForCausalLM inside
    with torch.no_grad():
        ref = causal(input_ids=torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    assert "a multimodal Llama 4; reading its text model, the vision model and projector skipped" in caplog.text
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(TOKENS)))
    assert np.abs(ours - ref).max() <= 1e-4
    hf.save_pretrained(params, cfg, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == "llama4_text"
    assert np.abs(H.reference_logits(str(tmp_path / "out"), TOKENS) - ref).max() <= 1e-4


@pytest.mark.slow
def test_a_llama4_run_on_ep2_dp4_starts_at_transformers_loss(llama4, tmp_path):
    """jaxllm train from the checkpoint on ep2 × dp4 (its experts' inputs scaled before the all-to-all): the first
    logged loss is transformers' language-model loss on the same batch."""
    from jaxllm.trainer.loop import train

    over = H.one_step_run(llama4, str(tmp_path / "run"), SEQ, **{"mesh.ep": 2, "mesh.dp": 4})
    train(build_config(None, over))
    ref = H.first_batch_loss(build_config(None, over))
    assert abs(H.first_logged_loss(over["run.dir"]) - ref) <= 1e-4 * abs(ref)
