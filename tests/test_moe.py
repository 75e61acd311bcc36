"""The mixture-of-experts layer and its expert-parallel dispatch (fp32, fake CPU devices).

The reference is naive: each token runs through each expert it chose, one token at a
time, with the expert's own weights picked out, weighted by its gate; with a capacity,
the pairs it keeps come from a plain Python count in the documented priority (all first
choices, then all second choices, each in token order, per group). The expert-parallel
island must equal it in forward and in gradients (tokens, router, expert weights) for
ep ∈ {2, 4, 8} and top-k ∈ {1, 2}, dropless and with a small capacity, and its compiled
program must move tokens by all-to-all and never gather expert weights.

The model: one step's loss and gradients of the whole objective equal the independent dense
MoE (tools/reference/plain_llama.py) on expert-parallel meshes; at the default capacity, meshes with
equal batch shards drop the same pairs, under sp (zig-zag) and inside pipeline stages too; what MoE cannot run
is refused in one line.
"""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import (CORPUS, assert_matches, equivalence_config, loss_and_grads, lower_loss_and_grads, reference,
                     step_fns, tiers, tokens, train_step)
from jaxllm.config import ConfigError, build_config, validate
from jaxllm.mesh import make_mesh
from jaxllm.models import transformer
from jaxllm.ops import moe
from jaxllm.parallel.expert_dispatch import expert_parallel_moe
from jaxllm.parallel.load_balance import zigzag_order
from jaxllm.trainer.loop import train

T, D, F, E = 64, 16, 32, 8


def weights(mlp: str, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    names = ("w_in", "w_out") if mlp == "gelu_tanh" else ("w_gate", "w_up", "w_down")
    shapes = {"w_in": (E, D, F), "w_out": (E, F, D), "w_gate": (E, D, F), "w_up": (E, D, F), "w_down": (E, F, D)}
    experts = {n: 0.3 * jax.random.normal(k, shapes[n]) for n, k in zip(names, keys)}
    return {"router": jax.random.normal(keys[4], (D, E)), "experts": experts}


def inputs(seed: int = 1):
    return jax.random.normal(jax.random.key(seed), (T, D)), jax.random.normal(jax.random.key(seed + 1), (T, D))


def kept_pairs(experts: np.ndarray, groups: int, slots: int) -> np.ndarray:
    """Which (token, choice) pairs fit: per group, first choices before second choices, then token order."""
    t, k = experts.shape
    kept = np.zeros((t, k), bool)
    for g in range(groups):
        count = np.zeros(E, int)
        for j in range(k):
            for i in range(g * t // groups, (g + 1) * t // groups):
                kept[i, j] = count[experts[i, j]] < slots
                count[experts[i, j]] += 1
    return kept


def one_token_ffn(w: dict, x, mlp: str):
    if mlp == "gelu_tanh":
        return jax.nn.gelu(x @ w["w_in"], approximate=True) @ w["w_out"]
    return (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]


def naive(params, x, top_k, mlp, kept):
    _, _, gates, experts = moe.route(params["router"], x, top_k)

    def token(xt, gt, et, kt):
        y = jnp.zeros_like(xt)
        for j in range(top_k):
            w = {n: a[et[j]] for n, a in params["experts"].items()}
            y = y + jnp.where(kt[j], gt[j], 0.0) * one_token_ffn(w, xt, mlp)
        return y

    return jax.vmap(token)(x, gates, experts, kept)


def parallel(params, x, top_k, mlp, factor, mesh):
    _, _, gates, experts = moe.route(params["router"], x, top_k)
    return expert_parallel_moe(params["experts"], x, gates, experts, E, factor, mlp, jnp.float32, mesh)


@functools.lru_cache(maxsize=None)
def ep_mesh(ep: int):
    return make_mesh({"pp": 1, "dp": 1, "fsdp": 1, "ep": ep, "sp": 1, "tp": 1}, devices=jax.devices()[:ep])


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.mark.parametrize("mlp", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("factor", [0.0, 0.5])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("ep", tiers([2, 4, 8], {4}))
def test_expert_parallel_equals_naive_reference(ep, top_k, factor, mlp):
    params, (x, cot) = weights(mlp), inputs()
    mesh = ep_mesh(ep)
    _, _, _, experts = moe.route(params["router"], x, top_k)
    slots = moe.capacity(T // ep, E, top_k, factor)
    kept = kept_pairs(np.asarray(experts), ep, slots)
    if factor:
        assert not kept.all()  # the small capacity really drops pairs
    else:
        assert kept.all() and slots == T // ep

    def ours(params, x):
        y, dropped = parallel(params, x, top_k, mlp, factor, mesh)
        return jnp.sum(y * cot), (y, dropped)

    def ref(params, x):
        y = naive(params, x, top_k, mlp, kept)
        return jnp.sum(y * cot), y

    (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(params, x)
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(ref, argnums=(0, 1), has_aux=True))(params, x)
    assert int(dropped) == int((~kept).sum())
    assert rel(y, y_ref) <= 1e-5
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert rel(g, g_ref) <= 1e-5


def test_local_groups_drop_like_the_reference():
    """On one device, `groups` equal slices of the tokens behave like ep devices' buffers."""
    params, (x, _) = weights("swiglu"), inputs()
    _, _, gates, experts = moe.route(params["router"], x, 2)
    y, dropped = moe.local_moe(params["experts"], x, gates, experts, E, 0.5, "swiglu", jnp.float32, groups=4)
    kept = kept_pairs(np.asarray(experts), 4, moe.capacity(T // 4, E, 2, 0.5))
    assert int(dropped) == int((~kept).sum()) > 0
    assert rel(y, naive(params, x, 2, "swiglu", kept)) <= 1e-5


def test_a_laid_out_sequence_queues_in_sequence_order():
    """Rows of 16 tokens laid out in the zig-zag order over sp=2: told that order, the queue keeps the pairs the
    naive count keeps on the rows in order (4 groups of one row each)."""
    params, (x, _) = weights("swiglu"), inputs()
    order = zigzag_order(16, 2)
    laid_out = x.reshape(4, 16, D)[:, order].reshape(T, D)
    _, _, gates, experts = moe.route(params["router"], laid_out, 2)
    in_order = lambda a: a.reshape(4, 16, -1)[:, np.argsort(order)].reshape(T, -1)
    kept = kept_pairs(np.asarray(in_order(experts)), 4, moe.capacity(16, E, 2, 0.5))
    assert not kept.all()
    y, dropped = moe.local_moe(params["experts"], laid_out, gates, experts, E, 0.5, "swiglu", jnp.float32, groups=4,
                               seq_order=order)
    assert rel(in_order(y), naive(params, x, 2, "swiglu", kept)) < 1e-6
    assert int(dropped) == int((~kept).sum())


def test_dispatch_uses_all_to_all_and_never_gathers_expert_weights():
    params, (x, cot) = weights("swiglu"), inputs()
    mesh = ep_mesh(4)
    sharded = jax.device_put(params["experts"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep")))
    loss = lambda p, x: jnp.sum(parallel({**params, "experts": p}, x, 2, "swiglu", 0.0, mesh)[0] * cot)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep")))
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(sharded, x).compile().as_text()
    assert hlo.count("all-to-all(") == 4  # there and back in the forward pass, and their transposes
    gathered = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", hlo)
    expert_shapes = {",".join(map(str, a.shape[i:])) for a in params["experts"].values() for i in (0, 1)}
    assert not expert_shapes & set(gathered), gathered  # neither all experts' weights nor one expert's


def test_aux_losses_equal_their_formula_on_a_hand_built_routing():
    # probs: [.5 .5], [.5 .5], [.75 .25], [.25 .75]; top-1 picks expert 0 on ties: experts 0, 0, 0, 1
    logits = jnp.array([[0.0, 0.0], [0.0, 0.0], [math.log(3), 0.0], [0.0, math.log(3)]])
    probs = jax.nn.softmax(logits, axis=-1)
    experts = jax.lax.top_k(probs, 1)[1]
    assert experts[:, 0].tolist() == [0, 0, 0, 1]
    aux = moe.aux_losses(logits, probs, experts)
    # f = [3/4, 1/4], P = [1/2, 1/2]: E·Σ f·P = 2·(3/8 + 1/8) = 1
    assert float(aux["balance"]) == pytest.approx(1.0, rel=1e-6)
    # lse = ln 2, ln 2, ln 4, ln 4: mean of squares = (2·ln²2 + 2·4·ln²2)/4 = 2.5·ln²2
    assert float(aux["z"]) == pytest.approx(2.5 * math.log(2) ** 2, rel=1e-6)
    np.testing.assert_allclose(np.asarray(aux["load"]), [0.75, 0.25])


def test_top1_gate_keeps_a_router_gradient_and_topk_gates_sum_to_one():
    params, (x, _) = weights("gelu_tanh"), inputs()
    _, _, gates2, _ = moe.route(params["router"], x, 2)
    np.testing.assert_allclose(np.asarray(gates2.sum(-1)), 1.0, rtol=1e-6)
    g = jax.grad(lambda r: jnp.sum(moe.route(r, x, 1)[2]))(params["router"])
    assert float(jnp.linalg.norm(g)) > 0


# ---------------------------------------------------------------- the model and the trainer

MODEL = {"model.moe.capacity_factor": 0.0}


def model_config(over: dict):
    return equivalence_config("tiny-moe", **{**MODEL, **over})


def reference_for(model_keys: dict):
    """(params, LM loss, gradients of the whole objective) on one device: the independent reference
    (tools/reference/plain_llama.py) where it has the model, else jaxllm on one device."""
    cfg = model_config(model_keys)
    if cfg.model.family == "llama" and cfg.model.pattern == ["moe"] and not any(k in ROUTING for k in model_keys):
        return reference(cfg.model)
    params = jax.device_get(step_fns(cfg).init(0).params)
    loss, grads = loss_and_grads(step_fns(cfg), params)
    return params, float(loss), jax.device_get(grads)


PIPELINED = {"train.microbatches": 2, "train.zero_stage": 2}  # MoE in pipeline stages: ZeRO-2 or 3 (see BAD_MOE)
# DeepSeek-V3's routing (sigmoid scores, 4 groups of 2 experts, the best 2 groups, scaled gates), which the plain
# reference does not have: against jaxllm on one device
ROUTING = {"model.moe.score": "sigmoid", "model.moe.n_group": 4, "model.moe.topk_group": 2,
           "model.moe.routed_scale": 2.5}
# ... in a DeepSeek-shaped stack: a dense layer, then two MoE layers (a segment scanned over 2 repeats) with a shared
# feed-forward of 2 experts' width, gated as Qwen2-MoE's, a router bias and the sequence-wise balance loss
SEGMENTED = {**ROUTING, "model.n_layers": 3, "model.segments": [{"layers": 1, "pattern": ["dense"]},
                                                                 {"layers": 2, "pattern": ["moe"]}],
             "model.moe.n_shared_experts": 2, "model.moe.shared_gate": True, "model.moe.seq_balance_weight": 0.01,
             "model.moe.bias_update_rate": 0.001}  # the bias's "gradient", the layer's load, compared too
MOE_MESHES = {  # name -> (mesh and options; model keys shared with the reference)
    "ep4_fsdp2": ({"mesh.ep": 4, "mesh.fsdp": 2}, {}),
    "ep2_tp2_fsdp2": ({"mesh.ep": 2, "mesh.tp": 2, "mesh.fsdp": 2}, {}),
    "ep8_top1": ({"mesh.ep": 8}, {"model.moe.top_k": 1}),
    "dp8_gpt2_every_second_layer": ({"mesh.dp": 8}, {"model.family": "gpt2", "model.n_kv_heads": 8,
                                                     "model.pattern": ["dense", "moe"]}),
    # per-microbatch routing statistics: the balance loss (not linear in them) is left out here
    "ep4_fsdp2_zero2_microbatches": ({"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 2, "train.microbatches": 2},
                                     {"model.moe.balance_weight": 0.0}),
    "ep4_fsdp2_zero3_segmented": ({"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3}, SEGMENTED),
    "dp2_tp2_ep2_segmented": ({"mesh.dp": 2, "mesh.tp": 2, "mesh.ep": 2}, SEGMENTED),
    # experts under context parallelism: tokens split over the sequence enter the routing and the dispatch like any
    # others; the sequence-wise balance loss and the bias's load are counted over every sp rank
    "sp2_ep2_dp2": ({"mesh.sp": 2, "mesh.ep": 2, "mesh.dp": 2}, {}),
    "sp2_tp2_ep2_segmented": ({"mesh.sp": 2, "mesh.tp": 2, "mesh.ep": 2, "train.sequence_parallel": True}, SEGMENTED),
    # ... and inside pipeline stages (every stage running its chunk, and the layers before the pipelined ones, at every
    # tick): the segmented stack, and DeepSeek's routing in one MoE segment under ZB-V
    "pp2_sp2_ep2_segmented": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.ep": 2, "train.zero_stage": 2,
                               "train.microbatches": 2}, {**SEGMENTED, "model.moe.balance_weight": 0.0}),
    "pp2_sp2_ep2_zb_v": ({"mesh.pp": 2, "mesh.sp": 2, "mesh.ep": 2, "train.zero_stage": 2, "train.microbatches": 4,
                          "train.pp_schedule": "zb_v"},
                         {**ROUTING, "model.n_layers": 4, "model.moe.n_shared_experts": 2, "model.moe.shared_gate": True,
                          "model.moe.seq_balance_weight": 0.01, "model.moe.bias_update_rate": 0.001,
                          "model.moe.balance_weight": 0.0}),
    # the dense segment on the first stage, the MoE segment pipelined (one layer a stage), its auxiliary losses and
    # the bias's load through the pipeline's backward; per-microbatch routing statistics: no balance loss
    "pp2_ep2_dp2_segmented": ({"mesh.pp": 2, "mesh.ep": 2, "mesh.dp": 2, "train.zero_stage": 2,
                               "train.microbatches": 2}, {**SEGMENTED, "model.moe.balance_weight": 0.0}),
    # the same through ZB-H1's split backward: R's forward carries the chunk's statistics, B the head's
    "pp2_ep2_dp2_segmented_zb_h1": ({"mesh.pp": 2, "mesh.ep": 2, "mesh.dp": 2, "train.zero_stage": 2,
                                     "train.microbatches": 2, "train.pp_schedule": "zb_h1"},
                                    {**SEGMENTED, "model.moe.balance_weight": 0.0}),
}


@pytest.mark.parametrize("mesh", tiers(MOE_MESHES, {"ep4_fsdp2"}))
def test_moe_model_matches_the_reference(mesh):
    axes, model_keys = MOE_MESHES[mesh]
    ref = reference_for(model_keys)
    cfg = model_config({**axes, **model_keys})
    loss, grads = loss_and_grads(step_fns(cfg), ref[0])
    assert_matches(loss, grads, ref)
    if cfg.mesh.ep > 1:  # expert weights stay split over ep
        block = next(b for b in grads["blocks"] if "moe" in b)
        w = block["moe"]["experts"]["w_up" if cfg.model.family == "llama" else "w_in"]
        assert "ep" in str(w.sharding.spec)


# Several microbatches at ZeRO-0/1 on several batch shards: MoE takes the compiler's accumulation (its routing
# statistics over each microbatch's rows on every device), so the balance loss is one device's on the same
# microbatches (each device's k-th slice of its rows: the one device's batch is put in that order)
ZERO01_MICROBATCHES = {"ep2_dp2_zero0": {"mesh.ep": 2, "mesh.dp": 2, "train.zero_stage": 0},
                       "pp2_ep2_dp2_zero1": {"mesh.pp": 2, "mesh.ep": 2, "mesh.dp": 2, "train.zero_stage": 1}}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ZERO01_MICROBATCHES)
def test_microbatches_at_zero_0_and_1_route_as_one_device_on_the_same_microbatches(mesh):
    keys = {"model.moe.capacity_factor": 0.0, "train.microbatches": 2}
    one, on_mesh = step_fns(model_config(keys)), step_fns(model_config({**keys, **ZERO01_MICROBATCHES[mesh]}))
    shards, rows = 4, np.asarray(tokens())
    laid = rows.reshape(shards, 2, -1, rows.shape[-1]).swapaxes(0, 1).reshape(rows.shape)  # microbatch-major
    params = jax.device_get(one.init(0).params)
    loss, grads = loss_and_grads(one, params, laid)
    assert model_config(keys).model.moe.balance_weight > 0  # the loss that is not linear in the statistics
    assert_matches(*loss_and_grads(on_mesh, params, rows), (params, float(loss), jax.device_get(grads)))


# The default capacity (factor 1.25) drops pairs, per batch shard: meshes with as many batch shards drop the same
# pairs, whether the experts run locally (dp) or behind the all-to-alls (ep). The segmented stack drops alike too
# (its MoE layers, gated shared feed-forward, bias and sequence-wise loss). Under sp with the zig-zag layout the
# queue still takes tokens in the sequence's order, and inside pipeline stages each batch shard keeps its buffers.
CAPACITY_MESHES = {"ep8": {"mesh.ep": 8}, "ep4_fsdp2_zero3": {"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3},
                   "ep2_dp4": {"mesh.ep": 2, "mesh.dp": 4},
                   "ep4_fsdp2_zero3_segmented": {"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3, **SEGMENTED},
                   "sp2_ep2_dp2_zigzag": {"mesh.sp": 2, "mesh.ep": 2, "mesh.dp": 2, "model.cp_load_balance": True},
                   "pp2_sp2_ep2_zigzag": {"mesh.pp": 2, "mesh.sp": 2, "mesh.ep": 2, **PIPELINED}}


def capacity_config(over: dict):
    return equivalence_config("tiny-moe", **over)  # the preset's default capacity factor


@pytest.mark.slow
@pytest.mark.parametrize("mesh", CAPACITY_MESHES)
def test_default_capacity_drops_alike_on_meshes_with_equal_batch_shards(mesh):
    over = CAPACITY_MESHES[mesh]
    kept = {k: v for k, v in over.items() if k.startswith(("model.", "train."))}
    assert capacity_config(kept).model.moe.capacity_factor == 1.25
    shards = math.prod(getattr(capacity_config(over).mesh, a) for a in ("dp", "fsdp", "ep"))
    # the experts run locally, one group per device, the sequence in order
    base = step_fns(capacity_config({"mesh.dp": shards, **kept, "model.cp_load_balance": False}))
    params = jax.device_get(base.init(0).params)
    _, metrics = train_step(base, base.init(0))
    assert float(metrics["moe_dropped"]) > 0.01  # the capacity really drops pairs
    ref_loss, ref_grads = loss_and_grads(base, params)
    loss, grads = loss_and_grads(step_fns(capacity_config(over)), params)
    assert_matches(loss, grads, (params, float(ref_loss), jax.device_get(ref_grads)))


def test_mixtral_preset_has_mixtrals_size():
    m = build_config(None, {"model.preset": "mixtral-8x7b"}).model
    assert transformer.count_params(m) == pytest.approx(46.7e9, rel=0.01)
    assert transformer.count_params(m, active=True) == pytest.approx(12.9e9, rel=0.01)


BAD_MOE = {
    "experts_over_ep": ({"mesh.ep": 8, "model.moe.n_experts": 4}, "model.moe.n_experts=4"),
    "top_k": ({"model.moe.top_k": 9}, "top_k"),
    "negative": ({"model.moe.capacity_factor": -1.0}, "model.moe.capacity_factor=-1.0: must be 0 or more"),
    "custom_allreduce": ({"mesh.dp": 8, "train.microbatches": 2, "train.allreduce": "ring"}, "MoE blocks"),
    "pattern": ({"model.pattern": ["dense", "sparse"]}, "model.pattern"),
    "segments_short": ({"model.segments": [{"layers": 1, "pattern": ["moe"]}]}, "model.segments hold 1 layers"),
    "segments_form": ({"model.segments": [{"layers": 2, "kinds": ["moe"]}]}, "model.segments[0]"),
    "segments_pipeline_split": ({"mesh.pp": 2, "train.microbatches": 2, "train.zero_stage": 2, "model.n_layers": 3,
                                 "model.segments": [{"layers": 2, "pattern": ["dense"]},
                                                    {"layers": 1, "pattern": ["moe"]}]}, "the last of model.segments"),
}


@pytest.mark.parametrize("case", BAD_MOE)
def test_bad_moe_configs_are_one_line_errors(case):
    over, needle = BAD_MOE[case]
    with pytest.raises(ConfigError) as e:
        validate(model_config({"mesh.dp": -1, **over}), 8)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_tiny_moe_trains_and_the_balance_loss_balances(tmp_path):
    """Loss falls and the router statistics are logged; with the Switch balance loss the busiest expert
    carries less than without it."""
    rows = {}
    for weight in (0.01, 0.0):
        cfg = build_config(None, {"model.preset": "tiny-moe", "model.seq_len": 32, "mesh.dp": 2, "mesh.ep": 4,
                                  "train.steps": 60, "data.source": CORPUS, "train.log_every": 10,
                                  "train.eval_every": 0, "train.checkpoint_every": 0,
                                  "run.sample_tokens": 0, "run.progress": False, "run.dir": str(tmp_path / str(weight)),
                                  "model.moe.balance_weight": weight})
        train(cfg)
        with open(tmp_path / str(weight) / "metrics.jsonl") as f:
            rows[weight] = [json.loads(line) for line in f if "moe_balance" in line]
    balanced, free = rows[0.01], rows[0.0]
    assert balanced[-1]["loss"] < balanced[0]["loss"] - 1.5
    for key in ("moe_balance", "moe_z", "moe_dropped", "moe_load_max_over_mean"):
        assert all(np.isfinite(r[key]) for r in balanced)
    for r in balanced:  # per-expert loads: shares of the routed pairs, and max/mean is read off them
        load = [r[f"moe_load_{e}"] for e in range(8)]
        assert sum(load) == pytest.approx(1.0, abs=1e-5)
        assert r["moe_load_max_over_mean"] == pytest.approx(max(load) * 8, rel=1e-5)
    late = lambda rs, key: np.mean([r[key] for r in rs[-3:]])
    assert late(balanced, "moe_load_max_over_mean") < late(free, "moe_load_max_over_mean")
    assert late(balanced, "moe_balance") < late(free, "moe_balance")


def test_trainer_step_moves_tokens_not_expert_weights():
    """ep=4×fsdp=2, ZeRO-0: the gradient program has the island's all-to-alls and no all-gather of any expert
    weight (whole, or one ep rank's share)."""
    fns = step_fns(model_config({"mesh.ep": 4, "mesh.fsdp": 2}))
    hlo = lower_loss_and_grads(fns).compile().as_text()
    assert hlo.count("all-to-all(") >= 4
    experts = fns.abstract_state.params["blocks"][0]["moe"]["experts"]
    shapes = {",".join(map(str, (n,) + a.shape[2:])) for a in experts.values() for n in (8, 2)}
    gathered = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", hlo)
    assert not shapes & set(gathered), gathered


# ---------------------------------------------------------------- routing options, by hand

def test_group_limited_topk_chooses_within_the_best_groups():
    """16 experts in 4 groups of 4, the best 2 groups, top 4 experts. Group scores (sum of each group's two
    highest): g0 = .9 + .1 = 1.0, g1 = .8 + .7 = 1.5, g2 = .6 + .55 = 1.15, g3 = .5 + .45 = .95: groups 1 and 2.
    Expert 0 (.9, the best score of all) is left out with its group; the top 4 of groups 1 and 2 are experts
    4 (.8), 5 (.7), 8 (.6) and 9 (.55)."""
    scores = jnp.array([[.9, .1, .05, .0, .8, .7, .2, .1, .6, .55, .3, .2, .5, .45, .4, .35]])
    routing = moe.Routing(score="sigmoid", norm_topk=False, n_group=4, topk_group=2)
    gates, experts = moe.select(scores, 4, routing)
    assert sorted(experts[0].tolist()) == [4, 5, 8, 9]
    np.testing.assert_allclose(np.sort(np.asarray(gates[0])), [.55, .6, .7, .8], rtol=1e-6)
    _, ungrouped = moe.select(scores, 4, moe.Routing(score="sigmoid", norm_topk=False))
    assert sorted(ungrouped[0].tolist()) == [0, 4, 5, 8]  # without groups expert 0 is in


def test_the_bias_decides_the_choice_and_the_gates_stay_unbiased():
    """Sigmoid scores [.7, .6, .5, .4], top 2: experts 0 and 1. A bias of +.4 on expert 3 (.4 + .4 = .8, first)
    brings it in with its own score .4 as the gate, not .8; normalised: .4 / 1.1 and .7 / 1.1, then ×2.5."""
    scores = jnp.array([[.7, .6, .5, .4]])
    assert moe.select(scores, 2, moe.Routing(score="sigmoid"))[1][0].tolist() == [0, 1]
    bias = jnp.array([0.0, 0.0, 0.0, 0.4])
    gates, experts = moe.select(scores, 2, moe.Routing(score="sigmoid", norm_topk=False), bias)
    assert experts[0].tolist() == [3, 0]
    np.testing.assert_allclose(np.asarray(gates[0]), [.4, .7], rtol=1e-6)
    gates, _ = moe.select(scores, 2, moe.Routing(score="sigmoid", norm_topk=True, routed_scale=2.5), bias)
    np.testing.assert_allclose(np.asarray(gates[0]), [2.5 * .4 / 1.1, 2.5 * .7 / 1.1], rtol=1e-6)


def test_sigmoid_scores_and_unnormalised_softmax_gates():
    """`score = sigmoid` scores each expert on its own (they need not sum to 1); softmax without `norm_topk` keeps
    the chosen probabilities as they are (Qwen2-MoE's norm_topk_prob = false)."""
    x, router = jnp.eye(4)[:1], jnp.zeros((4, 4)).at[0].set(jnp.array([2.0, 0.0, -1.0, 1.0]))  # x·router: the logits
    _, scores, gates, experts = moe.route(router, x, 2, moe.Routing(score="sigmoid", norm_topk=False))
    np.testing.assert_allclose(np.asarray(scores[0]), 1 / (1 + np.exp(-np.array([2.0, 0.0, -1.0, 1.0]))), rtol=1e-6)
    assert experts[0].tolist() == [0, 3]
    _, probs, gates, _ = moe.route(router, x, 2, moe.Routing(norm_topk=False))
    np.testing.assert_allclose(np.asarray(gates[0]), np.asarray(probs[0])[[0, 3]], rtol=1e-6)
    assert float(gates.sum()) < 1


@pytest.mark.parametrize("over, named", [
    ({"model.moe.score": "relu"}, "model.moe.score"),
    ({"model.moe.n_group": 3}, "model.moe.n_group"),  # 8 experts do not split into 3 groups
    ({"model.moe.n_group": 4, "model.moe.topk_group": 5}, "model.moe.topk_group"),
    ({"model.moe.n_group": 4, "model.moe.topk_group": 1, "model.moe.top_k": 3}, "model.moe.topk_group"),
])
def test_routing_keys_that_cannot_run_are_one_line_errors(over, named):
    from jaxllm.config import build_config, validate

    cfg = build_config(None, {"model.preset": "tiny-moe", "model.vocab_size": 257, "mesh.dp": 1, **over})
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    assert named in str(info.value) and "\n" not in str(info.value)
