"""gpt-oss (`GptOssForCausalLM`) on a tiny random transformers checkpoint (`hf_families.py`: 4 layers, windowed and
full alternating, attention sinks, q/k/v/o biases, YaRN without truncation, 4 experts with biases and a router
bias, a clamp the activations exceed). test_hf_interop.py's import/export test (logits within 1e-4, export
bitwise, the export's logits) and test_generate_hf.py's greedy generation (left padding, 32 tokens, margins) run
this family with the others; here: what config.json reads as, the first step's loss on ep2 × fsdp2 × dp2 equal to
transformers', that mesh and sp2 × tp2 × dp2 equal to one device, and what is refused."""

from __future__ import annotations

import chex
import jax
import pytest

import hf_families as H
from harness import assert_matches, loss_and_grads, step_fns, tokens
from jaxllm.config import build_config
from jaxllm.errors import ModelFileError
from jaxllm.interop import hf, hf_config


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    return H.build("gpt_oss", str(tmp_path_factory.mktemp("gpt_oss") / "hf"))


@pytest.fixture(scope="module")
def gpt_oss_config(tmp_path_factory) -> str:
    """The tiny checkpoint's config.json alone: what the config and the refusals read."""
    path = str(tmp_path_factory.mktemp("gpt_oss_config"))
    H.hf_config("gpt_oss").save_pretrained(path)
    return path


def test_gpt_oss_config_reads_as_its_features(gpt_oss_config):
    m = hf.config_for(gpt_oss_config).model
    assert (m.attn_sinks, m.attn_bias, m.mlp, m.mlp_limit, m.pattern) == (True, "qkvo", "swiglu_clamped", 0.5, ["moe"])
    assert (m.sliding_window, m.window_pattern) == (12, ["local", "global"] * 2)
    assert (m.rope_scaling, m.rope_truncate, m.rope_factor, m.rope_original_context) == ("yarn", False, 4.0, 32)
    assert (m.moe.router_logit_bias, m.moe.expert_biases, m.moe.norm_topk, m.moe.top_k, m.moe.d_ff) == (
        True, True, True, 2, 48)


@pytest.mark.slow
def test_the_plan_counts_the_parameters_transformers_counts(gpt_oss):
    """The count `jaxllm plan` prints beside Φ (test_plan.py's CLI test reads it there): transformers' own, Φ less
    the vocabulary's padding rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.models import transformer

    m = build_config(None, {"init.from": f"hf:{gpt_oss}", "model.seq_len": 32}).model
    theirs = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32)
    assert transformer.published_params(m) == sum(p.numel() for p in theirs.parameters()) < transformer.count_params(m)


def test_what_gpt_oss_cannot_be_is_refused(gpt_oss_config):
    import dataclasses

    m = hf.config_for(gpt_oss_config).model
    for change in ({"attn_sinks": False}, {"moe": dataclasses.replace(m.moe, expert_biases=False)}):
        with pytest.raises(ModelFileError, match="no transformers model type computes this model"):
            hf_config.exportable(dataclasses.replace(m, **change))
    with pytest.raises(ModelFileError, match="quant_method': 'mxfp4'.*dequantize other kinds to bf16 first"):
        hf_config.model_keys({**H.hf_config("gpt_oss").to_dict(), "quantization_config": {"quant_method": "mxfp4"}})


@pytest.mark.slow
def test_gpt_oss_on_ep2_fsdp2_dp2_starts_at_transformers_loss_and_equals_one_device(gpt_oss):
    """On ep2 × fsdp2 × dp2 (ZeRO-3; the experts and their biases behind the all-to-alls) the first step's loss is
    transformers' language-model loss on the same batch (1e-4), and the loss and every gradient leaf equal one
    device's (the equivalence contract). test_llama4.py holds a `jaxllm train` run's logged loss to transformers'."""
    one = {"init.from": f"hf:{gpt_oss}", "model.seq_len": 32, "precision.compute": "float32",
           "train.global_batch": 16, "mesh.dp": 1}
    cfg, params = hf.load_pretrained(gpt_oss, overrides=one)
    loss, grads = loss_and_grads(step_fns(cfg), params)
    sharded = step_fns(build_config(None, {**one, "mesh.ep": 2, "mesh.fsdp": 2, "mesh.dp": 2, "train.zero_stage": 3}))
    got_loss, got_grads = loss_and_grads(sharded, params)
    assert_matches(got_loss, got_grads, (params, float(loss), jax.device_get(grads)))
    chex.assert_trees_all_equal_structs(grads, params)
    theirs = H.reference_loss(gpt_oss, tokens(batch=16, seq=32))
    assert abs(float(got_loss) - theirs) <= 1e-4 * abs(theirs)


@pytest.mark.slow
def test_gpt_oss_on_sp2_tp2_dp2_equals_one_device(gpt_oss):
    """Sinks under the ring (once each, at the final merge), windows of 12 over a split sequence, the experts and
    their biases under context parallelism, heads and sinks split over tp: loss and gradients equal one device's."""
    one = {"init.from": f"hf:{gpt_oss}", "model.seq_len": 32, "precision.compute": "float32",
           "train.global_batch": 16, "mesh.dp": 1}
    cfg, params = hf.load_pretrained(gpt_oss, overrides=one)
    loss, grads = loss_and_grads(step_fns(cfg), params)
    sharded = step_fns(build_config(None, {**one, "mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2}))
    assert_matches(*loss_and_grads(sharded, params), (params, float(loss), jax.device_get(grads)))
