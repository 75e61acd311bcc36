"""The objective seam: an objective whose per-token weights come from the batch gives, through every
gradient path that moves rows (context parallelism in zig-zag order, microbatches in the ZeRO-0/1
island and at ZeRO-3, the pipeline), the weighted NLL that NumPy computes from the plain reference
model's logits, and that model's gradients; its metric is reduced like the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import (BATCH, LOSS_RTOL, SEQ, assert_matches, equivalence_config, loss_metrics_and_grads, step_fns,
                     tiers, tokens)
from jaxllm.models import transformer
from jaxllm.trainer.objectives import WEIGHTED_TOKENS
from tools.reference import plain_model

MESHES = {  # name -> (preset, overrides): each moves rows another way
    "one_device": ("tiny-llama", {}),
    "sp_zigzag": ("tiny-llama", {"mesh.sp": 4, "model.cp_load_balance": True}),
    "island_zero1": ("tiny-gpt2", {"mesh.dp": 2, "mesh.fsdp": 2, "train.zero_stage": 1, "train.microbatches": 2}),
    "zero3_microbatches": ("tiny-llama", {"mesh.fsdp": 4, "train.zero_stage": 3, "train.microbatches": 2}),
    "pipeline": ("tiny-llama", {"mesh.pp": 2, "mesh.dp": 2, "train.microbatches": 2}),
}


def weights() -> np.ndarray:
    """Non-uniform per-token weights with about a quarter zeros."""
    rng = np.random.default_rng(7)
    w = rng.uniform(0.1, 2.0, (BATCH, SEQ)).astype(np.float32)
    w[rng.random((BATCH, SEQ)) < 0.25] = 0.0
    return w


_references: dict = {}


def reference(preset: str):
    """(jaxllm's initial parameters, loss, target_prob, gradients): the loss and metric in float64 NumPy from
    the plain model's logits; the gradients of the same weighted NLL written on the plain model in JAX."""
    if preset in _references:
        return _references[preset]
    m = equivalence_config(preset).model
    module, c = plain_model(m)
    params = jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0))
    toks, w = tokens(), weights()
    inputs, targets = toks[:, :-1], toks[:, 1:]
    logits = np.asarray(jax.jit(lambda p: module.logits(module.from_jaxllm(p), inputs, c)[0])(params), np.float64)
    peak = logits.max(-1, keepdims=True)
    log_probs = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    logp = np.take_along_axis(log_probs, targets[..., None].astype(np.int64), -1)[..., 0]
    loss, prob = float(np.sum(-logp * w) / np.sum(w)), float(np.sum(np.exp(logp) * w) / np.sum(w))

    def weighted_nll(p):
        out, _ = module.logits(module.from_jaxllm(p), jnp.asarray(inputs), c)
        lp = jnp.take_along_axis(jax.nn.log_softmax(out), jnp.asarray(targets)[..., None], -1)[..., 0]
        return jnp.sum(-lp * w) / jnp.sum(w)

    grads = jax.device_get(jax.jit(jax.grad(weighted_nll))(params))
    _references[preset] = (jax.device_get(params), loss, prob, grads)
    return _references[preset]


@pytest.mark.parametrize("mesh", tiers(MESHES, fast=("one_device", "island_zero1", "zero3_microbatches")))
def test_weighted_tokens_equal_numpy_through_every_path(mesh):
    preset, over = MESHES[mesh]
    params, ref_loss, ref_prob, ref_grads = reference(preset)
    fns = step_fns(equivalence_config(preset, **over), objective=WEIGHTED_TOKENS)
    loss, metrics, grads = loss_metrics_and_grads(fns, params, fields={"weights": weights()})
    assert_matches(loss, grads, (params, ref_loss, ref_grads))
    assert abs(float(metrics["target_prob"]) - ref_prob) <= LOSS_RTOL * ref_prob, (float(metrics["target_prob"]), ref_prob)


def test_the_weights_matter():
    """The same tokens with uniform weights give the plain mean cross-entropy, which is further from the
    weighted reference than the tolerance above: a path that dropped the weights would fail there."""
    params, ref_loss, _, _ = reference("tiny-llama")
    fns = step_fns(equivalence_config("tiny-llama"), objective=WEIGHTED_TOKENS)
    loss, _, _ = loss_metrics_and_grads(fns, params, fields={"weights": np.ones((BATCH, SEQ), np.float32)})
    plain, _, _ = loss_metrics_and_grads(step_fns(equivalence_config("tiny-llama")), params)
    assert float(loss) == pytest.approx(float(plain), rel=LOSS_RTOL)
    assert abs(float(loss) - ref_loss) > 10 * LOSS_RTOL * ref_loss
