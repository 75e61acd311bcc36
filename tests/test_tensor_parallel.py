"""Tensor parallelism, Megatron sequence parallelism and collective matmuls over `tp` (fp32, 8 fake CPU devices).

Equivalence: one step's loss and gradients equal the single-device reference (see
test_equivalence.py) on tp ∈ {2, 4, 8} (alone, on 2, 4 and 8 devices), tp=2×fsdp=4 at ZeRO-3 and dp=2×tp=4, each
with sequence parallelism off, on, and on with collective matmuls. tiny-llama has 8
query heads and 4 KV heads, so tp=8 is grouped-query attention with fewer KV heads
than tp. Then the compiled programs: the collectives one layer's forward holds, the
temporaries sequence parallelism saves, and the logits the vocabulary-parallel loss
never materialises.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import _set, validate
from jaxllm.mesh import make_mesh
from jaxllm.models import transformer
from jaxllm.sharding import Layout, activation_rules, param_rules, use_layout
from jaxllm.train.step import make_step_fns
from test_equivalence import GRAD_RTOL, LOSS_RTOL, PRESETS, config, max_rel_err, reference, tokens, warm
from tools.collectives import collectives_per_step, computations, memory_summary

# name -> (mesh axes, zero stage, microbatches)
MESHES = {
    "tp2": (dict(tp=2), 0, 1),
    "tp4": (dict(tp=4), 0, 1),
    "tp8": (dict(tp=8), 0, 1),
    "tp2_fsdp4_zero3": (dict(tp=2, fsdp=4), 3, 2),
    "dp2_tp4": (dict(dp=2, tp=4), 0, 2),  # accumulation island (manual over dp) around the tp islands
}
MODES = {"tp": {}, "sp": {"train.sequence_parallel": True},
         "sp_cm": {"train.sequence_parallel": True, "model.collective_matmul": True}}


def tp_config(family: str, mesh: str, mode: str, **extra):
    axes, stage, microbatches = MESHES[mesh]
    cfg = config(family, "one", stage, microbatches)
    for key, value in {**{f"mesh.{a}": n for a, n in axes.items()}, **MODES[mode], **extra}.items():
        _set(cfg, key, value)
    return cfg


@functools.lru_cache(maxsize=None)
def step_fns(family: str, mesh: str, mode: str, loss_chunk: int = 0):
    cfg = tp_config(family, mesh, mode, **{"train.loss_chunk": loss_chunk})
    devices = jax.devices()[:math.prod(MESHES[mesh][0].values())]  # tp2 and tp4: tensor parallelism alone
    shape, notes = validate(cfg, len(devices))
    return make_step_fns(cfg, make_mesh(shape, cfg, devices=devices)), notes


def loss_and_grads(fns, family):
    params = jax.device_put(reference(family)[0], fns.state_shardings["params"])
    return fns.loss_and_grads(params, jax.device_put(tokens(), fns.batch_sharding))


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_grads_match_one_device(family, mesh, mode):
    _, ref_loss, ref_grads = reference(family)
    fns, notes = step_fns(family, mesh, mode)
    loss, grads = loss_and_grads(fns, family)
    assert abs(float(loss) - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert max_rel_err(grads, ref_grads) <= GRAD_RTOL
    # the layout is Megatron's: heads and the MLP hidden dimension split over tp
    wq, w_in = grads["blocks"][0]["attn"]["wq"], grads["blocks"][0]["mlp"]["w_in" if family == "gpt2" else "w_up"]
    assert "tp" in str(wq.sharding.spec) and "tp" in str(w_in.sharding.spec)
    gqa = family == "llama" and mesh == "tp8"  # 4 KV heads over 8 ranks
    assert any("KV heads are replicated" in n for n in notes) == gqa


@pytest.mark.parametrize("family", PRESETS)
def test_chunked_loss_matches_one_device(family):
    _, ref_loss, ref_grads = reference(family)
    loss, grads = loss_and_grads(step_fns(family, "dp2_tp4", "sp", loss_chunk=8)[0], family)
    assert abs(float(loss) - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert max_rel_err(grads, ref_grads) <= GRAD_RTOL


def test_one_train_step_matches_one_device():
    """The whole step (two microbatches, clipping, AdamW) on tp=2×fsdp=4, ZeRO-3, SP and collective
    matmuls gives one device's loss and new parameters. Both start from the same warm Adam state
    (see test_equivalence.warm: the step-1 update is ill-conditioned)."""
    family = "llama"
    one_cfg = config(family, "one", 3, 2)
    one = make_step_fns(one_cfg, make_mesh(validate(one_cfg, 1)[0], one_cfg, devices=jax.devices()[:1]))
    fns = step_fns(family, "tp2_fsdp4_zero3", "sp_cm")[0]
    ref_state, ref_metrics = one.train_step(warm(one.init(0)), jax.device_put(tokens(), one.batch_sharding))
    state, metrics = fns.train_step(warm(fns.init(0)), jax.device_put(tokens(), fns.batch_sharding))
    assert abs(float(metrics["loss"]) - float(ref_metrics["loss"])) <= LOSS_RTOL * abs(float(ref_metrics["loss"]))
    assert abs(float(metrics["grad_norm"]) / float(ref_metrics["grad_norm"]) - 1) <= GRAD_RTOL
    # new = old + update in fp32: the update matches to GRAD_RTOL up to one rounding of the sum
    for new, ref_new, old in zip(*map(jax.tree.leaves, (state["params"], ref_state["params"], reference(family)[0]))):
        new, ref_new, old = np.asarray(new), np.asarray(ref_new), np.asarray(old)
        bound = GRAD_RTOL * np.linalg.norm(ref_new - old) + np.linalg.norm(np.spacing(np.abs(ref_new)))
        assert np.linalg.norm(new - ref_new) <= bound


# ---------------------------------------------------------------- compiled programs


def layer_forward(family: str, tp: int, mode: str):
    """One layer's forward on dp=8/tp × tp, compiled: (HLO text, batch rows per device, seq, d_model)."""
    cfg = tp_config(family, "tp2", mode, **{"mesh.tp": tp, "mesh.dp": 8 // tp, "model.n_layers": 1})
    shape, _ = validate(cfg, 8)
    m, t = cfg.model, cfg.train
    layout = Layout(make_mesh(shape, cfg), param_rules(False), activation_rules(t.sequence_parallel),
                    collective_matmul=m.collective_matmul)
    names, shapes = transformer.param_names(m), transformer.param_shapes(m)
    weights = jax.tree.map(lambda n, s: layout.sharding(n, layout.params, s.shape), names["blocks"], shapes["blocks"],
                           is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, str) for e in x))
    b, s = 16, m.seq_len
    x = layout.sharding(("batch", "residual_seq", "embed"), layout.activations, (b, s, m.d_model))

    def forward(stack, x, positions, segment_ids):
        with use_layout(layout):
            return transformer.blocks(stack, x, positions, segment_ids, m, jnp.float32)

    ints = jax.ShapeDtypeStruct((b, s), jnp.int32)
    compiled = jax.jit(forward, in_shardings=(weights, x, None, None), out_shardings=x).lower(
        shapes["blocks"], jax.ShapeDtypeStruct((b, s, m.d_model), jnp.float32), ints, ints).compile()
    return compiled.as_text(), b // shape["dp"], s, m.d_model


def _dims(type_str: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", type_str)]


def activation_collectives(hlo: str, kind: str, shape: tuple[int, ...]) -> list[dict]:
    comps, _ = computations(hlo)
    return [i for instrs in comps.values() for i in instrs
            if i["opcode"] in (kind, kind + "-start") and shape in _dims(i["type"])]


def sliced_along_sequence(hlo: str, name: str, shard_shape: tuple[int, ...]) -> bool:
    """Whether every user of instruction `name` is a dynamic-slice (or a fusion containing one)
    whose result is the sequence shard: the CPU form of a reduce-scatter."""
    comps, _ = computations(hlo)
    ref = re.compile(r"%" + re.escape(name) + r"(?![\w.\-])")
    users = [i for instrs in comps.values() for i in instrs if ref.search(i["attrs"])]

    def slices(i):
        if i["opcode"] == "dynamic-slice":
            return True
        called = re.findall(r"calls=%?([\w.\-]+)", i["attrs"])
        return i["opcode"] == "fusion" and any(j["opcode"] == "dynamic-slice" for c in called for j in comps[c])

    return bool(users) and all(slices(i) and shard_shape in _dims(i["type"]) for i in users)


@pytest.mark.parametrize("family", PRESETS)
def test_layer_forward_collectives(family):
    """Megatron TP: two all-reduces of the layer's activations (after attention and after the MLP).
    With sequence parallelism they become all-gather + reduce-scatter (on CPU: an all-reduce whose
    only use is the slice to this rank's sequence block); with collective matmuls, only the
    collective-permutes of the rings: 2 islands in and 2 out, two directions, tp-1 steps each."""
    tp = 4
    hlo, b, s, d = layer_forward(family, tp, "tp")
    full, shard = (b, s, d), (b, s // tp, d)
    counts = {k: v["count"] for k, v in collectives_per_step(hlo).items() if v["count"]}
    assert counts == {"all-reduce": 2}
    assert len(activation_collectives(hlo, "all-reduce", full)) == 2

    hlo, *_ = layer_forward(family, tp, "sp")
    counts = {k: v["count"] for k, v in collectives_per_step(hlo).items() if v["count"]}
    gathers = activation_collectives(hlo, "all-gather", full)
    reduces = activation_collectives(hlo, "all-reduce", full) + activation_collectives(hlo, "reduce-scatter", shard)
    assert len(gathers) == 2 and len(reduces) == 2
    assert counts.get("all-gather", 0) + counts.get("all-reduce", 0) + counts.get("reduce-scatter", 0) == 4
    for r in reduces:
        assert r["opcode"].startswith("reduce-scatter") or sliced_along_sequence(hlo, r["name"], shard)

    hlo, *_ = layer_forward(family, tp, "sp_cm")
    coll = collectives_per_step(hlo)
    assert {k: v["count"] for k, v in coll.items() if v["count"]} == {"collective-permute": 4 * 2 * (tp - 1)}
    # the bytes of the all-gathers and reduce-scatters they replace: 4 × (tp-1)/tp × b·s·d·4
    assert coll["collective-permute"]["bytes"] == 4 * (tp - 1) * b * (s // tp) * d * 4


@pytest.mark.parametrize("family", PRESETS)
def test_sequence_parallel_temporaries_no_larger(family):
    """Per-device temporaries of the gradient program: SP (and SP with collective matmuls) ≤ TP alone."""
    def temps(mode):
        fns = step_fns(family, "tp8", mode)[0]
        params = jax.device_put(reference(family)[0], fns.state_shardings["params"])
        compiled = fns.loss_and_grads.lower(params, jax.device_put(tokens(), fns.batch_sharding)).compile()
        return memory_summary(compiled)["temp_bytes"]

    plain = temps("tp")
    assert temps("sp") <= plain
    assert temps("sp_cm") <= plain


def largest_with_dim(hlo: str, size: int) -> int:
    """Elements of the largest array in the program that has a dimension of `size`."""
    return max((math.prod(d) for d in _dims(hlo) if size in d), default=0)


@pytest.mark.parametrize("family", PRESETS)
def test_vocab_parallel_loss_never_holds_full_logits(family):
    """No array in the compiled gradient program has a full-vocabulary dimension as large as the
    tokens' logits; each rank's logits are [tokens, vocab/tp]. With `train.loss_chunk` the largest
    [., vocab/tp] array shrinks to one chunk's tokens. The same reading of a tp=1 program finds the
    full logits, so the check can fail."""
    from jaxllm.config import padded_vocab

    def program(mesh_axes, chunk=0):
        cfg = config(family, "one", 0, 1)
        for key, value in {**mesh_axes, "train.loss_chunk": chunk}.items():
            _set(cfg, key, value)
        fns = make_step_fns(cfg, make_mesh(validate(cfg, 8)[0], cfg))
        params = jax.device_put(reference(family)[0], fns.state_shardings["params"])
        return fns.loss_and_grads.lower(params, jax.device_put(tokens(), fns.batch_sharding)).compile().as_text()

    v, tp, chunk = padded_vocab(config(family, "one", 0, 1).model), 4, 8
    rows, seq = tokens().shape[0], tokens().shape[1] - 1
    assert largest_with_dim(program({"mesh.dp": 8}), v) >= rows // 8 * seq * v  # control: [tokens, vocab]
    hlo = program({"mesh.dp": 2, "mesh.tp": tp})
    assert largest_with_dim(hlo, v) <= v  # nothing with a full-vocabulary dimension but (at most) a vector
    assert largest_with_dim(hlo, v // tp) >= rows // 2 * seq * v // tp  # the logits, split over tp
    chunked = program({"mesh.dp": 2, "mesh.tp": tp}, chunk=chunk)
    assert largest_with_dim(chunked, v) <= v
    assert largest_with_dim(chunked, v // tp) <= rows // 2 * chunk * v // tp  # one chunk's logits at a time
