"""ZeRO++ (`jaxllm/ops/quantize.py`, `jaxllm/parallel/zeropp.py`): its numbers contract is not one device's
but the quantization bounds plus equality with an unsharded quantization reference on the same block
boundaries (numpy, below). The blockwise bounds hold element by element on heavy-tailed inputs, zero blocks
stay zero; the int8 all-gather and reduce-scatter equal their references on 8 devices; a qwZ step on fsdp=8
equals one device run on the fake-quantized weights; hpZ equals plain ZeRO-3 in fp32; the compiled programs
move s8 and keep hpZ's per-layer gathers inside one fsdp group; 30 quantized steps stay within 1% of the
unquantized loss."""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness as H
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from jaxllm.ops.quantize import dequantize, quantize
from jaxllm.parallel import zeropp
from jaxllm.plan.hlo import bytes_by_kind_and_dtype, dtype_of, executed_collectives

QMAX = 127


def fake_quant(x: np.ndarray, block: int) -> np.ndarray:
    """The reference: x flattened in C order, padded to blocks, each block rounded to 255 levels of
    max|block| · (1/127) in fp32 numpy (x times the scale's reciprocal, as the module defines it), and back."""
    flat = np.asarray(x, np.float32).reshape(-1)
    n = -(-flat.size // block) * block
    rows = np.pad(flat, (0, n - flat.size)).reshape(-1, block)
    scale = np.abs(rows).max(axis=1) * np.float32(1 / QMAX)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    q = np.clip(np.round(rows * inverse[:, None]), -QMAX, QMAX)
    return (q * scale[:, None]).astype(np.float32).reshape(-1)[:flat.size].reshape(x.shape)


def block_max(x: np.ndarray, block: int) -> np.ndarray:
    """max|block| for every element of x (its block's)."""
    flat = np.abs(np.asarray(x, np.float64)).reshape(-1)
    n = -(-flat.size // block) * block
    m = np.pad(flat, (0, n - flat.size)).reshape(-1, block).max(axis=1)
    return np.repeat(m, block)[:flat.size].reshape(x.shape)


def heavy_tailed(shape, seed=0) -> np.ndarray:
    """Student-t with 1.5 degrees of freedom, over six decades of scale, with whole zero stretches."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(1.5, size=shape) * 10.0 ** rng.uniform(-3, 3, size=shape)
    x.reshape(-1)[: x.size // 5] = 0.0  # the first blocks are all zero
    return x.astype(np.float32)


SLACK = 1 + 2**-20  # fp32 rounding of the scale and of q·scale, on top of the half step


@pytest.mark.parametrize("shape, block", [((1000,), 64), ((37, 53), 256), ((8, 16, 24), 7)])
def test_the_blockwise_bound_holds_element_by_element_and_zero_blocks_stay_zero(shape, block):
    x = heavy_tailed(shape)
    q, s = quantize(jnp.asarray(x), block)
    back = np.asarray(dequantize(q, s, shape), np.float64)
    chex.assert_shape(q, (-(-x.size // block), block))
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32
    assert np.all(np.isfinite(back))
    assert np.all(np.abs(back - x) <= block_max(x, block) / 254 * SLACK)
    assert np.all(back.reshape(-1)[: x.size // 5 // block * block] == 0)  # the all-zero blocks
    np.testing.assert_array_equal(back, fake_quant(x, block))  # and it is the reference's rounding


def mesh8():
    return jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])


@pytest.mark.parametrize("axis", [0, 1])
def test_the_int8_all_gather_equals_its_unsharded_reference(axis):
    """Each device's shard (an odd 80 elements: blocks of 32 padded) quantized on its own, gathered by 8."""
    x = heavy_tailed((16, 40) if axis == 1 else (40, 16), seed=1)
    spec = P(None, "fsdp") if axis == 1 else P("fsdp")
    f = jax.jit(jax.shard_map(lambda w: zeropp.quantized_all_gather(w, axis, 32), mesh=mesh8(), in_specs=spec,
                              out_specs=P(), check_vma=False))
    ref = np.concatenate([fake_quant(part, 32) for part in np.split(x, 8, axis=axis)], axis=axis)
    np.testing.assert_array_equal(np.asarray(f(jax.device_put(x, NamedSharding(mesh8(), spec)))), ref)


def test_the_int8_reduce_scatter_equals_its_reference_within_the_summed_bounds():
    """Eight devices' different [16, 40] gradients; device j keeps the sum of everyone's j-th shard."""
    g = np.stack([heavy_tailed((16, 40), seed=d) for d in range(8)])
    f = jax.jit(jax.shard_map(lambda x: zeropp.quantized_reduce_scatter(x[0], 1, 32), mesh=mesh8(),
                              in_specs=P("fsdp"), out_specs=P(None, "fsdp"), check_vma=False))
    ours = np.asarray(f(jax.device_put(g, NamedSharding(mesh8(), P("fsdp")))), np.float64)
    chunks = [np.split(g[d], 8, axis=1) for d in range(8)]
    terms = np.stack([np.concatenate([fake_quant(chunks[d][j], 32) for j in range(8)], axis=1) for d in range(8)])
    ref = terms.astype(np.float64).sum(0)
    assert np.all(np.abs(ours - ref) <= 8 * np.finfo(np.float32).eps * np.abs(terms).sum(0))  # fp32 summation
    bound = sum(np.concatenate([block_max(chunks[d][j], 32) for j in range(8)], axis=1) for d in range(8)) / 254
    assert np.all(np.abs(ours - g.astype(np.float64).sum(0)) <= bound * SLACK + 1e-6 * np.abs(ours))


# ---------------------------------------------------------------- the train step


def zpp_config(mesh: dict, over: dict | None = None, **zeropp_keys):
    """tiny-llama under ZeRO-3 on `mesh`, with these `train.zeropp` keys and other overrides."""
    return H.equivalence_config("tiny-llama", **{**mesh, "train.zero_stage": 3, **(over or {})},
                                **{f"train.zeropp.{k}": v for k, v in zeropp_keys.items()})


FSDP8 = {"mesh.fsdp": 8}
DP2_FSDP4 = {"mesh.dp": 2, "mesh.fsdp": 4}


def fake_quantized_params(params, m, fsdp: int, block: int):
    """The weights qwZ moves, as each layer's fsdp shards see them: every leaf with `embed` and another
    non-layer dimension, per layer, split along `embed` into the fsdp shards, each fake-quantized."""
    def one(w, names):
        w = np.asarray(w)
        if "embed" not in names or len([n for n in names if n != "layers"]) < 2:
            return w
        stacked = names[0] == "layers"
        axis = names.index("embed") - stacked
        per_layer = lambda a: np.concatenate([fake_quant(s, block) for s in np.split(a, fsdp, axis=axis)], axis=axis)
        return np.stack([per_layer(a) for a in w]) if stacked else per_layer(w)

    return jax.tree.map(one, params, transformer.param_names(m),
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x))


@pytest.mark.parametrize("mesh", H.tiers(["fsdp8", "dp2xfsdp4"], fast=["fsdp8"]))
def test_a_qwz_step_equals_one_device_on_the_fake_quantized_weights(mesh):
    """The forward sees exactly the dequantised shards; the backward's exact reduce-scatter gives the
    gradient at those weights (the quantizer passes the gradient straight through); over dp the shards'
    gradients are summed too."""
    mesh, fsdp = (FSDP8, 8) if mesh == "fsdp8" else (DP2_FSDP4, 4)
    cfg = zpp_config(mesh, weights=True, block=64)
    params = transformer.init_params(cfg.model, jax.random.key(0))
    loss, grads = H.loss_and_grads(H.step_fns(cfg), params)
    ref_loss, ref_grads = H.loss_and_grads(H.step_fns(H.equivalence_config("tiny-llama")),
                                           fake_quantized_params(params, cfg.model, fsdp, 64))
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert H.max_rel_err(grads, ref_grads) <= 1e-5
    plain, _ = H.loss_and_grads(H.step_fns(zpp_config(mesh)), params)
    assert float(loss) != float(plain)  # the quantization is really there


@pytest.mark.slow
def test_lora_in_the_zeropp_island_equals_one_device():
    """LoRA in ZeRO++'s island: with hpZ and fp32 gradient reduction (dp2 × fsdp4, 2 microbatches) the adapters'
    gradients equal one device's; with qwZ (fsdp8) one device's at the fake-quantized weights (the base's and the
    adapters' with an `embed` dimension, gathered as int8 blocks alike). The frozen base has no gradient to reduce."""
    lora_keys = {"model.lora.rank": 4, "model.lora.alpha": 8.0}
    one = H.step_fns(H.equivalence_config("tiny-llama", **lora_keys))
    params = jax.device_get(H.with_random_b(one.init(0).params))
    loss, grads = H.loss_and_grads(one, params)
    hpz = zpp_config(DP2_FSDP4, {**lora_keys, "train.microbatches": 2, "precision.grad_reduce": "float32"}, hpz=True)
    H.assert_matches(*H.loss_and_grads(H.step_fns(hpz), params), (params, float(loss), jax.device_get(grads)))
    qwz = zpp_config(FSDP8, lora_keys, weights=True, block=64)
    quantized = fake_quantized_params(params, qwz.model, 8, 64)
    ref_loss, ref_grads = H.loss_and_grads(one, quantized)
    assert float(ref_loss) != float(loss)  # the quantization is really there
    H.assert_matches(*H.loss_and_grads(H.step_fns(qwz), params), (quantized, float(ref_loss),
                                                                    jax.device_get(ref_grads)))


def hpz_and_plain(microbatches: int = 1):
    over = {"train.microbatches": microbatches}
    return H.step_fns(zpp_config(DP2_FSDP4, over, hpz=True)), H.step_fns(zpp_config(DP2_FSDP4, over))


@pytest.mark.parametrize("microbatches", H.tiers([1, 2], fast=[1]))
def test_hpz_gradients_equal_plain_zero3_in_fp32(microbatches):
    """hpZ moves bytes differently, not numbers."""
    ours, ref = hpz_and_plain(microbatches)
    params = transformer.init_params(H.equivalence_config("tiny-llama").model, jax.random.key(0))
    (loss, grads), (ref_loss, ref_grads) = H.loss_and_grads(ours, params), H.loss_and_grads(ref, params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert H.max_rel_err(grads, ref_grads) <= 1e-6


@pytest.mark.slow
def test_hpz_trains_like_plain_zero3_with_the_master_over_all_devices():
    """Three updates with the master and optimizer state sharded over dp × fsdp equal ZeRO-3's."""
    ours, ref = hpz_and_plain()
    states = [fns.init(0) for fns in (ours, ref)]
    for step in range(3):
        states = [H.train_step(fns, s, H.tokens(step))[0] for fns, s in zip((ours, ref), states)]
    assert H.max_rel_err(states[0].params, states[1].params) <= 1e-6
    for tree in (states[0].params, states[0].opt_state):  # each device holds an eighth of a weight
        wq = [leaf for leaf in jax.tree.leaves(tree) if leaf.shape == ref.abstract_state.params["blocks"][0][
            "attn"]["wq"].shape][0]
        assert wq.addressable_shards[0].data.size * 8 == wq.size


# ---------------------------------------------------------------- what the compiled programs move


def collectives_of(cfg) -> list[dict]:
    return executed_collectives(H.lower_loss_and_grads(H.step_fns(cfg)).compile().as_text())[0]


def leaves(m, kind: str) -> list:
    """Shapes of the parameter leaves ZeRO++ gathers at their use ("use": `embed` and another non-layer
    dimension) or once per step in fp32 ("small": `embed` alone, as norm scales and output biases)."""
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x)
    pairs = zip(jax.tree.leaves(transformer.param_names(m), is_leaf=is_names),
                jax.tree.leaves(transformer.param_shapes(m)))
    dims = lambda n: len([d for d in n if d != "layers"])
    return [s.shape for n, s in pairs if "embed" in n and (dims(n) == 1) == (kind == "small")]


def small_leaf_elements(m) -> int:
    return sum(int(np.prod(s)) for s in leaves(m, "small"))


def test_quantized_steps_move_int8_and_no_float_copy_of_the_weights():
    """fsdp=8, qwZ + qgZ: the weights' gathers and their gradients' all-to-alls are s8; the only float
    gathers are the blocks' scales and the small leaves, the only float all-to-alls the scales."""
    cfg = zpp_config(FSDP8, weights=True, grads=True)
    ops = collectives_of(cfg)
    table = bytes_by_kind_and_dtype(ops)
    total = lambda kind, dtype: table.get((kind, dtype), 0)
    s8_ops = [o for o in ops if dtype_of(o) == "s8"]
    assert {o["kind"] for o in s8_ops} == {"all-gather", "all-to-all"}
    scales = {kind: sum(o["bytes"] // 256 * 4 * o["times"] for o in s8_ops if o["kind"] == kind)
              for kind in ("all-gather", "all-to-all")}  # one fp32 scale per block of 256 int8s
    assert total("all-gather", "f32") == scales["all-gather"] + 4 * small_leaf_elements(cfg.model)
    assert total("all-to-all", "f32") == scales["all-to-all"]
    assert total("reduce-scatter", "f32") == 4 * small_leaf_elements(cfg.model) // 8
    assert total("all-reduce", "f32") <= 16  # the loss and the token count, nothing of the gradients
    assert not [o for o in ops if dtype_of(o) in ("bf16", "f16")]


def test_hpz_gathers_each_layer_inside_one_fsdp_group():
    """dp=2 × fsdp=4 (devices 0-3 and 4-7 are the fsdp groups): every int8 gather runs within one fsdp group;
    across dp, each weight's secondary copy is gathered once per step, outside the layer loop."""
    cfg = zpp_config(DP2_FSDP4, weights=True, hpz=True)
    ops = [o for o in collectives_of(cfg) if o["kind"] == "all-gather"]
    fsdp_groups, dp_groups = "{{0,1,2,3},{4,5,6,7}}", "{{0,4},{1,5},{2,6},{3,7}}"
    assert {o["groups"] for o in ops if dtype_of(o) == "s8"} == {fsdp_groups}
    across_dp = [o for o in ops if o["groups"] == dp_groups]
    assert [o["times"] for o in across_dp] == [1] * len(leaves(cfg.model, "use"))
    assert {o["groups"] for o in ops} <= {fsdp_groups, dp_groups, "{{0,4,1,5,2,6,3,7}}"}  # + small leaves


# ---------------------------------------------------------------- training, refusals, checkpoints


@pytest.mark.slow
def test_thirty_quantized_steps_end_within_one_percent_of_the_unquantized_loss():
    """tiny-llama on fsdp=8, qwZ + qgZ against plain ZeRO-3, same data and seed."""
    def losses(cfg):
        fns, out = H.step_fns(cfg), []
        state = fns.init(0)
        for step in range(30):
            state, metrics = H.train_step(fns, state, H.tokens(step))
            out.append(float(metrics["loss"]))
        return out

    ours, ref = losses(zpp_config(FSDP8, weights=True, grads=True)), losses(zpp_config(FSDP8))
    assert ref[-1] < 0.85 * ref[0]  # it learned something
    assert abs(ours[-1] - ref[-1]) <= 0.01 * ref[-1], (ours[-1], ref[-1])


@pytest.mark.parametrize("over, message", [
    ({"train.zero_stage": 2}, "train.zeropp with train.zero_stage != 3"),
    ({"mesh.tp": 2, "mesh.fsdp": 4}, "train.zeropp with mesh.tp, mesh.sp or mesh.ep > 1"),
    ({"mesh.pp": 2, "mesh.fsdp": 4, "train.microbatches": 2}, "train.zeropp with mesh.pp > 1"),
    ({"train.zeropp.hpz": True}, "train.zeropp.hpz needs mesh.dp > 1"),
    ({"train.zeropp.block": 0}, "train.zeropp.block: must be at least 1"),
    ({"model.d_model": 52, "model.n_heads": 2, "model.n_kv_heads": 2}, "model.d_model=52 is not divisible by the 8 shards"),
])
def test_what_zeropp_does_not_support_is_refused_in_one_line(over, message):
    cfg = zpp_config(FSDP8, {"train.global_batch": 16, **over}, weights=True)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 8)


@pytest.mark.slow
@pytest.mark.parametrize("saved_hpz", [False, True])
def test_a_checkpoint_restores_across_hpz_on_and_off(tmp_path, saved_hpz):
    """The stored arrays are the same arrays, laid out over fsdp or fsdp × dp: an Orbax checkpoint of either
    restores into the other's layout and the next step equals the saving run's."""
    from jaxllm.trainer import checkpoint

    saver, loader = (H.step_fns(zpp_config(DP2_FSDP4, hpz=True) if hpz else zpp_config(DP2_FSDP4))
                     for hpz in (saved_hpz, not saved_hpz))
    state, _ = H.train_step(saver, saver.init(0), H.tokens(0))
    mngr = checkpoint.open_manager(str(tmp_path), keep=1)
    checkpoint.save(mngr, 1, state, {"step": 1})
    mngr.wait_until_finished()
    restored = checkpoint.read_state(mngr, 1, loader.abstract_state)
    mngr.close()
    wq = restored.params["blocks"][0]["attn"]["wq"]
    assert wq.sharding == loader.state_shardings.params["blocks"][0]["attn"]["wq"]
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(state.params["blocks"][0]["attn"]["wq"]))
    ours, _ = H.train_step(loader, restored, H.tokens(1))
    ref, _ = H.train_step(saver, state, H.tokens(1))
    assert H.max_rel_err(ours.params, ref.params) <= 1e-6


@pytest.mark.slow
def test_the_planner_shows_the_bytes_drop_as_predicted():
    """jaxllm plan on fsdp=8, qwZ + qgZ, fp32: the all-gathers against the same step compiled without
    quantization and the gradient all-to-alls against their elements in fp32, both at (1 + 4/256) / 4 within
    1% (the small leaves' fp32 gathers and the blocks' padding); with hpZ the compiled step's arguments are
    the ZeRO-3 theory over dp × fsdp."""
    from jaxllm.plan import format_table, plan

    report = plan(zpp_config(FSDP8, weights=True, grads=True))
    z = report["zeropp"]
    assert z["predicted_ratio"] == pytest.approx((1 + 4 / 256) / 4)
    assert z["gathers"] / z["gathers_unquantized"] == pytest.approx(z["predicted_ratio"], rel=0.01)
    assert z["grad_all_to_all"] / z["grad_unquantized"] == pytest.approx(z["predicted_ratio"], rel=0.01)
    assert "ZeRO++ (qwZ, qgZ; blocks of 256" in format_table(report)
    # hpZ: the state as stored is ZeRO-3's over all 8 devices (12Φ/8 in fp32), not over the 4 of fsdp
    hpz = plan(zpp_config(DP2_FSDP4, hpz=True))
    assert hpz["theory"]["fsdp"] == 8
    got, expected = hpz["memory"]["argument_bytes"], hpz["theory"]["fp32"]["argument_bytes"]
    assert abs(got - expected) <= 0.10 * expected, (got, expected)
