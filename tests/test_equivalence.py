"""Every data-parallel mesh and ZeRO stage computes the same numbers as the independent reference
(fp32, 8 fake CPU devices).

The reference is the model written without jaxllm (`tools/reference/plain_gpt.py`, `tools/reference/plain_llama.py`;
`harness.reference`), from jaxllm's own initial parameters: one step's loss within 1e-5 and each
gradient leaf within 1e-4 of it (`harness.assert_matches`), on one device and on meshes
{dp=8, fsdp=8, dp=2×fsdp=4} × ZeRO stages × {with, without} accumulation. Then a whole optimizer
step on every mesh at every stage (each family on every mesh and at every stage) and a 20-step
loss curve against one device, and initial parameters bitwise equal on every mesh. Programs come
from the registry (`harness.step_fns`); ZeRO stages 0 and 1 share a gradient program (they
differ only in the optimizer state's layout, which the one-step test covers), see `same_program`.
"""

import chex
import jax
import numpy as np
import pytest

from harness import (GRAD_RTOL, LOSS_RTOL, assert_matches, equivalence_config, max_rel_err, reference, step_fns,
                     tiers, tokens, train_step, warm, warm_optimizer_state)
from harness import loss_and_grads as run_loss_and_grads
from jaxllm.models import transformer
from jaxllm.trainer.optimizer import make_optimizer

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}
MESHES = {"dp8": dict(dp=8), "fsdp8": dict(fsdp=8), "dp2_fsdp4": dict(dp=2, fsdp=4)}


def same_program(mesh: str, stage: int, grads_only: bool = False) -> int:
    """The stage whose compiled program stands for `stage` on this mesh.

    ZeRO-0 and 1 differ only in the optimizer state's layout (not in the gradient path);
    without an fsdp axis, 0/1 and 2/3 differ only in code path, not in layout.
    """
    if stage <= 1 and (grads_only or "fsdp" not in mesh):
        return 0
    return stage if "fsdp" in mesh else 2


def config(family: str, mesh: str, stage: int, microbatches: int):
    axes = {f"mesh.{a}": n for a, n in MESHES.get(mesh, {}).items()}
    return equivalence_config(PRESETS[family], **axes, **{"train.zero_stage": stage,
                                                          "train.microbatches": microbatches})


def fns_for(family: str, mesh: str, stage: int, microbatches: int):
    return step_fns(config(family, mesh, stage, microbatches))


CASES = ([("one", 0, mb) for mb in (1, 2)]
         + [(mesh, s, mb) for mesh in MESHES for s in (0, 1, 2, 3) for mb in (1, 2)])
FAST = {("fsdp8", 3, 2), ("dp2_fsdp4", 1, 2)}  # the rest run in the slow tier


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("mesh,stage,microbatches", tiers(CASES, FAST))
def test_loss_and_grads_match_the_reference(family, mesh, stage, microbatches):
    ref = reference(config(family, "one", 0, 1).model)
    fns = fns_for(family, mesh, same_program(mesh, stage, grads_only=True), microbatches)
    loss, grads = run_loss_and_grads(fns, ref[0])
    assert_matches(loss, grads, ref)
    # the layout is what the stage says: ZeRO-2/3 gradients are sharded over fsdp
    leaf = grads["blocks"][0]["mlp"]["w_" + ("in" if family == "gpt2" else "up")]
    sharded_over_fsdp = "fsdp" in str(leaf.sharding.spec)
    assert sharded_over_fsdp == (stage >= 2 and "fsdp" in mesh)


@pytest.mark.parametrize("family,mesh", tiers([(f, m) for f in PRESETS for m in MESHES], {("llama", "fsdp8")}))
def test_initial_params_bitwise_equal(family, mesh):
    ref_params = reference(config(family, "one", 0, 1).model)[0]
    for stage in (0, 3):
        state = fns_for(family, mesh, same_program(mesh, stage), 2).init(0)
        chex.assert_trees_all_equal(state.params, ref_params)


# every mesh at every stage, each family on every mesh and at every stage
STEP_CASES = [(mesh, stage, ("gpt2", "llama")[(i + stage) % 2]) for i, mesh in enumerate(MESHES) for stage in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,stage,family", STEP_CASES)
def test_one_train_step_matches_one_device(family, mesh, stage):
    """The whole step (accumulation over 2 microbatches, clipping, AdamW on the ZeRO layout)
    equals the update one device computes from the reference's gradients."""
    ref_params, ref_loss, ref_grads = reference(config(family, "one", 0, 1).model)
    cfg = config(family, mesh, stage, 2)
    tx = make_optimizer(cfg.train, transformer.param_table(cfg.model))
    ref_opt = warm_optimizer_state(tx.init(ref_params))
    ref_updates, ref_opt = jax.jit(tx.update)(ref_grads, ref_opt, ref_params)

    fns = fns_for(family, mesh, same_program(mesh, stage), 2)
    new_state, metrics = train_step(fns, warm(fns.init(0)))
    assert abs(float(metrics["loss"]) - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    adam = new_state.opt_state[1][0]
    assert max_rel_err(adam.mu, ref_opt[1][0].mu) <= GRAD_RTOL
    assert max_rel_err(adam.nu, ref_opt[1][0].nu) <= GRAD_RTOL
    # new = old + update, rounded to fp32: the update must match to GRAD_RTOL, up to one
    # rounding of the sum per entry (an update is ~1e-5 of a norm scale of 1.0). Where the exact
    # gradient is zero (GPT-2's key bias, see max_rel_err) the update is noise and must be tiny.
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(ref_grads)))
    noise = jax.tree.map(lambda g: bool(np.linalg.norm(g) < 1e-6 * total), ref_grads)
    assert sum(jax.tree.leaves(noise)) == (1 if family == "gpt2" else 0)  # only the key bias
    for is_noise, new, old, upd in zip(*map(jax.tree.leaves, (noise, new_state.params, ref_params, ref_updates))):
        new, ref_new, upd = np.asarray(new), np.asarray(old) + np.asarray(upd), np.asarray(upd)
        if is_noise:
            assert np.abs(new - np.asarray(old)).max() < 1e-2 * cfg.train.lr
        else:
            bound = GRAD_RTOL * np.linalg.norm(upd) + np.linalg.norm(np.spacing(np.abs(ref_new)))
            assert np.linalg.norm(new - ref_new) <= bound
    mu = adam.mu["blocks"][0]["attn"]["wq"]
    assert ("fsdp" in str(mu.sharding.spec)) == (stage >= 1 and "fsdp" in mesh)
    wq = new_state.params["blocks"][0]["attn"]["wq"]
    assert ("fsdp" in str(wq.sharding.spec)) == (stage == 3 and "fsdp" in mesh)


def run_steps(fns, n: int) -> list[float]:
    state = fns.init(0)
    losses = []
    for step in range(n):
        state, metrics = train_step(fns, state, tokens(step))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("family", PRESETS)
def test_twenty_step_loss_curves_match(family):
    ref = run_steps(fns_for(family, "one", 0, 1), 20)
    assert ref[-1] < ref[0] - 0.5  # it learns
    for mesh, stage in (("fsdp8", 3), ("dp2_fsdp4", 1)):
        losses = run_steps(fns_for(family, mesh, same_program(mesh, stage), 2), 20)
        np.testing.assert_allclose(losses, ref, rtol=LOSS_RTOL)
