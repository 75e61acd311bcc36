"""Options of the step: precision, remat policies, optimizers (incl. Muon on stacked weights), config parsing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

import harness
from harness import (GRAD_RTOL, LOSS_RTOL, equivalence_config, loss_and_grads, lower_loss_and_grads, max_rel_err,
                     step_fns, train_step)
from jaxllm.config import ConfigError, build_config, validate
from jaxllm.models.transformer import padded_vocab
from jaxllm.models import transformer
from jaxllm.trainer.optimizer import decay_mask, make_optimizer, muon_dimensions
from jaxllm.plan.hlo import memory_summary

BASE = {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.seq_len": 32, "train.global_batch": 8,
        "mesh.dp": 1, "train.warmup_steps": 0}


def one_device_fns(**over):
    cfg = build_config(None, {**BASE, **over})
    return cfg, step_fns(cfg)


def tokens():
    return harness.tokens(batch=8)  # BASE's global batch


def test_float32_compute_asks_for_full_precision_matmuls():
    _, fns = one_device_fns(**{"precision.compute": "float32"})
    text = lower_loss_and_grads(fns, batch=8).as_text()
    assert "HIGHEST" in text.upper()


def test_bfloat16_compute_keeps_fp32_master_and_grads():
    _, f32 = one_device_fns(**{"precision.compute": "float32"})
    _, bf16 = one_device_fns(**{"precision.compute": "bfloat16"})
    params = f32.init(0).params
    l32, g32 = loss_and_grads(f32, params, tokens())
    l16, g16 = loss_and_grads(bf16, params, tokens())
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    assert abs(float(l16) - float(l32)) < 2e-2 * float(l32)
    assert float(l16) != float(l32)  # bf16 matmuls really happened
    text = lower_loss_and_grads(bf16, batch=8).as_text()
    assert "bf16" in text


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "save-dots", "save-named"])
def test_remat_policies_give_the_same_gradients(remat):
    _, plain = one_device_fns(**{"precision.compute": "float32"})
    _, fns = one_device_fns(**{"precision.compute": "float32", "model.remat": remat})
    params = plain.init(0).params
    l0, g0 = loss_and_grads(plain, params, tokens())
    l1, g1 = loss_and_grads(fns, params, tokens())
    assert float(l0) == pytest.approx(float(l1), rel=1e-6)
    chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-7)


def test_save_named_keeps_more_than_full_remat_and_less_than_none():
    """Compiled temporaries of the gradient program: `full` recomputes everything (least memory), `none`
    keeps every activation (most), `save-named` keeps q, k, v, the attention output and the MLP hidden
    state: strictly in between."""
    def temps(remat: str) -> int:
        _, fns = one_device_fns(**{"precision.compute": "float32", "model.remat": remat})
        return memory_summary(lower_loss_and_grads(fns, batch=8).compile())["temp_bytes"]

    full, named, none = temps("full"), temps("save-named"), temps("none")
    assert full < named < none, (full, named, none)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.3), ("adafactor", 0.1), ("lion", 3e-4), ("muon", 2e-2)])
def test_other_optimizers_train(optimizer, lr):
    _, fns = one_device_fns(**{"precision.compute": "float32", "train.optimizer": optimizer, "train.lr": lr,
                               "train.steps": 8})
    state = fns.init(0)
    losses = []
    for _ in range(8):
        state, metrics = train_step(fns, state, tokens())
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def test_muon_orthogonalises_each_layer_of_stacked_weights():
    cfg = build_config(None, {**BASE, "train.optimizer": "muon", "train.weight_decay": 0.0, "train.grad_clip": 0.0})
    table = transformer.param_table(cfg.model)
    dims = muon_dimensions(table)
    assert dims["blocks"][0]["mlp"]["w_up"].reduction_axis == (1,)
    assert dims["blocks"][0]["attn"]["wo"].reduction_axis == (1, 2)
    assert dims["embed"]["tok"] is None and dims["blocks"][0]["ln1"]["scale"] is None

    tx = make_optimizer(cfg.train, table)
    params = transformer.init_params(cfg.model, jax.random.key(0))
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    u = np.asarray(updates["blocks"][0]["mlp"]["w_up"])  # [layers, d_model, d_ff]
    for layer in u:  # Newton-Schulz: all singular values of each layer's update are about equal
        s = np.linalg.svd(layer, compute_uv=False)
        assert s.max() / s.min() < 3.0, s
    # Adam on the same gradient would give a sign-like matrix with widely spread singular values
    adam = make_optimizer(build_config(None, {**BASE, "train.weight_decay": 0.0, "train.grad_clip": 0.0}).train, table)
    a = np.asarray(adam.update(grads, adam.init(params), params)[0]["blocks"][0]["mlp"]["w_up"][0])
    s = np.linalg.svd(a, compute_uv=False)
    assert s.max() / s.min() > 3.0


def test_config_layers_preset_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layers = 6\n[train]\nlr = 1\n')
    # explicit keys beat the preset whatever their order; an int is accepted for a float
    cfg = build_config(str(f), ["model.d_model=128", "model.preset=tiny-gpt2", "train.resume=true"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads) == (6, 128, 8)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.resume is True
    cfg = build_config(None, ["data.source=some/file.txt", "run.sample_prompt='x = '"])
    assert cfg.data.source == "some/file.txt" and cfg.run.sample_prompt == "x = "
    with pytest.raises(ConfigError, match="expected an integer"):
        build_config(None, ["train.steps=1.5"])
    with pytest.raises(ConfigError, match="unknown key 'model.layers'"):
        build_config(None, ["model.layers=2"])


def test_validation_of_the_mesh_and_tp_splits():
    cfg = build_config(None, {"model.preset": "tiny-llama", "model.vocab_size": 257, "mesh.dp": 1, "mesh.tp": 8})
    shape, notes = validate(cfg, 8)
    assert shape["tp"] == 8 and any("KV heads are replicated" in n for n in notes)
    assert padded_vocab(cfg.model) == 384
    cfg = build_config(None, {"model.preset": "tiny-gpt2", "model.vocab_size": 257, "mesh.dp": 2, "mesh.fsdp": -1})
    assert validate(cfg, 8)[0]["fsdp"] == 4
    for over, match in [({"mesh.dp": 2, "mesh.fsdp": -1, "mesh.tp": -1}, "only one axis"),
                        ({"mesh.dp": 1, "mesh.tp": 8, "model.d_ff": 100}, "model.d_ff"),
                        ({"mesh.sp": 8, "mesh.dp": 1, "model.seq_len": 60}, "model.seq_len"),
                        ({"train.global_batch": 12}, "train.global_batch"),
                        ({"mesh.dp": 1, "mesh.tp": 8, "model.collective_matmul": True}, "model.collective_matmul"),
                        ({"mesh.dp": 1, "mesh.tp": 8, "model.seq_len": 60, "train.sequence_parallel": True},
                         "train.sequence_parallel"),
                        ({"train.loss_chunk": 7}, "train.loss_chunk"),
                        ({"mesh.dp": 1, "mesh.sp": 8, "model.cp_strategy": "ulysses", "model.n_heads": 4,
                          "model.n_kv_heads": 4, "model.d_model": 64}, "n_heads"),
                        ({"mesh.dp": 1, "mesh.sp": 8, "model.seq_len": 24}, "model.cp_load_balance")]:
        cfg = build_config(None, {"model.preset": "tiny-gpt2", "model.vocab_size": 257, **over})
        with pytest.raises(ConfigError, match=match):
            validate(cfg, 8)


def test_weight_decay_only_on_matrices():
    for preset in ("tiny-gpt2", "tiny-llama"):
        m = build_config(None, {"model.preset": preset, "model.vocab_size": 257}).model
        mask = decay_mask(transformer.param_table(m))
        attn = mask["blocks"][0]["attn"]
        assert attn["wq"] and attn["wo"] and mask["embed"]["tok"]
        assert not mask["blocks"][0]["ln1"]["scale"] and not mask["final_norm"]["scale"]
        if preset == "tiny-gpt2":  # biases, including the 2-D-per-layer attention biases
            assert not any([attn["bq"], attn["bk"], attn["bv"], attn["bo"], mask["blocks"][0]["mlp"]["b_in"]])


# ---------------------------------------------------------------- optimizers under ZeRO on fsdp × tp

OPTIMIZERS = {"sgd": 0.3, "adafactor": 0.1, "lion": 3e-4, "muon": 2e-2}  # name -> learning rate
# d_ff = d_model: w_up [embed, mlp] and w_down [mlp, embed] have one shape but not one layout
SHARDED = {"model.d_ff": 64, "mesh.fsdp": 4, "mesh.tp": 2}


def optimizer_config(optimizer: str, stage: int, **over):
    return equivalence_config("tiny-llama", **{"model.d_ff": 64, "train.optimizer": optimizer,
                                               "train.lr": OPTIMIZERS[optimizer], "train.zero_stage": stage, **over})


# Under ZeRO-3 on fsdp4 × tp2 (jaxllm/sharding.py's rules), for the stacked [layers, in, out] MLP weights:
# the embedding axis over fsdp, the MLP's hidden axis over tp. w_up and w_down have one shape here
# ([2, 64, 64]) and transposed layouts.
EXPECTED = {"['blocks'][0]['mlp']['w_up']": P(None, "fsdp", "tp"),
            "['blocks'][0]['mlp']['w_down']": P(None, "tp", "fsdp")}


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_is_laid_out_as_its_parameter(optimizer, stage):
    """The state an optimizer keeps per element of w_up or w_down (momenta, second moments) is sharded
    as that parameter is under ZeRO-3, over fsdp and tp; step counts are replicated."""
    fns = step_fns(optimizer_config(optimizer, stage, **SHARDED))
    found = {name: [] for name in EXPECTED}
    for path, leaf in jax.tree_util.tree_leaves_with_path(fns.abstract_state.opt_state):
        key = jax.tree_util.keystr(path)
        name = next((n for n in EXPECTED if key.endswith(n)), None)
        if leaf.shape == (2, 64, 64) and name is not None:
            found[name].append(leaf.sharding.spec)
        elif leaf.ndim == 0:  # step counts
            assert leaf.sharding.spec == P(), key
    for name, spec in EXPECTED.items():  # each of these optimizers keeps one such leaf per parameter
        assert found[name] == [spec], (name, found[name])


WARM = {"sgd": {}, "adafactor": {".v[": 1e-4}, "lion": {".mu[": 1e-2}, "muon": {".nu[": 1e-4}}


def warm_optimizer(state, optimizer: str):
    """A state as after some training, so one update is a smooth function of the gradient: second
    moments positive (at step 1 Adam-like updates are g/|g|, rounding noise made O(1)), and Lion's
    momentum large enough that its sign does not hang on gradients at the level of rounding."""
    def leaf(path, a):
        key = jax.tree_util.keystr(path)
        value = next((v for tag, v in WARM[optimizer].items() if tag in key), None)
        return a if value is None else a * 0 + value

    return state.replace(opt_state=jax.tree_util.tree_map_with_path(leaf, state.opt_state))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_step_on_fsdp_and_tp_matches_one_device(optimizer, stage):
    one = step_fns(optimizer_config(optimizer, 0))
    fns = step_fns(optimizer_config(optimizer, stage, **SHARDED))
    start = jax.device_get(warm_optimizer(one.init(0), optimizer))
    ref, ref_metrics = train_step(one, start)
    new, metrics = train_step(fns, start)
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=LOSS_RTOL)
    assert float(metrics["grad_norm"]) == pytest.approx(float(ref_metrics["grad_norm"]), rel=GRAD_RTOL)
    floats = lambda tree: [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert max_rel_err(floats(new.opt_state), floats(ref.opt_state)) <= GRAD_RTOL
    for got, want, old in zip(*map(jax.tree.leaves, (new.params, ref.params, start.params))):
        got, want, old = np.asarray(got), np.asarray(want), np.asarray(old)
        bound = GRAD_RTOL * np.linalg.norm(want - old) + np.linalg.norm(np.spacing(np.abs(want)))
        assert np.linalg.norm(got - want) <= bound


def _adam_reference(grads: list, b1: float, b2: float, eps: float, stored) -> list:
    """Adam's updates for a sequence of gradients (float64 arithmetic), the moments passed through `stored`
    (a rounding) after each step."""
    mu = nu = np.zeros_like(grads[0], np.float64)
    out = []
    for step, g in enumerate(grads, start=1):
        mu, nu = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g
        out.append(mu / (1 - b1 ** step) / (np.sqrt(nu / (1 - b2 ** step)) + eps))
        mu, nu = stored(mu), stored(nu)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adam_moments_kept_in_bfloat16_update_as_a_plain_reference(dtype):
    """train.moment_dtype: the moments are stored in `dtype` between steps (bf16: half of fp32's bytes) and each
    step's update is Adam's on them, against a NumPy Adam whose moments are rounded alike."""
    import ml_dtypes

    from jaxllm.trainer.optimizer import scale_by_adam_stored_in

    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((64, 32)).astype(np.float32) * 10.0 ** rng.uniform(-6, 0) for _ in range(5)]
    tx = scale_by_adam_stored_in(jnp.dtype(dtype), 0.9, 0.95, 1e-8)
    state = tx.init(jnp.zeros((64, 32)))
    assert state.mu.dtype == state.nu.dtype == jnp.dtype(dtype)
    stored = (lambda a: a.astype(np.float32).astype(np.float64)) if dtype == "float32" else (
        lambda a: a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
    for g, want in zip(grads, _adam_reference(grads, 0.9, 0.95, 1e-8, stored)):
        update, state = tx.update(jnp.asarray(g), state)
        np.testing.assert_allclose(np.asarray(update, np.float64), want, rtol=2e-5, atol=1e-7)


def test_the_train_state_holds_bfloat16_moments_and_other_optimizers_are_refused():
    _, fns = one_device_fns(**{"train.moment_dtype": "bfloat16"})
    moments = [leaf for leaf in jax.tree.leaves(fns.abstract_state.opt_state) if leaf.ndim > 0]
    assert moments and all(leaf.dtype == jnp.bfloat16 for leaf in moments)
    with pytest.raises(ConfigError, match="train.moment_dtype=bfloat16 is for adamw's moments; train.optimizer=lion"):
        validate(build_config(None, {**BASE, "train.moment_dtype": "bfloat16", "train.optimizer": "lion"}), 1)
