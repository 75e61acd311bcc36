"""Every mesh and ZeRO stage computes the same numbers as one device (fp32, 8 fake CPU devices).

The reference is the model run plainly: no mesh, no layout, `jax.value_and_grad` of the
summed token loss over the token count. Compiled step functions are cached per distinct
program and shared between tests: ZeRO stages 0 and 1 have the same gradient program
(they differ only in the optimizer state's sharding, which the one-step test covers);
see `same_program`.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import build_config, validate
from jaxllm.data import batch_rows, window_starts
from jaxllm.mesh import make_mesh
from jaxllm.models import transformer
from jaxllm.train.optimizer import make_optimizer
from jaxllm.train.step import lm_batch, make_step_fns

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}
MESHES = {"dp8": dict(dp=8), "fsdp8": dict(fsdp=8), "dp2_fsdp4": dict(dp=2, fsdp=4)}
BATCH, SEQ = 16, 32
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def same_program(mesh: str, stage: int, grads_only: bool = False) -> int:
    """The stage whose compiled program stands for `stage` on this mesh.

    ZeRO-0 and 1 differ only in the optimizer state's layout (not in the gradient path);
    without an fsdp axis, 0/1 and 2/3 differ only in code path, not in layout.
    """
    if stage <= 1 and (grads_only or "fsdp" not in mesh):
        return 0
    return stage if "fsdp" in mesh else 2


def config(family: str, mesh: str, stage: int, microbatches: int):
    over = {"model.preset": PRESETS[family], "model.vocab_size": 257, "model.seq_len": SEQ,
            "precision.compute": "float32", "train.global_batch": BATCH, "train.microbatches": microbatches,
            "train.zero_stage": stage, "train.lr": 1e-3, "train.warmup_steps": 0, "train.steps": 20,
            "mesh.dp": 1}
    over.update({f"mesh.{a}": n for a, n in MESHES.get(mesh, {}).items()})
    return build_config(None, over)


@functools.lru_cache(maxsize=None)
def step_fns(family: str, mesh: str, stage: int, microbatches: int):
    cfg = config(family, mesh, stage, microbatches)
    if mesh == "one":
        shape, _ = validate(cfg, 1)
        return make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:1]))
    shape, _ = validate(cfg, 8)
    return make_step_fns(cfg, make_mesh(shape, cfg))


def tokens(step: int = 0) -> np.ndarray:
    # real text (the `os` module's source, as bytes) so a 20-step run has something to learn
    stream = np.frombuffer(open(os.__file__, "rb").read(), np.uint8).astype(np.uint16)
    return batch_rows(stream, window_starts(len(stream), 0, step, BATCH, SEQ), slice(None), SEQ)


@functools.lru_cache(maxsize=None)
def reference(family: str):
    """Initial params, loss and grads on one device, no layout at all."""
    return plain_reference(config(family, "one", 0, 1).model)


def plain_reference(m):
    """Initial params (seed 0), loss and grads of model config `m` on `tokens()`, run plainly on one device."""
    params = jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0))

    @jax.jit
    def loss_and_grads(p, toks):
        batch = lm_batch(toks)
        count = batch["loss_mask"].sum()
        return jax.value_and_grad(lambda q: transformer.forward_loss(q, batch, m, jnp.float32)[0] / count)(p)

    loss, grads = loss_and_grads(params, jnp.asarray(tokens()))
    return jax.device_get(params), float(loss), jax.device_get(grads)


def max_rel_err(a, b) -> float:
    """Largest per-leaf relative error ||a - b|| / ||b||.

    A leaf whose exact gradient is zero holds only rounding noise (GPT-2's key bias: adding
    a constant to every key shifts all scores of a query equally, which softmax ignores),
    so its norm is floored at 1e-6 of the whole gradient's norm.
    """
    total = np.sqrt(sum(float(np.sum(np.square(np.asarray(y, np.float64)))) for y in jax.tree.leaves(b)))
    errs = jax.tree.map(lambda x, y: float(np.linalg.norm(np.asarray(x) - np.asarray(y)) /
                                          max(np.linalg.norm(np.asarray(y)), 1e-6 * total)), a, b)
    return max(jax.tree.leaves(errs))


CASES = [("one", 0, mb) for mb in (1, 2)] + [(mesh, s, mb) for mesh in MESHES for s in (0, 1, 2, 3) for mb in (1, 2)]


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("mesh,stage,microbatches", CASES)
def test_loss_and_grads_match_one_device(family, mesh, stage, microbatches):
    ref_params, ref_loss, ref_grads = reference(family)
    fns = step_fns(family, mesh, same_program(mesh, stage, grads_only=True), microbatches)
    params = jax.device_put(ref_params, fns.state_shardings["params"])
    toks = jax.device_put(tokens(), fns.batch_sharding)
    loss, grads = fns.loss_and_grads(params, toks)
    assert abs(float(loss) - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert max_rel_err(grads, ref_grads) <= GRAD_RTOL
    # the layout is what the stage says: ZeRO-2/3 gradients are sharded over fsdp
    leaf = grads["blocks"][0]["mlp"]["w_" + ("in" if family == "gpt2" else "up")]
    sharded_over_fsdp = "fsdp" in str(leaf.sharding.spec)
    assert sharded_over_fsdp == (stage >= 2 and "fsdp" in mesh)


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_initial_params_bitwise_equal(family, mesh):
    ref_params = reference(family)[0]
    for stage in (0, 3):
        state = step_fns(family, mesh, same_program(mesh, stage), 2).init(0)
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def warm(state):
    """Adam's state as after some training: a positive second moment, so that one update is
    a smooth function of the gradient. (At step 1 the update is g / (|g| + eps), which turns
    the rounding noise of entries with |g| ~ eps into O(1) differences.) Shardings are kept."""
    clip, (adam, *rest) = state["opt_state"]
    adam = adam._replace(count=adam.count * 0 + 10, nu=jax.tree.map(lambda v: v * 0 + 1e-4, adam.nu))
    return {**state, "opt_state": (clip, (adam, *rest))}


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_train_step_matches_one_device(family, mesh, stage):
    """The whole step (accumulation over 2 microbatches, clipping, AdamW on the ZeRO layout)
    equals one device's update."""
    ref_params, ref_loss, ref_grads = reference(family)
    cfg = config(family, mesh, stage, 2)
    tx = make_optimizer(cfg.train, transformer.param_table(cfg.model))
    ref_opt = warm({"opt_state": tx.init(ref_params)})["opt_state"]
    ref_updates, ref_opt = jax.jit(tx.update)(ref_grads, ref_opt, ref_params)

    fns = step_fns(family, mesh, same_program(mesh, stage), 2)
    new_state, metrics = fns.train_step(warm(fns.init(0)), jax.device_put(tokens(), fns.batch_sharding))
    assert abs(float(metrics["loss"]) - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    adam = new_state["opt_state"][1][0]
    assert max_rel_err(adam.mu, ref_opt[1][0].mu) <= GRAD_RTOL
    assert max_rel_err(adam.nu, ref_opt[1][0].nu) <= GRAD_RTOL
    # new = old + update, rounded to fp32: the update must match to GRAD_RTOL, up to one
    # rounding of the sum per entry (an update is ~1e-5 of a norm scale of 1.0). Where the exact
    # gradient is zero (GPT-2's key bias, see max_rel_err) the update is noise and must be tiny.
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(ref_grads)))
    noise = jax.tree.map(lambda g: bool(np.linalg.norm(g) < 1e-6 * total), ref_grads)
    assert sum(jax.tree.leaves(noise)) == (1 if family == "gpt2" else 0)  # only the key bias
    for is_noise, new, old, upd in zip(*map(jax.tree.leaves, (noise, new_state["params"], ref_params, ref_updates))):
        new, ref_new, upd = np.asarray(new), np.asarray(old) + np.asarray(upd), np.asarray(upd)
        if is_noise:
            assert np.abs(new - np.asarray(old)).max() < 1e-2 * cfg.train.lr
        else:
            bound = GRAD_RTOL * np.linalg.norm(upd) + np.linalg.norm(np.spacing(np.abs(ref_new)))
            assert np.linalg.norm(new - ref_new) <= bound
    mu = adam.mu["blocks"][0]["attn"]["wq"]
    assert ("fsdp" in str(mu.sharding.spec)) == (stage >= 1 and "fsdp" in mesh)
    wq = new_state["params"]["blocks"][0]["attn"]["wq"]
    assert ("fsdp" in str(wq.sharding.spec)) == (stage == 3 and "fsdp" in mesh)


def run_steps(fns, n: int) -> list[float]:
    state = fns.init(0)
    losses = []
    for step in range(n):
        state, metrics = fns.train_step(state, jax.device_put(tokens(step), fns.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("family", PRESETS)
def test_twenty_step_loss_curves_match(family):
    ref = run_steps(step_fns(family, "one", 0, 1), 20)
    assert ref[-1] < ref[0] - 0.5  # it learns
    for mesh, stage in (("fsdp8", 3), ("dp2_fsdp4", 1)):
        losses = run_steps(step_fns(family, mesh, same_program(mesh, stage), 2), 20)
        np.testing.assert_allclose(losses, ref, rtol=LOSS_RTOL)
