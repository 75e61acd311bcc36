"""Multi-token prediction (`model.mtp_depth`, `train.mtp_weight`; `models/mtp.py`) against the plain reference
(`tools/reference/plain_llama.py`'s `mtp_losses`, written from DeepSeek-V3 §2.2 with nothing of jaxllm's): the loss
and every gradient on one device (dense and MoE stacks) and on context- and tensor-parallel meshes; which positions each
module predicts in packed and masked rows; the logged parts of the loss; the refusals. The DeepSeek-shaped model
with MTP on ep, tp and pp meshes is tests/test_deepseek.py's; D = 0's numbers are the earlier code's bitwise
(tests/test_state.py resumes checkpoints saved before MTP existed to the losses they logged)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import (assert_matches, equivalence_config, eval_loss, loss_and_grads, loss_metrics_and_grads, step_fns,
                     tiers, tokens)
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.models import mtp

WEIGHT = 0.5
KEYS = {"model.mtp_depth": 2, "train.mtp_weight": WEIGHT}


def config(preset: str = "tiny-llama", **over):
    return equivalence_config(preset, **{**KEYS, **over})


def plain_reference(cfg):
    """(params, loss, gradients) of the plain model with its prediction modules, at jaxllm's initial params."""
    from tools.reference import plain_model

    module, c = plain_model(cfg.model)
    c = dataclasses.replace(c, mtp_weight=cfg.train.mtp_weight)
    params = jax.device_get(step_fns(cfg).init(0).params)  # the same values on any mesh

    def objective(p, t):
        loss, aux = module.losses(module.from_jaxllm(p), t, c)
        return loss + aux, loss

    (_, loss), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, jnp.asarray(tokens()))
    return params, float(loss), jax.device_get(grads)


CASES = {  # name -> (preset, mesh and options, model keys)
    "dense": ("tiny-llama", {}),
    "moe": ("tiny-moe", {"model.moe.capacity_factor": 0.0}),
    # the modules' logits in loss chunks too (strided positions: the shifted fields travel with them)
    "sp2_tp2_sequence_parallel_chunked_loss": ("tiny-llama", {"mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2,
                                                              "train.sequence_parallel": True,
                                                              "train.loss_chunk": 8}),
    # inside pipeline stages with islands: the modules (their collective matmuls) on every stage, the heads on the
    # last; depth 2 through the 1F1B fused backward
    "pp2_tp2_dp2_collective_matmul": ("tiny-llama", {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2,
                                                     "train.sequence_parallel": True, "model.collective_matmul": True,
                                                     "train.microbatches": 2}),
}


@pytest.mark.parametrize("case", tiers(CASES, {"dense"}))
def test_multi_token_prediction_equals_the_plain_reference(case):
    preset, over = CASES[case]
    cfg = config(preset, **over)
    ref = plain_reference(cfg)
    loss, grads = loss_and_grads(step_fns(cfg), ref[0])
    assert_matches(loss, grads, ref)


def test_the_logged_loss_is_the_language_model_loss_plus_the_weighted_modules_and_evaluation_runs_none():
    fns = step_fns(config())
    params = jax.device_get(fns.init(0).params)
    loss, metrics, _ = loss_metrics_and_grads(fns, params)
    lm, mean = float(metrics["lm_loss"]), float(metrics["mtp_loss"])
    assert float(loss) == pytest.approx(lm + WEIGHT * mean, rel=1e-6) and mean > 0
    total, count, _ = eval_loss(fns, params)
    assert float(total) / float(count) == pytest.approx(lm, rel=1e-6)


def test_each_module_predicts_only_within_its_rows_segment_and_loss_mask():
    """A packed row (segments 1, 1, 1, 2, 2, 0 for padding) whose loss mask drops position 1's target: module k at
    position i predicts targets[i + k] only where i + k is in i's segment and its target counts."""
    row = lambda *v: jnp.asarray([v])
    batch = {"targets": row(11, 12, 13, 21, 22, 0), "segment_ids": row(1, 1, 1, 2, 2, 0),
             "loss_mask": row(1.0, 0.0, 1.0, 1.0, 1.0, 0.0)}
    out = mtp.with_fields(batch, 2)
    np.testing.assert_array_equal(out["mtp_targets_1"], row(12, 13, 21, 22, 0, 0))
    np.testing.assert_array_equal(out["mtp_mask_1"], row(0.0, 1.0, 0.0, 1.0, 0.0, 0.0))
    np.testing.assert_array_equal(out["mtp_targets_2"], row(13, 21, 22, 0, 0, 0))
    np.testing.assert_array_equal(out["mtp_mask_2"], row(1.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    assert mtp.with_fields(batch, 0) is batch


BAD = {
    "grpo": ({"train.objective": "grpo"}, "train.objective=grpo"),
    "windows_by_layer": ({"model.sliding_window": 8, "model.window_pattern": ["local", "global"]}, "differ by layer"),
    "negative": ({"model.mtp_depth": -1}, "model.mtp_depth=-1"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_multi_token_prediction_cannot_run_is_a_one_line_error(case):
    over, needle = BAD[case]
    with pytest.raises(ConfigError) as e:
        validate(config(**over), 1)
    assert needle in str(e.value) and "\n" not in str(e.value)
