"""Auxiliary-loss-free balancing (`model.moe.bias_update_rate`, `trainer/bias_balance.py`) and the sequence-wise balance
loss, on a stack of a dense layer and an MoE layer (fp32, dropless): the bias moves by the rate against each
expert's load over the whole step, alike on one device, over 2 microbatches on 4 devices and for 5 steps under
context parallelism; it decides the choice
and takes no part in the gradients; a resumed run continues it bitwise."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import as_batch, equivalence_config, loss_and_grads, step_fns, tokens, train_step
from jaxllm.models import moe as moe_lib
from jaxllm.models import transformer
from jaxllm.trainer.objectives import LANGUAGE_MODEL

RATE = 0.01
KEYS = {"model.segments": [{"layers": 1, "pattern": ["dense"]}, {"layers": 1, "pattern": ["moe"]}],
        "model.moe.bias_update_rate": RATE, "model.moe.capacity_factor": 0.0}


def config(**over):
    return equivalence_config("tiny-moe", **{**KEYS, **over})


def bias_of(params) -> np.ndarray:
    return np.asarray(params["blocks"][1]["moe"]["router_bias"][0])


def test_the_bias_moves_against_each_experts_load_over_the_whole_step():
    one = step_fns(config())
    start = jax.device_get(one.init(0).params)
    new, metrics = train_step(one, one.init(0))
    load = np.asarray(metrics["moe_load"])  # the one MoE layer's share of the pairs, per expert
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and under.any()
    first = bias_of(new.params)
    np.testing.assert_array_equal(first, np.where(over, -RATE, np.where(under, RATE, 0.0)).astype(np.float32))
    # the load stays out of the gradient norm, the clipping and every other parameter's update: the step without
    # a bias (it starts at 0, so the same experts are chosen) gives the same norm and the same other parameters
    without = step_fns(config(**{"model.moe.bias_update_rate": 0.0}))
    start["blocks"][1]["moe"].pop("router_bias")
    plain, plain_metrics = train_step(without, without.init(0).replace(params=start))
    assert float(plain_metrics["grad_norm"]) == float(metrics["grad_norm"])
    new_moe = {k: v for k, v in new.params["blocks"][1]["moe"].items() if k != "router_bias"}
    chex.assert_trees_all_equal(new_moe, plain.params["blocks"][1]["moe"])
    # a second step moves it again by the rate, from where it is
    twice, _ = train_step(one, new, tokens(1))
    steps = (bias_of(twice.params) - first) / RATE
    assert np.all(np.isin(np.round(steps, 5), (-1.0, 0.0, 1.0))) and np.any(steps != 0)


@pytest.mark.slow
def test_a_fixed_bias_decides_the_choice_and_never_moves():
    """`model.moe.router_bias` without a rate (an imported DeepSeek-V3's `e_score_correction_bias`): the step keeps
    it bitwise, and it changes the experts chosen (the loss differs from the same weights without it)."""
    fixed = step_fns(config(**{"model.moe.bias_update_rate": 0.0, "model.moe.router_bias": True}))
    state = fixed.init(0)
    params = jax.device_get(state.params)
    bias = np.random.default_rng(0).normal(0, 0.5, (1, 8)).astype(np.float32)
    params["blocks"][1]["moe"]["router_bias"] = bias
    new, metrics = train_step(fixed, state.replace(params=jax.device_put(params, fixed.state_shardings.params)))
    np.testing.assert_array_equal(bias_of(new.params), bias[0])
    zero = {**params, "blocks": [params["blocks"][0], {**params["blocks"][1], "moe": {
        **params["blocks"][1]["moe"], "router_bias": np.zeros_like(bias)}}]}
    assert float(loss_and_grads(fixed, zero)[0]) != float(metrics["loss"])


@pytest.mark.slow
def test_the_load_is_counted_over_every_microbatch_and_device():
    """2 microbatches on ep2×fsdp2 (ZeRO-2): the biases after one step are those of the step on one device."""
    one, four = step_fns(config()), step_fns(config(**{"mesh.ep": 2, "mesh.fsdp": 2, "train.zero_stage": 2,
                                                        "train.microbatches": 2}))
    new, metrics = train_step(one, one.init(0))
    load = np.asarray(metrics["moe_load"])
    assert np.any(bias_of(new.params) != 0) and len(set(np.sign(load - load.mean()))) > 1
    np.testing.assert_array_equal(bias_of(train_step(four, one.init(0))[0].params), bias_of(new.params))


@pytest.mark.slow
def test_five_steps_under_context_parallelism_move_the_bias_as_one_device():
    """sp2 × ep2 × dp2, the sequence in zig-zag order: after each of 5 steps the biases are one device's within 1e-6
    (the loads are counts: the biases move by whole rates), and they have moved."""
    one, spread = step_fns(config()), step_fns(config(**{"mesh.sp": 2, "mesh.ep": 2, "mesh.dp": 2,
                                                         "model.cp_load_balance": True}))
    a = b = jax.device_get(one.init(0))
    for step in range(5):
        a, b = (jax.device_get(train_step(fns, state, tokens(step))[0]) for fns, state in ((one, a), (spread, b)))
        np.testing.assert_allclose(bias_of(b.params), bias_of(a.params), rtol=0, atol=1e-6)
    assert np.abs(bias_of(a.params)).max() >= 2 * RATE


@pytest.mark.slow
def test_the_bias_decides_the_choice_and_the_gradients_are_the_routers_with_it_held_constant():
    """With a bias that changes which experts tokens go to, one step's loss and gradients on ep4×fsdp2 (ZeRO-3)
    are those of the model on one device with the bias a constant (jax.grad of the forward pass, not the step)."""
    m = config().model
    params = jax.device_get(step_fns(config()).init(0).params)
    bias = 0.2 * jax.random.normal(jax.random.key(3), (1, m.moe.n_experts))
    params["blocks"][1]["moe"]["router_bias"] = np.asarray(bias)
    batch = jax.tree.map(jnp.asarray, as_batch(tokens()))

    def objective(p, bias):  # the parameters' own bias leaf replaced by a constant
        moe = {**p["blocks"][1]["moe"], "router_bias": bias}
        p = {**p, "blocks": [p["blocks"][0], {**p["blocks"][1], "moe": moe}]}
        total, _, aux = transformer.forward(p, batch, m, jnp.float32, LANGUAGE_MODEL.token_terms)
        lm = total / batch["loss_mask"].sum()
        return lm + moe_lib.objective(aux, m), lm

    with jax.default_matmul_precision("float32"):
        (_, want_loss), want = jax.value_and_grad(objective, has_aux=True)(params, bias)
        unbiased = objective(params, jnp.zeros_like(bias))[1]
    assert abs(float(unbiased) - float(want_loss)) > 1e-4  # the bias changes the choice
    loss, grads = loss_and_grads(step_fns(config(**{"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3})), params)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * float(want_loss)
    # router_bias's "gradient" is the layer's load (the test above): left out of both trees
    no_bias = lambda t: jax.tree_util.tree_map_with_path(lambda p, x: None if p[-1].key == "router_bias" else x, t)
    chex.assert_trees_all_close(no_bias(grads), no_bias(want), rtol=1e-5, atol=1e-7)


def test_the_sequence_wise_balance_loss_on_hand_computed_routing():
    """Two sequences of two tokens, 4 experts, top-1. Sequence 1: scores [2,1,1,0] and [1,1,0,2] normalise to
    [.5,.25,.25,0] and [.25,.25,0,.5], P = [.375,.25,.125,.25]; experts 0 and 3, f = 4/(1·2)·[1,0,0,1] = [2,0,0,2];
    Σ f·P = 1.25. Sequence 2: uniform scores, P = .25 each, expert 1 twice, f = [0,4,0,0]; Σ f·P = 1. Mean 1.125."""
    scores = jnp.array([[[2, 1, 1, 0], [1, 1, 0, 2]], [[1, 1, 1, 1], [1, 1, 1, 1]]], jnp.float32)
    experts = jnp.array([[[0], [3]], [[1], [1]]], jnp.int32)
    assert float(moe_lib.seq_balance(scores, experts)) == pytest.approx(1.125, abs=1e-7)


@pytest.mark.slow
def test_a_resumed_run_continues_the_biases_bitwise(tmp_path):
    """4 steps straight, and the same run cut back to its step-2 checkpoint and resumed to 4: the biases at step 4
    are the same bits (and have moved)."""
    import shutil

    from harness import CORPUS
    from jaxllm.config import build_config
    from jaxllm.trainer import checkpoint
    from jaxllm.trainer.loop import train

    over = {**KEYS, "model.preset": "tiny-moe", "model.seq_len": 32, "train.global_batch": 8, "train.steps": 4,
            "train.schedule_steps": 4,
            "train.checkpoint_every": 2, "train.eval_every": 0, "data.source": CORPUS, "run.sample_tokens": 0,
            "run.progress": False}
    train(build_config(None, {**over, "run.dir": str(tmp_path / "straight")}))
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    rows = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[:2]
    (tmp_path / "resumed" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    train(build_config(None, {**over, "run.dir": str(tmp_path / "resumed"), "train.resume": True}))
    m = build_config(None, over).model
    abstract = jax.eval_shape(lambda: transformer.init_params(m, jax.random.key(0)))
    straight, resumed = (checkpoint.read_params(str(tmp_path / name), 4, abstract) for name in ("straight", "resumed"))
    assert np.any(bias_of(straight) != 0)
    np.testing.assert_array_equal(bias_of(straight), bias_of(resumed))
