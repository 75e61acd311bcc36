"""gpt-oss (`GptOssForCausalLM`) on a tiny random transformers checkpoint (`hf_families.py`: 4 layers, windowed and
full alternating, attention sinks, q/k/v/o biases, YaRN without truncation, 4 experts with biases and a router
bias, a clamp the activations exceed). test_hf_interop.py's import/export test (logits within 1e-4, export
bitwise, the export's logits) and test_generate_hf.py's greedy generation (left padding, 32 tokens, margins) run
this family with the others; here: what config.json reads as, a run's first loss equal to transformers' on
ep2 × fsdp2 × dp2, that mesh equal to one device, and what is refused."""

from __future__ import annotations

import chex
import jax
import pytest

import hf_families as H
from harness import assert_matches, loss_and_grads, step_fns
from jaxllm.config import build_config
from jaxllm.errors import ModelFileError
from jaxllm.interop import hf, hf_config

SEQ = 64


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    return H.build("gpt_oss", str(tmp_path_factory.mktemp("gpt_oss") / "hf"))


def test_gpt_oss_config_reads_as_its_features(gpt_oss):
    m = hf.config_for(gpt_oss).model
    assert (m.attn_sinks, m.attn_bias, m.mlp, m.mlp_limit, m.pattern) == (True, "qkvo", "swiglu_clamped", 0.5, ["moe"])
    assert (m.sliding_window, m.window_pattern) == (12, ["local", "global"] * 2)
    assert (m.rope_scaling, m.rope_truncate, m.rope_factor, m.rope_original_context) == ("yarn", False, 4.0, 32)
    assert (m.moe.router_logit_bias, m.moe.expert_biases, m.moe.norm_topk, m.moe.top_k, m.moe.d_ff) == (
        True, True, True, 2, 48)


@pytest.mark.slow  # a compile of the train step on 8 devices
def test_the_plan_counts_the_parameters_transformers_counts(gpt_oss):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.plan import plan

    report = plan(build_config(None, {"init.from": f"hf:{gpt_oss}", "model.seq_len": 32, "train.global_batch": 8}))
    theirs = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32)
    assert report["published_params"] == sum(p.numel() for p in theirs.parameters()) < report["params"]


def test_what_gpt_oss_cannot_be_is_refused(gpt_oss):
    import dataclasses

    m = hf.config_for(gpt_oss).model
    for change in ({"attn_sinks": False}, {"moe": dataclasses.replace(m.moe, expert_biases=False)}):
        with pytest.raises(ModelFileError, match="no transformers model type computes this model"):
            hf_config.exportable(dataclasses.replace(m, **change))
    with pytest.raises(ModelFileError, match="quant_method': 'mxfp4'.*dequantize other kinds to bf16 first"):
        hf_config.model_keys({**H.hf_config("gpt_oss").to_dict(), "quantization_config": {"quant_method": "mxfp4"}})


@pytest.mark.slow
def test_a_gpt_oss_run_on_ep2_fsdp2_dp2_starts_at_transformers_loss_and_equals_one_device(gpt_oss, tmp_path):
    """jaxllm train from the checkpoint on ep2 × fsdp2 × dp2 (ZeRO-3; the experts and their biases behind the
    all-to-alls): the first logged loss is transformers' language-model loss on the same batch (1e-4); the loss
    and gradients of that mesh equal one device's (the equivalence contract)."""
    from jaxllm.trainer.loop import train

    mesh = {"mesh.ep": 2, "mesh.fsdp": 2, "mesh.dp": 2, "train.zero_stage": 3}
    over = H.one_step_run(gpt_oss, str(tmp_path / "run"), SEQ, **mesh)
    train(build_config(None, over))
    ref = H.first_batch_loss(build_config(None, over))
    assert abs(H.first_logged_loss(over["run.dir"]) - ref) <= 1e-4 * abs(ref)

    one = {"init.from": f"hf:{gpt_oss}", "model.seq_len": 32, "precision.compute": "float32",
           "train.global_batch": 16, "mesh.dp": 1}
    cfg, params = hf.load_pretrained(gpt_oss, overrides=one)
    loss, grads = loss_and_grads(step_fns(cfg), params)
    sharded = step_fns(build_config(None, {**one, **mesh}))
    assert_matches(*loss_and_grads(sharded, params), (params, float(loss), jax.device_get(grads)))
    chex.assert_trees_all_equal_structs(grads, params)


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
